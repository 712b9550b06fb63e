"""The paged key/value cache of an `Engine`: device pages for every attention layer, a free-list page
allocator, a block table per slot and the prefix cache, on the host.

Pages are ``[kv_heads, num_pages, page_size, head_dim]`` per layer (``[layers, ...]`` when the model
scans its layers), the `mtjax.flax.PAGED_KV_COLLECTION` variables of the model; with a mesh they
are sharded over the key/value heads on its ``tp`` axis. Page 0 is a scratch page: padding tokens
write there and no sequence reads it, so the allocator hands out pages ``1 .. num_pages - 1``.

Prefix caching (after vLLM's automatic prefix caching): a full page whose tokens' keys and values are
computed is registered under its tokens and the chain of pages before it. A later sequence that starts
with the same tokens takes those pages into its block table (reference-counted, never written again)
and prefills only the rest. Registered pages nobody holds stay cached and count as free; the
allocator evicts them, least recently released first, when the free list runs dry.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mtjax.flax import PAGED_KV_COLLECTION, PagedKV
from mtjax.models import GPT

KV_DTYPES = ("bfloat16", "float16", "float32", "fp8")
SCRATCH_PAGE = 0


def resolve_kv_dtype(kv_dtype: Any, model_dtype: Any) -> jnp.dtype:
    """``None`` (the model's compute dtype), a float dtype, or ``"fp8"`` (float8_e4m3fn with per-head scales)."""
    if kv_dtype is None:
        return jnp.dtype(model_dtype)
    if isinstance(kv_dtype, str) and kv_dtype.lower() in ("fp8", "e4m3", "float8_e4m3fn"):
        return jnp.dtype(jnp.float8_e4m3fn)
    try:
        dtype = jnp.dtype(kv_dtype)
    except TypeError:
        dtype = None
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32),
                     jnp.dtype(jnp.float8_e4m3fn)):
        raise ValueError(f"kv_dtype={kv_dtype!r} is not supported; accepted: None (the model dtype), "
                         f"{', '.join(KV_DTYPES)}")
    return dtype


