"""The serving path's `AttentionCache`: each layer writes this step's K/V by slot and attends over its pages.

`PagedCache` is the join of one serving step. It holds the allocator's `StepOutput` for the step (every KV-cache
group's block tables and slots) and the engine's KV-cache tensors stacked in one array; the model calls
``attend(layer, q, k, v, ...)``, and the layer's tensor and its group's `AttentionMetadata` go to
`layer_attention` (the Mosaic GPU kernels on a GPU, the reference elsewhere). Everything here is traced inside
the engine's jitted forward.

A layer's tensor and group may be traced values (`at_layer` inside a scan over layers): the layer then attends
over the whole stack viewed as one pool of ``num_tensors * B`` blocks, with its block ids and slots offset into
its own tensor (a view, never a copy of the tensor). Tensor t's block 0 is its null block, so offset null
entries stay null.

Shape letters: T tokens · R rows · G KV-cache groups · P blocks per row · N query heads · K kv heads ·
H head size · B blocks · S block size.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Int

from .._compat import register_pytree_dataclass
from ..allocator import StepOutput
from ..attention import layer_attention
from ..constants import PAD_SLOT_ID
from ..kernels.mixed_batch import KernelPlan, plan_kernels
from ..layout import FP8_DTYPE, KVCache, KVLayout
from ..metadata import AttentionMetadata
from ..sharding import sharded_layer_attention
from ..validation import resolve_implementation

__all__ = ["PagedCache", "with_checked_block_tables"]


@dataclasses.dataclass(frozen=True)
class PagedCache:
    """The step's KV-cache tensors and block tables, and each layer's place in them.

    Attributes:
      kv: [num_tensors, B, 2, S, K, H] ("NHD") or [num_tensors, B, 2, K, S, H] ("HND_VT"), the shared KV-cache
        tensors (`KVCacheLayout.allocate`).
      step: the allocator's `StepOutput` for this step's T tokens (block tables [G, R, P_max], slots [G, T]).
      positions: [T] position of each token in its request.
      layer: the layer attending now (`at_layer`; traced inside a scan), or None: `attend`'s argument.
      layer_group, layer_tensor: per layer, its group and tensor (static; `KVCacheLayout`).
      blocks_per_row: per group, P (static; the allocator's).
      max_query_len, max_seq_len, token_budget: the metadata's static bounds.
      implementation, interpret: as `paged_attention` (static).
      mesh, axis: with a mesh, each layer's heads are split over its `axis` (`sharded_layer_attention`; the
        tensors split the same way); None: one device.
      common_prefix_blocks: [G] per group, the leading blocks every row shares, or None: with them, the layers
        without a window or chunk attend as cascade attention (`cascade`). Windowed and chunked layers do not:
        their kernels already skip a prefix that lies outside every query's window or chunk.
      kv_layout: the tensors' layout (static; `KVCacheLayout.kv_layout`).
      block_ids_in_range: static; `step`'s block tables hold only ids in a tensor's ``[0, B)``
        (`with_checked_block_tables`, once per step): each layer's metadata says so
        (`AttentionMetadata.block_ids_in_range`), and the attention checks no block table per layer.
      kernel_plans: per block-table width P, the kernels' launch plan of the layers of that width
        (`with_kernel_plans`, once per step), or None: each layer plans its own launch.
    """

    kv: jax.Array
    step: StepOutput
    positions: Int[Array, "T"]
    layer: Int[Array, ""] | int | None
    layer_group: tuple[int, ...]
    layer_tensor: tuple[int, ...]
    blocks_per_row: tuple[int, ...]
    max_query_len: int
    max_seq_len: int
    token_budget: int | None = None
    implementation: str | None = None
    interpret: bool = False
    mesh: Mesh | None = None
    axis: str | None = None
    common_prefix_blocks: Int[Array, "G"] | None = None
    kv_layout: KVLayout = "NHD"
    block_ids_in_range: bool = False
    kernel_plans: dict[int, KernelPlan | None] | None = None

    def at_layer(self, layer) -> "PagedCache":
        return dataclasses.replace(self, layer=layer)

    def metadata(self, layer, kind_layer: int) -> AttentionMetadata:
        """Layer `layer`'s metadata over the stack viewed as one pool: its group's block tables and slots,
        offset into its tensor. `kind_layer` (static) has the same kind, hence the same P."""
        step = self.step
        num_blocks, block_size = self.kv.shape[1], self.kv.shape[3 if self.kv_layout == "NHD" else 4]
        if isinstance(layer, int):
            group, tensor = self.layer_group[layer], self.layer_tensor[layer]
        else:
            group = jnp.asarray(self.layer_group, jnp.int32)[layer]
            tensor = jnp.asarray(self.layer_tensor, jnp.int32)[layer]
        width = self.blocks_per_row[self.layer_group[kind_layer]]
        slots = step.slot_mappings[group, : self.positions.shape[0]]
        return AttentionMetadata(
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            block_tables=step.block_tables[group, :, :width] + tensor * num_blocks,
            slot_mapping=jnp.where(slots == PAD_SLOT_ID, PAD_SLOT_ID, slots + tensor * num_blocks * block_size),
            num_actual_tokens=step.query_start_loc[-1],
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            token_budget=self.token_budget,
            block_ids_in_range=self.block_ids_in_range,
            kernel_plan=None if self.kernel_plans is None else self.kernel_plans[width],
        )

    def with_kernel_plans(self, *, num_q_heads: int, head_dim: int, q_dtype) -> "PagedCache":
        """This cache with the kernels' launch plan of each block-table width (`mixed_batch.plan_kernels`) for
        layers whose q has `num_q_heads` heads of `head_dim` in `q_dtype`: built here, before the scans over
        layers, instead of in every iteration of them. Unchanged where the layers do not run the kernels
        (the reference path) or run split over a mesh (each device plans for its own heads)."""
        if self.mesh is not None or resolve_implementation(self.implementation, self.interpret) != "kernel":
            return self
        first_layer_of_width = {}
        for layer, group in enumerate(self.layer_group):
            first_layer_of_width.setdefault(self.blocks_per_row[group], layer)
        pool = KVCache(self.kv.reshape(-1, *self.kv.shape[2:]), self.kv_layout)  # only its dims and dtype count
        plans = {width: plan_kernels(self.metadata(layer, layer), num_q_heads=num_q_heads, head_dim=head_dim,
                                     q_dtype=q_dtype, kv_cache=pool)
                 for width, layer in first_layer_of_width.items()}  # fmt: skip
        return dataclasses.replace(self, kernel_plans=plans)

    def attend(self, layer, q, k, v, *, params, sinks=None, k_scale=None, v_scale=None):
        """Write the layer's k/v into its tensor at its group's slots, then attend (`layer_attention`). A float8
        cache stores them divided by the layer's `k_scale` / `v_scale` (1.0 where None); other caches ignore
        the scales, as vLLM does."""
        where = layer if self.layer is None else self.layer
        metadata = self.metadata(where, layer)
        windowed = params.sliding_window is not None or params.attention_chunk_size is not None
        if self.common_prefix_blocks is not None and not windowed:
            group = self.layer_group[where] if isinstance(where, int) else jnp.asarray(self.layer_group)[where]
            metadata = metadata.replace(num_common_prefix_blocks=self.common_prefix_blocks[group])
        pool = self.kv.reshape(-1, *self.kv.shape[2:])  # [num_tensors * B, 2, ...]: a view
        scales = dict(k_scale=k_scale, v_scale=v_scale) if self.kv.dtype == FP8_DTYPE else {}
        pool = KVCache(pool, self.kv_layout, **scales)
        options = dict(params=params, sinks=sinks, implementation=self.implementation, interpret=self.interpret)
        if self.mesh is None:
            out, pool = layer_attention(q, k, v, pool, metadata, **options)
        else:
            out, pool = sharded_layer_attention(self.mesh, self.axis, q, k, v, pool, metadata, **options)
        return out, dataclasses.replace(self, kv=pool.data.reshape(self.kv.shape))


def with_checked_block_tables(step: StepOutput, *, num_blocks: int, max_keys: int) -> StepOutput:
    """`step` with its block tables checked once, before the layers: ids clipped into ``[0, num_blocks)``, and a
    row that held an id outside it in any group flagged through its ``seq_lens`` (``max_keys + 1``, beyond the
    ``P * S`` keys of every group's table, so that its tokens come out NaN, never a wrong number); for
    `PagedCache` with ``block_ids_in_range``."""
    tables = step.block_tables
    bad = jnp.any((tables < 0) | (tables >= num_blocks), axis=(0, 2))
    return dataclasses.replace(
        step,
        block_tables=jnp.clip(tables, 0, num_blocks - 1),
        seq_lens=jnp.where(bad, max_keys + 1, step.seq_lens),
    )


register_pytree_dataclass(
    PagedCache,
    data_fields=["kv", "step", "positions", "layer", "common_prefix_blocks", "kernel_plans"],
    meta_fields=["layer_group", "layer_tensor", "blocks_per_row", "max_query_len", "max_seq_len",
                 "token_budget", "implementation", "interpret", "mesh", "axis", "kv_layout", "block_ids_in_range"],
)  # fmt: skip
