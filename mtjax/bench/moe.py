"""`mtjax bench moe`: grouped GEMMs, the MoE layer and whole MoE train steps against stock JAX / Flax.

Three parts, every row timed in one process (``--quick``: tiny shapes for the CPU):

- ``grouped gemm``: forward and forward+backward of one expert GEMM ``[tokens * top_k, hidden] x
  [experts, hidden, ffn]`` at the issue's three shapes (8 experts, 64 fine-grained experts, 128
  experts), with balanced and skewed (Zipf: expert ``g`` gets a share proportional to ``1 / (g + 1)``)
  group sizes. Implementations: ``mtjax`` (`mtjax.ops.grouped_gemm`, automatic kernel selection;
  ``--block-m`` ... set its forward tiles), ``mtjax fp8`` (`mtjax.ops.grouped_gemm_fp8`, current
  scaling, E5M2 gradients), ``mtjax fp8 block`` (`mtjax.ops.grouped_gemm_block_fp8`: the
  casts of `BlockScaling`, block-scaled FP8 GEMMs on Hopper, grouped GEMMs of the dequantized operands
  elsewhere; measured against the bf16 ceiling), ``ragged_dot``
  (`jax.lax.ragged_dot`, the peer), ``tokamax`` (``tokamax.ragged_dot`` where importable) and
  ``dense`` (one ``[tokens * top_k, hidden] x [hidden, ffn]`` GEMM: the same FLOPs, the rate a
  grouped GEMM aims for; each row's ``extra.fraction_of_dense`` is the dense time over its time).
  FLOPs: ``2 M K N`` forward, ``6 M K N`` forward+backward.
- ``moe layer``: `mtjax.flax.MoEBlock` (router, permute, two grouped GEMMs with SwiGLU, unpermute,
  shared experts) forward+backward against `stock_moe_mlp`, the same layer as a JAX user writes it
  (``lax.top_k``, ``jnp.argsort`` permutation, ``lax.ragged_dot``, scatter back, weighted sum), at the
  two MoE presets' layer shapes and 16384 tokens. FLOPs: ``6 * tokens * active MLP parameters``.
- ``train``: AdamW train steps of ``moe-mixtral-1b`` and ``moe-deepseek-1b`` (batch 8 x 2048): mtjax
  bf16, mtjax FP8 (``fp8_autocast``'s default recipe: delayed scaling, the grouped GEMMs' per-expert
  kernel histories included) and `FlaxMoEGPT`, the
  stock-Flax model of the same sizes (its MoE MLP is `stock_moe_mlp`). Model FLOPs are the preset's
  ``flops_per_token`` (``6 * N_active`` + causal attention) for all, so MFU compares the same work.

A row that fails records its error in ``extra.error`` (time NaN) and the suite goes on.
``python -m mtjax.bench.moe [--quick]`` prints the rows as a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from mtjax import backend, ops
from mtjax.bench import peers, timing
from mtjax.bench import train as train_suite
from mtjax.bench.variants import DEFAULT
from mtjax.kernels.grouped_gemm import BlockSizes, GemmTiles

SUITE = "moe"
# (label, rows = tokens * top_k, hidden K, expert ffn N, experts G): the shapes.
GEMM_SHAPES = (
    ("8 experts", 16384 * 2, 2048, 8192, 8),
    ("64 experts", 16384 * 6, 2048, 1408, 64),
    ("128 experts", 8192 * 8, 4096, 2048, 128),
)
QUICK_GEMM_SHAPES = (("4 experts", 256, 64, 128, 4),)
LAYER_PRESETS = ("moe-mixtral-1b", "moe-deepseek-1b")
LAYER_TOKENS, QUICK_LAYER_TOKENS = 16384, 64
TRAIN_PRESETS, QUICK_TRAIN_PRESETS = ("moe-mixtral-1b", "moe-deepseek-1b"), ("moe-tiny",)
# XLA's GPU ragged_dot materializes a [G, M, N] f32 buffer; above this fraction of device memory the
# peer row is skipped (at the 128-expert shape its autotuner asked for more than the device holds).
RAGGED_DOT_MEMORY_FRACTION = 0.4
NAN_TIMING = timing.Timing(math.nan, math.nan, math.nan, 0)
PARTS = ("gemm", "layer", "train")


def group_sizes(rows: int, groups: int, skewed: bool) -> jax.Array:
    """``[groups]`` int32 summing to ``rows``: equal, or Zipf-skewed (share of group ``g`` ~ ``1 / (g + 1)``)."""
    weights = [1.0 / (g + 1) for g in range(groups)] if skewed else [1.0] * groups
    sizes = [int(rows * w / sum(weights)) for w in weights]
    sizes[0] += rows - sum(sizes)
    return jnp.asarray(sizes, jnp.int32)


def _failed(name: str, implementation: str, err: BaseException, **extra: Any) -> dict:
    print(f"mtjax bench: moe {name} {implementation}: failed: {err!r}", file=sys.stderr, flush=True)
    return timing.row(SUITE, name, implementation, NAN_TIMING, error=repr(err)[:2000], **extra)


def _tokamax_ragged_dot() -> Callable[..., jax.Array] | None:
    if importlib.util.find_spec("tokamax") is None:
        return None
    try:
        import tokamax
    except Exception as err:  # noqa: BLE001  (an unimportable optional peer only loses its rows)
        print(f"mtjax bench: tokamax is installed but does not import ({err!r}); no tokamax rows", file=sys.stderr)
        return None
    return getattr(tokamax, "ragged_dot", None)


def _gemm_variants(tiles: GemmTiles | None, m: int, k: int, n: int, g: int) -> dict[str, Callable[..., jax.Array]]:
    """implementation -> ``f(lhs, rhs, group_sizes) -> out`` (bf16 out)."""
    blocks = None if tiles is None else dataclasses.replace(BlockSizes.default(m, k, n, g), forward=tiles)
    out = {
        "mtjax": lambda x, w, s: ops.grouped_gemm(x, w, s, block_sizes=blocks),
        "ragged_dot": lambda x, w, s: lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32).astype(x.dtype),
        "mtjax fp8": lambda x, w, s: ops.grouped_gemm_fp8(x, w, s, block_sizes=blocks),
        "mtjax fp8 block": lambda x, w, s: ops.grouped_gemm_block_fp8(x, w, s, block_sizes=blocks),
    }
    for kernel in ("triton", "mosaic_gpu", "cublaslt"):  # each kernel family beside the default selection
        if backend.get_implementation("grouped_gemm", kernel).runs_on(backend.platform()) is None:
            out[f"mtjax [{kernel}]"] = functools.partial(_grouped_gemm, ops.grouped_gemm, kernel)
            out[f"mtjax fp8 [{kernel}]"] = functools.partial(_grouped_gemm, ops.grouped_gemm_fp8, kernel)
            if kernel in backend.implementations("grouped_gemm_block_scaled"):
                out[f"mtjax fp8 block [{kernel}]"] = functools.partial(_grouped_gemm, ops.grouped_gemm_block_fp8,
                                                                       kernel)
    tokamax_ragged_dot = _tokamax_ragged_dot()
    if tokamax_ragged_dot is not None:
        out["tokamax"] = lambda x, w, s: tokamax_ragged_dot(x, w, s, preferred_element_type=x.dtype)
    return out


def _grouped_gemm(op: Callable[..., jax.Array], implementation: str, x: jax.Array, w: jax.Array,
                  sizes: jax.Array) -> jax.Array:
    return op(x, w, sizes, implementation=implementation)


def _dense(x: jax.Array, w: jax.Array, _sizes: jax.Array) -> jax.Array:
    return lax.dot_general(x, w[0], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)


def _fwd(fn):
    return jax.jit(fn)


def _fwd_bwd(fn):
    def run(x, w, s, dy):
        y, vjp = jax.vjp(lambda x, w: fn(x, w, s), x, w)
        return (y, *vjp(dy))

    return jax.jit(run)


def _ragged_dot_buffer(m: int, n: int, g: int) -> int:
    """Bytes of the ``[G, M, N]`` float32 buffer XLA's GPU ``ragged_dot`` materializes (one output per group)."""
    return 4 * g * m * n


