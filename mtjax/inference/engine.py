"""`Engine`: continuous-batching text generation with a paged key/value cache on the device.

One jitted prefill per (batch, length) bucket and one jitted decode over all ``max_slots`` slots,
``decode_steps`` tokens per dispatch (a `jax.lax.fori_loop` of embedding -> layers -> logits ->
sampling that writes each step's keys and values into the pages), all warmed up front
(`Engine.warmup`) so that no request recompiles anything. The model runs its own code path
(`mtjax.models.GPT` with ``paged_kv=``): the same modules and parameters as training.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mtjax.flax import PAGED_KV_COLLECTION, PagedKV
from mtjax.flax.attention import E4M3_MAX
from mtjax.inference.kv_cache import SCRATCH_PAGE, KVCache, resolve_kv_dtype
from mtjax.inference.sampling import (
    SamplingParams,
    TokenLogprobs,
    apply_penalties,
    request_key,
    sample,
    token_logprobs,
)
from mtjax.inference.scheduler import PrefillChunk, Request, RequestStatus, Scheduler
from mtjax.models import GPT, unstack_layers

WEIGHT_FORMATS = (None, "fp8")


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one `Engine.step` produced for a request.

    Attributes:
      request_id: the id `Engine.add_request` returned.
      new_token_ids: the tokens produced by this step.
      token_ids: every token produced so far.
      finished: the request is done (it holds no slot any more).
      finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or None while running.
      logprobs: a `TokenLogprobs` per token of ``token_ids`` if the request asked for them, else None.
    """

    request_id: int
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


def _geometric(low: int, high: int, factor: int) -> list[int]:
    """``low, low * factor, ...`` below ``high``, then ``high``."""
    sizes, size = [], low
    while size < high:
        sizes.append(size)
        size *= factor
    return sizes + [high]


