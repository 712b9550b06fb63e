"""An OpenAI-compatible completions server over the continuous-batching `Engine` (``mtjax serve``).

    mtjax serve --checkpoint runs/tiny --port 8000
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def main(", "max_tokens": 32, "temperature": 0}'

Endpoints:
- ``POST /v1/completions``: OpenAI's completions request (``prompt`` text or token ids, one or a list;
  ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``, ``n``, ``logprobs``, ``echo``;
  ``presence_penalty`` and ``frequency_penalty`` with ``mtjax serve --penalties``; extensions ``top_k``,
  ``repetition_penalty`` (``--penalties``), ``stop_token_ids``, ``ignore_eos``); JSON, or server-sent
  events with ``"stream": true`` (one ``data:`` chunk per batch of new tokens, then ``data: [DONE]``).
  Each choice also carries the ``token_ids`` it produced. Bad requests get HTTP 400 with OpenAI's
  error object.
- ``POST /v1/chat/completions``: OpenAI's chat request (``messages`` rendered by the model's chat
  template, `mtjax.inference.chat`; ``max_completion_tokens`` or ``max_tokens``, by default what fits
  the context; the other options as above), answered as ``chat.completion`` objects or
  ``chat.completion.chunk`` events.
- ``GET /health``: ``{"status": "ok"}`` while the engine loop runs.
- ``GET /metrics``: Prometheus text: waiting and running requests, free pages, preemptions, tokens
  generated, tokens/s.

Every request goes into one `Engine`; a background thread runs its ``step()`` loop, so concurrent
clients are decoded together in one batch. The server listens on 127.0.0.1 unless told otherwise.
Needs the ``serve`` extra (aiohttp).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # jax, the engine and aiohttp are imported when the command runs
    from aiohttp import web

    from mtjax.inference.chat import ChatTemplate
    from mtjax.inference.engine import Engine, RequestOutput

logger = logging.getLogger("mtjax.serve")

MAX_STOP_STRINGS = 4
MAX_CHOICES = 16  # the most choices ("n") per prompt


class RequestError(ValueError):
    """A request the server refuses (HTTP 400), naming the offending parameter."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, *, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# --------------------------------------------------------------------------------------------------
# The engine loop: one thread steps the engine; requests come and go from the event loop
# --------------------------------------------------------------------------------------------------


