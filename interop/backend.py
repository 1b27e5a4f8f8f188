"""A torch-facing paged-attention backend on jax_hybrid_attn, shaped after vLLM's and FlashInfer's.

    backend = PagedAttentionBackend(layers, block_size=16)         # vLLM: AttentionBackend + AttentionImpl(s)
    backend.plan(query_start_loc, seq_lens, block_tables, slot_mapping)   # once per step (FlashInfer: plan)
    out = backend.run("layers.0.attn", q, k, v, kv_cache)          # once per layer (vLLM: forward)

`run` writes the step's k/v into the layer's cache by slot mapping, then computes paged attention with the
library's kernels (the jnp reference on a CPU), in one jitted JAX call; the result comes back as a torch tensor
that shares JAX's memory. Nothing is copied on a GPU: q, k, v and a torch-owned cache enter JAX through DLPack
(`dlpack.to_jax`), the cache is donated so that XLA updates it in place, and the output leaves through DLPack.

q, k and v that are the column blocks of one [T, (N + 2K) * H] tensor (vLLM splits its QKV projection output so)
enter JAX as that one tensor and are split inside the jitted call: one import instead of three.

Per step, `plan` packs the metadata of every KV-cache group into one int32 buffer on the torch side and imports
it once (`plan.py`: each DLPack import costs host time comparable to a decode kernel); `run` slices one group's
`AttentionMetadata` out of it inside its jitted call, where `layer_attention` writes the layer's k/v and attends.
Layers with different windows, chunks, soft caps, scales or sinks are never an error: each `metadata_group_key`
compiles its own function, all reading the same plan.

Cache ownership (`cache_owner`):
  * "torch" (vLLM's way): the caller allocates each layer's cache with `get_kv_cache_shape` and passes it to
    every `run`. It is donated, so XLA writes it in place: torch sees the new k/v. The array XLA returns is then
    that tensor's memory, and the layer's next `run` with the same tensor uses it instead of importing the tensor
    again (an import costs host time). (XLA's CPU client does not alias imported buffers; on a CPU the update is
    copied back, which tests check, and each run imports the cache.)
  * "jax": the backend allocates the caches as JAX arrays (`allocate_kv_caches`) and rebinds them after every
    `run`. `kv_cache_as_torch` exports one for inspection, zero-copy; drop that tensor before the next `run` of
    the layer (JAX refuses to donate a buffer torch still holds; `run` raises a clear error instead).

Stream order: torch's current stream is the one that matters. Inputs are imported after the writes queued on it
(JAX's stream waits on an event torch records), and the returned tensor is exported so that work queued on it
afterwards waits for JAX. Writes queued on another torch stream must be ordered by the caller.

Shape letters: T tokens · R requests · N query heads · K kv heads · H head size · B blocks · S block
size · P blocks per request · G KV-cache groups.
"""

import math
import weakref
from collections.abc import Mapping, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import torch

from jax_hybrid_attn import KVCache, get_kv_cache_shape, layer_attention, metadata_group_key
from jax_hybrid_attn._compat import resolve_interpret
from jax_hybrid_attn.integers import check_int
from jax_hybrid_attn.validation import resolve_implementation

from .attention_layer import AttentionLayer
from .dlpack import ALIGNMENT, check_shareable, is_compact, jax_dtype, same_memory, to_jax, to_torch
from .layer_inputs import FUSED, fused_qkv, padded_rows, split_fused_qkv, tensor_key
from .plan import PACKED_FIELD_ALIGNMENT, PlanLayout, pack_plan

__all__ = ["AttentionLayer", "PagedAttentionBackend"]

CACHE_OWNERS = ("torch", "jax")
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_DTYPES = (*SUPPORTED_DTYPES, torch.float8_e4m3fn)
"""The dtypes of a cache `allocate_kv_caches` makes: q's, or float8 e4m3 (vLLM's ``fp8``)."""