def run_gemm(quick: bool, tiles: GemmTiles | None = None, experts: Sequence[int] | None = None) -> list[dict]:
    """The grouped GEMM rows (module docstring); ``experts``: only the shapes with these group counts."""
    shapes = QUICK_GEMM_SHAPES if quick else GEMM_SHAPES
    if experts is not None:
        known = sorted({g for *_, g in shapes})
        if not set(experts) <= set(known):
            raise ValueError(f"mtjax bench moe: gemm experts {sorted(experts)}; accepted: {known}")
    rows = []
    for index, (label, m, k, n, g) in enumerate(shapes):
        if experts is not None and g not in experts:
            continue
        keys = jax.random.split(jax.random.key(index), 3)
        x = timing.random_array(keys[0], (m, k), jnp.bfloat16)
        w = timing.random_array(keys[1], (g, k, n), jnp.bfloat16, k ** -0.5)
        dy = timing.random_array(keys[2], (m, n), jnp.bfloat16, 1e-2)
        dense_w = w[:1]
        for skewed in (False, True):
            sizes = group_sizes(m, g, skewed)
            for mode, flops, wrap in (("fwd", 2 * m * k * n, _fwd), ("fwd+bwd", 6 * m * k * n, _fwd_bwd)):
                name = f"grouped gemm {mode} {label} {'skewed' if skewed else 'balanced'} ({m}x{k}x{n}, G={g})"
                times: dict[str, float] = {}
                cases = {"dense": _dense, **_gemm_variants(tiles, m, k, n, g)}
                shape_rows = []
                for implementation, fn in cases.items():
                    if implementation == "ragged_dot" and _ragged_dot_buffer(m, n, g) > RAGGED_DOT_MEMORY_FRACTION * (
                            timing.device_memory_bytes() or math.inf):
                        shape_rows.append(timing.row(
                            SUITE, name, "ragged_dot skipped: its [G, M, N] f32 buffer exceeds "
                            f"{RAGGED_DOT_MEMORY_FRACTION:.0%} of the device", NAN_TIMING, shape=[m, k, n, g],
                            skipped="memory"))
                        continue
                    weights = dense_w if implementation == "dense" else w
                    args = (x, weights, sizes) + ((dy,) if mode == "fwd+bwd" else ())
                    try:
                        compiled, _ = timing.compile_lowered(wrap(fn).lower(*args))
                        t = timing.measure(compiled, [args], runs=3 if quick else 20)
                    except Exception as err:  # noqa: BLE001  (a failing row records its error)
                        shape_rows.append(_failed(name, implementation, err, shape=[m, k, n, g]))
                        continue
                    times[implementation] = t.median
                    is_fp8 = implementation.startswith("mtjax fp8") and "block" not in implementation
                    shape_rows.append(timing.row(
                        SUITE, name, implementation, t, flops=flops,
                        peer=None if implementation in ("ragged_dot", "dense") else "ragged_dot",
                        ceiling="fp8_gemm_tflops" if is_fp8 else "bf16_gemm_tflops", shape=[m, k, n, g],
                        group_sizes="skewed" if skewed else "balanced", dtype="fp8" if is_fp8 else "bf16"))
                for r in shape_rows:
                    if "dense" in times and r["implementation"] in times:
                        r["extra"]["fraction_of_dense"] = times["dense"] / times[r["implementation"]]
                    fp8_row = r["implementation"].startswith("mtjax fp8")
                    if fp8_row and "mtjax" in times and r["implementation"] in times:
                        r["extra"]["speedup_vs_mtjax_bf16"] = times["mtjax"] / times[r["implementation"]]
                    if "tokamax" in times and "mtjax" in times and r["implementation"] == "mtjax":
                        r["extra"]["speedup_vs_tokamax"] = times["tokamax"] / times["mtjax"]
                rows += shape_rows
    return rows


