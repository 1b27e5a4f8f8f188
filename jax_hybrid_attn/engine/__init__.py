"""Serving: a continuous-batching engine over the hybrid allocator and the paged kernels.

Data flow of one step: `Engine.step` plans (host) → `device_step.allocate` (the allocator's `allocate_slots`) →
`device_step.run_model`: `metadata_from_step` per KV-cache group → the model's forward through `PagedCache` →
`layer_attention` → the kernels; then sampling, and the sampled tokens back into the allocator. The host reads a
step back while the next one runs.
With ``EngineConfig(tensor_parallel=N)`` the model's heads and MLP are split over N devices
(`models.partitioning`) and each layer attends per device (`sharding.sharded_layer_attention`).
"""

from .config import EngineConfig, EngineStats
from .engine import Engine
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