class Engine:
    """Generates continuations of many prompts at once on a `mtjax.models.GPT`.

    ``generate(prompts, params)`` runs an offline batch; ``add_request`` / ``step`` / ``abort`` serve
    online (another thread may add and abort while one thread steps).

    Args:
      model: a `mtjax.models.GPT` (any preset: learned or rotary positions, GQA, tied or untied
        output, scanned or unrolled layers; a scanned stack runs unrolled, `mtjax.models.unstack_layers`).
      params: its parameters (``init(...)["params"]``, boxed or not).
      max_slots: requests decoded together (the decode batch; fixed, so the decode compiles once).
      page_size: tokens per cache page.
      num_pages: cache pages per layer including the scratch page (default: ``max_slots`` sequences
        of ``max_seq_len`` tokens, no preemption ever needed).
      max_seq_len: longest prompt + new tokens (default and at most the model's ``max_seq_len``).
      kv_dtype: None (the model's compute dtype), ``"bfloat16"``, ``"float16"``, ``"float32"`` or
        ``"fp8"`` (float8_e4m3fn pages with per-head scales, `set_kv_scales` / `calibrate_kv_scales`).
      weights: None: the GEMM kernels in the model's dtype, stored output axes first
        (`mtjax.inference.fp8_weights.output_first_weights`: a decode step's small GEMMs reduce over
        contiguous axes); ``"fp8"``: stored in FP8, output axes first (`fp8_weights.quantize_weights`).
        Either is a new copy of the kernels: the ``params`` passed in can be dropped.
      output_first: with ``weights=None``, store the 16-bit kernels output axes first (a copy);
        False: decode with the kernels as given (no copy, slower small GEMMs).
      mesh: a `jax.sharding.Mesh` with a ``tp_axis``: the pages are sharded over key/value heads on it
        (parameters not already on the mesh are replicated).
      tp_axis: that axis' name.
      decode_steps: tokens decoded per dispatch (the host reads results once per dispatch).
      prefill_chunk: most prompt tokens per prefill call; longer prompts prefill in chunks.
      prefill_buckets: padded prompt lengths (default: powers of two from 32 up to ``prefill_chunk``);
        prefill batches pad to 1, 4, 16, ... rows (at most ``max_prefill_tokens`` tokens).
      max_prefill_tokens: prompt tokens prefilled per step at most (default ``max(2048, prefill_chunk)``).
      max_stop_tokens: most stop tokens of one request.
      max_logprobs: the most alternatives a request may ask for with ``SamplingParams.logprobs`` (0:
        no request may ask for log-probabilities, and the steps compute none).
      prefix_caching: a prompt that starts with the tokens of full pages another sequence computed
        reads their keys and values from those pages (shared, reference-counted) and prefills only
        the rest; finished sequences' pages stay cached until the pages are needed (`KVCache`).
      penalties: requests may ask for `SamplingParams`' presence, frequency and repetition
        penalties; the steps then keep each slot's token counts and prompt tokens on the device
        (``2 * max_slots * vocab_size`` words: off by default).
    """

    def __init__(self, model: GPT, params: Any, *, max_slots: int = 8, page_size: int = 16,
                 num_pages: int | None = None, max_seq_len: int | None = None, kv_dtype: Any = None,
                 weights: str | None = None, output_first: bool = True, mesh: Mesh | None = None,
                 tp_axis: str = "tp", decode_steps: int = 8,
                 prefill_chunk: int | None = None, prefill_buckets: Sequence[int] | None = None,
                 max_prefill_tokens: int | None = None, max_stop_tokens: int = 8, max_logprobs: int = 0,
                 prefix_caching: bool = True, penalties: bool = False):
        if not isinstance(model, GPT):
            raise TypeError(f"Engine: model must be a mtjax.models.GPT; got {type(model).__name__}")
        cfg = model.config
        if cfg.cross_attention:
            raise ValueError("Engine: a GPT with cross_attention (a VLM's decoder) needs what it attends to; "
                             "decode it with mtjax.models.vlm_generate")
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"Engine: weights={weights!r} is not supported; accepted: None, 'fp8'")
        max_seq_len = cfg.max_seq_len if max_seq_len is None else max_seq_len
        if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= cfg.max_seq_len:
            raise ValueError(f"Engine: max_seq_len={max_seq_len!r}; expected 1 .. the model's "
                             f"max_seq_len={cfg.max_seq_len}")
        for name, value in (("max_slots", max_slots), ("page_size", page_size), ("decode_steps", decode_steps),
                            ("max_stop_tokens", max_stop_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Engine: {name}={value!r}; expected a positive int")
        if not isinstance(max_logprobs, int) or not 0 <= max_logprobs <= cfg.vocab_size:
            raise ValueError(f"Engine: max_logprobs={max_logprobs!r}; expected an int in [0, vocab_size]")
        prefill_chunk = min(512, max_seq_len) if prefill_chunk is None else prefill_chunk
        if not isinstance(prefill_chunk, int) or not 1 <= prefill_chunk <= max_seq_len:
            raise ValueError(f"Engine: prefill_chunk={prefill_chunk!r}; expected 1 .. max_seq_len={max_seq_len}")
        buckets = _geometric(min(32, prefill_chunk), prefill_chunk, 2) if prefill_buckets is None else sorted(
            set(prefill_buckets) | {prefill_chunk})
        if buckets[0] < 1 or buckets[-1] > prefill_chunk:
            raise ValueError(f"Engine: prefill_buckets={prefill_buckets!r}; expected lengths 1 .. "
                             f"prefill_chunk={prefill_chunk}")
        max_pages_per_seq = -(-max_seq_len // page_size)
        num_pages = max_slots * max_pages_per_seq + 1 if num_pages is None else num_pages
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"Engine: num_pages={num_pages!r}; expected an int >= 2 (page 0 is scratch)")

        stored = getattr(model, "stored_gemms", None) is not None  # kernels stored output first by the caller
        if cfg.scan_layers and stored:
            raise ValueError("Engine: a scanned model with kernels stored output first (mtjax.inference.fp8_weights) "
                             "cannot be unstacked; pass the model itself (and weights='fp8' for FP8 weights)")
        if not isinstance(output_first, bool):
            raise TypeError(f"Engine: output_first={output_first!r}; expected True or False")
        if weights == "fp8" and not output_first:
            raise ValueError("Engine: weights='fp8' stores the kernels output first; output_first=False "
                             "applies to 16-bit weights")
        if weights == "fp8" and stored:
            raise ValueError("Engine: weights='fp8' takes the model as trained; this one's kernels are stored "
                             "output first already (mtjax.inference.fp8_weights)")
        params = nn.meta.unbox(params)
        if cfg.scan_layers:  # scanned, every step would copy each layer's pages through the scan
            params = unstack_layers(params, cfg.num_layers)
            model = GPT(dataclasses.replace(cfg, scan_layers=False))
        if not stored and (weights == "fp8" or output_first):
            from mtjax.inference.fp8_weights import output_first_weights, quantize_weights
            store = quantize_weights if weights == "fp8" else output_first_weights
            model, params = store(model, params)
        if mesh is not None:
            replicated = NamedSharding(mesh, PartitionSpec())
            params = jax.tree.map(
                lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
                else jax.device_put(x, replicated), params)
        self.model, self.params = model, params
        self.max_seq_len, self.max_slots, self.decode_steps = max_seq_len, max_slots, decode_steps
        self.prefill_chunk, self.prefill_buckets, self.max_stop_tokens = prefill_chunk, tuple(buckets), max_stop_tokens
        self.max_logprobs = max_logprobs
        self.penalties = bool(penalties)
        # Per slot: how often each token was generated, and the prompt's tokens (penalties only).
        self._token_counts = None
        if self.penalties:
            self._token_counts = (jnp.zeros((max_slots, cfg.vocab_size), jnp.int32),
                                  jnp.zeros((max_slots, cfg.vocab_size), jnp.bool_))
            if mesh is not None:
                self._token_counts = jax.device_put(self._token_counts, NamedSharding(mesh, PartitionSpec()))
        self.kv_dtype = resolve_kv_dtype(kv_dtype, cfg.dtype)
        self.cache = KVCache(model, params, max_slots=max_slots, page_size=page_size, num_pages=num_pages,
                             max_seq_len=max_seq_len, dtype=self.kv_dtype, mesh=mesh, tp_axis=tp_axis,
                             prefix_caching=prefix_caching)
        max_prefill_tokens = max(2048, prefill_chunk) if max_prefill_tokens is None else max_prefill_tokens
        self.scheduler = Scheduler(self.cache, prefill_chunk=prefill_chunk, max_prefill_tokens=max_prefill_tokens,
                                   chunk_lengths=buckets)
        self.prefill_batch_sizes = {
            # Batch sizes grow by 4 (fewer compilations; a batch pads to at most 4x its rows).
            length: _geometric(1, max(1, min(max_slots, self.scheduler.max_prefill_tokens // length)), 4)
            for length in self.prefill_buckets}
        self._page_shardings = jax.tree.map(lambda x: x.sharding, self.cache.pages)
        self.compilations: collections.Counter[str] = collections.Counter()
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,))
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,), static_argnames=("whole",))
        self._score = jax.jit(self._score_fn)
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._inbox: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._generated_tokens = 0
        self._busy_seconds = 0.0

    # -- device functions ------------------------------------------------------------------------
    def _forward(self, params, pages, tokens, positions, view, logits_index=None):
        logits, variables = self.model.apply({"params": params, PAGED_KV_COLLECTION: pages}, tokens,
                                             positions=positions, paged_kv=view, logits_index=logits_index,
                                             mutable=[PAGED_KV_COLLECTION])
        pages = jax.lax.with_sharding_constraint(variables[PAGED_KV_COLLECTION], self._page_shardings)
        return logits, pages

    def _view(self, block_tables, lengths, slots, prefill):
        return PagedKV(block_tables=block_tables, lengths=lengths, slots=slots, num_pages=self.cache.num_pages,
                       page_size=self.cache.page_size, dtype=self.kv_dtype, prefill=prefill)

    def _prefill_fn(self, params, pages, tokens, positions, slots, block_tables, lengths, last, temperature, top_k,
                    top_p, keys, index, penalties, *, whole):
        self.compilations["prefill"] += 1  # runs when jax traces, i.e. on a compilation-cache miss
        view = self._view(block_tables, lengths, slots, whole)
        logits, pages = self._forward(params, pages, tokens, positions, view, logits_index=last)
        scores, counts = logits[:, 0], None
        if penalties is not None:
            (counts, seen), history, prompt_len, rows, emits, presence, frequency, repetition = penalties
            # Each row's counts and prompt tokens, from its whole sequence so far (prompt + output).
            batch, vocab = history.shape[0], counts.shape[1]
            at = jnp.arange(history.shape[1])[None, :]
            token = jnp.maximum(history, 0)
            row = jnp.broadcast_to(jnp.arange(batch)[:, None], history.shape)
            in_prompt = at < prompt_len[:, None]
            row_counts = jnp.zeros((batch, vocab), jnp.int32).at[row, token].add(
                ((history >= 0) & ~in_prompt).astype(jnp.int32))
            row_seen = jnp.zeros((batch, vocab), jnp.bool_).at[row, token].max((history >= 0) & in_prompt)
            scores = apply_penalties(scores, row_counts, row_seen, presence, frequency, repetition)
        new = sample(scores, temperature=temperature, top_k=top_k, top_p=top_p, keys=keys, index=index)
        if penalties is not None:  # the new token of a request's last chunk counts from now on
            row_counts = row_counts.at[jnp.arange(batch), new].add(emits.astype(jnp.int32))
            counts = (counts.at[rows].set(row_counts, mode="drop"), seen.at[rows].set(row_seen, mode="drop"))
        out = (new,) if not self.max_logprobs else (new, *token_logprobs(logits[:, 0], new, self.max_logprobs))
        return pages, counts, out

    def _decode_fn(self, params, pages, tokens, lengths, active, generated, max_tokens, temperature, top_k, top_p,
                   keys, stop, block_tables, penalties):
        self.compilations["decode"] += 1
        page_size, steps = self.cache.page_size, self.decode_steps
        last_page = block_tables.shape[1] - 1

        def body(i, carry):
            pages, tokens, lengths, active, generated, counts, out, logprobs = carry
            page_index = jnp.minimum(lengths // page_size, last_page)[:, None]
            page = jnp.take_along_axis(block_tables, page_index, axis=1)[:, 0]
            slot = jnp.where(active, page * page_size + lengths % page_size, SCRATCH_PAGE * page_size)
            view = self._view(block_tables, jnp.where(active, lengths + 1, 0), slot[:, None], False)
            positions = jnp.where(active, lengths, 0)[:, None]
            logits, pages = self._forward(params, pages, tokens[:, None], positions, view)
            scores = logits[:, -1]
            if penalties is not None:
                _, seen, presence, frequency, repetition = penalties
                scores = apply_penalties(scores, counts, seen, presence, frequency, repetition)
            new = sample(scores, temperature=temperature, top_k=top_k, top_p=top_p, keys=keys, index=generated)
            if self.max_logprobs:
                logprobs = tuple(x.at[:, i].set(y) for x, y in zip(
                    logprobs, token_logprobs(logits[:, -1], new, self.max_logprobs)))
            new = jnp.where(active, new, -1)
            if penalties is not None:
                counts = counts.at[jnp.arange(new.shape[0]), jnp.maximum(new, 0)].add(active.astype(jnp.int32))
            out = out.at[:, i].set(new)
            generated = generated + active
            finished = (generated >= max_tokens) | jnp.any(new[:, None] == stop, axis=-1)
            lengths = lengths + active
            tokens = jnp.where(active, new, tokens)
            return pages, tokens, lengths, active & ~finished, generated, counts, out, logprobs

        slots, top = tokens.shape[0], self.max_logprobs
        out = jnp.full((slots, steps), -1, jnp.int32)
        logprobs = () if not top else (jnp.zeros((slots, steps), jnp.float32),
                                       jnp.zeros((slots, steps, top), jnp.int32),
                                       jnp.zeros((slots, steps, top), jnp.float32))
        counts = None if penalties is None else penalties[0]
        carry = jax.lax.fori_loop(0, steps, body, (pages, tokens, lengths, active, generated, counts, out, logprobs))
        return carry[0], carry[5], (carry[-2], *carry[-1])

    # -- public API ------------------------------------------------------------------------------
    @property
    def max_cached_tokens(self) -> int:
        """The most cached tokens one request can hold: its prompt plus all its new tokens but the last."""
        return (self.cache.num_pages - 1) * self.cache.page_size

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queues ``prompt`` (token ids); returns its request id. Raises ValueError for an empty prompt,
        token ids outside the vocabulary, a prompt + ``max_tokens`` beyond ``max_seq_len`` or the
        cache, or more than ``max_stop_tokens`` stop tokens or stop ids outside the vocabulary."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Engine.add_request: params must be a SamplingParams; got {type(params).__name__}")
        prompt = self._token_ids("Engine.add_request", prompt)
        if len(prompt) + params.max_tokens > self.max_seq_len:
            raise ValueError(f"Engine.add_request: the prompt ({len(prompt)} tokens) plus "
                             f"max_tokens={params.max_tokens} exceed max_seq_len={self.max_seq_len}: ask for at most "
                             f"{max(self.max_seq_len - len(prompt), 0)} new tokens")
        needed = self.cache.pages_for(len(prompt) + params.max_tokens - 1)
        if needed > self.cache.num_pages - 1:
            raise ValueError(f"Engine.add_request: the request needs {needed} cache pages; the cache has "
                             f"{self.cache.num_pages - 1} (raise num_pages)")
        if len(params.stop) > self.max_stop_tokens:
            raise ValueError(f"Engine.add_request: {len(params.stop)} stop tokens; at most max_stop_tokens="
                             f"{self.max_stop_tokens}")
        vocab = self.model.config.vocab_size
        if any(t >= vocab for t in params.stop):
            raise ValueError(f"Engine.add_request: stop={params.stop!r}; stop token ids must be in [0, {vocab})")
        if params.logprobs is not None and (not self.max_logprobs or params.logprobs > self.max_logprobs):
            raise ValueError(f"Engine.add_request: logprobs={params.logprobs}; this engine returns "
                             + (f"at most {self.max_logprobs} alternatives" if self.max_logprobs else
                                "no log-probabilities (build it with max_logprobs > 0)"))
        if params.penalized and not self.penalties:
            raise ValueError("Engine.add_request: presence_penalty, frequency_penalty and repetition_penalty need "
                             "an Engine built with penalties=True")
        request_id = next(self._ids)
        self._inbox.append(("add", Request(request_id, prompt, params, arrival=request_id)))
        return request_id

    def abort(self, request_id: int) -> None:
        """Stops a request; its last `RequestOutput` (finish_reason ``"abort"``) comes from the next step."""
        self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        """Requests are queued or running."""
        return bool(self._inbox) or bool(self._requests)

    def stats(self) -> dict[str, Any]:
        """Queue length, running requests, free pages (cached ones included), preemptions, prefix-cache
        pages and the prompt tokens read from them, tokens/s and compilations so far."""
        sched = self.scheduler
        return dict(
            waiting=len(sched.waiting) + sum(1 for op, _ in list(self._inbox) if op == "add"),
            running=len(sched.running), free_pages=self.cache.num_free_pages, total_pages=self.cache.num_pages - 1,
            page_size=self.cache.page_size, max_slots=self.max_slots, preemptions=sched.num_preemptions,
            cached_pages=self.cache.num_cached_pages, cached_prompt_tokens=sched.num_cached_tokens,
            generated_tokens=self._generated_tokens,
            tokens_per_s=self._generated_tokens / self._busy_seconds if self._busy_seconds else 0.0,
            compilations=dict(self.compilations),
        )

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[list[int]]:
        """The new token ids of each prompt (one `SamplingParams` for all, or one per prompt)."""
        params = SamplingParams() if params is None else params
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"Engine.generate: {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt)]
        results: dict[int, list[int]] = {}
        wanted = set(ids)
        while wanted - results.keys():
            for output in self.step():
                if output.finished and output.request_id in wanted:
                    results[output.request_id] = output.token_ids
        return [results[i] for i in ids]

    def step(self) -> list[RequestOutput]:
        """Admits waiting requests, runs a prefill chunk of each admitted one and ``decode_steps``
        tokens of every decoding one; returns what changed (requests with new tokens or finished)."""
        with self._lock:
            start = time.perf_counter()
            changed: dict[int, list[int]] = {}
            self._drain_inbox(changed)
            sched = self.scheduler
            sched.admit(self.decode_steps)
            chunks = sched.prefill_chunks()
            for whole, length, batch in self._prefill_batches(chunks):
                self._run_prefill(batch, length, whole, changed)
            decoding = sched.reserve_decode(self.decode_steps)
            if decoding:
                self._run_decode(decoding, changed)
            outputs = []
            for request_id, new in changed.items():
                request = self._requests[request_id]
                finished = request.status == RequestStatus.FINISHED
                logprobs = None if request.params.logprobs is None else list(request.logprobs)
                outputs.append(RequestOutput(request_id, new, list(request.output), finished, request.finish_reason,
                                             logprobs))
                if finished:
                    del self._requests[request_id]
            self._generated_tokens += sum(len(o.new_token_ids) for o in outputs)
            self._busy_seconds += time.perf_counter() - start
            return outputs

    def warmup(self) -> None:
        """Compiles the decode and every prefill bucket now (padding rows only: no cache page changes)."""
        with self._lock:
            for length in self.prefill_buckets:
                for batch in self.prefill_batch_sizes[length]:
                    for whole in (True, False):
                        self._call_prefill([], length, batch, whole)
            self._call_decode([])

    def prompt_logprobs(self, prompt: Sequence[int], top: int = 0) -> list[TokenLogprobs | None]:
        """The log-probability of each token of ``prompt`` given the ones before it (None for the first),
        with the ``top`` likeliest alternatives: scoring a text (OpenAI's ``echo`` with ``logprobs``).
        One forward of the whole prompt, outside the cache (its length padded to a power of two).

        Raises:
          ValueError: an empty prompt, ids outside the vocabulary, more than ``max_seq_len`` tokens, or
            ``top`` above ``max_logprobs``.
        """
        ids = self._token_ids("Engine.prompt_logprobs", prompt)
        if len(ids) > self.max_seq_len:
            raise ValueError(f"Engine.prompt_logprobs: the prompt has {len(ids)} tokens; at most max_seq_len="
                             f"{self.max_seq_len}")
        if not isinstance(top, int) or not 0 <= top <= self.max_logprobs:
            raise ValueError(f"Engine.prompt_logprobs: top={top!r}; expected 0 .. max_logprobs={self.max_logprobs}")
        length = min(self.max_seq_len, 1 << max(len(ids) - 1, 31).bit_length())  # a power of two >= 32
        tokens = np.zeros((1, length), np.int32)
        tokens[0, :len(ids)] = ids
        with self._lock:
            chosen, top_ids, top_logprobs = (np.asarray(x) for x in self._score(self.params, tokens))
        # Position i's logits predict token i + 1.
        return [None] + [TokenLogprobs.from_arrays(chosen[i], top_ids[i], top_logprobs[i], top)
                         for i in range(len(ids) - 1)]

    def _token_ids(self, op: str, prompt: Sequence[int]) -> list[int]:
        """``prompt`` as a list of ints; ValueError when it is empty or leaves the vocabulary."""
        ids = [int(t) for t in np.asarray(prompt).reshape(-1)] if len(prompt) else []
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError(f"{op}: the prompt is empty; expected token ids")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"{op}: prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
        return ids

    def _score_fn(self, params, tokens):
        self.compilations["score"] += 1
        logits = self.model.apply({"params": params}, tokens)[0]
        return token_logprobs(logits[:-1], tokens[0, 1:], max(self.max_logprobs, 1))

    def set_kv_scales(self, k_scale: Any, v_scale: Any) -> None:
        """Float8 dequantization scales of every layer's pages (floats or ``[kv_heads]``)."""
        self._check_idle("set_kv_scales")
        self.cache.set_scales(k_scale, v_scale)

    def calibrate_kv_scales(self, prompts: Sequence[Sequence[int]], margin: float = 1.0) -> None:
        """Sets each layer's per-head float8 scales to ``margin * amax / 448`` of the keys and values
        the model computes on ``prompts`` (one float32 prefill, outside the engine's cache)."""
        self._check_idle("calibrate_kv_scales")
        if not self.cache.dtype == jnp.dtype(jnp.float8_e4m3fn):
            raise ValueError(f"Engine.calibrate_kv_scales: kv_dtype is {self.cache.dtype}, not fp8")
        prompts = [list(p) for p in prompts]
        if not prompts or min(len(p) for p in prompts) < 1 or max(len(p) for p in prompts) > self.max_seq_len:
            raise ValueError(f"Engine.calibrate_kv_scales: expected prompts of 1 .. {self.max_seq_len} tokens")
        width, page_size = max(len(p) for p in prompts), self.cache.page_size
        per_seq = -(-width // page_size)
        calib = KVCache(self.model, self.params, max_slots=len(prompts), page_size=page_size,
                        num_pages=1 + len(prompts) * per_seq, max_seq_len=width, dtype=jnp.float32)
        tokens = np.zeros((len(prompts), width), np.int32)
        slots = np.zeros((len(prompts), width), np.int32)  # padding: the scratch page
        for i, prompt in enumerate(prompts):
            calib.reserve(i, len(prompt))
            tokens[i, :len(prompt)] = prompt
            slots[i, :len(prompt)] = calib.slot_mapping(i, np.arange(len(prompt)))
        view = calib.view(calib.block_tables, [len(p) for p in prompts], slots, prefill=True)
        _, variables = jax.jit(lambda p, pages: self.model.apply(
            {"params": p, PAGED_KV_COLLECTION: pages}, jnp.asarray(tokens), paged_kv=view,
            mutable=[PAGED_KV_COLLECTION]))(self.params, calib.pages)
        amax = {}
        for path, leaf in jax.tree_util.tree_leaves_with_path(variables[PAGED_KV_COLLECTION]):
            axes = tuple(range(leaf.ndim - 3, leaf.ndim))  # pages, offset, head_dim
            amax[jax.tree_util.keystr(path[:-1]), path[-1].key[0]] = jnp.max(jnp.abs(leaf), axis=axes)

        def scale(path, leaf):
            name = getattr(path[-1], "key", "")
            if name not in ("k_scale", "v_scale"):
                return leaf
            value = jnp.maximum(margin * amax[jax.tree_util.keystr(path[:-1]), name[0]], 1e-6) / E4M3_MAX
            return jax.device_put(value.astype(jnp.float32), leaf.sharding)

        self.cache.pages = jax.tree_util.tree_map_with_path(scale, self.cache.pages)

    def _check_idle(self, what: str) -> None:
        if self.has_unfinished():
            raise RuntimeError(f"Engine.{what}: requests are queued or running; set the scales before the first "
                               f"request (pages already written keep their scaling)")

    # -- host side -------------------------------------------------------------------------------
    def _drain_inbox(self, changed: dict[int, list[int]]) -> None:
        while self._inbox:
            op, item = self._inbox.popleft()
            if op == "add":
                self._requests[item.request_id] = item
                self.scheduler.add(item)
            elif item in self._requests:
                self.scheduler.abort(self._requests[item])
                changed.setdefault(item, [])

    def _prefill_batches(self, chunks: list[PrefillChunk]):
        """Groups chunks by kind and padded length into batches of the compiled sizes."""
        groups: dict[tuple[bool, int], list[PrefillChunk]] = collections.defaultdict(list)
        for chunk in chunks:
            # A chunk after cached tokens has a bucket's length already (it cannot be padded).
            length = next(b for b in self.prefill_buckets if b >= chunk.length) if chunk.whole else chunk.length
            groups[(chunk.whole, length)].append(chunk)
        for (whole, length), group in groups.items():
            largest = self.prefill_batch_sizes[length][-1]
            for i in range(0, len(group), largest):
                yield whole, length, group[i:i + largest]

    def _sampling_rows(self, requests: list[Request | None], rows: int):
        temperature = np.zeros(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        top_p = np.ones(rows, np.float32)
        keys = np.zeros((rows, 2), np.uint32)
        for i, request in enumerate(requests):
            if request is not None:
                p = request.params
                # a top_k beyond the vocabulary keeps every token, as 0 does (and fits int32)
                top_k[i] = min(p.top_k, self.model.config.vocab_size)
                temperature[i], top_p[i], keys[i] = p.temperature, p.top_p, request_key(p.seed)
        return temperature, top_k, top_p, keys

    def _penalty_rows(self, requests: list[Request | None], rows: int) -> tuple[np.ndarray, ...]:
        """``(presence, frequency, repetition)`` per row (0, 0, 1 where none)."""
        presence, frequency = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
        repetition = np.ones(rows, np.float32)
        for i, request in enumerate(requests):
            if request is not None:
                p = request.params
                presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        return presence, frequency, repetition

    def _prefill_penalties(self, batch: list[PrefillChunk], rows: int) -> tuple[Any, ...] | None:
        """The prefill's penalty state: each row's whole sequence so far (-1 padded), prompt length,
        slot (``max_slots`` on padding rows: their results are dropped) and whether it emits a token."""
        if not self.penalties:
            return None
        history = np.full((rows, self.max_seq_len), -1, np.int32)
        prompt_len = np.zeros(rows, np.int32)
        slots = np.full(rows, self.max_slots, np.int32)
        emits = np.zeros(rows, bool)
        for i, chunk in enumerate(batch):
            sequence = chunk.request.sequence
            history[i, :len(sequence)] = sequence
            prompt_len[i], slots[i], emits[i] = len(chunk.request.prompt), chunk.request.slot, chunk.last
        return (self._token_counts, history, prompt_len, slots, emits,
                *self._penalty_rows([c.request for c in batch], rows))

    def _call_prefill(self, batch: list[PrefillChunk], length: int, rows: int, whole: bool) -> tuple[np.ndarray, ...]:
        cache = self.cache
        tokens = np.zeros((rows, length), np.int32)
        positions = np.zeros((rows, length), np.int32)
        slots = np.full((rows, length), SCRATCH_PAGE * cache.page_size, np.int32)
        tables = np.full((rows, cache.max_pages_per_seq), SCRATCH_PAGE, np.int32)
        lengths = np.zeros(rows, np.int32)
        last = np.zeros(rows, np.int32)
        index = np.zeros(rows, np.int32)
        for i, chunk in enumerate(batch):
            request, n = chunk.request, chunk.length
            span = np.arange(chunk.start, chunk.start + n)
            tokens[i, :n] = np.asarray(request.sequence, np.int32)[span]
            positions[i, :n] = span
            slots[i, :n] = cache.slot_mapping(request.slot, span)
            tables[i] = cache.block_tables[request.slot]
            lengths[i], last[i], index[i] = chunk.start + n, n - 1, len(request.output)
        sampling = self._sampling_rows([c.request for c in batch], rows)
        cache.pages, counts, new = self._prefill(self.params, cache.pages, tokens, positions, slots, tables, lengths,
                                                 last, *sampling, index, self._prefill_penalties(batch, rows),
                                                 whole=whole)
        if counts is not None:
            self._token_counts = counts
        return tuple(np.asarray(x) for x in new)

    def _run_prefill(self, batch: list[PrefillChunk], length: int, whole: bool, changed: dict[int, list[int]]) -> None:
        rows = next(b for b in self.prefill_batch_sizes[length] if b >= len(batch))
        new = self._call_prefill(batch, length, rows, whole)
        for row, chunk in enumerate(batch):
            request = chunk.request
            request.num_computed = chunk.start + chunk.length
            if chunk.last:
                request.status = RequestStatus.DECODING
                self.cache.register(request.slot, request.sequence, request.prefill_target)
                self._append(request, int(new[0][row]), changed, [x[row] for x in new[1:]])

    def _call_decode(self, requests: list[Request]) -> tuple[np.ndarray, ...]:
        slots = self.max_slots
        tokens = np.zeros(slots, np.int32)
        lengths = np.zeros(slots, np.int32)
        active = np.zeros(slots, bool)
        generated = np.zeros(slots, np.int32)
        max_tokens = np.zeros(slots, np.int32)
        stop = np.full((slots, self.max_stop_tokens), -1, np.int32)
        rows: list[Request | None] = [None] * slots
        for request in requests:
            s = request.slot
            rows[s] = request
            tokens[s], lengths[s], active[s] = request.output[-1], request.cache_length, True
            generated[s], max_tokens[s] = len(request.output), request.params.max_tokens
            stop[s, :len(request.params.stop)] = request.params.stop
        sampling = self._sampling_rows(rows, slots)
        penalties = None if not self.penalties else (*self._token_counts, *self._penalty_rows(rows, slots))
        self.cache.pages, counts, out = self._decode(self.params, self.cache.pages, tokens, lengths, active,
                                                     generated, max_tokens, *sampling, stop, self.cache.block_tables,
                                                     penalties)
        if counts is not None:
            self._token_counts = (counts, self._token_counts[1])
        return tuple(np.asarray(x) for x in out)

    def _run_decode(self, requests: list[Request], changed: dict[int, list[int]]) -> None:
        out, *logprobs = self._call_decode(requests)
        for request in requests:
            for i, token in enumerate(out[request.slot]):
                if token < 0 or request.status == RequestStatus.FINISHED:
                    break
                self._append(request, int(token), changed, [x[request.slot, i] for x in logprobs])

    def _append(self, request: Request, token: int, changed: dict[int, list[int]], logprobs: list[Any]) -> None:
        """Adds a new token (with its ``[logprob, top ids, top logprobs]`` when the engine computes them)."""
        if request.params.logprobs is not None:
            request.logprobs.append(TokenLogprobs.from_arrays(*logprobs, request.params.logprobs))
        request.output.append(token)
        changed.setdefault(request.request_id, []).append(token)
        if token in request.params.stop:
            self.scheduler.finish(request, "stop")
        elif len(request.output) >= request.params.max_tokens:
            self.scheduler.finish(request, "length")


