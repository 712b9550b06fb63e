"""Inference: a continuous-batching `Engine` over a paged key/value cache (`KVCache`), its
`Scheduler`, and on-device sampling (`SamplingParams`). User guide: docs/inference.md."""

from mtjax.inference.engine import Engine, RequestOutput
from mtjax.inference.kv_cache import KV_DTYPES, KVCache, PageAllocator
from mtjax.inference.sampling import SamplingParams, TokenLogprobs, sample, token_logprobs
from mtjax.inference.scheduler import Request, RequestStatus, Scheduler

__all__ = [
    "KV_DTYPES", "Engine", "KVCache", "PageAllocator", "Request", "RequestOutput", "RequestStatus", "SamplingParams",
    "Scheduler", "TokenLogprobs", "sample", "token_logprobs",
]
