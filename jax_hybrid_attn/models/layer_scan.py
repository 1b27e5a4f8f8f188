"""A decoder's layers as scans over their repeating pattern: each kind of layer is traced, lowered and compiled
once, however deep the model.

Layers of one kind (`ModelConfig.layer_kind`: attention type and parameters, RoPE, sinks, MLP) run the same code
on weights of the same shapes. A model's layers are a few `LayerRun`s: a period of kinds repeated, e.g. Gemma 3's
26 layers are its 6-layer period (5 sliding-window, 1 global) 4 times and then 2 sliding-window layers. Each run
is one `jax.lax.scan` whose body is the period unrolled, over the period's weights stacked by repeat (MaxText
scans Gemma 3 the same way). A scan's trip count is static, so on a GPU it makes the host wait for nothing.

The layers reach their KV cache through ``cache.at_layer(i)``: inside a scan the layer index is traced, and the
cache finds the layer's tensor and group from it (`engine.paged_cache.PagedCache`).

The stacked weights can be those of layers whose q/k/v projections and gate/up projections are fused
(`ScannedDecoder.from_decoder(..., fuse_projections=True)`, `DecoderLayer.fuse_projections`): each layer then runs
one matmul per group on weights concatenated once, here. Left apart, XLA merges each group's matmuls into one
itself, by concatenating their weights inside the scan's body, at every step, on top of copying each sliced
weight.

A scan's body slices each stacked weight once per iteration. On a GPU, cuBLAS reads a matrix's slice in place
(`EngineConfig.cublas_matmuls`), but every other slice is a kernel of its own. The small weights (norm weights,
biases, sinks, KV-cache scales) are therefore sliced together: `VectorPack` puts a period's small weights in one
array per dtype, and the body slices only those and the matrices.

Shape letters: T tokens · D hidden size · V vocabulary · R rows kept for the LM head.
"""

import dataclasses
import math
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from .attention_cache import AttentionCache
from .config import ModelConfig
from .decoder import Decoder, DecoderEnds

