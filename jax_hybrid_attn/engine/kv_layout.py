"""Where each layer's K/V lives: a model's layers grouped into KV-cache groups, the shared tensors, the sizing.

vLLM's hybrid layout (`jax_hybrid_attn.allocator.get_kv_cache_config`): layers with the same attention spec form
groups of equal size; there are ``group_size`` tensors of ``num_blocks`` blocks, tensor i shared by the i-th
layer of every group. All groups draw block ids from one pool, so a block id names memory in one group only.
With ``hybrid=False`` every layer is given full attention's spec, as a JAX serving stack without hybrid
allocation would: the same engine then shows what the hybrid allocator saves.

Shape letters: B blocks in the pool · S block size · K kv heads · H head size.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..allocator import (
    AllocatorConfig,
    KVCacheConfig,
    blocks_per_request,
    get_kv_cache_config,
    get_kv_cache_groups,
)
from ..integers import check_int
from ..layout import FP8_DTYPE, KVLayout, get_kv_cache_shape, preferred_kv_layout
from ..models.config import ModelConfig
from ..models.partitioning import tensor_parallel_config

__all__ = ["KVCacheLayout"]


def layer_name(layer: int) -> str:
    return f"layers.{layer}"


@dataclasses.dataclass(frozen=True)
class KVCacheLayout:
    """A model's KV-cache groups and tensors, and each layer's place in them (static, hashable).

    Attributes:
      kv_config: groups, tensors and ``num_blocks`` (the allocator's sizing).
      layer_group: per layer, its KV-cache group (which block tables and slots it uses).
      layer_tensor: per layer, which shared tensor holds its K/V.
      tensor_shape: [B, 2, S, K, H] ("NHD") or [B, 2, K, S, H] ("HND_VT") of every tensor (one page size for all
        groups).
      dtype: the cache dtype.
      kv_layout: the tensors' layout (`layout.preferred_kv_layout`).
    """

    kv_config: KVCacheConfig
    layer_group: tuple[int, ...]
    layer_tensor: tuple[int, ...]
    tensor_shape: tuple[int, ...]
    dtype: np.dtype
    kv_layout: KVLayout = "NHD"

    @classmethod
    def for_engine(cls, model_config: ModelConfig, config, *, max_model_len: int, dtype) -> "KVCacheLayout":
        """The layout an engine of `config` (a resolved `EngineConfig`) keeps for a model of `model_config`
        whose weights are in `dtype`: the cache in ``config.kv_cache_dtype`` (None: `dtype`), each layer's KV
        heads split over ``config.tensor_parallel`` devices, ``config.kv_memory`` per device. Nothing is
        allocated, so the engine's options are checked with it before any weight is read. `ValueError` for a
        cache dtype that is neither `dtype` nor float8, or a pool too small for one request of `max_model_len`
        tokens."""
        model_dtype = jnp.dtype(dtype)
        cache_dtype = config.kv_cache_dtype or model_dtype
        if cache_dtype not in (model_dtype, FP8_DTYPE):
            raise ValueError(
                f"kv_cache_dtype={cache_dtype} must be the model's dtype ({model_dtype}) or {FP8_DTYPE}"
            )
        devices = config.tensor_parallel
        per_device = model_config if devices == 1 else tensor_parallel_config(model_config, devices)
        return cls.for_model(
            per_device,
            block_size=config.block_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            dtype=cache_dtype,
            num_blocks=config.num_blocks,
            kv_memory=None if config.kv_memory is None else config.kv_memory * devices,
            hybrid=config.hybrid,
        )

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        *,
        block_size: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int = 1,
        dtype=jnp.bfloat16,
        num_blocks: int | None = None,
        kv_memory: int | None = None,
        hybrid: bool = True,
    ) -> "KVCacheLayout":
        """Size the cache by `num_blocks` (blocks in the pool, the null block included) or by `kv_memory` bytes
        (at most one of them; neither: room for `max_num_seqs` requests of `max_model_len` tokens at once).
        `ValueError` when a request of `max_model_len` tokens would not fit."""
        check_int("block_size", block_size)
        if num_blocks is not None and kv_memory is not None:
            raise ValueError(f"give at most one of num_blocks={num_blocks!r} and kv_memory={kv_memory!r}")
        specs = {
            layer_name(i): config.kv_cache_spec(i, block_size=block_size, dtype=dtype, hybrid=hybrid)
            for i in range(config.num_layers)
        }
        if kv_memory is not None:
            check_int("kv_memory", kv_memory, maximum=None)
        elif num_blocks is None:
            groups = get_kv_cache_groups(specs)
            per_request = blocks_per_request(
                [g.kv_cache_spec for g in groups], max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
            )  # fmt: skip
            num_blocks = 1 + check_int("max_num_seqs", max_num_seqs) * per_request
        kv_config = get_kv_cache_config(
            specs,
            available_memory=0 if kv_memory is None else kv_memory,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            num_blocks_override=num_blocks,
        )
        group_of, tensor_of = {}, {}
        for g, group in enumerate(kv_config.kv_cache_groups):
            for name in group.layer_names:
                group_of[name] = g
        for t, tensor in enumerate(kv_config.kv_cache_tensors):
            for name in tensor.shared_by:
                tensor_of[name] = t
        spec = kv_config.kv_cache_groups[0].kv_cache_spec
        pages = {(g.kv_cache_spec.block_size, g.kv_cache_spec.num_kv_heads, g.kv_cache_spec.head_size)
                 for g in kv_config.kv_cache_groups}  # fmt: skip
        if len(pages) > 1:
            raise NotImplementedError(
                f"layers with different (block size, kv heads, head size) {sorted(pages)}: the engine's shared "
                "tensors need one page shape"
            )
        kv_layout = preferred_kv_layout(dtype, spec.block_size)
        shape = get_kv_cache_shape(kv_config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size,
                                   kv_layout=kv_layout)  # fmt: skip
        names = [layer_name(i) for i in range(config.num_layers)]
        return cls(
            kv_config=kv_config,
            layer_group=tuple(group_of[n] for n in names),
            layer_tensor=tuple(tensor_of[n] for n in names),
            tensor_shape=tuple(shape),
            dtype=np.dtype(dtype),
            kv_layout=kv_layout,
        )

    def allocator_config(self, **options) -> AllocatorConfig:
        """The allocator of this layout; `options` are `AllocatorConfig`'s other fields."""
        return AllocatorConfig.from_kv_cache_config(self.kv_config, **options)

    def allocate(self, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
        """The KV-cache tensors stacked in one zero-filled array [num_tensors, *tensor_shape], on the default
        device or created with `sharding`."""
        shape = (self.num_tensors, *self.tensor_shape)
        return jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=sharding)()

    @property
    def num_tensors(self) -> int:
        return len(self.kv_config.kv_cache_tensors)

    @property
    def num_blocks(self) -> int:
        return self.kv_config.num_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one block id across every tensor (what one block of the pool costs)."""
        return self.kv_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes * len(
            self.kv_config.kv_cache_tensors
        )

    @property
    def total_bytes(self) -> int:
        return sum(t.size for t in self.kv_config.kv_cache_tensors)
