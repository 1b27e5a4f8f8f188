"""Kernel configurations other than the defaults, for the benchmarks that sweep or inspect them.

    with configs_changed(prefill=dict(ping_pong=False)):
        paged_attention(...)   # the prefill kernel with that change, the decode kernel as by default
"""

import contextlib
import dataclasses

from jax_hybrid_attn.kernels import mixed_batch
from jax_hybrid_attn.kernels.config import KernelConfig


def parse_variant(text: str) -> dict[str, int]:
    """``"ping_pong=0,block_kv=64"`` -> ``{"ping_pong": 0, "block_kv": 64}`` (integer KernelConfig fields)."""
    return {name: int(value) for name, value in (setting.split("=") for setting in text.split(","))}


def _changed(change, default: KernelConfig) -> KernelConfig:
    if change is None:
        return default
    return change if isinstance(change, KernelConfig) else dataclasses.replace(default, **change)


@contextlib.contextmanager
def configs_changed(*, decode=None, prefill=None):
    """Within the block `paged_attention` runs its decode and prefill kernels with these configurations: each a
    `KernelConfig` (used as is), a dict of fields to replace in the default, or None (the default)."""
    original = mixed_batch.kernel_configs

    def changed(*args, **kwargs):
        default_decode, default_prefill = original(*args, **kwargs)
        return _changed(decode, default_decode), _changed(prefill, default_prefill)

    mixed_batch.kernel_configs = changed
    mixed_batch._paged_attention_kernels.clear_cache()  # its executables hold the configurations they traced
    try:
        yield
    finally:
        mixed_batch.kernel_configs = original
        mixed_batch._paged_attention_kernels.clear_cache()