__all__ = ["LayerRun", "ScannedDecoder", "VectorPack", "layer_runs"]


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Layers ``start, ..., start + period * repeats - 1``: the kinds of the first `period` of them, `repeats`
    times over."""

    start: int
    period: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    def layers(self, position: int) -> list[int]:
        """The layers at `position` of the period, one per repeat."""
        return [self.start + repeat * self.period + position for repeat in range(self.repeats)]


def _smallest_period(kinds: Sequence[Hashable]) -> int:
    """The smallest p such that every kind equals the one p layers before it."""
    return next(p for p in range(1, len(kinds) + 1) if all(kinds[i] == kinds[i - p] for i in range(p, len(kinds))))


def layer_runs(kinds: Sequence[Hashable]) -> tuple[LayerRun, ...]:
    """The layers (of these kinds, in order) as runs: the smallest period of the kinds, repeated as often as it
    fits, then the rest the same way. Gemma 3's 26 layers: runs of period 6 × 4 and period 1 × 2 (7 layers to
    compile; a model of 6 of them compiles 6)."""
    runs, start = [], 0
    while start < len(kinds):
        rest = kinds[start:]
        period = _smallest_period(rest)
        runs.append(LayerRun(start, period, len(rest) // period))
        start = runs[-1].stop
    return tuple(runs)


def _stack(states: list[nnx.State]) -> nnx.State:
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)


def _layer_split(layer: nnx.Module, *, fuse_projections: bool) -> tuple[nnx.GraphDef, nnx.State]:
    """`nnx.split` of `layer`, or, with `fuse_projections`, of a copy of it with its projections fused. The copy
    (`nnx.merge` of the layer's split) has modules of its own around the layer's arrays (none is copied), so
    fusing it replaces the copy's Linears and leaves the layer as it was."""
    graph, state = nnx.split(layer)
    if not fuse_projections:
        return graph, state
    copy = nnx.merge(graph, state)
    copy.fuse_projections()
    return nnx.split(copy)


def _stacked_position(layers, indices: list[int], *, stack, fuse_projections: bool):
    """The graph of layer ``indices[0]`` and the stacked weights of `indices` (`_layer_split` of each). The
    layers' own fused weights are dropped on return: only the stack stays."""
    splits = [_layer_split(layers[i], fuse_projections=fuse_projections) for i in indices]
    return splits[0][0], stack([state for _, state in splits])


@dataclasses.dataclass(frozen=True)
class ScannedDecoder:
    """A `Decoder` laid out for scans over its layers: its ends (`DecoderEnds`) and, per `LayerRun` and position
    in its period, the weights of that position's layers stacked on a leading axis (one entry per repeat).

    It is a pytree: the weights are its leaves, the graphs and runs static, so a jitted step takes it as an
    argument. `from_decoder` stacks the layer weights into new arrays: the decoder's own stay as they are (drop
    the decoder to free them). With ``fuse_projections`` the stacked layers are fused copies of the decoder's
    (`DecoderLayer.fuse_projections`): one q/k/v matmul and one gate/up matmul per layer, on weights concatenated
    once when stacked, where the scan's body would otherwise concatenate them at every step.

    Attributes:
      runs: the `layer_runs` of the layers' kinds.
      ends_graph, ends: the graph and weights of the decoder's `DecoderEnds`.
      layer_graphs: per run, per position, the graph of that position's first layer (all its repeats share it).
      layer_weights: per run, per position, the stacked weights.
    """

    runs: tuple[LayerRun, ...]
    ends_graph: nnx.GraphDef
    ends: nnx.State
    layer_graphs: tuple[tuple[nnx.GraphDef, ...], ...]
    layer_weights: tuple[tuple[nnx.State, ...], ...]

    @classmethod
    def from_decoder(cls, decoder: Decoder, *, stack=_stack, fuse_projections: bool = False) -> "ScannedDecoder":
        """Lay `decoder` out for scans. `stack` makes a stacked state of a list of layer states (default:
        `jnp.stack` of each leaf, on the leaves' device). `fuse_projections`: stack fused copies of the layers
        (`DecoderLayer.fuse_projections`; the decoder is left unchanged), one position of a period at a time, so
        that at most one position's fused layers exist apart from their stack."""
        config: ModelConfig = decoder.config
        runs = layer_runs([config.layer_kind(i) for i in range(config.num_layers)])
        ends_graph, ends = nnx.split(DecoderEnds(decoder))
        layers = decoder.model.layers
        graphs, weights = [], []
        for run in runs:
            positions = [_stacked_position(layers, run.layers(j), stack=stack, fuse_projections=fuse_projections)
                         for j in range(run.period)]  # fmt: skip
            graphs.append(tuple(graph for graph, _ in positions))
            weights.append(tuple(stacked for _, stacked in positions))
        return cls(runs, ends_graph, ends, tuple(graphs), tuple(weights))

    def __call__(
        self,
        token_ids: Int[Array, "T"],
        cache: AttentionCache,
        *,
        logits_indices: Int[Array, "R"] | None = None,
        pack_vectors: bool = True,
        float32_logits: bool = True,
    ) -> tuple[Float[Array, "R V"], AttentionCache]:
        """`Decoder.__call__`: the same logits and cache, the layers run as scans.

        `pack_vectors`: a scan's body slices one array per dtype holding all of its period's small weights (norm
        weights, biases, sinks, KV-cache scales: `VectorPack`), concatenated once per call, instead of one slice
        per weight and layer. Leave it off where the vectors are split over devices differently.

        `float32_logits`: off, the logits stay in the LM head's dtype where the model has no final soft cap
        (`DecoderEnds.logits`)."""
        ends = nnx.merge(self.ends_graph, self.ends)
        x = ends.embed(token_ids)
        for run, graphs, weights in zip(self.runs, self.layer_graphs, self.layer_weights, strict=True):

            def period(carry, xs, graphs=graphs):
                x, cache = carry
                states, ids = xs
                for j, (graph, state) in enumerate(zip(graphs, states, strict=True)):
                    x, cache = nnx.merge(graph, state)(x, cache.at_layer(ids[j]))
                return (x, cache.at_layer(None)), None

            if run.repeats == 1:  # nothing to scan: the period once, on the unstacked weights, its layers static
                unstacked = jax.tree.map(lambda leaf: leaf[0], weights)
                (x, cache), _ = period((x, cache), (unstacked, range(run.start, run.stop)))
                continue
            layer_ids = jnp.asarray([run.layers(j) for j in range(run.period)], jnp.int32).T  # [repeats, period]
            if not pack_vectors:
                (x, cache), _ = jax.lax.scan(period, (x, cache), (weights, layer_ids))
                continue
            pack = VectorPack.of(weights)

            def packed_period(carry, xs, pack=pack, period=period):
                matrices, vectors, ids = xs
                return period(carry, (pack.unpack(matrices, vectors), ids))

            matrices, vectors = pack.pack(weights)
            (x, cache), _ = jax.lax.scan(packed_period, (x, cache), (matrices, vectors, layer_ids))
        return ends.logits(x, logits_indices, float32=float32_logits), cache


PACKED_MAX_SIZE = 65_536
"""A layer's weight of at most this many elements is packed (`VectorPack`): norm weights, biases, sinks, scales."""


@dataclasses.dataclass(frozen=True)
class VectorPack:
    """Where a period's small stacked weights go in one array per dtype, so that a scan's body slices each of
    those arrays once per iteration instead of every weight (each slice is a kernel on a GPU).

    The period's stacked weights (a tree of ``[repeats, ...]`` leaves) flatten to `treedef`; the leaves of at
    most `PACKED_MAX_SIZE` elements per layer (vectors, scalars, per-head norm weights) are `packed`, the
    matrices pass as they are.

    Attributes:
      treedef: the structure of the period's weights.
      packed: per dtype, the flat indices of its vectors and their per-layer shapes, in packing order.
    """

    treedef: jax.tree_util.PyTreeDef
    packed: tuple[tuple[jnp.dtype, tuple[tuple[int, tuple[int, ...]], ...]], ...]

    @classmethod
    def of(cls, weights) -> "VectorPack":
        leaves, treedef = jax.tree.flatten(weights)
        by_dtype: dict = {}
        for index, leaf in enumerate(leaves):
            if math.prod(leaf.shape[1:]) <= PACKED_MAX_SIZE:
                by_dtype.setdefault(jnp.dtype(leaf.dtype), []).append((index, tuple(leaf.shape[1:])))
        return cls(treedef, tuple((dtype, tuple(entries)) for dtype, entries in by_dtype.items()))

    def pack(self, weights) -> tuple[list, list]:
        """(the leaves that stay apart, one ``[repeats, n]`` array per dtype of the others concatenated)."""
        leaves = jax.tree.leaves(weights)
        vectors = [jnp.concatenate([leaves[i].reshape(leaves[i].shape[0], -1) for i, _ in entries], axis=1)
                   for _, entries in self.packed]  # fmt: skip
        packed = {i for _, entries in self.packed for i, _ in entries}
        return [leaf for i, leaf in enumerate(leaves) if i not in packed], vectors

    def unpack(self, matrices: list, vectors: list):
        """The period's weights (one repeat's, inside the scan) from `pack`'s two lists (sliced likewise)."""
        leaves: dict[int, jax.Array] = {}
        for (_, entries), row in zip(self.packed, vectors, strict=True):
            offset = 0
            for index, shape in entries:
                size = math.prod(shape)
                leaves[index] = row[offset : offset + size].reshape(shape)
                offset += size
        rest = iter(matrices)
        ordered = [leaves[i] if i in leaves else next(rest) for i in range(self.treedef.num_leaves)]
        return jax.tree.unflatten(self.treedef, ordered)


jax.tree_util.register_dataclass(
    ScannedDecoder, data_fields=["ends", "layer_weights"], meta_fields=["runs", "ends_graph", "layer_graphs"]
)
