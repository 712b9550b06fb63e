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