# --------------------------------------------------------------------------------------------------
# The MoE MLP as a JAX user writes it
# --------------------------------------------------------------------------------------------------


def stock_moe_mlp(x: jax.Array, router: jax.Array, wi: jax.Array, wo: jax.Array, *, top_k: int,
                  score_function: str = "softmax", shared: tuple[jax.Array, jax.Array] | None = None,
                  ) -> tuple[jax.Array, jax.Array]:
    """Stock-JAX dropless MoE SwiGLU MLP: ``x [tokens, hidden]``, ``router [hidden, experts]``,
    ``wi [experts, hidden, 2 * ffn]`` (gate, up), ``wo [experts, ffn, hidden]``, optional dense
    ``shared = (wi [hidden, 2 * ffn_s], wo [ffn_s, hidden])``. Returns ``(y, load-balancing loss)``."""
    tokens, hidden = x.shape
    num_experts = router.shape[1]
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, -1) if score_function == "softmax" else jax.nn.sigmoid(logits)
    weights, experts = lax.top_k(probs, top_k)
    weights = weights / weights.sum(-1, keepdims=True)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    x_sorted = x[order // top_k]
    gate, up = jnp.split(lax.ragged_dot(x_sorted, wi, sizes), 2, axis=-1)
    y_sorted = lax.ragged_dot(nn.silu(gate) * up, wo, sizes)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(tokens, top_k, hidden)
    out = jnp.einsum("tkh,tk->th", y, weights.astype(y.dtype))
    if shared is not None:
        gate, up = jnp.split(x @ shared[0], 2, axis=-1)
        out = out + (nn.silu(gate) * up) @ shared[1]
    fraction = sizes.astype(jnp.float32) / flat.shape[0]
    aux = num_experts * jnp.sum(fraction * probs.mean(0))
    return out, aux


def _layer_params(config: Any, key: jax.Array) -> dict[str, jax.Array]:
    h, e, f = config.hidden_size, config.num_experts, config.moe_mlp_dim or config.mlp_dim
    keys = jax.random.split(key, 5)
    params = {"router": timing.random_array(keys[0], (h, e), jnp.float32, h ** -0.5),
              "wi": timing.random_array(keys[1], (e, h, 2 * f), jnp.bfloat16, h ** -0.5),
              "wo": timing.random_array(keys[2], (e, f, h), jnp.bfloat16, f ** -0.5)}
    if config.num_shared_experts:
        fs = config.num_shared_experts * (config.shared_expert_dim or f)
        params["shared_wi"] = timing.random_array(keys[3], (h, 2 * fs), jnp.bfloat16, h ** -0.5)
        params["shared_wo"] = timing.random_array(keys[4], (fs, h), jnp.bfloat16, fs ** -0.5)
    return params


def _mtjax_layer_params(config: Any, stock: dict[str, jax.Array]) -> dict[str, Any]:
    """The stock layer's weights in `MoEBlock`'s layout (wi ``[E, H, 2, F]``: slot 0 activated, slot 1 the gate)."""
    e, h, two_f = stock["wi"].shape
    params = {"router_kernel": stock["router"], "wi_kernel": stock["wi"].reshape(e, h, 2, two_f // 2),
              "wo_kernel": stock["wo"]}
    if "shared_wi" in stock:
        params["shared_experts"] = {"wi_kernel": stock["shared_wi"].reshape(h, 2, -1), "wo_kernel": stock["shared_wo"]}
    return params


def run_layer(quick: bool) -> list[dict]:
    """The MoE layer rows (module docstring): mtjax `MoEBlock` vs `stock_moe_mlp`, forward+backward."""
    from mtjax.flax import MOE_LOSSES, MOE_METRICS, MoEBlock, moe_aux_loss
    from mtjax.models import gpt_config

    rows = []
    tokens = QUICK_LAYER_TOKENS if quick else LAYER_TOKENS
    for preset in ("moe-tiny",) if quick else LAYER_PRESETS:
        config = gpt_config(preset)
        kwargs = {**config.moe_block_kwargs(), "normalize_weights": True, "num_expert_groups": None,
                  "expert_group_top_k": None, "use_expert_bias": False, "router_z_loss_weight": 0.0}
        block = MoEBlock(**kwargs, activations=("silu", "linear"), enable_layernorm=False, dtype=jnp.bfloat16)
        stock = _layer_params(config, jax.random.key(0))
        ours = _mtjax_layer_params(config, stock)
        x = timing.random_array(jax.random.key(1), (1, tokens, config.hidden_size), jnp.bfloat16)
        dy = timing.random_array(jax.random.key(2), x.shape, jnp.bfloat16, 1e-2)
        top_k = config.experts_per_token
        f = config.moe_mlp_dim or config.mlp_dim
        fs = config.num_shared_experts * (config.shared_expert_dim or f)
        active = config.hidden_size * (config.num_experts + 3 * top_k * f + 3 * fs)
        flops = 6 * tokens * active
        name = f"moe layer fwd+bwd {preset} ({tokens} tokens, E={config.num_experts}, top-{top_k})"

        def mtjax_layer(params, x, block=block):
            (y, _), sown = block.apply({"params": params}, x, deterministic=True, mutable=[MOE_LOSSES, MOE_METRICS])
            return y, moe_aux_loss(sown.get(MOE_LOSSES, {}))

        def stock_layer(params, x, config=config, top_k=top_k):
            shared = (params["shared_wi"], params["shared_wo"]) if "shared_wi" in params else None
            y, aux = stock_moe_mlp(x[0], params["router"], params["wi"], params["wo"], top_k=top_k,
                                   score_function=config.router_score_function, shared=shared)
            return y[None], config.load_balancing_loss_weight * aux

        def fwd_bwd(layer):
            def run(layer_params, inputs, cotangent):
                (y, aux), vjp = jax.vjp(layer, layer_params, inputs)
                return (y, *vjp((cotangent, jnp.ones_like(aux))))
            return jax.jit(run)

        times = {}
        for implementation, layer, params in (("stock jax", stock_layer, stock), ("mtjax", mtjax_layer, ours)):
            try:
                compiled, _ = timing.compile_lowered(fwd_bwd(layer).lower(params, x, dy))
                t = timing.measure(compiled, [(params, x, dy)], runs=3 if quick else 20)
            except Exception as err:  # noqa: BLE001  (a failing row records its error)
                rows.append(_failed(name, implementation, err))
                continue
            times[implementation] = t.median
            rows.append(timing.row(SUITE, name, implementation, t, flops=flops,
                                   peer="stock jax" if implementation == "mtjax" else None,
                                   ceiling="bf16_gemm_tflops", tokens=tokens, active_mlp_params=active))
    return rows


# --------------------------------------------------------------------------------------------------
# Whole train steps: mtjax against the stock-Flax MoE GPT
# --------------------------------------------------------------------------------------------------


class FlaxMoELayer(nn.Module):
    """A pre-norm GPT block of stock Flax: `peers.FlaxTransformerLayer`'s attention and a `stock_moe_mlp`.

    Attributes:
      hidden_size, num_heads, num_kv_heads, layernorm_type: as `peers.FlaxTransformerLayer`.
      num_experts, top_k, expert_dim: routed experts (SwiGLU).
      shared_dim: width of the dense shared-expert MLP (0: none).
      score_function: ``"softmax"`` or ``"sigmoid"`` router scores.
      aux_weight: coefficient of the load-balancing loss.
      dtype: compute dtype (parameters f32).

    ``(x [batch, seq, hidden], aux) -> ((x, aux + this layer's weighted aux loss), None)`` for `nn.scan`.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int | None
    layernorm_type: str
    num_experts: int
    top_k: int
    expert_dim: int
    shared_dim: int = 0
    score_function: str = "softmax"
    aux_weight: float = 0.01
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, carry: tuple[jax.Array, jax.Array], _: Any = None) -> tuple[tuple[jax.Array, jax.Array], None]:
        x, aux = carry
        # Attention exactly as peers.FlaxTransformerLayer writes it.
        norm = functools.partial(nn.LayerNorm if self.layernorm_type == "layernorm" else nn.RMSNorm, dtype=self.dtype)
        dense = functools.partial(nn.Dense, dtype=self.dtype)
        batch, seq, _ = x.shape
        x = peers.attention_residual(x, self.num_heads, self.num_kv_heads or self.num_heads, norm, dense)
        h = norm(name="ln_mlp")(x).reshape(batch * seq, self.hidden_size)
        init = nn.initializers.lecun_normal()
        router = self.param("router", init, (self.hidden_size, self.num_experts))
        wi = self.param("wi", init, (self.num_experts, self.hidden_size, 2 * self.expert_dim)).astype(self.dtype)
        wo = self.param("wo", init, (self.num_experts, self.expert_dim, self.hidden_size)).astype(self.dtype)
        shared = None
        if self.shared_dim:
            shared = (self.param("shared_wi", init, (self.hidden_size, 2 * self.shared_dim)).astype(self.dtype),
                      self.param("shared_wo", init, (self.shared_dim, self.hidden_size)).astype(self.dtype))
        y, layer_aux = stock_moe_mlp(h, router, wi, wo, top_k=self.top_k, score_function=self.score_function,
                                     shared=shared)
        return (x + y.reshape(x.shape).astype(x.dtype), aux + self.aux_weight * layer_aux), None


class FlaxMoEGPT(nn.Module):
    """The stock-Flax MoE GPT of a `mtjax.models.GPTConfig`: tied embedding, ``first_k_dense`` scanned
    `peers.FlaxTransformerLayer` s, then scanned `FlaxMoELayer` s. ``tokens -> (logits, aux loss)``.

    Attributes:
      config: the `mtjax.models.GPTConfig` (sizes, norm, MoE fields; group-limited routing and the
        expert bias are left out: a plain top-k router).
    """

    config: Any

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, name="embed")
        x = embed(tokens)
        if cfg.first_k_dense:
            dense = nn.scan(peers.FlaxTransformerLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=cfg.first_k_dense)
            x, _ = dense(cfg.hidden_size, cfg.num_heads, cfg.mlp_dim, cfg.num_kv_heads, cfg.layernorm_type,
                         tuple(cfg.activations), cfg.dtype, False, name="dense_layers")(x, None)
        expert_dim = cfg.moe_mlp_dim or cfg.mlp_dim
        moe = nn.scan(FlaxMoELayer, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=cfg.num_layers - cfg.first_k_dense)
        (x, aux), _ = moe(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.layernorm_type, cfg.num_experts,
                          cfg.experts_per_token, expert_dim,
                          cfg.num_shared_experts * (cfg.shared_expert_dim or expert_dim), cfg.router_score_function,
                          cfg.load_balancing_loss_weight, cfg.dtype, name="moe_layers")((x, jnp.zeros((), jnp.float32)))
        norm = nn.LayerNorm if cfg.layernorm_type == "layernorm" else nn.RMSNorm
        return embed.attend(norm(dtype=cfg.dtype, name="ln_final")(x)), aux


def flax_moe_train_step(model: FlaxMoEGPT, optimizer: optax.GradientTransformation):
    """A jitted AdamW step ``((params, opt_state), batch) -> (state, {"loss"})`` of `FlaxMoEGPT`, donating the state."""

    def loss_fn(params, batch):
        logits, aux = model.apply({"params": params}, batch["inputs"])
        return peers.cross_entropy(logits, batch["targets"]) + aux

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    return jax.jit(step, donate_argnums=0)


def _flax_moe_variant(config: Any, batch_shape: tuple[int, int]) -> train_suite.Variant:
    model = FlaxMoEGPT(config)
    opt = train_suite.optimizer()

    def init():
        params = jax.jit(model.init)(jax.random.key(0), jnp.zeros(batch_shape, jnp.int32))["params"]
        return params, jax.jit(opt.init)(params)

    return train_suite.Variant("flax moe", None, "bf16_gemm_tflops", init, flax_moe_train_step(model, opt))


def run_train(quick: bool, presets: Sequence[str] | None = None, batch_size: int | None = None) -> list[dict]:
    """The train-step rows (module docstring): mtjax bf16 and FP8 against `FlaxMoEGPT`, ``batch_size``
    sequences a step (default 8; 2 with ``quick``)."""
    from mtjax.models import gpt_config

    presets = list(presets or (QUICK_TRAIN_PRESETS if quick else TRAIN_PRESETS))
    default_batch, seq = ((train_suite.QUICK_BATCH, train_suite.QUICK_SEQ_LEN) if quick
                          else (train_suite.BATCH, train_suite.SEQ_LEN))
    batch_size = default_batch if batch_size is None else batch_size
    rows = []
    for preset in presets:
        config = gpt_config(preset)
        seq_len = min(seq, config.max_seq_len)
        tokens_per_step = batch_size * seq_len
        flops = config.flops_per_token(seq_len) * tokens_per_step
        name = f"train {preset} b{batch_size} s{seq_len}"
        batches = train_suite._batches(config.vocab_size, batch_size, seq_len)
        times = {}
        for implementation in ("mtjax", "flax moe", "mtjax fp8"):
            try:
                variant = (_flax_moe_variant(config, (batch_size, seq_len)) if implementation == "flax moe" else
                           train_suite._mtjax_variant(config, implementation == "mtjax fp8", DEFAULT,
                                                      (batch_size, seq_len)))
                variant.peer = None if implementation == "flax moe" else "flax moe"
                step, compile_s = train_suite._compile(variant, batches[0])
                with variant.context():
                    state = variant.init()
                t, (state, metrics) = timing.measure_steps(step, state, batches, warmup=2, runs=3 if quick else 6,
                                                          steps_per_sample=1 if quick else 3)
                memory = step.memory_analysis()
            except Exception as err:  # noqa: BLE001  (a failing row records its error)
                rows.append(_failed(name, implementation, err, preset=preset))
                continue
            times[implementation] = t.median
            extra = {"tokens_per_s": tokens_per_step / t.median, "batch": batch_size, "seq_len": seq_len,
                     "params": config.num_params(), "active_params": config.num_active_params(),
                     "loss": float(metrics["loss"]), "compile_s": compile_s,
                     "temp_memory_gb": None if memory is None else memory.temp_size_in_bytes / 1e9}
            if implementation == "mtjax fp8" and "mtjax" in times:
                extra["speedup_vs_mtjax_bf16"] = times["mtjax"] / t.median
            for key in ("moe_max_load", "moe_min_load", "moe_dropped_fraction"):
                if key in metrics:
                    extra[key] = float(metrics[key])
            print(f"mtjax bench: moe {name} {implementation}: {t.median * 1e3:.1f} ms/step, "
                  f"{extra['tokens_per_s']:.0f} tokens/s, loss {extra['loss']:.3f}, compiled in {compile_s:.0f} s",
                  file=sys.stderr, flush=True)
            del state
            rows.append(timing.row(SUITE, name, implementation, t, flops=flops, peer=variant.peer,
                                   ceiling=variant.ceiling, **extra))
    return rows


def run(quick: bool, presets: Sequence[str] | None = None, tiles: GemmTiles | None = None,
        parts: Sequence[str] = ("gemm", "layer", "train"), gemm_experts: Sequence[int] | None = None,
        train_batch: int | None = None) -> list[dict]:
    """Rows of the parts asked for (``"gemm"``, ``"layer"``, ``"train"``), in that order.

    Args:
      quick: tiny shapes (a CPU smoke test).
      presets: the train part's presets (default ``moe-mixtral-1b``, ``moe-deepseek-1b``; ``moe-tiny``
        with ``quick``).
      tiles: forward tiles of mtjax's grouped GEMM kernel (default: `BlockSizes.default`).
      parts: which parts to run.
      gemm_experts: the grouped GEMM shapes to run, by their number of experts (default: all of
        `GEMM_SHAPES`).
      train_batch: sequences per train step (default 8, 2 with ``quick``): fewer fit a smaller GPU.
    """
    if train_batch is not None and train_batch < 1:
        raise ValueError(f"mtjax bench moe: train_batch={train_batch}; expected an int >= 1")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"mtjax bench moe: parts={unknown}; accepted: {list(PARTS)}")
    rows = []
    for part in PARTS:
        if part not in parts:
            continue
        if part == "gemm":
            rows += run_gemm(quick, tiles, gemm_experts)
        elif part == "layer":
            rows += run_layer(quick)
        else:
            rows += run_train(quick, presets, train_batch)
    return rows


def tiles_from_args(args: argparse.Namespace) -> GemmTiles | None:
    """`GemmTiles` from the ``--block-m ...`` flags (None when none is given: the default tiles)."""
    names = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m")
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    return GemmTiles(**given) if given else None


def add_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The moe suite's flags: the grouped GEMM kernel's forward tiles, the parts and the train presets."""
    for flag in ("block-m", "block-n", "block-k", "num-warps", "num-stages", "group-m"):
        parser.add_argument(f"--{flag}", type=int,
                            help=f"moe suite: grouped GEMM forward tile {flag.replace('-', '_')}")
    parser.add_argument("--moe-parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="moe suite: which parts to run (default: all)")
    parser.add_argument("--moe-gemm-experts", nargs="+", type=int, metavar="G",
                        help="moe suite: grouped GEMM shapes to run, by number of experts (default: all)")
    parser.add_argument("--moe-presets", nargs="+", metavar="NAME",
                        help="moe suite: MoE presets to train (default: moe-mixtral-1b moe-deepseek-1b; "
                             "moe-tiny with --quick)")
    parser.add_argument("--moe-train-batch", type=int, metavar="N",
                        help="moe suite: sequences per train step (default 8; fewer fit an 80 GB GPU)")


def main() -> None:
    from mtjax.bench import report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    add_arguments(parser)
    args = parser.parse_args()
    rows = report.complete(run(args.quick, presets=args.moe_presets, tiles=tiles_from_args(args),
                               parts=args.moe_parts, gemm_experts=args.moe_gemm_experts,
                               train_batch=args.moe_train_batch), {},
                           report.H200_BF16_PEAK_TFLOPS)
    print(report.table(rows))


if __name__ == "__main__":
    main()