class PageAllocator:
    """Free list of the pages ``1 .. num_pages - 1`` (page 0 is the scratch page)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}; expected >= 2 (page 0 is scratch)")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` page ids; raises RuntimeError when fewer are free (check `num_free` first)."""
        if count > len(self._free):
            raise RuntimeError(f"PageAllocator: {count} pages asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class KVCache:
    """Device pages of every attention layer of a `mtjax.models.GPT`, with the host-side bookkeeping.

    Attributes:
      pages: the `PAGED_KV_COLLECTION` variables (a pytree mirroring the model's layers).
      page_size, num_pages, max_slots, max_pages_per_seq: the geometry.
      dtype: page dtype.
      block_tables: ``[max_slots, max_pages_per_seq]`` int32 on the host (unused entries: the scratch page).
      allocator: the `PageAllocator` of the pages no one holds and no prefix is cached in.
      prefix_caching: full computed pages are shared by sequences that start with the same tokens
        (`match`, `share`, `register`).
    """

    def __init__(self, model: GPT, params: Any, *, max_slots: int, page_size: int, num_pages: int, max_seq_len: int,
                 dtype: jnp.dtype, mesh: Mesh | None = None, tp_axis: str = "tp", prefix_caching: bool = False):
        for name, value in (("max_slots", max_slots), ("page_size", page_size), ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCache: {name}={value!r}; expected a positive int")
        self.page_size, self.num_pages, self.max_slots = page_size, num_pages, max_slots
        self.max_pages_per_seq = math.ceil(max_seq_len / page_size)
        self.dtype = jnp.dtype(dtype)
        self.allocator = PageAllocator(num_pages)
        self.block_tables = np.full((max_slots, self.max_pages_per_seq), SCRATCH_PAGE, np.int32)
        self.slot_pages: list[list[int]] = [[] for _ in range(max_slots)]
        self.prefix_caching = prefix_caching
        self._refs = np.zeros(num_pages, np.int32)  # slots holding each page
        # The prefix cache: a registered page's key is (the node of the page before it, its tokens); a
        # node id is never reused, so an evicted page's successors can no longer be matched.
        self._prefix: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}  # key -> (page, node)
        self._registered: dict[int, tuple[tuple[int, tuple[int, ...]], int]] = {}  # page -> (key, node)
        self._cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._nodes = itertools.count(1)

        view = self.view(np.zeros((1, self.max_pages_per_seq), np.int32), np.ones((1,), np.int32),
                         np.zeros((1, 1), np.int32), prefill=True)
        shapes = jax.eval_shape(lambda p: model.apply({"params": p}, jnp.zeros((1, 1), jnp.int32), paged_kv=view,
                                                      mutable=[PAGED_KV_COLLECTION])[1][PAGED_KV_COLLECTION], params)
        kv_heads = model.config.resolved_num_kv_heads
        self.sharding = None
        if mesh is not None:
            if tp_axis not in mesh.axis_names:
                raise ValueError(f"KVCache: mesh has axes {mesh.axis_names}; expected a {tp_axis!r} axis to shard "
                                 f"the key/value heads over")
            if mesh.axis_types[mesh.axis_names.index(tp_axis)] != jax.sharding.AxisType.Auto:
                raise ValueError(f"KVCache: the mesh's {tp_axis!r} axis must be AxisType.Auto (as "
                                 f"mtjax.sharding's meshes are); got {mesh.axis_types}")
            if kv_heads % mesh.shape[tp_axis]:
                raise ValueError(f"KVCache: num_kv_heads={kv_heads} is not divisible by the mesh's {tp_axis!r} axis "
                                 f"({mesh.shape[tp_axis]} devices)")

        def make(shape):
            # The key/value-head axis is the first of a layer's pages, second under a scanned stack.
            head_axis = len(shape.shape) - 4 if len(shape.shape) >= 4 else len(shape.shape) - 1
            # Committed to a device from the start, as the pages every call returns (an uncommitted
            # first cache would make the second call compile again).
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            if mesh is not None:
                spec = [None] * len(shape.shape)
                spec[head_axis] = tp_axis
                sharding = NamedSharding(mesh, PartitionSpec(*spec))
            fill = jnp.ones if len(shape.shape) < 4 else jnp.zeros  # scales start at 1
            return jax.jit(lambda: fill(shape.shape, shape.dtype), out_shardings=sharding)()

        self.pages = jax.tree.map(make, shapes)
        self.bytes_per_page = sum(x.nbytes for x in jax.tree.leaves(self.pages) if x.ndim >= 4) // num_pages

    def view(self, block_tables: Any, lengths: Any, slots: Any, *, prefill: bool) -> PagedKV:
        """The `mtjax.flax.PagedKV` of one model call on this cache."""
        return PagedKV(block_tables=jnp.asarray(block_tables, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32),
                       slots=jnp.asarray(slots, jnp.int32), num_pages=self.num_pages, page_size=self.page_size,
                       dtype=self.dtype, prefill=prefill)

    @property
    def num_free_pages(self) -> int:
        """Pages a sequence can get: the free list and the cached pages no one holds."""
        return self.allocator.num_free + len(self._cached_free)

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache (held or not)."""
        return len(self._registered)

    def _allocate(self, count: int) -> list[int]:
        short = count - self.allocator.num_free
        for _ in range(max(short, 0)):  # evict the least recently released cached pages
            page, _ = self._cached_free.popitem(last=False)
            key, _ = self._registered.pop(page)
            del self._prefix[key]
            self.allocator.free([page])
        return self.allocator.allocate(count)

    def _page_keys(self, tokens: Sequence[int], num_pages: int):
        """``(index, the page's tokens)`` of ``tokens``' first ``num_pages`` pages."""
        size = self.page_size
        return [(i, tuple(int(t) for t in tokens[i * size:(i + 1) * size])) for i in range(num_pages)]

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The cached pages holding the longest run of ``tokens``' leading full pages, leaving at least
        one token to compute (its logits pick the next token); [] without prefix caching."""
        if not self.prefix_caching:
            return []
        pages, node = [], 0
        for _, chunk in self._page_keys(tokens, (len(tokens) - 1) // self.page_size):
            hit = self._prefix.get((node, chunk))
            if hit is None:
                break
            page, node = hit
            pages.append(page)
        return pages

    def num_cached_free(self, pages: Sequence[int]) -> int:
        """How many of ``pages`` no slot holds (taking them shrinks `num_free_pages`)."""
        return sum(1 for p in pages if self._refs[p] == 0)

    def share(self, slot: int, pages: Sequence[int]) -> None:
        """Puts the cached ``pages`` (from `match`) at the start of the empty ``slot``'s block table."""
        if self.slot_pages[slot]:
            raise ValueError(f"KVCache.share: slot {slot} already holds pages")
        for page in pages:
            if self._refs[page] == 0:
                del self._cached_free[page]
            self._refs[page] += 1
        self.block_tables[slot, :len(pages)] = pages
        self.slot_pages[slot] = list(pages)

    def register(self, slot: int, tokens: Sequence[int], num_computed: int) -> None:
        """Registers ``slot``'s full pages among the first ``num_computed`` tokens (``tokens``' keys and
        values are in them) in the prefix cache. A page whose tokens another page already caches stays
        private."""
        if not self.prefix_caching:
            return
        node = 0
        for i, chunk in self._page_keys(tokens, num_computed // self.page_size):
            page = self.slot_pages[slot][i]
            if page in self._registered:
                node = self._registered[page][1]
                continue
            hit = self._prefix.get((node, chunk))
            if hit is not None:
                node = hit[1]
                continue
            key, node = (node, chunk), next(self._nodes)
            self._prefix[key] = (page, node)
            self._registered[page] = (key, node)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def missing_pages(self, slot: int, num_tokens: int) -> int:
        """Pages ``slot`` still needs to hold ``num_tokens`` tokens."""
        return max(self.pages_for(num_tokens) - len(self.slot_pages[slot]), 0)

    def reserve(self, slot: int, num_tokens: int) -> bool:
        """Grows ``slot``'s pages to hold ``num_tokens`` tokens; False (and no change) when too few are free."""
        if num_tokens > self.max_pages_per_seq * self.page_size:
            raise ValueError(f"KVCache: {num_tokens} tokens exceed max_seq_len ({self.max_pages_per_seq} pages of "
                             f"{self.page_size})")
        missing = self.missing_pages(slot, num_tokens)
        if missing > self.num_free_pages:
            return False
        pages = self.slot_pages[slot]
        new = self._allocate(missing)
        self._refs[new] = 1
        self.block_tables[slot, len(pages):len(pages) + missing] = new
        pages.extend(new)
        return True

    def release(self, slot: int) -> None:
        """Returns ``slot``'s pages: to the free list, or, registered ones, to the cached pages (the
        last page first, so a sequence's tail is evicted before its head)."""
        for page in reversed(self.slot_pages[slot]):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._registered:
                    self._cached_free[page] = None
                else:
                    self.allocator.free([page])
        self.slot_pages[slot] = []
        self.block_tables[slot] = SCRATCH_PAGE

    def slot_mapping(self, slot: int, positions: np.ndarray) -> np.ndarray:
        """Flat cache slots (``page * page_size + offset``) of ``slot``'s tokens at ``positions``; a
        position in a registered page maps to the scratch page (its keys and values are there already
        and other sequences may read them: a recomputation never writes them again)."""
        positions = np.asarray(positions)
        pages = self.block_tables[slot, positions // self.page_size]
        if self._registered:
            pages = np.where(np.isin(pages, list(self._registered)), SCRATCH_PAGE, pages)
        return (pages * self.page_size + positions % self.page_size).astype(np.int32)

    def set_scales(self, k_scale: Any, v_scale: Any) -> None:
        """Sets the float8 dequantization scales of every layer: floats or ``[kv_heads]`` arrays."""
        if self.dtype != jnp.dtype(jnp.float8_e4m3fn):
            raise ValueError(f"KVCache.set_scales: the pages are {self.dtype}, not fp8")

        def replace(path, leaf):
            name = getattr(path[-1], "key", None)
            if name in ("k_scale", "v_scale"):
                given = k_scale if name == "k_scale" else v_scale
                value = jnp.broadcast_to(jnp.asarray(given, jnp.float32), leaf.shape)
                return jax.device_put(value, leaf.sharding)
            return leaf

        self.pages = jax.tree_util.tree_map_with_path(replace, self.pages)

