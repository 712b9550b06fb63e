"""``mtjax bench decode``: prefill and decode of the inference engine, its peers, and the paged-attention kernel.

Rows (suite ``decode``; every one that fails records its error in the table and the run goes on):

- ``prefill <model> 8x2048``: the whole-prompt forward the engine's prefill runs (flash attention,
  pages written), tokens/s in ``extra`` and MFU from the forward FLOPs.
- ``decode <model> b<batch> ctx<context>``: ms per decoded token of the whole batch, for
  ``mtjax bf16`` (the peer of the case; kernels stored output axes first, as the engine stores
  them), ``mtjax fp8 weights`` (the default ``mode="auto"``: weight-only at small batches),
  ``mtjax fp8 kv``, ``mtjax bf16 model layout`` (the kernels as the model has them); the decode loop
  the engine runs (greedy, ``DECODE_STEPS`` tokens per dispatch, the cache donated) on a cache filled
  to ``context`` tokens per sequence (and ``mtjax fp8 weights fp8_gemm``, the FP8 GEMMs, where the
  default runs weight-only). ``bytes`` counts the weights plus the KV-cache read per step, so
  ``of ceiling`` is the fraction of the memory roofline (the measured copy bandwidth). Also the old
  token-at-a-time loop (one jitted call per token over a dense cache, batch 1) and HF transformers +
  torch eager with its dynamic cache (same shapes, random weights, no downloads) where installed.
- ``engine generate <model> ...``: `mtjax.inference.Engine.generate` end to end (prefill, continuous
  batching, sampling on the device, host bookkeeping), tokens/s in ``extra``.
- ``paged_attention b<batch> ctx<context> <dtype>``: the decode attention op alone at llama-1b's
  shape (32 query / 8 KV heads of 64): ``pallas_triton``, ``xla`` (the peer) and cuDNN's paged flash
  attention in its own cache layout; GB/s of the KV read and its fraction of the copy bandwidth.

``--quick`` runs the tiny model at toy sizes (a CPU smoke test; the kernel in interpret mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtjax.bench import timing, variants

SUITE = "decode"
MODELS = ("llama-1b", "gpt-1.3b")
BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 2048, 8192)
PAGE_SIZE = 16
DECODE_STEPS = 8
PREFILL = (8, 2048)  # sequences x tokens
HF_BATCHES = (1, 32)
# Leave this fraction of the device's memory for weights, activations and XLA's buffers.
CACHE_MEMORY_FRACTION = 0.7


@dataclasses.dataclass(frozen=True)
class Sizes:
    models: tuple[str, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill: tuple[int, int]
    steps: int
    runs: int
    hf_batches: tuple[int, ...]


FULL = Sizes(MODELS, BATCHES, CONTEXTS, PREFILL, DECODE_STEPS, runs=10, hf_batches=HF_BATCHES)
QUICK = Sizes(("tiny",), (2,), (32, 64), (2, 32), steps=2, runs=2, hf_batches=(1,))


def error_row(name: str, implementation: str, err: BaseException | str, **extra: Any) -> dict:
    """`timing.error_row` of this suite."""
    return timing.error_row(SUITE, name, implementation, err, **extra)


def skipped_row(name: str, implementation: str, reason: str) -> dict:
    row = timing.row(SUITE, name, f"{implementation} skipped: {reason}", timing.Timing(math.nan, math.nan, math.nan, 0),
                     skipped=reason)
    return row | {"time_ms": None, "time_ms_min": None, "time_ms_max": None}


def guarded(name: str, implementation: str, fn: Callable[[], dict | list[dict]]) -> list[dict]:
    """``fn()``'s row(s), or an `error_row` when it raises (out of memory, a kernel that does not compile...)."""
    try:
        out = fn()
        return out if isinstance(out, list) else [out]
    except Exception as err:  # noqa: BLE001 - every failure becomes a row; the run goes on
        return [error_row(name, implementation, err)]


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def model_and_params(name: str, max_seq_len: int):
    """A `mtjax.models.GPT` preset (``max_seq_len`` raised to the contexts benchmarked) with random
    weights in its compute dtype, unboxed."""
    import flax.linen as nn

    from mtjax.models import GPT, gpt_config

    cfg = gpt_config(name)
    cfg = gpt_config(name, max_seq_len=max(cfg.max_seq_len, max_seq_len))
    model = GPT(cfg)
    init = jax.jit(lambda key: nn.meta.unbox(model.init(key, jnp.zeros((1, 8), jnp.int32))["params"]))
    params = init(jax.random.key(0))
    params = jax.tree.map(lambda x: x.astype(cfg.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    return model, params


def tree_bytes(tree: Any) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


# --------------------------------------------------------------------------------------------------
# The engine's decode loop on a filled cache
# --------------------------------------------------------------------------------------------------


def decode_loop(model, page_size: int, num_pages: int, kv_dtype: Any, steps: int):
    """``(params, pages, tokens, lengths, block_tables) -> (pages, tokens, lengths)``: ``steps`` greedy
    decode steps of every sequence, as `mtjax.inference.Engine` dispatches them (jitted, pages donated)."""
    from mtjax.flax import PagedKV
    from mtjax.flax.attention import PAGED_KV_COLLECTION

    def run(params, pages, tokens, lengths, block_tables):
        def body(_, carry):
            pages, tokens, lengths = carry
            page = jnp.take_along_axis(block_tables, (lengths // page_size)[:, None], axis=1)[:, 0]
            slots = (page * page_size + lengths % page_size)[:, None]
            view = PagedKV(block_tables=block_tables, lengths=lengths + 1, slots=slots, num_pages=num_pages,
                           page_size=page_size, dtype=kv_dtype, prefill=False)
            logits, variables = model.apply({"params": params, PAGED_KV_COLLECTION: pages}, tokens[:, None],
                                            positions=lengths[:, None], paged_kv=view, mutable=[PAGED_KV_COLLECTION])
            new = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
            return variables[PAGED_KV_COLLECTION], new, lengths + 1

        return jax.lax.fori_loop(0, steps, body, (pages, tokens, lengths))

    return jax.jit(run, donate_argnums=(1,))


def _cache(model, params, batch: int, context: int, kv_dtype: Any):
    from mtjax.inference import KVCache

    pages_per_seq = math.ceil(context / PAGE_SIZE)
    num_pages = batch * pages_per_seq + 1  # page 0: scratch
    cache = KVCache(model, params, max_slots=batch, page_size=PAGE_SIZE, num_pages=num_pages,
                    max_seq_len=pages_per_seq * PAGE_SIZE, dtype=kv_dtype)
    tables = 1 + np.arange(batch * pages_per_seq, dtype=np.int32).reshape(batch, pages_per_seq)
    return cache, jnp.asarray(tables)


def decode_rows_of_batch(model_name: str, implementation: str, model, params, batch: int, contexts: Sequence[int],
                         kv_dtype: Any, sizes: Sizes, setting: variants.Setting = variants.DEFAULT,
                         profile_dir: str | None = None) -> list[dict]:
    """One row per context: a cache of ``batch`` sequences of the longest context (one compilation),
    timed with every sequence at ``context - steps`` tokens (each call rewrites the same last ``steps``).
    ``setting``: kernel choices forced while tracing and XLA options of the compilation; ``profile_dir``:
    also a device-time profile of each row (`mtjax.bench.profile`), its trace written there."""
    timing.note(f"decode {model_name} b{batch} {implementation}: cache of {max(contexts)} tokens, compiling")
    cache, tables = _cache(model, params, batch, max(contexts), kv_dtype)
    steps = sizes.steps
    loop = decode_loop(model, PAGE_SIZE, cache.num_pages, cache.dtype, steps)
    lengths0 = jnp.zeros((batch,), jnp.int32)
    with variants.mtjax_context(False, setting):
        lowered = loop.lower(params, cache.pages, lengths0, lengths0, tables)
    step, _ = timing.compile_lowered(lowered, setting.xla_options)
    weights = tree_bytes(params)
    # a setting's row against the same weights without it; the others against bf16
    peer = ("mtjax fp8 weights" if implementation.startswith("mtjax fp8 weights [") else
            None if implementation == "mtjax bf16" else "mtjax bf16")
    rows = []
    state = (cache.pages, jnp.zeros((batch,), jnp.int32))
    for context in contexts:
        name = f"decode {model_name} b{batch} ctx{context}"
        lengths = jnp.full((batch,), max(context - steps, 0), jnp.int32)

        def call(state, _, lengths=lengths):
            pages, tokens = state
            pages, tokens, _ = step(params, pages, tokens, lengths, tables)
            return (pages, tokens), tokens

        try:
            t, (state, _) = timing.measure_steps(call, state, [None], warmup=2, runs=sizes.runs, steps_per_sample=3)
        except Exception as err:  # noqa: BLE001 - recorded; the cache may be gone (donated), so stop this batch
            rows.append(error_row(name, implementation, err))
            break
        per_token = timing.Timing(t.median / steps, t.min / steps, t.max / steps, t.runs)
        kv_read = cache.bytes_per_page / PAGE_SIZE * (context - steps / 2) * batch
        extra = {}
        if profile_dir is not None:
            state, extra = _profiled(call, state, step, steps, profile_dir, f"{name} {implementation}")
        rows.append(timing.row(SUITE, name, implementation, per_token, bytes=int(weights + kv_read), peer=peer,
                               ceiling="copy_gbps", batch=batch, context=context, tokens_per_s=batch / per_token.median,
                               weight_bytes=weights, kv_bytes_read=int(kv_read), steps_per_dispatch=steps, **extra))
    return rows


def _profiled(call, state, compiled, steps: int, profile_dir: str, label: str) -> tuple[Any, dict]:
    """Device time per decoded token of ``call`` (the compiled decode loop), by category and source op;
    the Perfetto trace is kept in ``profile_dir``. Returns the threaded state and the row's extra fields."""
    from mtjax.bench import profile

    box = [state]

    def once():
        box[0], out = call(box[0], None)
        return out

    summary = profile.profile(once, steps=2, out_dir=profile_dir, label=label.replace(" ", "_"),
                              hlo_text=compiled.as_text())
    per_token = {k: v / steps for k, v in summary["by_category_ms"].items()}
    timing.note(profile.format_summary(f"{label} (per dispatch of {steps} tokens)", summary, top=15))
    return box[0], {"profile_device_ms_per_token": summary["device_ms_per_step"] / steps,
                    "profile_by_category_ms_per_token": per_token,
                    "profile_by_source_ms_per_dispatch": summary.get("by_source_ms", {})}


def decode_rows(model_name: str, sizes: Sizes, settings: Sequence[variants.Setting] = (),
                profile_dir: str | None = None) -> list[dict]:
    from mtjax.inference.fp8_weights import WEIGHT_ONLY_MAX_ROWS, output_first_weights, quantize_weights

    rows: list[dict] = []
    memory = timing.device_memory_bytes()
    timing.note(f"decode {model_name}: building the model")
    try:
        model, params = model_and_params(model_name, max(sizes.contexts))
    except Exception as err:  # noqa: BLE001
        return [error_row(f"decode {model_name}", "mtjax", err)]
    cfg = model.config
    made: dict[str, Any] = {}

    def fp8_model(mode):
        if mode not in made:
            made[mode] = quantize_weights(model, params, mode=mode)
        return made[mode]

    def output_first_model():  # the engine's layout of 16-bit weights
        if "output first" not in made:
            made["output first"] = output_first_weights(model, params)
        return made["output first"]

    cases = [("mtjax bf16", output_first_model, cfg.dtype, variants.DEFAULT),
             ("mtjax fp8 weights", lambda: fp8_model("auto"), cfg.dtype, variants.DEFAULT),
             ("mtjax fp8 weights fp8_gemm", lambda: fp8_model("fp8_gemm"), cfg.dtype, variants.DEFAULT),
             ("mtjax fp8 kv", output_first_model, jnp.float8_e4m3fn, variants.DEFAULT),
             ("mtjax bf16 model layout", lambda: (model, params), cfg.dtype, variants.DEFAULT)]
    cases += [(f"mtjax bf16 [{s.label()}]", output_first_model, cfg.dtype, s) for s in settings]
    cases += [(f"mtjax fp8 weights [{s.label()}]", lambda: fp8_model("auto"), cfg.dtype, s) for s in settings]
    for batch in sizes.batches:
        for label, make, kv_dtype, setting in cases:
            if label.endswith("fp8_gemm") and batch > WEIGHT_ONLY_MAX_ROWS:
                continue  # the default row runs the FP8 GEMMs there already
            per_token = (2 * cfg.num_layers * cfg.resolved_num_kv_heads * cfg.resolved_head_dim
                         * jnp.dtype(kv_dtype).itemsize)
            fits = [c for c in sizes.contexts if not memory or per_token * batch * c <= CACHE_MEMORY_FRACTION * memory]
            for context in sizes.contexts:
                if context not in fits:
                    need = per_token * batch * context / 2**30
                    rows.append(skipped_row(f"decode {model_name} b{batch} ctx{context}", label,
                                            f"a {need:.0f} GiB cache exceeds {CACHE_MEMORY_FRACTION:.0%} of "
                                            "the device"))
            if not fits:
                continue

            def one(make=make, label=label, batch=batch, kv_dtype=kv_dtype, fits=fits, setting=setting):
                m, p = make()
                return decode_rows_of_batch(model_name, label, m, p, batch, fits, kv_dtype, sizes, setting,
                                            profile_dir)

            rows += guarded(f"decode {model_name} b{batch} ctx{fits[0]}", label, one)
    made.clear()
    first = f"decode {model_name} b1 ctx{sizes.contexts[0]}"
    rows += guarded(first, "old loop", lambda: old_loop_row(first, model, params, sizes))
    for context in sizes.contexts[:2]:
        for batch in sizes.hf_batches:
            rows += hf_rows(f"decode {model_name} b{batch} ctx{context}", model, batch, context, sizes)
    return _drop_failed_peers(rows)


def _drop_failed_peers(rows: list[dict]) -> list[dict]:
    """Rows whose peer has no time compare with nothing (the report divides by the peer's time)."""
    timed = {(r["name"], r["implementation"]) for r in rows if r["time_ms"] is not None}
    for r in rows:
        if r["peer"] is not None and (r["name"], r["peer"]) not in timed:
            r["peer"] = None
    return rows


# --------------------------------------------------------------------------------------------------
# Prefill and the engine end to end
# --------------------------------------------------------------------------------------------------


def prefill_row(model_name: str, sizes: Sizes) -> list[dict]:
    from mtjax.flax import PagedKV
    from mtjax.flax.attention import PAGED_KV_COLLECTION

    batch, length = sizes.prefill
    name = f"prefill {model_name} {batch}x{length}"

    def one():
        model, params = model_and_params(model_name, length)
        cache, tables = _cache(model, params, batch, length, model.config.dtype)
        slots = (tables[:, :, None] * PAGE_SIZE + jnp.arange(PAGE_SIZE)[None, None, :]).reshape(batch, -1)[:, :length]
        view = PagedKV(block_tables=tables, lengths=jnp.full((batch,), length, jnp.int32), slots=slots,
                       num_pages=cache.num_pages, page_size=PAGE_SIZE, dtype=cache.dtype, prefill=True)
        last = jnp.full((batch,), length - 1, jnp.int32)

        @functools.partial(jax.jit, donate_argnums=(1,))
        def prefill(params, pages, tokens):
            logits, variables = model.apply({"params": params, PAGED_KV_COLLECTION: pages}, tokens, paged_kv=view,
                                            logits_index=last, mutable=[PAGED_KV_COLLECTION])
            return variables[PAGED_KV_COLLECTION], jnp.argmax(logits[:, -1], axis=-1)

        keys = jax.random.split(jax.random.key(1), 4)
        batches = [jax.random.randint(k, (batch, length), 0, model.config.vocab_size) for k in keys]

        def call(pages, tokens):
            return prefill(params, pages, tokens)

        t, _ = timing.measure_steps(call, cache.pages, batches, runs=sizes.runs, steps_per_sample=1)
        flops = model.config.flops_per_token(length) / 3 * batch * length  # the forward third of training's
        return timing.row(SUITE, name, "mtjax", t, flops=flops, tokens_per_s=batch * length / t.median)

    return guarded(name, "mtjax", one)


def engine_row(model_name: str, sizes: Sizes) -> list[dict]:
    """``Engine.generate`` end to end on a batch of random prompts, greedy; beside it the same with
    presence, frequency and repetition penalties (``Engine(penalties=True)``: its per-slot token counts
    read and updated at every decoded token), against the first."""
    from mtjax.inference import Engine, SamplingParams

    batch = max(sizes.batches[:3])
    prompt_len, new = (sizes.contexts[0] // 2, sizes.contexts[0] // 4)
    name = f"engine generate {model_name} {batch}x({prompt_len}+{new})"
    greedy = SamplingParams(max_tokens=new, temperature=0.0)
    penalized = SamplingParams(max_tokens=new, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5,
                               repetition_penalty=1.2)
    built: list[Any] = []

    def one(implementation: str, penalties: bool, sampling: SamplingParams) -> dict:
        if not built:
            built.extend(model_and_params(model_name, sizes.contexts[0]))
        model, params = built
        # The timed runs repeat the warm-up's prompts: without prefix caching they prefill them again.
        engine = Engine(model, params, max_slots=batch, page_size=PAGE_SIZE, max_seq_len=sizes.contexts[0],
                        decode_steps=sizes.steps, prefix_caching=False, penalties=penalties)
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(0, model.config.vocab_size, prompt_len)] for _ in range(batch)]
        engine.generate(prompts, sampling)  # compiles what this workload uses
        times = []
        for _ in range(max(1, sizes.runs // 5)):
            start = time.perf_counter()
            out = engine.generate(prompts, sampling)
            times.append(time.perf_counter() - start)
        produced = sum(len(o) for o in out)
        t = timing.Timing(float(np.median(times)), min(times), max(times), len(times))
        return timing.row(SUITE, name, implementation, t, tokens_per_s=produced / t.median, batch=batch,
                          prompt_tokens=prompt_len, new_tokens=new,
                          peer="mtjax engine" if penalties else None)

    return (guarded(name, "mtjax engine", lambda: one("mtjax engine", False, greedy))
            + guarded(name, "mtjax engine penalties", lambda: one("mtjax engine penalties", True, penalized)))


# --------------------------------------------------------------------------------------------------
# Peers: the old token-at-a-time loop, HF transformers
# --------------------------------------------------------------------------------------------------


def old_loop_row(name: str, model, params, sizes: Sizes) -> dict:
    """mtjax's decoding before the engine: one jitted call per token over the dense ``decode=True``
    cache of the model's whole ``max_seq_len`` (what ``mtjax generate`` ran), batch 1."""
    max_length = model.config.max_seq_len
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, max_length), jnp.int32), decode=True))
    cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract["cache"])

    @jax.jit
    def step(cache, token):
        logits, mutated = model.apply({"params": params, "cache": cache}, token.reshape(1, 1), decode=True,
                                      mutable=["cache"])
        return mutated["cache"], jnp.argmax(logits[0, -1]).astype(jnp.int32)

    def call(cache, token):
        return step(cache, token)

    tokens = [jnp.asarray(i, jnp.int32) for i in range(4)]
    t, _ = timing.measure_steps(call, cache, tokens, runs=sizes.runs, steps_per_sample=2)
    return timing.row(SUITE, name, "old loop", t, bytes=tree_bytes(params), peer=None, ceiling="copy_gbps",
                      batch=1, tokens_per_s=1 / t.median, note="dense cache of max_seq_len, one dispatch per token")


