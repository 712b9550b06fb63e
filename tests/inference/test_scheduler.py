"""Host-side pieces: the page allocator, the scheduler's FIFO admission, chunking and preemption
order, and the sampler's top-k / top-p / greedy properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax.inference import (
    KVCache,
    PageAllocator,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    sample,
)
from mtjax.models import GPT, gpt_config

pytestmark = pytest.mark.usefixtures("fast_compiles")


def test_allocator_hands_out_pages_once_and_never_the_scratch_page():
    allocator = PageAllocator(6)
    pages = allocator.allocate(3) + allocator.allocate(2)
    assert sorted(pages) == [1, 2, 3, 4, 5] and allocator.num_free == 0
    with pytest.raises(RuntimeError, match="2 pages asked, 0 free"):
        allocator.allocate(2)
    allocator.free(pages[:2])
    assert allocator.num_free == 2 and set(allocator.allocate(2)) == set(pages[:2])
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(1)


@pytest.fixture
def cache():
    model = GPT(gpt_config("tiny", max_seq_len=64))
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    # 3 slots, 8 usable pages of 4 tokens.
    return KVCache(model, params, max_slots=3, page_size=4, num_pages=9, max_seq_len=64, dtype=jnp.float32)


def _request(i, prompt_len, max_tokens=8):
    return Request(i, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), arrival=i)


def test_admission_is_fifo_and_a_large_head_blocks_the_queue(cache):
    sched = Scheduler(cache, prefill_chunk=16, max_prefill_tokens=32)
    first, big, small = _request(0, 12), _request(1, 24), _request(2, 2)
    for r in (small, big, first):  # added out of order: the queue sorts by arrival
        sched.add(r)
    assert [r.request_id for r in sched.waiting] == [0, 1, 2]
    assert sched.admit(steps=2) == [first]  # 14 tokens: 4 pages; big needs 26 -> 7 pages, 4 left
    assert big.status == RequestStatus.WAITING and small.status == RequestStatus.WAITING  # no overtaking
    cache.register(first.slot, first.sequence, 12)  # without prefix caching: nothing is shared
    assert cache.num_cached_pages == 0 and cache.match(first.sequence) == []
    sched.finish(first, "length")
    assert sched.admit(steps=2) == [big, small]  # 7 pages, then 1 page of the 1 left


def test_long_prompts_prefill_in_fixed_size_chunks_within_the_budget(cache):
    sched = Scheduler(cache, prefill_chunk=8, max_prefill_tokens=8)
    long = _request(0, 20, max_tokens=2)
    sched.add(long)
    sched.admit(steps=1)
    spans = []
    while long.status == RequestStatus.PREFILLING:
        (chunk,) = sched.prefill_chunks()
        spans.append((chunk.start, chunk.length, chunk.whole, chunk.last))
        long.num_computed = chunk.start + chunk.length
        if chunk.last:
            long.status = RequestStatus.DECODING
    # The last chunk ends at the end and overlaps the one before: every chunk is 8 tokens.
    assert spans == [(0, 8, True, False), (8, 8, False, False), (12, 8, False, True)]


def test_preemption_takes_the_most_recent_request_and_requeues_it_in_order(cache):
    sched = Scheduler(cache, prefill_chunk=16, max_prefill_tokens=64)
    old, young = _request(0, 10, max_tokens=20), _request(1, 10, max_tokens=20)
    for r in (old, young):
        sched.add(r)
    assert sched.admit(steps=1) == [old, young]  # 3 pages each, 2 free
    for r in (old, young):
        r.status, r.output = RequestStatus.DECODING, [7]
    decoding = sched.reserve_decode(steps=8)  # each needs 5 pages: only one fits
    assert decoding == [old] and sched.num_preemptions == 1
    assert young.status == RequestStatus.WAITING and young.slot is None and young.num_preemptions == 1
    assert young.sequence == young.prompt + [7]  # recomputed with its tokens so far
    waiting = _request(2, 3)
    sched.add(waiting)
    assert [r.request_id for r in sched.waiting] == [1, 2]


def test_sample_greedy_top_k_top_p():
    vocab, draws = 12, 256
    logits = jnp.asarray(np.random.RandomState(0).randn(vocab) * 2, jnp.float32)
    probs = np.asarray(jax.nn.softmax(logits))
    order = np.argsort(-probs)
    rows = jnp.broadcast_to(logits, (draws, vocab))
    keys = jnp.broadcast_to(jnp.asarray(jax.random.key_data(jax.random.PRNGKey(3))), (draws, 2))
    index = jnp.arange(draws)

    def draw(temperature, top_k, top_p):
        full = lambda v, dt: jnp.full((draws,), v, dt)
        return np.asarray(sample(rows, temperature=full(temperature, jnp.float32), top_k=full(top_k, jnp.int32),
                                 top_p=full(top_p, jnp.float32), keys=keys, index=index))

    assert set(draw(0.0, 0, 1.0)) == {order[0]}
    top3 = draw(1.0, 3, 1.0)
    assert set(top3) == set(order[:3])
    nucleus = int(np.sum(np.cumsum(probs[order]) - probs[order] < 0.6))
    assert set(draw(1.0, 0, 0.6)) == set(order[:nucleus])
    everything = draw(1.0, 0, 1.0)
    assert len(set(everything)) > 3
    # Mixed rows in one call: greedy rows stay greedy.
    mixed = np.asarray(sample(rows[:2], temperature=jnp.asarray([0.0, 1.0]), top_k=jnp.zeros(2, jnp.int32),
                              top_p=jnp.ones(2), keys=keys[:2], index=index[:2]))
    assert mixed[0] == order[0]


def _sharing_cache(num_pages=9):
    model = GPT(gpt_config("tiny", max_seq_len=64))
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    return KVCache(model, params, max_slots=3, page_size=4, num_pages=num_pages, max_seq_len=64, dtype=jnp.float32,
                   prefix_caching=True)


def test_prefix_cache_shares_registered_pages_and_evicts_the_least_recent_unheld_ones():
    cache = _sharing_cache()
    seq = list(range(10, 21))  # 11 tokens: 2 full pages and 3 tokens
    assert cache.match(seq) == []
    assert cache.reserve(0, 11)
    cache.register(0, seq, 11)
    held = cache.slot_pages[0]
    assert cache.num_cached_pages == 2  # full pages only
    # A sequence with the same first 8 tokens reads those 2 pages; one of 9 tokens with the same 8
    # too, but one of exactly 8 only the first page (its last token must be computed).
    assert cache.match(seq[:8] + [99, 98]) == held[:2] == cache.match(seq[:9])
    assert cache.match(seq[:8]) == held[:1]
    assert cache.match([10, 11, 12, 0] + seq[4:]) == []  # a page matches only after the same pages before it
    # Positions in registered pages are never written again: they map to the scratch page.
    assert cache.slot_mapping(0, np.arange(6, 10)).tolist() == [2, 3, held[2] * 4, held[2] * 4 + 1]
    cache.share(1, held[:2])
    assert cache.reserve(1, 10) and cache.slot_pages[1][:2] == held[:2] and cache.block_tables[1, 0] == held[0]
    free = cache.num_free_pages
    cache.release(0)  # slot 1 still holds the shared pages; slot 0's private page goes back
    assert cache.num_free_pages == free + 1 and cache.match(seq) == held[:2]
    cache.release(1)  # now nobody holds them: cached, and counted as free
    assert cache.num_free_pages == 8 and cache.num_cached_pages == 2
    assert cache.num_cached_free(held[:2]) == 2
    # Allocating all 8 evicts the cached pages (the sequence's tail page first) once the free list is empty.
    assert cache.reserve(2, 6 * 4) and cache.match(seq) == held[:2] and cache.num_cached_pages == 2
    assert cache.reserve(2, 7 * 4) and cache.match(seq) == held[:1]
    assert cache.reserve(2, 8 * 4) and cache.match(seq) == [] and cache.num_cached_pages == 0
    assert not cache.reserve(2, 9 * 4)


def test_prefix_hits_skip_their_tokens_and_chunks_keep_compiled_lengths():
    cache = _sharing_cache(num_pages=17)
    sched = Scheduler(cache, prefill_chunk=8, max_prefill_tokens=8, chunk_lengths=(4, 8))
    first = _request(0, 18, max_tokens=2)
    sched.add(first)
    sched.admit(steps=1)
    cache.register(first.slot, first.sequence, 18)  # as the engine does once the prompt is prefilled
    sched.finish(first, "length")
    spans = {}
    for i, prompt_len in ((1, 19), (2, 13), (3, 9)):  # the same tokens 1..n: 4, 3 and 2 pages cached
        request = _request(i, prompt_len, max_tokens=2)
        sched.add(request)
        (admitted,) = sched.admit(steps=1)
        (chunk,) = sched.prefill_chunks()
        spans[prompt_len] = (admitted.num_computed, chunk.start, chunk.length, chunk.whole, chunk.last)
        sched.finish(request, "length")
    # 19 tokens, 16 cached: the 3 left in a chunk of 4 ending at the end; 13 tokens, 12 cached: a
    # chunk of 4; 9 tokens, 8 cached: a chunk of 4 overlapping cached tokens.
    assert spans == {19: (16, 15, 4, False, True), 13: (12, 9, 4, False, True), 9: (8, 5, 4, False, True)}
    assert sched.num_cached_tokens == 36
    short = _request(4, 5, max_tokens=2)  # 4 cached, 1 left: a chunk of 4 from position 1
    sched.add(short)
    sched.admit(steps=1)
    (chunk,) = sched.prefill_chunks()
    assert (short.num_computed, chunk.start, chunk.length) == (4, 1, 4)
    sched.finish(short, "length")
    sched = Scheduler(cache, prefill_chunk=8, max_prefill_tokens=8, chunk_lengths=(8,))
    tiny = _request(5, 6, max_tokens=2)  # 4 cached, 2 left; the only chunk length, 8, exceeds the sequence
    sched.add(tiny)
    sched.admit(steps=1)
    (chunk,) = sched.prefill_chunks()
    assert (tiny.num_computed, chunk.start, chunk.length, chunk.whole) == (4, 0, 6, True)
