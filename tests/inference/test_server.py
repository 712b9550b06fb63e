"""`mtjax serve` end to end: a checkpoint written with the train API (and a chat template beside it), the
server started as a process, concurrent clients (aiohttp's), completions and chat completions checked
against `Engine.generate`, and bad requests answered with HTTP 400 while the server keeps serving."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from mtjax.generate import load_checkpoint
from mtjax.inference import Engine, SamplingParams
from mtjax.inference.server import Completion
from mtjax.train.checkpoint import Checkpointer
from mtjax.train.cli import RunConfig
from mtjax.train.state import init_train_state

pytestmark = pytest.mark.usefixtures("fast_compiles")

aiohttp = pytest.importorskip("aiohttp")

MAX_SLOTS, DECODE_STEPS, EOS = 4, 2, 256  # the byte tokenizer's end of document
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
PROMPTS = [[5, 6, 7], [100, 3, 3, 9, 250, 1, 2], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [300, 301], [1, 2, 3, 4]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run = RunConfig(preset="tiny", model="tiny", model_overrides={"vocab_size": 384}, tokenizer="byte", batch_size=2,
                    seq_len=32, steps=0, learning_rate=1e-3, warmup_steps=0, grad_accum=1, seed=0, fp8=False)
    from mtjax.models import GPT

    state = init_train_state(GPT(run.model_config()), optax.adamw(1e-3), jax.random.PRNGKey(3), (1, 8))
    workdir = tmp_path_factory.mktemp("serve_run")
    with Checkpointer(workdir / "checkpoints", save_every=None, async_save=False) as checkpointer:
        checkpointer.save(0, state, {"run": dataclasses.asdict(run)}, force=True)
    (workdir / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # found in the checkpoint folder
    return workdir


@pytest.fixture(scope="module")
def server(checkpoint):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtjax.cli", "serve", "--checkpoint", str(checkpoint), "--port", str(port),
         "--no-warmup", "--max-slots", str(MAX_SLOTS), "--decode-steps", str(DECODE_STEPS), "--model-name", "tiny"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mtjax serve exited with {proc.returncode}:\n{proc.stdout.read()}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("mtjax serve did not start listening within 300 s")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, params, tokenizer = load_checkpoint(checkpoint)
    engine = Engine(model, params, max_slots=MAX_SLOTS, decode_steps=DECODE_STEPS)
    return engine, tokenizer


async def post(session, url, body, *, raw=None, route="/v1/completions"):
    async with session.post(url + route, data=raw if raw is not None else json.dumps(body),
                            headers={"Content-Type": "application/json"}) as response:
        return response.status, await response.json()


async def post_stream(session, url, body, route="/v1/completions"):
    chunks = []
    async with session.post(url + route, json={**body, "stream": True}) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for line in response.content:
            line = line.decode().strip()
            if not line:
                continue
            assert line.startswith("data: ")
            chunks.append(line[len("data: "):])
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


def test_concurrent_requests_match_engine_generate(server, reference):
    engine, _ = reference
    max_tokens = [9, 5, 12, 3, 7, 10]
    want = [engine.generate([p], SamplingParams(max_tokens=n, temperature=0.0))[0] for p, n in zip(PROMPTS, max_tokens)]

    async def main():
        async with aiohttp.ClientSession() as session:
            plain = [post(session, server, {"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True})
                     for p, n in zip(PROMPTS[:4], max_tokens[:4])]
            streamed = [post_stream(session, server, {"prompt": p, "max_tokens": n, "temperature": 0,
                                                      "ignore_eos": True, "stream_options": {"include_usage": usage}})
                        for p, n, usage in zip(PROMPTS[4:], max_tokens[4:], (True, False))]
            return await asyncio.gather(*plain, *streamed)

    results = asyncio.run(main())  # 6 clients at once on 4 slots: some wait for a slot
    for i, result in enumerate(results[:4]):
        status, body = result
        assert status == 200, body
        [choice] = body["choices"]
        assert choice["token_ids"] == want[i]
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(PROMPTS[i]), "completion_tokens": max_tokens[i],
                                 "total_tokens": len(PROMPTS[i]) + max_tokens[i]}
        assert body["object"] == "text_completion" and body["model"] == "tiny"
    for i, chunks in enumerate(results[4:], start=4):
        tokens = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
        assert tokens == want[i]
        if i == 4:  # include_usage: every chunk has "usage", null but in the last, which has no choices
            assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
            assert chunks[-1]["usage"]["completion_tokens"] == max_tokens[i]
            chunks = chunks[:-1]
        else:
            assert all("usage" not in c and c["choices"] for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_choices_per_prompt_draw_with_consecutive_seeds(server, reference):
    engine, _ = reference
    prompts = [PROMPTS[0], PROMPTS[2]]
    want = [engine.generate([p], SamplingParams(max_tokens=6, temperature=1.0, seed=5 + j))[0]
            for p in prompts for j in range(3)]

    async def main():
        async with aiohttp.ClientSession() as session:
            return await post(session, server, {"prompt": prompts, "n": 3, "max_tokens": 6, "seed": 5,
                                                "ignore_eos": True})

    status, body = asyncio.run(main())
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["token_ids"] for c in body["choices"]] == want
    assert body["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[1])  # each prompt once


def test_text_prompts_batches_and_stop_strings(server, reference):
    engine, tokenizer = reference
    prompt = "The quick"
    ids = [int(t) for t in tokenizer.encode(prompt)]
    free = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, stop=(EOS,)))[0]

    async def main(body):
        async with aiohttp.ClientSession() as session:
            return await post(session, server, body)

    status, body = asyncio.run(main({"prompt": [prompt, ids], "max_tokens": 12, "temperature": 0}))
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        assert choice["token_ids"] == free
        assert choice["text"] == tokenizer.decode([t for t in free if t != EOS])
    text = body["choices"][0]["text"]
    if len(text) >= 4:  # a stop string taken from the answer cuts it there
        stop = text[2:4]
        status, body = asyncio.run(main({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]}))
        assert status == 200, body
        assert body["choices"][0]["text"] == text[:text.find(stop)]
        assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body,raw,param", [
    (None, "{not json", None),
    ([1, 2], None, None),
    ({"max_tokens": 4}, None, "prompt"),
    ({"prompt": ""}, None, "prompt"),
    ({"prompt": [1.5, 2]}, None, "prompt"),
    ({"prompt": [1000]}, None, "prompt"),  # outside the vocabulary
    ({"prompt": [1] * 200}, None, "prompt"),  # longer than the model's 128 tokens
    ({"prompt": [1], "max_tokens": 500}, None, "max_tokens"),
    ({"prompt": [1], "max_tokens": "ten"}, None, "max_tokens"),
    ({"prompt": [1], "temperature": -1}, None, "temperature"),
    ({"prompt": [1], "top_p": 0}, None, "top_p"),
    ({"prompt": [1], "n": 0}, None, "n"),
    ({"prompt": [1], "n": 17}, None, "n"),
    ({"prompt": [1], "n": 2, "best_of": 3}, None, "best_of"),
    ({"prompt": [1], "presence_penalty": 0.5}, None, "presence_penalty"),
    ({"prompt": [1], "logit_bias": {"5": 10}}, None, "logit_bias"),
    ({"prompt": [1], "stream": "yes"}, None, "stream"),
    ({"prompt": [1], "stop": [""]}, None, "stop"),
    ({"prompt": [1], "stop_token_ids": [2**40]}, None, "stop_token_ids"),  # outside the vocabulary
    ({"prompt": [1], "stream_options": {"include_usage": True}}, None, "stream_options"),  # without stream
    ({"prompt": [1], "stream": True, "stream_options": {"include_usage": 1}}, None, "stream_options"),
])
def test_bad_requests_get_400_and_the_server_lives(server, body, raw, param):
    async def main():
        async with aiohttp.ClientSession() as session:
            status, answer = await post(session, server, body, raw=raw)
            async with session.get(server + "/health") as health:
                healthy = health.status, await health.json()
            return status, answer, healthy

    status, answer, healthy = asyncio.run(main())
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
    assert answer["error"]["param"] == param
    assert healthy == (200, {"status": "ok"})


def test_chat_completions_render_the_template_and_match_engine_generate(server, reference):
    engine, tokenizer = reference
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    text = "<system>Be brief.\n<user>Hi there\n<assistant>"
    want = engine.generate([[int(t) for t in tokenizer.encode(text)]],
                           SamplingParams(max_tokens=10, temperature=0.0, stop=(EOS,)))[0]
    body = {"messages": messages, "max_completion_tokens": 10, "temperature": 0}

    async def main():
        async with aiohttp.ClientSession() as session:
            return (await post(session, server, body, route="/v1/chat/completions"),
                    await post_stream(session, server, body, route="/v1/chat/completions"))

    (status, answer), chunks = asyncio.run(main())
    assert status == 200, answer
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    [choice] = answer["choices"]
    assert choice["token_ids"] == want
    assert choice["message"] == {"role": "assistant", "content": tokenizer.decode([t for t in want if t != EOS])}
    assert answer["usage"]["prompt_tokens"] == len(text.encode())
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_logprobs_of_completions_and_chat_streamed_or_not(server):
    completion = {"prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 3}

    async def main():
        async with aiohttp.ClientSession() as session:
            return (await post(session, server, completion), await post_stream(session, server, completion),
                    await post(session, server, chat, route="/v1/chat/completions"),
                    await post_stream(session, server, chat, route="/v1/chat/completions"))

    (status, plain), plain_chunks, (chat_status, chat_answer), chat_chunks = asyncio.run(main())
    assert status == 200 and chat_status == 200, (plain, chat_answer)
    [choice] = plain["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(choice["token_ids"]) == 5
    for token_logprob, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert len(top) <= 2 and token_logprob <= 0.0
        assert max(top.values()) == pytest.approx(token_logprob)  # greedy: the token is the likeliest
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    streamed = [x for c in plain_chunks for ch in c["choices"] for x in ch["logprobs"]["token_logprobs"]]
    assert streamed == logprobs["token_logprobs"]
    content = chat_answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        assert entry["bytes"] == list(entry["token"].encode())
    streamed = [x for c in chat_chunks for ch in c["choices"] for x in (ch["logprobs"] or {}).get("content", [])]
    assert [x["logprob"] for x in streamed] == [x["logprob"] for x in content]


def test_echo_scores_the_prompt(server, reference):
    """lm-eval-harness' log-likelihood request: ``echo`` with ``logprobs`` and ``max_tokens: 0``."""
    engine, tokenizer = reference
    text = "The quick brown"
    ids = [int(t) for t in tokenizer.encode(text)]
    want = engine.prompt_logprobs(ids)
    greedy = engine.generate([ids], SamplingParams(max_tokens=3, temperature=0.0, stop=(EOS,)))[0]

    async def main():
        async with aiohttp.ClientSession() as session:
            return (await post(session, server, {"prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0}),
                    await post(session, server, {"prompt": text, "echo": True, "max_tokens": 3, "temperature": 0}))

    (status, scored), (status_2, echoed) = asyncio.run(main())
    assert status == 200 and status_2 == 200, (scored, echoed)
    [choice] = scored["choices"]
    assert choice["text"] == text and choice["token_ids"] == [] and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None and all(len(t) == 1 for t in logprobs["top_logprobs"][1:])
    np.testing.assert_allclose(logprobs["token_logprobs"][1:], [e.logprob for e in want[1:]], rtol=1e-4, atol=1e-4)
    assert logprobs["text_offset"] == list(range(len(ids)))  # one byte per token
    assert scored["usage"]["completion_tokens"] == 0
    assert echoed["choices"][0]["text"] == text + tokenizer.decode([t for t in greedy if t != EOS])
    assert echoed["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": [1], "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": [1], "echo": True, "stream": True}, "echo"),
    ("/v1/completions", {"prompt": [1], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [1], "echo": "yes"}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
])
def test_bad_logprobs_and_echo_get_400(server, route, body, param):
    async def main():
        async with aiohttp.ClientSession() as session:
            return await post(session, server, body, route=route)

    status, answer = asyncio.run(main())
    assert status == 400 and answer["error"]["param"] == param, answer


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 4}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
])
def test_bad_chat_requests_get_400(server, body, param):
    async def main():
        async with aiohttp.ClientSession() as session:
            return await post(session, server, body, route="/v1/chat/completions")

    status, answer = asyncio.run(main())
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["message"]