def hf_config(cfg):
    """The HF transformers config of a `mtjax.models.GPTConfig` (Llama for RMSNorm/RoPE/SwiGLU presets, GPT-2 else)."""
    import transformers

    if cfg.layernorm_type == "rmsnorm":
        return transformers.LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.mlp_dim,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.resolved_num_kv_heads, max_position_embeddings=cfg.max_seq_len,
            rope_theta=cfg.rope_max_timescale, tie_word_embeddings=True)
    return transformers.GPT2Config(vocab_size=cfg.vocab_size, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
                                   n_head=cfg.num_heads, n_inner=cfg.mlp_dim, n_positions=cfg.max_seq_len)


def hf_rows(name: str, model, batch: int, context: int, sizes: Sizes) -> list[dict]:
    try:
        import torch
        import transformers
    except ImportError:
        return [skipped_row(name, "hf transformers", "transformers/torch not installed")]

    def one():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        with torch.device(device):
            try:
                hf = transformers.AutoModelForCausalLM.from_config(hf_config(model.config), dtype=dtype)
            except TypeError:  # transformers < 4.56 names it torch_dtype
                hf = transformers.AutoModelForCausalLM.from_config(hf_config(model.config), torch_dtype=dtype)
        hf.eval()
        prompt = torch.randint(0, model.config.vocab_size, (batch, context - sizes.steps * 4), device=device)
        with torch.inference_mode():
            try:  # logits of the last position only, as the engine computes
                out = hf(input_ids=prompt, use_cache=True, logits_to_keep=1)
            except TypeError:
                out = hf(input_ids=prompt, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for sample in range(3 + 1):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(sizes.steps):
                    out = hf(input_ids=token, past_key_values=cache, use_cache=True)
                    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                if sample:  # the first sample warms up
                    times.append((time.perf_counter() - start) / sizes.steps)
        del hf, cache
        if device == "cuda":
            torch.cuda.empty_cache()
        t = timing.Timing(float(np.median(times)), min(times), max(times), len(times))
        return timing.row(SUITE, name, "hf transformers", t, peer=None, batch=batch, context=context,
                          tokens_per_s=batch / t.median, torch=torch.__version__, transformers=transformers.__version__)

    return guarded(name, "hf transformers", one)


def link_hf_peers(rows: list[dict]) -> list[dict]:
    """``mtjax bf16`` decode rows of a case with an HF row get ``speedup vs hf transformers`` instead of none."""
    timed_hf = {r["name"] for r in rows if r["implementation"] == "hf transformers" and r["time_ms"] is not None}
    for r in rows:
        if r["implementation"] == "mtjax bf16" and r["name"] in timed_hf:
            r["peer"] = "hf transformers"
    return rows


# --------------------------------------------------------------------------------------------------
# The kernel alone
# --------------------------------------------------------------------------------------------------


def kernel_time(impl: str, q, k, v, tables, lengths, scales: dict, sizes: Sizes, quick: bool) -> timing.Timing:
    """Seconds per call of the decode attention op through ``impl`` (cuDNN in its own cache layout)."""
    from mtjax import ops
    from mtjax.config import override
    from mtjax.ops.paged_attention import cudnn_paged_attention

    with override(pallas_interpret=quick and impl == "pallas_triton"):
        if impl == "cudnn":  # what cuDNN costs when the cache is laid out for it
            kb, vb = (jnp.transpose(p, (1, 2, 0, 3)) for p in (k, v))
            fn = jax.jit(lambda q, kb, vb, t, n: cudnn_paged_attention(q, kb, vb, t, n, scale=0.125))
            return timing.measure(fn, [(q, kb, vb, tables, lengths)], runs=sizes.runs)
        fn = jax.jit(lambda q, k, v, t, n: ops.paged_attention(q, k, v, t, n, scale=0.125, implementation=impl,
                                                               **scales))
        return timing.measure(fn, [(q, k, v, tables, lengths)], runs=sizes.runs)


def kernel_case_rows(batch: int, context: int, page_dtype: Any, sizes: Sizes, quick: bool) -> list[dict]:
    heads, kv_heads, head_dim = (4, 2, 16) if quick else (32, 8, 64)
    dtype_name = "bf16" if page_dtype == jnp.bfloat16 else "fp8"
    name = f"paged_attention b{batch} ctx{context} {dtype_name} kv"
    pages_per_seq = math.ceil(context / PAGE_SIZE)
    num_pages = batch * pages_per_seq
    kv_bytes = 2 * kv_heads * num_pages * PAGE_SIZE * head_dim * jnp.dtype(page_dtype).itemsize
    memory = timing.device_memory_bytes()
    if memory and 3 * kv_bytes > CACHE_MEMORY_FRACTION * memory:
        return [skipped_row(name, "pallas_triton", f"{kv_bytes / 2**30:.0f} GiB of pages")]
    kq, kk, kv = jax.random.split(jax.random.key(batch * 100003 + context), 3)
    q = jax.random.normal(kq, (batch, 1, heads, head_dim), jnp.bfloat16)
    shape = (kv_heads, num_pages, PAGE_SIZE, head_dim)
    k = jax.random.normal(kk, shape, jnp.bfloat16).astype(page_dtype)
    v = jax.random.normal(kv, shape, jnp.bfloat16).astype(page_dtype)
    tables = jnp.asarray(np.random.default_rng(0).permutation(num_pages).reshape(batch, pages_per_seq), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    scales = {}
    if page_dtype != jnp.bfloat16:
        scales = {"k_scale": jnp.ones((kv_heads,), jnp.float32), "v_scale": jnp.ones((kv_heads,), jnp.float32)}
    read = kv_bytes + 2 * q.nbytes + tables.nbytes
    rows = []
    for impl in ["pallas_triton", "xla"] + (["cudnn"] if page_dtype == jnp.bfloat16 else []):
        try:
            t = kernel_time(impl, q, k, v, tables, lengths, scales, sizes, quick)
        except Exception as err:  # noqa: BLE001 - e.g. cuDNN missing or too old, out of memory
            rows.append(error_row(name, impl, err))
            continue
        rows.append(timing.row(SUITE, name, impl, t, bytes=read, peer=None if impl == "xla" else "xla",
                               ceiling="copy_gbps", batch=batch, context=context))
    return rows


def kernel_rows(sizes: Sizes, quick: bool) -> list[dict]:
    rows: list[dict] = []
    for context in sizes.contexts:
        for batch in sizes.batches:
            for page_dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
                rows += guarded(f"paged_attention b{batch} ctx{context}", "inputs",
                                functools.partial(kernel_case_rows, batch, context, page_dtype, sizes, quick))
    return _drop_failed_peers(rows)


PARTS = ("prefill", "engine", "decode", "kernel")


def run(quick: bool, models: Sequence[str] | None = None, batches: Sequence[int] | None = None,
        contexts: Sequence[int] | None = None, parts: Sequence[str] = PARTS,
        settings: Sequence[variants.Setting] = (), profile_dir: str | None = None) -> list[dict]:
    """Rows of the parts asked for, per model (module docstring).

    Args:
      quick: the tiny model at toy sizes (a CPU smoke test).
      models: GPT presets (default `MODELS`; ``tiny`` with ``quick``).
      batches, contexts: the decode and kernel grid (default `BATCHES`, `CONTEXTS`).
      parts: any of `PARTS`.
      settings: ``--variant`` settings: each adds ``mtjax bf16 [setting]`` and ``mtjax fp8 weights
        [setting]`` decode rows (kernel choices, switches and XLA options; model and train fields do
        not apply to decoding).
      profile_dir: profile every decode row's device time (`mtjax.bench.profile`), traces written here.
    """
    for setting in settings:
        if setting.model or setting.train or setting.recipe:
            raise ValueError(f"mtjax bench decode: --variant {setting.label()}: only op=implementation, "
                             "switches and xla_* options apply to decoding")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"mtjax bench decode: parts={unknown}; accepted: {list(PARTS)}")
    for label, values in (("batches", batches), ("contexts", contexts)):
        if values is not None and (not values or any(v < 1 for v in values)):
            raise ValueError(f"mtjax bench decode: {label}={list(values)}; accepted: positive integers")
    sizes = QUICK if quick else FULL
    replace = {"models": models, "batches": batches, "contexts": contexts}
    sizes = dataclasses.replace(sizes, **{k: tuple(v) for k, v in replace.items() if v})
    rows: list[dict] = []
    for model_name in sizes.models:
        if "prefill" in parts:
            rows += prefill_row(model_name, sizes)
        if "engine" in parts:
            rows += engine_row(model_name, sizes)
        if "decode" in parts:
            rows += link_hf_peers(decode_rows(model_name, sizes, settings, profile_dir))
    if "kernel" in parts:
        rows += kernel_rows(sizes, quick)
    return rows


def add_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The decode suite's flags: which parts, and the batch and context grid."""
    parser.add_argument("--decode-parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="decode suite: which parts to run (default: all)")
    parser.add_argument("--decode-batches", nargs="+", type=int, metavar="B",
                        help=f"decode suite: decode batch sizes (default: {' '.join(map(str, BATCHES))})")
    parser.add_argument("--decode-contexts", nargs="+", type=int, metavar="T",
                        help=f"decode suite: cache contexts (default: {' '.join(map(str, CONTEXTS))})")
