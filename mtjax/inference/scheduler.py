"""Continuous batching: which requests hold a slot, which prompt chunks run next, who is preempted.

Modelled on vLLM's scheduler and block manager, on the host, in plain Python:

- Requests wait in arrival order (FIFO). Between steps the oldest waiting request is admitted when a
  slot is free and the free pages hold its whole prompt; a request that does not fit blocks the ones
  behind it (no overtaking), so every request is served in turn.
- An admitted request first takes the cached pages of its prompt's longest cached prefix (with prefix
  caching, `KVCache.match`), then prefills the rest: in chunks of at most ``prefill_chunk`` tokens,
  oldest first, up to ``max_prefill_tokens`` per step, then it decodes with the others.
- Before each decode dispatch every decoding request gets the pages for the tokens the dispatch may
  add. When the free list runs dry the most recently admitted request is preempted: its pages go back
  and it returns to the waiting queue (at its arrival place) with the tokens it produced; when admitted
  again its prompt and those tokens are prefilled anew (recompute), and it continues where it stopped.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
from collections.abc import Sequence

from mtjax.inference.kv_cache import KVCache
from mtjax.inference.sampling import SamplingParams, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One prompt being continued.

    Attributes:
      request_id: the id `Engine.add_request` returned.
      prompt: the prompt's token ids.
      params: its `SamplingParams`.
      arrival: the order of arrival (FIFO rank).
      output: the new tokens so far.
      status: `RequestStatus`.
      slot: the decode slot it holds (None while waiting).
      num_computed: tokens of `sequence` whose keys and values are in the cache (while prefilling).
      finish_reason: ``"stop"`` (a stop token), ``"length"`` (max_tokens) or ``"abort"``.
      num_preemptions: times it was preempted.
      logprobs: a `TokenLogprobs` per token of ``output`` when its params ask for them.
    """

    request_id: int
    prompt: list[int]
    params: SamplingParams
    arrival: int
    output: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    num_computed: int = 0
    finish_reason: str | None = None
    num_preemptions: int = 0
    prefill_target: int = 0
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)

    @property
    def sequence(self) -> list[int]:
        """What a prefill puts in the cache: the prompt and every token produced so far."""
        return self.prompt + self.output

    @property
    def cache_length(self) -> int:
        """Tokens in the cache while decoding: all but the last produced token (the next input)."""
        return len(self.prompt) + len(self.output) - 1

    @property
    def max_cache_length(self) -> int:
        """The most tokens it ever keeps in the cache (its last token is never fed)."""
        return len(self.prompt) + self.params.max_tokens - 1


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Tokens ``[start, start + length)`` of ``request.sequence`` to run; ``whole``: from position 0
    (attending among themselves), else after cached ones (attending to the pages)."""

    request: Request
    start: int
    length: int

    @property
    def whole(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        """The chunk ends the sequence: its last token's logits give the next token."""
        return self.start + self.length == self.request.prefill_target