def test_too_long_prompt_says_how_long(server):
    async def main():
        async with aiohttp.ClientSession() as session:
            return await post(session, server, {"prompt": [1] * 200})

    _, answer = asyncio.run(main())
    assert "200 tokens" in answer["error"]["message"] and "at most 127" in answer["error"]["message"]


def test_top_k_beyond_the_vocabulary_keeps_every_token(server):
    async def main():
        async with aiohttp.ClientSession() as session:
            return await post(session, server, {"prompt": [1], "max_tokens": 2, "top_k": 2**31, "seed": 1})

    status, answer = asyncio.run(main())
    assert status == 200, answer


def test_a_stop_string_ends_one_streamed_choice_once(server, reference):
    _, tokenizer = reference
    body = {"prompt": "The quick", "n": 2, "max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True}

    async def main(extra, stream):
        async with aiohttp.ClientSession() as session:
            if stream:
                return await post_stream(session, server, body | extra)
            return await post(session, server, body | extra)

    status, free = asyncio.run(main({}, False))
    assert status == 200, free
    text = free["choices"][0]["text"]
    if len(text) < 3:
        pytest.skip("the sampled answer is too short to take a stop string from")
    stop = text[1:3]
    chunks = asyncio.run(main({"stop": [stop]}, True))
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert [ch["finish_reason"] is not None for ch in mine].count(True) == 1  # one final chunk, the last
        assert mine[-1]["finish_reason"] is not None
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == 0)
    assert streamed == text[:text.find(stop)]