@partial(
    jax.jit,
    static_argnames=("layout", "group", "params", "implementation", "interpret"),
    donate_argnames=("kv_data", "out_buffer"),
)
def _layer_step(
    packed, q, k, v, kv_data, kv_cache, sinks, out_buffer, *, layout, group, params, implementation, interpret
):
    """The plan's metadata of `group`, then `layer_attention` on `kv_cache` holding `kv_data` (donated apart from
    the scales): one compiled function per (layout, layer). With k = v = `FUSED`, q is the fused
    [T, (N + 2K) * H] projection output, split here."""
    kv_cache = kv_cache.replace(data=kv_data)
    if k is FUSED:
        _, _, num_kv_heads, head_size = kv_cache.dims
        q, k, v = split_fused_qkv(q, num_kv_heads=num_kv_heads, head_size=head_size)
    out, kv_cache = layer_attention(
        q, k, v, kv_cache, layout.metadata(packed, group), params=params, sinks=sinks,
        implementation=implementation, interpret=interpret,
    )  # fmt: skip
    if out_buffer is not None:  # the caller's `out`, donated: XLA writes the result into its memory
        out = out.reshape(out_buffer.shape)
    return out, kv_cache.data


class PagedAttentionBackend:
    """Paged attention for PyTorch serving code: `plan` once per step, `run` once per layer.

    Args:
      layers: the attention layers by name.
      block_size: S, tokens per cache block (a multiple of 16 for the kernels).
      kv_layout: "NHD" (cache [B, 2, S, K, H], vLLM's), "HND" ([B, 2, K, S, H]) or "HND_VT" ("HND"'s shape with
        V transposed per block and head: a float8 cache's fast layout on the kernels, blocks of a multiple of 64).
      cache_owner: "torch" (the caller passes each layer's cache to `run`) or "jax" (see `allocate_kv_caches`).
      implementation, interpret: passed to `jax_hybrid_attn.paged_attention` (default: the kernels on a GPU,
        the jnp reference on a CPU; ``interpret=True`` runs the kernels in Mosaic GPU interpret mode).
    """

    def __init__(
        self,
        layers: Mapping[str, AttentionLayer],
        *,
        block_size: int,
        kv_layout: str = "NHD",
        cache_owner: str = "torch",
        implementation: str | None = None,
        interpret: bool = False,
    ):
        if not isinstance(layers, Mapping) or not layers:
            raise ValueError(
                f"layers must be a non-empty mapping from name to AttentionLayer, got {layers!r}"
            )
        for name, layer in layers.items():
            if not isinstance(layer, AttentionLayer):
                raise ValueError(f"layers[{name!r}] must be an AttentionLayer, got {type(layer).__name__}")
        check_int("block_size", block_size)
        if cache_owner not in CACHE_OWNERS:
            raise ValueError(f"{cache_owner=} must be one of {CACHE_OWNERS}")
        get_kv_cache_shape(1, block_size, 1, 1, kv_layout=kv_layout)  # validates kv_layout
        resolve_interpret(interpret), resolve_implementation(implementation, interpret)  # as `layer_attention` will
        self.layers = dict(layers)
        self.block_size = block_size
        self.kv_layout = kv_layout
        self.cache_owner = cache_owner
        self.implementation = implementation
        self.interpret = interpret
        self.num_kv_cache_groups = 1 + max(layer.kv_cache_group for layer in self.layers.values())
        # per KV-cache group, the distinct parameters of its layers (a checked plan checks their reads)
        groups = self.metadata_groups()
        self._group_params = tuple(
            tuple(self.layers[names[0]].params for (group, _), names in groups.items() if group == g)
            for g in range(self.num_kv_cache_groups)
        )
        self._sinks: dict[str, jax.Array] = {}
        self._scales: dict[tuple, KVCache] = {}  # per layer and scale values: the scales on the device, no data
        self._caches: dict[str, jax.Array] = {}
        self._exported: dict[str, weakref.ref] = {}
        self._aliases: dict[tuple, bool] = {}
        self._held: dict[str, tuple[tuple, jax.Array]] = {}  # torch-owned caches XLA updated in place, by layer
        self._packed: jax.Array | None = None
        self._layout: PlanLayout | None = None
        self._needed_blocks: tuple[int, ...] | None = None  # per group, from a checked plan
        self._plan_device: torch.device | None = None
        self._padding: torch.Tensor | None = None

    # --------------------------------------------------------------------------------- vLLM's static side

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """vLLM's signature: ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` (NHD)."""
        if cache_dtype_str not in KV_CACHE_DTYPES:
            raise ValueError(f"{cache_dtype_str=} must be one of {tuple(KV_CACHE_DTYPES)}")
        return get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, kv_layout="NHD")

    def metadata_groups(self) -> dict[tuple, list[str]]:
        """Layers by (KV-cache group, `metadata_group_key`): the layers that share one compiled function."""
        groups: dict[tuple, list[str]] = {}
        for name, layer in self.layers.items():
            groups.setdefault((layer.kv_cache_group, metadata_group_key(layer.params)), []).append(name)
        return groups

    # ------------------------------------------------------------------------------------------- per step

    def plan(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
        causal: bool = True,
        checked: bool = True,
        num_common_prefix_blocks: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        """Take this step's metadata (vLLM's `CommonAttentionMetadata` fields) for every following `run`.

        Args:
          query_start_loc: [R+1] cumulative query lengths.
          seq_lens: [R] context lengths including this step's tokens.
          block_tables: [R, P], or [G, R, P] with one table per KV-cache group.
          slot_mapping: [T], or [G, T]; `PAD_SLOT_ID` (-1) for padding tokens.
          max_query_len, max_seq_len: host-side upper bounds (vLLM's); if None they are read from the values.
            Both are rounded up to a power of two to limit recompiles.
          causal: whether the layers attend causally.
          num_common_prefix_blocks: per KV-cache group, the leading block-table entries every request holds
            alike (vLLM's common prefix, in blocks): the layers then run as cascade attention
            (`jax_hybrid_attn.cascade`). None: plain attention.
          checked: read the tensors' values on the host and raise `ValueError`, naming the argument, for
            metadata that would give a wrong number or NaN: int64 values beyond int32; `query_start_loc` not
            starting at 0, decreasing or past T; a query longer than its `seq_lens`; a sequence beyond its
            block table (P*S); a negative block id; a token's slot other than its position p's slot in its
            request's block table (``block_tables[r, p // S] * S + p % S``), a padding token's (from
            ``query_start_loc[-1]`` on) other than `PAD_SLOT_ID`, a slot in the null block or written twice, a
            block written for two requests; a key position a layer of the group attends (its window and chunk
            applied) in the null block or in a block this step writes elsewhere (for another request, or at
            another column); a bound below the actual maximum; a common prefix the split cannot serve. Each
            following `run` then checks the block ids and slots against its cache's block count. CPU tensors
            are read where they are (host time only); CUDA tensors are copied to the host once, which waits
            for them.

            ``checked=False`` reads no value (nor waits, when both bounds are given): the caller then vouches
            that the metadata passes every check above, block ids below each layer's cache block count
            included, as vLLM's own metadata does. Metadata that breaks it can give wrong numbers (a slot
            written twice or elsewhere than its position's, a decreasing `query_start_loc`) or NaN (a query
            longer than its `seq_lens` or bound, a block id outside the cache, a common prefix the split
            cannot serve).

        Always checked (no value read): types, dtypes, shapes and devices.

        The four tensors are packed, converted to int32, into one buffer on their device and imported into JAX
        once. The request, token and block counts are rounded up to powers of two there (padding requests are
        empty, padding tokens write nowhere), so that a serving loop's varying batches compile a few shapes;
        `run` then pads q, k and v with zero rows to that token count (a copy, when the count was rounded up).
        A call that raises leaves the previous plan in place.
        """
        device = query_start_loc.device if isinstance(query_start_loc, torch.Tensor) else None
        if self._padding is None or self._padding.device != device:
            self._padding = torch.zeros(PACKED_FIELD_ALIGNMENT // 4, dtype=torch.int32, device=device)
        packed, layout, needed_blocks = pack_plan(
            query_start_loc, seq_lens, block_tables, slot_mapping, num_groups=self.num_kv_cache_groups,
            block_size=self.block_size, max_query_len=max_query_len, max_seq_len=max_seq_len, causal=causal,
            checked=checked, padding=self._padding, num_common_prefix_blocks=num_common_prefix_blocks,
            group_params=self._group_params,
        )  # fmt: skip
        self._packed = to_jax(packed, name="packed metadata")
        self._layout, self._needed_blocks, self._plan_device = layout, needed_blocks, device
        self._num_tokens = slot_mapping.shape[-1]  # the step's tokens; the layout's count is rounded up

    def run(
        self,
        layer: str,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's k/v into the layer's cache, then attend over it (vLLM's ``forward``).

        Args:
          layer: a name given at construction.
          q: [T, N, H] or [T, N*H]; k, v: [T, K, H] or [T, K*H], or both None for a layer that shares another
            layer's cache (nothing is written).
          kv_cache: the layer's cache (`get_kv_cache_shape`) with ``cache_owner="torch"``; None with "jax".
          out: optional contiguous [T, N, H] or [T, N*H] tensor in q's dtype to write the result into.

        Returns:
          The attention output, shaped like `q` (or `out` itself), sharing memory with JAX's result.
        """
        if self._layout is None:
            raise RuntimeError("call plan(...) for this step before run(...)")
        if layer not in self.layers:
            raise ValueError(f"{layer=} is not one of the backend's layers {sorted(self.layers)}")
        spec = self.layers[layer]
        num_tokens, padded_tokens = self._num_tokens, self._layout.num_tokens
        if not isinstance(q, torch.Tensor) or q.dim() == 0 or q.shape[0] != num_tokens:
            got = f"shape {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q must be a torch.Tensor of T={num_tokens} tokens (the plan's slot_mapping), got {got}")
        shape = (num_tokens, spec.num_heads, spec.head_size)
        if (k is None) != (v is None):
            raise ValueError("k and v must both be given, or both be None (a layer sharing another's cache)")
        kv_shape = (num_tokens, spec.num_kv_heads, spec.head_size)
        fused = fused_qkv(q, k, v, shape, kv_shape, dtypes=SUPPORTED_DTYPES)
        if fused is not None:  # q, k, v are the column blocks of one projection output: one import
            q_jax = to_jax(padded_rows(fused, padded_tokens), name="qkv")
            k_jax = v_jax = FUSED
        else:
            # Every input (with its padding copy) is ready on torch's stream before q's import orders JAX's stream
            # after it; the others then skip that wait
            q_in = self._checked(q, "q", shape, padded_tokens, dtypes=SUPPORTED_DTYPES)
            k_in = v_in = None
            if k is not None:
                options = dict(dtypes=(q.dtype,), dtypes_are="q's dtype")
                k_in = self._checked(k, "k", kv_shape, padded_tokens, **options)
                v_in = self._checked(v, "v", kv_shape, padded_tokens, **options)
            q_jax = to_jax(q_in, name="q")
            k_jax, v_jax = (None if x is None else to_jax(x, name=name, already_ordered=True)
                            for x, name in ((k_in, "k"), (v_in, "v")))  # fmt: skip
        cache_jax = self._layer_cache(layer, kv_cache, spec)
        if self._needed_blocks is not None and cache_jax.shape[0] < self._needed_blocks[spec.kv_cache_group]:
            raise ValueError(
                f"the checked plan's block_tables / slot_mapping of group {spec.kv_cache_group} need "
                f"{self._needed_blocks[spec.kv_cache_group]} blocks, kv_cache of {layer!r} holds {cache_jax.shape[0]}"
            )
        out_jax = None
        if out is not None:
            if out.dtype != q.dtype or tuple(out.shape) not in (shape, (shape[0], shape[1] * shape[2])):
                raise ValueError(
                    f"out.shape={tuple(out.shape)}, out.dtype={out.dtype} must be {shape} or "
                    f"{(shape[0], shape[1] * shape[2])} in q's dtype {q.dtype}"
                )
            check_shareable(out, "out")  # written in place: its memory must be its values
            if not out.is_contiguous():  # XLA writes the result row-major into out's memory
                raise ValueError(f"out with strides {out.stride()} must be contiguous (row-major): pass "
                                 "out.contiguous() and copy back, or no out")  # fmt: skip
            if padded_tokens == num_tokens:  # XLA writes the result into out's memory; else it is copied there
                out_jax = to_jax(out, name="out", already_ordered=True)
        scales_and_layout, sinks = self._layer_scales(layer, spec), self._layer_sinks(layer, spec)
        result, new_cache = _layer_step(
            self._packed, q_jax, k_jax, v_jax, cache_jax, scales_and_layout, sinks, out_jax,
            layout=self._layout, group=spec.kv_cache_group, params=spec.params, implementation=self.implementation,
            interpret=self.interpret,
        )  # fmt: skip
        if self.cache_owner == "jax":
            self._caches[layer] = new_cache
        elif self._aliased(("kv_cache", layer, cache_jax.shape, cache_jax.dtype), kv_cache, new_cache):
            self._held[layer] = (tensor_key(kv_cache), new_cache)  # the next run of the layer imports nothing
        else:
            kv_cache.copy_(to_torch(new_cache, name="updated kv cache"))
        if out is None:
            return to_torch(result, name="output")[:num_tokens].reshape(q.shape)
        if out_jax is None or not self._aliased(("out", layer, out_jax.shape, out_jax.dtype), out, result):
            out.copy_(to_torch(result, name="output")[:num_tokens].reshape(out.shape))
        return out

    # ----------------------------------------------------------------------------------- JAX-owned caches

    def allocate_kv_caches(self, num_blocks: int, *, dtype: torch.dtype = torch.bfloat16) -> None:
        """With ``cache_owner="jax"``: one zeroed cache per layer, [B, 2, S, K, H] (or HND), on JAX's default
        device. `dtype` may be ``torch.float8_e4m3fn``."""
        if self.cache_owner != "jax":
            raise ValueError(
                f"allocate_kv_caches is for cache_owner='jax', this backend has {self.cache_owner!r}"
            )
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"{dtype=} must be one of {CACHE_DTYPES}")
        for name, spec in self.layers.items():
            shape = get_kv_cache_shape(
                num_blocks, self.block_size, spec.num_kv_heads, spec.head_size, kv_layout=self.kv_layout
            )
            self._caches[name] = jnp.zeros(shape, jax_dtype(dtype))

    def kv_cache_as_torch(self, layer: str) -> torch.Tensor:
        """With ``cache_owner="jax"``: the layer's cache as a torch tensor, zero-copy, for inspection.

        Drop the tensor before the layer's next `run`, which donates the cache.
        """
        if layer not in self._caches:
            raise ValueError(
                f"{layer=} has no JAX-owned cache (cache_owner='jax' and allocate_kv_caches first)"
            )
        tensor = to_torch(self._caches[layer], name=f"kv cache of {layer}")
        self._exported[layer] = weakref.ref(tensor)
        return tensor

    # -------------------------------------------------------------------------------------------- helpers

    def _checked(self, tensor, name, shape, padded_tokens, *, dtypes, dtypes_are="supported") -> torch.Tensor:
        """`tensor` ([T, ...] as `shape`, or flat per token) checked, as [padded_tokens, ...] (a zero-padded copy
        when the step's token count was rounded up)."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in dtypes:
            raise ValueError(f"{name}.dtype={tensor.dtype} must be one of {dtypes} ({dtypes_are})")
        if tensor.device != self._plan_device:
            raise ValueError(f"{name} is on {tensor.device}, the plan's metadata on {self._plan_device}")
        if tensor.numel() != math.prod(shape) or tensor.shape[0] != shape[0]:
            raise ValueError(
                f"{name}.shape={tuple(tensor.shape)} must be {shape} or {shape[:1] + (math.prod(shape[1:]),)}"
            )
        if tensor.dim() == 2:
            tensor = tensor.view(shape)
        if is_compact(tensor):  # a tensor DLPack cannot share is refused by to_jax, padded or not
            tensor = padded_rows(tensor, padded_tokens)
        return tensor

    def _aliased(self, key: tuple, tensor: torch.Tensor, array: jax.Array) -> bool:
        """Whether XLA wrote `array` into the donated memory of `tensor`. On a GPU it does (measured on the H200);
        XLA's CPU client does not alias imported buffers, and the caller copies back. Checked once per key: reading
        the pointer waits for the computation."""
        if key not in self._aliases:
            self._aliases[key] = same_memory(tensor, array)
        return self._aliases[key]

    def _layer_cache(self, layer: str, kv_cache, spec: AttentionLayer) -> jax.Array:
        if self.cache_owner == "jax":
            if kv_cache is not None:
                raise ValueError("with cache_owner='jax' the backend holds the caches: pass kv_cache=None")
            if layer not in self._caches:
                raise RuntimeError("call allocate_kv_caches(...) before run(...) with cache_owner='jax'")
            exported = self._exported.pop(layer, None)
            if exported is not None and exported() is not None:
                self._exported[layer] = exported
                raise RuntimeError(
                    f"the tensor from kv_cache_as_torch({layer!r}) is still alive: drop it before the next run, "
                    "which updates the cache in place (JAX cannot donate a buffer that torch holds)"
                )
            return self._caches[layer]
        if not isinstance(kv_cache, torch.Tensor):
            raise ValueError(
                f"kv_cache must be the layer's torch cache tensor, got {type(kv_cache).__name__}"
            )
        check_shareable(kv_cache, "kv_cache")  # before the held array is reused: a negated view shares its memory
        expected = get_kv_cache_shape(
            kv_cache.shape[0] if kv_cache.dim() else 1,
            self.block_size,
            spec.num_kv_heads,
            spec.head_size,
            kv_layout=self.kv_layout,
        )
        if tuple(kv_cache.shape) != expected:
            raise ValueError(f"kv_cache.shape={tuple(kv_cache.shape)} must be {expected} ({self.kv_layout})")
        if kv_cache.device != self._plan_device:
            raise ValueError(f"kv_cache is on {kv_cache.device}, the plan's metadata on {self._plan_device}")
        held = self._held.pop(layer, None)
        if held is not None and held[0] == tensor_key(kv_cache) and not held[1].is_deleted():
            # XLA wrote the last run's cache into this tensor's memory: that array is this tensor, already in JAX
            return held[1]
        alignment = PACKED_FIELD_ALIGNMENT if kv_cache.is_cuda else ALIGNMENT  # kernels run on the GPU only
        return to_jax(kv_cache, name="kv_cache", alignment=alignment, already_ordered=True)

    def _layer_scales(self, layer: str, spec: AttentionLayer) -> KVCache:
        """The layer's cache layout and KV scales, without its data: the scales imported once per layer (numbers
        passed to the compiled step would be sent to the device at every call)."""
        key = (layer, spec.k_scale, spec.v_scale)
        if key not in self._scales:
            scales = [None if scale is None else to_jax(torch.tensor(scale, dtype=torch.float32,
                                                                     device=self._plan_device), name=name)
                      for name, scale in (("k_scale", spec.k_scale), ("v_scale", spec.v_scale))]  # fmt: skip
            self._scales[key] = KVCache(None, self.kv_layout, *scales)
        return self._scales[key]

    def _layer_sinks(self, layer: str, spec: AttentionLayer) -> jax.Array | None:
        if spec.sinks is None:
            return None
        if layer not in self._sinks:  # imported once per layer (a copy: sinks are tiny and must be float32)
            sinks = spec.sinks.detach().to(device=self._plan_device, dtype=torch.float32).clone()
            self._sinks[layer] = to_jax(sinks, name="sinks")
        return self._sinks[layer]