class Scheduler:
    """Queues, slots and pages of an `Engine` (host side; the engine runs what it plans).

    Args:
      cache: the `KVCache` whose pages and slots it hands out.
      prefill_chunk: most tokens of one prompt per prefill call.
      max_prefill_tokens: most prompt tokens prefilled per step (at least one chunk).
      chunk_lengths: the lengths a chunk after a sequence's first may have (the engine's compiled
        prefill lengths; ``prefill_chunk`` is added).

    Attributes:
      num_preemptions: requests preempted so far.
      num_cached_tokens: prompt tokens taken from the prefix cache instead of prefilled.
    """

    def __init__(self, cache: KVCache, *, prefill_chunk: int, max_prefill_tokens: int,
                 chunk_lengths: Sequence[int] = ()):
        self.cache = cache
        self.prefill_chunk = prefill_chunk
        self.max_prefill_tokens = max(max_prefill_tokens, prefill_chunk)
        self.chunk_lengths = sorted({n for n in chunk_lengths if n <= prefill_chunk} | {prefill_chunk})
        self.waiting: list[Request] = []  # sorted by arrival
        self.running: dict[int, Request] = {}  # slot -> request
        self.free_slots = list(range(cache.max_slots - 1, -1, -1))
        self.num_preemptions = 0
        self.num_cached_tokens = 0

    # -- queue ---------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        keys = [r.arrival for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, request.arrival), request)

    def abort(self, request: Request) -> None:
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status != RequestStatus.FINISHED:
            self._release(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, "abort"

    def finish(self, request: Request, reason: str) -> None:
        self._release(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason

    def _release(self, request: Request) -> None:
        computed = request.cache_length if request.status == RequestStatus.DECODING else request.num_computed
        self.cache.register(request.slot, request.sequence, computed)
        self.cache.release(request.slot)
        del self.running[request.slot]
        self.free_slots.append(request.slot)
        request.slot = None

    # -- planning ------------------------------------------------------------------------------
    def admit(self, steps: int) -> list[Request]:
        """Moves waiting requests into free slots, oldest first, while the free pages hold their
        sequences and ``steps`` decode steps of them and of every decoding request (so that an
        admission does not force a preemption at once)."""
        admitted = []
        committed = sum(self.cache.missing_pages(r.slot, min(r.cache_length + steps, r.max_cache_length))
                        for r in self.running.values() if r.status == RequestStatus.DECODING)
        while self.waiting and self.free_slots:
            request = self.waiting[0]
            slot = self.free_slots[-1]
            target = min(len(request.sequence) + steps, request.max_cache_length)
            cached = self.cache.match(request.sequence)
            needed = self.cache.pages_for(target) - len(cached) + self.cache.num_cached_free(cached)
            if needed + committed > self.cache.num_free_pages:
                break
            self.cache.share(slot, cached)
            if not self.cache.reserve(slot, target):
                raise RuntimeError(f"Scheduler.admit: {needed} pages counted for request {request.request_id}, "
                                   f"fewer allocated (page accounting is broken)")
            self.free_slots.pop()
            self.waiting.pop(0)
            request.slot, request.status = slot, RequestStatus.PREFILLING
            request.num_computed, request.prefill_target = len(cached) * self.cache.page_size, len(request.sequence)
            self.num_cached_tokens += request.num_computed
            self.running[slot] = request
            admitted.append(request)
        return admitted

    def prefill_chunks(self) -> list[PrefillChunk]:
        """The next chunk of each prefilling request, oldest first, within the step's token budget.

        A sequence with nothing cached starts with a chunk from position 0 of up to ``prefill_chunk``
        tokens (attending among themselves). The chunks after it (or after cached pages) attend to
        the cache and have a length of ``chunk_lengths``, so they need no padding: ``prefill_chunk``
        tokens while more than that remain, then the shortest length that holds the rest, ending at
        the sequence's end and overlapping the chunk before (recomputing a few cached tokens); where
        that length exceeds the sequence, one chunk from position 0 instead."""
        chunks, budget = [], self.max_prefill_tokens
        for request in sorted(self.running.values(), key=lambda r: r.arrival):
            if request.status != RequestStatus.PREFILLING:
                continue
            total, done, size = request.prefill_target, request.num_computed, self.prefill_chunk
            if done == 0:
                start, length = 0, min(size, total)
            elif total - done > size:
                start, length = done, size
            else:
                length = next(n for n in self.chunk_lengths if n >= total - done)
                start = total - length
                if start < 0:
                    start, length = 0, total
            if length > budget:
                break
            budget -= length
            chunks.append(PrefillChunk(request, start, length))
        return chunks

    def reserve_decode(self, steps: int) -> list[Request]:
        """Pages for ``steps`` more tokens of every decoding request, preempting the most recently
        admitted requests while pages are short; returns the decoding requests."""
        while True:
            decoding = sorted((r for r in self.running.values() if r.status == RequestStatus.DECODING),
                              key=lambda r: r.arrival)
            short = None
            for request in decoding:
                target = min(request.cache_length + steps, request.max_cache_length)
                if not self.cache.reserve(request.slot, target):
                    short = request
                    break
            if short is None:
                return decoding
            self.preempt(max(self.running.values(), key=lambda r: r.arrival))

    def preempt(self, request: Request) -> None:
        """Frees ``request``'s slot and pages and queues it again (it will be recomputed)."""
        self._release(request)
        request.status, request.num_computed = RequestStatus.WAITING, 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request)