def test_health_metrics_and_unknown_routes(server):
    async def main():
        async with aiohttp.ClientSession() as session:
            await post(session, server, {"prompt": [3, 4], "max_tokens": 2})
            async with session.get(server + "/metrics") as metrics:
                text = await metrics.text()
            async with session.get(server + "/v1/nothing") as missing:
                return text, missing.status, await missing.json()

    text, status, missing = asyncio.run(main())
    samples = [line.split() for line in text.splitlines() if line and not line.startswith("#")]
    values = {name: float(value) for name, value in samples}
    assert values["mtjax_requests_waiting"] == 0
    assert values["mtjax_generated_tokens_total"] >= 2
    assert values["mtjax_prefix_cache_hit_tokens_total"] >= 0 and "mtjax_prefix_cache_pages" in values
    assert "mtjax_tokens_per_second" in values and 'mtjax_http_responses_total{status="200"}' in values
    assert status == 404 and "error" in missing


def test_completion_streams_text_but_holds_back_a_possible_stop():
    class Chars:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    class Output:
        def __init__(self, ids, finished=False):
            self.token_ids, self.finished, self.finish_reason = ids, finished, "length" if finished else None
            self.logprobs = None

    c = Completion(0, [1], ["xyz"], frozenset(), Chars())
    c.update(Output([ord(ch) for ch in "abcx"]))
    assert c.delta() == "ab"  # the last len("xyz") - 1 characters may begin the stop string
    c.update(Output([ord(ch) for ch in "abcxyzq"]))
    assert c.finish_reason == "stop" and c.text == "abc" and c.delta() == "c"
    assert c.token_ids == [ord(ch) for ch in "abcxyz"]  # up to the token that completes the stop string