class EngineLoop:
    """Runs ``engine.step()`` on a background thread while requests are pending.

    ``submit`` queues a request and registers ``on_output(output, error)``, called on the loop thread
    with each `RequestOutput` of the request (``error`` set instead if the engine failed; the
    request is then dropped). A failing step fails the requests it was running, never the loop.
    """

    def __init__(self, engine: Engine, *, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._callbacks: dict[int, Callable[[RequestOutput | None, BaseException | None], None]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mtjax-engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, prompt: Sequence[int], params: Any,
               on_output: Callable[[RequestOutput | None, BaseException | None], None]) -> int:
        """Queues a request (raises the engine's ValueError for one it refuses); returns its id."""
        with self._lock:
            request_id = self.engine.add_request(prompt, params)
            self._callbacks[request_id] = on_output
        self._wake.set()
        return request_id

    def abort(self, request_id: int) -> None:
        with self._lock:
            if self._callbacks.pop(request_id, None) is not None:
                self.engine.abort(request_id)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping.is_set():
            if not self.engine.has_unfinished():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as err:  # the server must outlive any failing step
                self.failures += 1
                logger.exception("engine step failed; failing its requests")
                with self._lock:
                    failed, self._callbacks = self._callbacks, {}
                for request_id, callback in failed.items():
                    self.engine.abort(request_id)
                    callback(None, err)
                continue
            with self._lock:
                targets = [(self._callbacks.get(o.request_id), o) for o in outputs]
                for output in outputs:
                    if output.finished:
                        self._callbacks.pop(output.request_id, None)
            for callback, output in targets:
                if callback is not None:
                    callback(output, None)


# --------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float, *,
            low_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise RequestError(f"'{name}' must be a number; got {value!r}", name)
    if not (low < value if low_open else low <= value) or value > high:
        bound = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(f"'{name}'={value!r} is outside {bound}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if not _is_int(value) or value < low or (high is not None and value > high):
        accepted = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"'{name}' must be an integer {accepted}; got {value!r}", name)
    return value


def parse_prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """OpenAI's ``prompt``: a string, a list of token ids, or a list of either, as token-id lists."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise RequestError("'prompt' must be a non-empty string, a list of token ids, or a list of those", "prompt")
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            if tokenizer is None:
                raise RequestError("this server has no tokenizer: send 'prompt' as token ids", "prompt")
            ids = [int(t) for t in tokenizer.encode(item)]
        elif isinstance(item, list) and all(_is_int(t) for t in item):
            ids = list(item)
        else:
            raise RequestError("'prompt' must be a non-empty string, a list of token ids, or a list of those", "prompt")
        if not ids:
            raise RequestError("'prompt' is empty; expected at least one token", "prompt")
        prompts.append(ids)
    return prompts


class Completion:
    """The state of one prompt of a request: tokens so far, text emitted so far, stop strings."""

    def __init__(self, index: int, prompt: list[int], stop: list[str], stop_ids: frozenset[int], tokenizer: Any):
        self.index, self.prompt, self.stop, self.stop_ids, self.tokenizer = index, prompt, stop, stop_ids, tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.finish_reason: str | None = None
        self.request_id: int | None = None
        self.logprobs: list[Any] | None = None  # the engine's TokenLogprobs per token, if asked for
        self.echo_text = ""  # with echo: the prompt's text, then its TokenLogprobs (None for the first)
        self.prompt_logprobs: list[Any] | None = None

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in token_ids if t not in self.stop_ids])

    def update(self, output: RequestOutput) -> bool:
        """Takes the request's new tokens; True once it is done (a stop string may end it early: the
        text is cut before it, the tokens and log-probabilities after the token that completes it)."""
        if self.finish_reason is not None:
            return True
        seen = len(self.token_ids)  # the text of these held no stop string
        self.token_ids = list(output.token_ids)
        self.logprobs = output.logprobs
        if self.tokenizer is not None:
            self.text = self._decode(self.token_ids)
        found = [(at, s) for s in self.stop if (at := self.text.find(s)) >= 0]
        if found:
            at, stop = min(found)
            kept = next(j for j in range(seen + 1, len(self.token_ids) + 1)
                        if stop in self._decode(self.token_ids[:j]))
            self.token_ids = self.token_ids[:kept]
            if self.logprobs is not None:
                self.logprobs = self.logprobs[:kept]
            self.text = self.text[:at]
            self.finish_reason = "stop"
            return True
        if output.finished:
            self.finish_reason = "stop" if output.finish_reason == "stop" else output.finish_reason or "length"
        return self.finish_reason is not None

    def delta(self) -> str:
        """Text not streamed yet that can be streamed now: a tail that may still become a stop string
        or an incomplete UTF-8 character is held back until the completion ends."""
        end = len(self.text)
        if self.finish_reason is None:
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1
            if self.stop:
                end = max(self.emitted, end - (max(len(s) for s in self.stop) - 1))
        piece = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return piece


@dataclasses.dataclass(frozen=True)
class RequestOptions:
    """What a request asks for besides its prompts.

    Attributes:
      params: the engine's `SamplingParams` (``max_tokens`` at least 1 even when ``generate`` is False).
      stop: stop strings; stop_ids: stop token ids (the tokenizer's end of text included).
      stream: answer with server-sent events.
      include_usage: a stream's last chunk before ``[DONE]`` holds the usage (``stream_options``).
      n: choices per prompt.
      echo: completions: each choice's text (and log-probabilities) starts with its prompt's.
      generate: False for ``max_tokens: 0`` with ``echo`` (scoring a text): nothing is generated.
    """

    params: Any
    stop: list[str]
    stop_ids: frozenset[int]
    stream: bool
    include_usage: bool = False
    n: int = 1
    echo: bool = False
    generate: bool = True


class CompletionServer:
    """The aiohttp application: parses requests, feeds the `EngineLoop`, answers JSON or SSE.

    Args:
      engine: the `Engine` every request goes to.
      tokenizer: encodes text prompts and decodes the answers (``None``: token-id prompts only, empty texts).
      model_name: the ``model`` field of responses.
      chat_template: a `mtjax.inference.chat.ChatTemplate` for ``/v1/chat/completions`` (None: that
        endpoint answers 400).
    """

    def __init__(self, engine: Engine, tokenizer: Any = None, *, model_name: str = "mtjax",
                 chat_template: ChatTemplate | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.chat_template = chat_template
        self.loop = EngineLoop(engine)
        self.started = time.time()
        self.http_requests: dict[str, int] = {}
        self.active = 0

    def app(self) -> web.Application:
        from aiohttp import web

        app = web.Application(client_max_size=16 * 2**20, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app) -> None:
        self.loop.start()

    async def _stop(self, _app) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.loop.stop)

    def _count(self, status: int) -> None:
        self.http_requests[str(status)] = self.http_requests.get(str(status), 0) + 1

    def _json(self, body: Any, status: int = 200):
        from aiohttp import web

        self._count(status)
        return web.json_response(body, status=status)

    @staticmethod
    def _json_error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        from aiohttp import web

        return web.json_response(error_body(message, param=param, kind=kind), status=status)

    async def _errors_impl(self, request, handler):
        from aiohttp import web

        try:
            response = await handler(request)
        except RequestError as err:
            self._count(400)
            return self._json_error(400, str(err), err.param)
        except web.HTTPException as err:
            self._count(err.status)
            if err.status >= 400:
                return self._json_error(err.status, err.reason or "error", kind="not_found_error"
                                        if err.status == 404 else "invalid_request_error")
            raise
        except Exception as err:  # a handler bug answers 500; the server lives on
            logger.exception("request failed")
            self._count(500)
            return self._json_error(500, f"internal error: {type(err).__name__}: {err}", kind="server_error")
        return response

    @property
    def _errors(self):
        from aiohttp import web

        @web.middleware
        async def errors(request, handler):
            return await self._errors_impl(request, handler)

        return errors

    # -- endpoints -------------------------------------------------------------------------------

    async def health(self, _request):
        if not self.loop.alive:
            return self._json(error_body("the engine loop is not running", kind="server_error"), 503)
        return self._json({"status": "ok"})

    async def metrics(self, _request):
        from aiohttp import web

        stats = self.engine.stats()
        lines: list[str] = []
        described: set[str] = set()

        def metric(name: str, kind: str, help_text: str, value: Any, labels: str = "") -> None:
            if name not in described:
                described.add(name)
                lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            lines.append(f"{name}{labels} {value}")

        metric("mtjax_requests_waiting", "gauge", "Requests queued for a slot (the queue length).", stats["waiting"])
        metric("mtjax_requests_running", "gauge", "Requests holding a decode slot.", stats["running"])
        metric("mtjax_completion_requests_active", "gauge", "HTTP completion requests in progress.", self.active)
        metric("mtjax_cache_pages_free", "gauge", "Free KV-cache pages.", stats["free_pages"])
        metric("mtjax_cache_pages_total", "gauge", "KV-cache pages.", stats["total_pages"])
        metric("mtjax_preemptions_total", "counter", "Requests preempted for pages (recomputed later).",
               stats["preemptions"])
        metric("mtjax_prefix_cache_pages", "gauge", "KV-cache pages holding a cached prompt prefix.",
               stats["cached_pages"])
        metric("mtjax_prefix_cache_hit_tokens_total", "counter", "Prompt tokens read from the prefix cache.",
               stats["cached_prompt_tokens"])
        metric("mtjax_generated_tokens_total", "counter", "Tokens generated.", stats["generated_tokens"])
        metric("mtjax_tokens_per_second", "gauge", "Generated tokens per second of engine time.",
               f"{stats['tokens_per_s']:.3f}")
        metric("mtjax_engine_failures_total", "counter", "Engine steps that raised.", self.loop.failures)
        metric("mtjax_uptime_seconds", "gauge", "Seconds since the server started.",
               f"{time.time() - self.started:.1f}")
        for status, count in sorted(self.http_requests.items()):
            metric("mtjax_http_responses_total", "counter", "HTTP responses by status.", count,
                   f'{{status="{status}"}}')
        self._count(200)
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        from mtjax.inference.chat import ChatTemplateError

        if self.chat_template is None or self.tokenizer is None:
            raise RequestError("this model has no chat template (start mtjax serve with --chat-template): use "
                               "/v1/completions", "messages")
        if "messages" not in body:
            raise RequestError("'messages' is required", "messages")
        for name in ("tools", "functions"):
            if body.get(name):
                raise RequestError(f"'{name}' is not supported by this server", name)
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise RequestError("'response_format' other than {'type': 'text'} is not supported", "response_format")
        try:
            text = self.chat_template.render(body["messages"])
        except ChatTemplateError as err:
            raise RequestError(str(err), "messages") from None
        ids = [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
        if not ids:
            raise RequestError("the rendered conversation is empty", "messages")
        return ids

    def _sampling(self, body: dict[str, Any], prompts: list[list[int]], *, chat: bool) -> RequestOptions:
        """The `RequestOptions` of a request body."""
        from mtjax.inference.sampling import SamplingParams

        # Options this server does not implement are refused unless they ask for the default: ignoring
        # a penalty or a logit bias would answer another question than the one asked.
        unsupported = {"best_of": lambda v: _is_int(v) and v == body.get("n", 1), "suffix": lambda v: v == "",
                       "logit_bias": lambda v: v == {}, "min_tokens": lambda v: v == 0,
                       "tool_choice": lambda v: v == "none"}
        if not self.engine.penalties:  # `mtjax serve --penalties`
            unsupported.update({"frequency_penalty": lambda v: v == 0, "presence_penalty": lambda v: v == 0,
                                "repetition_penalty": lambda v: v == 1})
        if chat:
            unsupported["echo"] = lambda v: v is False
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise RequestError("'echo' must be a boolean", "echo")
        for name, accepted in unsupported.items():
            value = body.get(name)
            if value is not None and not accepted(value):
                hint = " (start it with --penalties)" if name.endswith("_penalty") else ""
                raise RequestError(f"'{name}'={value!r} is not supported by this server{hint}", name)
        max_len = self.engine.max_seq_len
        for ids in prompts:
            if len(ids) >= max_len:
                raise RequestError(f"the prompt has {len(ids)} tokens; this model takes at most {max_len} tokens "
                                   f"in all, so at most {max_len - 1} prompt tokens",
                                   "messages" if chat else "prompt")
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        # OpenAI's completions default to 16 new tokens; a chat answer may fill the context (and the
        # cache, when it holds less). max_tokens 0 with echo scores the prompt alone.
        longest = max(len(p) for p in prompts)
        room = min(max_len - longest, self.engine.max_cached_tokens + 1 - longest)
        max_tokens = _integer(body, name, max(room, 1) if chat else 16, 0 if echo else 1)
        temperature = _number(body, "temperature", 1.0, 0.0, 100.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
        top_k = _integer(body, "top_k", 0, 0)
        seed = _integer(body, "seed", None, 0, 2**32 - 1)
        seed = random.randrange(2**32) if seed is None else seed
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
                or len(stop) > MAX_STOP_STRINGS):
            raise RequestError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS}", "stop")
        if stop and self.tokenizer is None:
            raise RequestError("this server has no tokenizer: use 'stop_token_ids' instead of 'stop'", "stop")
        stop_ids = body.get("stop_token_ids") or []
        vocab = self.engine.model.config.vocab_size
        if not isinstance(stop_ids, list) or not all(_is_int(t) and 0 <= t < vocab for t in stop_ids):
            raise RequestError(f"'stop_token_ids' must be a list of token ids in [0, {vocab})", "stop_token_ids")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise RequestError("'ignore_eos' must be a boolean", "ignore_eos")
        eos = getattr(self.tokenizer, "eos_id", None)
        if eos is not None and not ignore_eos and eos < vocab:
            stop_ids = [*stop_ids, int(eos)]
        stop_ids = list(dict.fromkeys(stop_ids))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("'stream' must be a boolean", "stream")
        stream_options = body.get("stream_options")
        if stream_options is not None and not (stream and isinstance(stream_options, dict)
                                               and set(stream_options) <= {"include_usage"}
                                               and isinstance(stream_options.get("include_usage", False), bool)):
            raise RequestError("'stream_options' must be {\"include_usage\": true|false} with 'stream': true",
                               "stream_options")
        include_usage = bool((stream_options or {}).get("include_usage", False))
        logprobs = self._logprobs(body, chat)
        if echo and stream:
            raise RequestError("'echo' with 'stream' is not supported by this server", "echo")
        for ids in prompts:
            if len(ids) + max_tokens > max_len:
                raise RequestError(f"the prompt ({len(ids)} tokens) plus {name}={max_tokens} exceed the model's "
                                   f"{max_len} tokens: ask for at most {max_len - len(ids)}", name)
        penalties = dict(presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                         frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                         repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 100.0, low_open=True))
        try:
            params = SamplingParams(max_tokens=max(max_tokens, 1), temperature=temperature, top_k=top_k, top_p=top_p,
                                    seed=seed, stop=tuple(stop_ids), logprobs=logprobs, **penalties)
        except ValueError as err:
            raise RequestError(str(err)) from None
        return RequestOptions(params, stop, frozenset(stop_ids), stream, include_usage,
                              _integer(body, "n", 1, 1, MAX_CHOICES), echo, max_tokens > 0)

    def _logprobs(self, body: dict[str, Any], chat: bool) -> int | None:
        """The alternatives a request wants per token (None: no log-probabilities): completions'
        ``logprobs: int``, chat's ``logprobs: true`` with ``top_logprobs: int``."""
        if chat:
            wanted = body.get("logprobs", False)
            if not isinstance(wanted, bool):
                raise RequestError("'logprobs' must be a boolean", "logprobs")
            if body.get("top_logprobs") is not None and not wanted:
                raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            name, top = "top_logprobs", _integer(body, "top_logprobs", 0, 0) if wanted else None
        else:
            name, top = "logprobs", _integer(body, "logprobs", None, 0)
        if top is not None and (not self.engine.max_logprobs or top > self.engine.max_logprobs):
            limit = (f"at most {self.engine.max_logprobs}" if self.engine.max_logprobs else
                     "none (start mtjax serve with --max-logprobs N)")
            raise RequestError(f"'{name}'={top}: this server returns {limit} alternatives per token", name)
        return top

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else f"token_id:{token}"

    def _logprobs_body(self, c: Completion, start: int, chat: bool) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` of ``c``'s tokens from ``start`` on (None if the request asked for none)."""
        if c.logprobs is None:
            return None
        tokens, entries = c.token_ids[start:], list(c.logprobs[start:])
        if c.prompt_logprobs is not None:  # echo (never streamed: start is 0)
            tokens, entries = c.prompt + tokens, c.prompt_logprobs + entries
        if chat:
            def item(token, logprob):
                text = self._token_text(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            return {"content": [item(t, e.logprob) | {"top_logprobs": [item(a, v) for a, v in e.top]}
                                for t, e in zip(tokens, entries)]}
        texts = [self._token_text(t) for t in tokens]
        offset = len(c.tokenizer.decode(c.token_ids[:start])) if start and c.tokenizer is not None else 0
        offsets = list(itertools.accumulate([len(t) for t in texts[:-1]], initial=offset)) if texts else []
        return {"tokens": texts, "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else {self._token_text(a): v for a, v in e.top} for e in entries],
                "text_offset": offsets}

    @staticmethod
    async def _read_json(request) -> dict[str, Any]:
        """The request's body, which must be a JSON object."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise RequestError("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    async def completions(self, request):
        body = await self._read_json(request)
        if "prompt" not in body:
            raise RequestError("'prompt' is required", "prompt")
        prompts = parse_prompts(body["prompt"], self.tokenizer)
        return await self._generate(request, prompts, self._sampling(body, prompts, chat=False), chat=False)

    async def chat_completions(self, request):
        body = await self._read_json(request)
        prompts = [self._chat_prompt(body)]
        return await self._generate(request, prompts, self._sampling(body, prompts, chat=True), chat=True)

    async def _generate(self, request, prompts: list[list[int]], options: RequestOptions, *, chat: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        params, n = options.params, options.n
        # Choice i * n + j is prompt i's j-th, drawn with the request's seed + j.
        completions = [Completion(i * n + j, p, options.stop, options.stop_ids, self.tokenizer)
                       for i, p in enumerate(prompts) for j in range(n)]
        seeds = [(params.seed + j) % 2**32 for j in range(n)]
        if options.echo:
            await self._echo(completions, n, params.logprobs)

        def on_output(index):
            def deliver(output, error):
                loop.call_soon_threadsafe(queue.put_nowait, (index, output, error))
            return deliver

        self.active += 1
        try:
            for c in completions if options.generate else ():
                try:
                    c.request_id = self.loop.submit(c.prompt, dataclasses.replace(params, seed=seeds[c.index % n]),
                                                    on_output(c.index))
                except ValueError as err:
                    raise RequestError(str(err), "messages" if chat else "prompt") from None
            if not options.generate:  # max_tokens 0: the echo is the answer
                for c in completions:
                    c.finish_reason, c.logprobs = "length", None if params.logprobs is None else []
            created = int(time.time())
            completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            if options.stream:
                return await self._stream(request, completions, queue, completion_id, created, chat, n,
                                          options.include_usage)
            await self._drain(completions, queue)
            self._count(200)
            from aiohttp import web

            return web.json_response(self._response(completion_id, created, completions, chat, n))
        finally:
            self.active -= 1
            for c in completions:  # the client left, or a stop string ended it: free the slot (no-op if done)
                if c.request_id is not None:
                    self.loop.abort(c.request_id)

    async def _echo(self, completions: list[Completion], n: int, top: int | None) -> None:
        """Gives each completion its prompt's text and, if asked, the prompt's log-probabilities (one
        scoring forward per prompt, on the engine's device)."""
        loop = asyncio.get_running_loop()
        for first in completions[::n]:
            scored = None
            if top is not None:
                try:
                    scored = await loop.run_in_executor(None, self.engine.prompt_logprobs, first.prompt, top)
                except ValueError as err:
                    raise RequestError(str(err), "prompt") from None
            text = self.tokenizer.decode(first.prompt) if self.tokenizer is not None else ""
            for c in completions[first.index:first.index + n]:
                c.prompt_logprobs, c.echo_text = scored, text

    async def _next(self, completions: list[Completion], queue: asyncio.Queue) -> Completion | None:
        """The completion the engine's next output updated; None for an output that came after a
        stop string had ended its completion."""
        index, output, error = await queue.get()
        if error is not None:
            raise RuntimeError(f"the engine failed: {type(error).__name__}: {error}")
        completion = completions[index]
        if completion.finish_reason is not None:
            return None
        if completion.update(output) and not output.finished:  # a stop string: free its slot now
            self.loop.abort(completion.request_id)
        return completion

    async def _drain(self, completions: list[Completion], queue: asyncio.Queue) -> None:
        while any(c.finish_reason is None for c in completions):
            await self._next(completions, queue)

    def _response(self, completion_id: str, created: int, completions: list[Completion], chat: bool, n: int
                  ) -> dict[str, Any]:
        if chat:
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "token_ids": c.token_ids, "logprobs": self._logprobs_body(c, 0, chat),
                        "finish_reason": c.finish_reason} for c in completions]
        else:
            choices = [{"index": c.index, "text": c.echo_text + c.text, "token_ids": c.token_ids,
                        "logprobs": self._logprobs_body(c, 0, chat), "finish_reason": c.finish_reason}
                       for c in completions]
        return {
            "id": completion_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": self.model_name, "choices": choices, "usage": self._usage(completions, n),
        }

    @staticmethod
    def _usage(completions: list[Completion], n: int) -> dict[str, int]:
        prompt_tokens = sum(len(c.prompt) for c in completions[::n])  # each prompt once, as OpenAI counts
        completion_tokens = sum(len(c.token_ids) for c in completions)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def _stream(self, request, completions, queue, completion_id: str, created: int, chat: bool, n: int,
                      include_usage: bool):
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        self._count(200)
        # With include_usage every chunk has "usage": null but the last, which has the usage and no choices.
        head = {"id": completion_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model_name} | ({"usage": None} if include_usage else {})

        async def send(payload: Any) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        sent_tokens = [0] * len(completions)
        try:
            if chat:  # OpenAI's first chunk names the role
                await send(head | {"choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None} for c in completions]})
            while any(c.finish_reason is None for c in completions):
                c = await self._next(completions, queue)
                if c is None:
                    continue
                start = sent_tokens[c.index]
                new_ids = c.token_ids[start:]
                sent_tokens[c.index] = len(c.token_ids)
                text = c.delta()
                choice = {"index": c.index, "token_ids": new_ids, "logprobs": self._logprobs_body(c, start, chat),
                          "finish_reason": c.finish_reason}
                choice |= {"delta": {"content": text} if text or c.finish_reason is None else {}} if chat else {
                    "text": text}
                await send(head | {"choices": [choice]})
            if include_usage:
                await send(head | {"choices": [], "usage": self._usage(completions, n)})
        except (ConnectionResetError, asyncio.CancelledError):
            logger.info("client of %s went away; aborting", completion_id)
            raise
        except RuntimeError as err:  # the engine failed mid-stream: tell the client in-band
            await send(error_body(str(err), kind="server_error"))
        await send("[DONE]")
        await response.write_eof()
        return response


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------


def serve(engine: Engine, tokenizer: Any = None, *, host: str = "127.0.0.1", port: int = 8000,
          model_name: str = "mtjax", chat_template: ChatTemplate | None = None) -> None:
    """Serve ``engine`` over HTTP until interrupted (SIGINT/SIGTERM)."""
    from aiohttp import web

    def ready(*_):
        print(f"mtjax serve: listening on http://{host}:{port}", flush=True)

    server = CompletionServer(engine, tokenizer, model_name=model_name, chat_template=chat_template)
    web.run_app(server.app(), host=host, port=port, print=ready, handle_signals=True)
