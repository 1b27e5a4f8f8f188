"""The serving path's `AttentionCache`: each layer writes this step's K/V by slot and attends over its pages.

`PagedCache` is the join of one serving step. The allocator's `StepOutput` gives, through `metadata_from_step`,
one `AttentionMetadata` per KV-cache group; the model calls ``attend(layer, q, k, v, ...)``, and the layer's
tensor and group metadata go to `layer_attention` (the Mosaic GPU kernels on a GPU, the reference elsewhere).
Everything here is traced inside the engine's one jitted step.

Shape letters: T tokens · N query heads · K kv heads · H head size.
"""

import dataclasses

import jax
from jax.sharding import Mesh
from jaxtyping import Array, Int

from .._compat import register_pytree_dataclass
from ..attention import layer_attention
from ..metadata import AttentionMetadata
from ..sharding import sharded_layer_attention

__all__ = ["PagedCache"]


@dataclasses.dataclass(frozen=True)
class PagedCache:
    """The step's KV-cache tensors and per-group metadata, and each layer's place in them.

    Attributes:
      tensors: the shared KV-cache tensors, [B, 2, S, K, H] each.
      metadata: one `AttentionMetadata` per KV-cache group, for this step's T tokens.
      positions: [T] position of each token in its request.
      layer_group, layer_tensor: per layer, its group and tensor (static; `KVCacheLayout`).
      implementation, interpret: as `paged_attention` (static).
      mesh, axis: with a mesh, each layer's heads are split over its `axis` (`sharded_layer_attention`; the
        tensors split the same way); None: one device.
    """

    tensors: tuple[jax.Array, ...]
    metadata: tuple[AttentionMetadata, ...]
    positions: Int[Array, "T"]
    layer_group: tuple[int, ...]
    layer_tensor: tuple[int, ...]
    implementation: str | None = None
    interpret: bool = False
    mesh: Mesh | None = None
    axis: str | None = None

    def attend(self, layer, q, k, v, *, params, sinks=None):
        """Write the layer's k/v into its tensor at its group's slots, then attend (`layer_attention`)."""
        tensor = self.layer_tensor[layer]
        options = dict(params=params, sinks=sinks, implementation=self.implementation, interpret=self.interpret)
        inputs = (q, k, v, self.tensors[tensor], self.metadata[self.layer_group[layer]])
        if self.mesh is None:
            out, updated = layer_attention(*inputs, **options)
        else:
            out, updated = sharded_layer_attention(self.mesh, self.axis, *inputs, **options)
        tensors = self.tensors[:tensor] + (updated,) + self.tensors[tensor + 1 :]
        return out, dataclasses.replace(self, tensors=tensors)


register_pytree_dataclass(
    PagedCache,
    data_fields=["tensors", "metadata", "positions"],
    meta_fields=["layer_group", "layer_tensor", "implementation", "interpret", "mesh", "axis"],
)