def test_the_earliest_stop_string_ends_a_completion_and_cuts_its_tokens():
    class Chars:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    class Output:
        def __init__(self, text):
            self.token_ids, self.finished, self.finish_reason = [ord(ch) for ch in text], False, None
            self.logprobs = list(range(len(text)))

    c = Completion(0, [1], ["zz", "b"], frozenset(), Chars())
    c.update(Output("a"))
    assert c.finish_reason is None
    c.update(Output("abczzb"))  # "b" comes first though listed second
    assert c.finish_reason == "stop" and c.text == "a"
    assert c.token_ids == [ord("a"), ord("b")] and c.logprobs == [0, 1]


def test_penalties_are_parsed_where_the_engine_tracks_them(reference):
    """`mtjax serve --penalties`: the request's presence, frequency and repetition penalties reach its
    `SamplingParams`; without the option they get a 400 that names it; out-of-range values a 400."""
    from mtjax.inference.server import CompletionServer, RequestError

    engine, tokenizer = reference
    body = {"prompt": [1], "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2}
    with pytest.raises(RequestError, match="--penalties") as refused:
        CompletionServer(engine, tokenizer)._sampling(body, [[1]], chat=False)
    assert refused.value.param.endswith("_penalty")
    server = CompletionServer(Engine(engine.model, engine.params, max_slots=2, penalties=True), tokenizer)
    p = server._sampling(body, [[1]], chat=False).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2)
    for name, value in (("presence_penalty", 2.5), ("frequency_penalty", "x"), ("repetition_penalty", 0)):
        with pytest.raises(RequestError) as refused:
            server._sampling({"prompt": [1], name: value}, [[1]], chat=False)
        assert refused.value.param == name
