"""Serving: a continuous-batching engine over the hybrid allocator and the paged kernels.

Data flow of one step: `Engine.step` plans (host, its `Scheduler`) → `ModelRunner.run_step`, the one owner of the device state
and of the executables it compiled before serving (`step_shapes`; `step_cache` lowers them in worker processes
and keeps them across processes; `lower_ahead` starts that before the weights load) → `device_step.allocate` (the allocator's `allocate_slots`) →
`device_step.forward`: the model's layers scanned over their pattern (`models.layer_scan`), each attending
through `PagedCache` (its group's metadata) → `layer_attention` → the kernels → `device_step.sample`, and the
sampled tokens back into the allocator. The host reads a step back while the next one runs.
With ``EngineConfig(tensor_parallel=N)`` the model's heads and MLP are split over N devices
(`models.partitioning`) and each layer attends per device (`sharding.sharded_layer_attention`).
"""

from .config import EngineConfig, EngineStats
from .engine import Engine, check_engine_config, lower_ahead
from .kv_layout import KVCacheLayout
from .model_runner import ModelRunner
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
    "ModelRunner",
    "PagedCache",
    "RequestOutput",
    "SamplingParams",
    "check_engine_config",
    "lower_ahead",
    "sample_tokens",
]
