"""Serving: a continuous-batching engine over the hybrid allocator and the paged kernels.

Data flow of one step: `Engine.step` schedules (host) → `KVCacheManager.schedule` allocates (device) →
`metadata_from_step` per KV-cache group → the model's forward through `PagedCache` → `layer_attention` → the
kernels; then sampling, all in one jitted call.
"""

from .engine import Engine, EngineConfig, EngineStats
from .kv_layout import KVCacheLayout
from .paged_cache import PagedCache
from .requests import FinishReason, RequestOutput
from .sampling import NO_TOP_K, SamplingParams, sample_tokens

__all__ = [
    "NO_TOP_K",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "KVCacheLayout",
    "PagedCache",
    "RequestOutput",
    "SamplingParams",
    "sample_tokens",
]
