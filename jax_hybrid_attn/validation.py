"""Argument checks of the public functions, in one place.

Static checks (shapes, dtypes, options) run on every call and raise `ValueError` naming the argument and
its value. The checked mode (``checked=True``) also reads the metadata's values, which must be concrete:
call it outside `jax.jit`. Unsupported combinations raise `NotImplementedError` where they are detected.
"""

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from ._compat import resolve_interpret
from .constants import NULL_BLOCK_ID, PAD_SLOT_ID
from .integers import INT32_MAX, check_bool, check_int
from .layout import FP8_DTYPE, KV_CACHE_DTYPES, KVCache, as_kv_cache, check_kv_layout, is_kv_pair
from .masks import allowed_key_range
from .metadata import AttentionMetadata
from .params import LayerAttentionParams, check_params, resolve_sm_scale

QUERY_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
METADATA_INDEX_DTYPE = jnp.dtype(jnp.int32)


def _check_array(name: str, x, *, ndim: int) -> None:
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)):  # a numpy scalar is a 0-d array
        hint = " (a torch tensor enters JAX through jax_hybrid_attn_torch.to_jax)" if "torch" in type(x).__module__ else ""
        raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}{hint}")
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
        raise ValueError(f"{name} was deleted: donated to an earlier call (pass the array that call returned)")
    if x.ndim != ndim:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must have {ndim} dimensions")
    if 0 in x.shape[1:]:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must have no empty dimension after the first")


def _check_index_array(name: str, x, *, ndim: int) -> None:
    _check_array(name, x, ndim=ndim)
    if x.dtype != METADATA_INDEX_DTYPE:
        raise ValueError(
            f"{name}.dtype={x.dtype} must be int32; convert explicitly (x.astype(jnp.int32)) after checking the "
            "values fit, or build the metadata with make_attention_metadata"
        )


IMPLEMENTATIONS = ("kernel", "reference")


def resolve_implementation(implementation: str | None, interpret) -> str:
    """`paged_attention`'s implementation: the kernels on a GPU or with `interpret`, else the reference.
    `interpret` applies to the kernels only: with ``implementation="reference"`` it must be False or None."""
    interpreted = resolve_interpret(interpret) is not None
    if implementation is None:
        return "kernel" if interpreted or jax.default_backend() == "gpu" else "reference"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} must be one of {IMPLEMENTATIONS}")
    if interpreted and implementation == "reference":
        raise ValueError(f"interpret={interpret!r} runs the kernels: not for implementation='reference'")
    return implementation


def check_metadata(metadata) -> None:
    """Types, ranks, dtypes and mutual shapes of an `AttentionMetadata`."""
    if not isinstance(metadata, AttentionMetadata):
        raise ValueError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
    _check_index_array("metadata.query_start_loc", metadata.query_start_loc, ndim=1)
    _check_index_array("metadata.seq_lens", metadata.seq_lens, ndim=1)
    _check_index_array("metadata.block_tables", metadata.block_tables, ndim=2)
    _check_index_array("metadata.slot_mapping", metadata.slot_mapping, ndim=1)
    _check_index_array("metadata.num_actual_tokens", metadata.num_actual_tokens, ndim=0)
    if metadata.num_common_prefix_blocks is not None:
        _check_index_array("metadata.num_common_prefix_blocks", metadata.num_common_prefix_blocks, ndim=0)
    num_reqs = metadata.seq_lens.shape[0]
    if metadata.query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(
            f"metadata.query_start_loc.shape={tuple(metadata.query_start_loc.shape)} must be [R+1={num_reqs + 1}]"
        )
    if metadata.block_tables.shape[0] != num_reqs:
        raise ValueError(f"metadata.block_tables.shape={tuple(metadata.block_tables.shape)} must be [R={num_reqs}, P]")
    for name in ("max_query_len", "max_seq_len"):
        value = getattr(metadata, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT32_MAX:
            raise ValueError(f"metadata.{name}={value!r} must be an int in [0, {INT32_MAX}]")
    for name in ("causal", "block_ids_in_range"):
        if not isinstance(getattr(metadata, name), bool):
            raise ValueError(f"metadata.{name}={getattr(metadata, name)!r} must be a bool")
    budget, num_tokens = metadata.token_budget, metadata.slot_mapping.shape[0]
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < num_tokens):
        raise ValueError(f"metadata.token_budget={budget!r} must be None or an int >= T={num_tokens}")
    if metadata.kernel_plan is not None:
        from .kernels.launch_plan import KernelPlan  # the kernels import this module

        if not isinstance(metadata.kernel_plan, KernelPlan):
            raise ValueError(
                f"metadata.kernel_plan must be a KernelPlan (plan_kernels) or None, got "
                f"{type(metadata.kernel_plan).__name__}"
            )


def _concrete(name: str, x) -> np.ndarray:
    if isinstance(x, jax.core.Tracer):
        raise ValueError(f"checked=True reads {name}, which is traced here: call outside jax.jit")
    return np.asarray(x)


def check_slot_values(name: str, slots: np.ndarray, *, num_slots: int, block_size: int) -> None:
    """Every slot lies in ``[0, num_slots)`` or is `PAD_SLOT_ID`, none in the null block (`NULL_BLOCK_ID`, whose
    contents no request owns), and none is written twice in one step."""
    is_slot = slots != PAD_SLOT_ID
    outside = is_slot & ((slots < 0) | (slots >= num_slots))
    if outside.any():
        raise ValueError(
            f"{name} holds {slots[outside][:4].tolist()}: slots must lie in [0, {num_slots}) or be "
            f"PAD_SLOT_ID={PAD_SLOT_ID}"
        )
    null = is_slot & (slots // block_size == NULL_BLOCK_ID)
    if null.any():
        raise ValueError(f"{name} holds {slots[null][:4].tolist()}: slots of the null block {NULL_BLOCK_ID} "
                         "(no request owns it)")  # fmt: skip
    values, counts = np.unique(slots[is_slot], return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"{name} writes slots {values[counts > 1][:4].tolist()} more than once in one step")


def check_metadata_values(
    metadata: AttentionMetadata, *, num_blocks: int | None, block_size: int, params: LayerAttentionParams | None = None
) -> None:
    """Value checks: block ids in the pool (``num_blocks=None``: only not negative), lengths within the tables,
    consistent query offsets, no slot in the null block or written twice, static bounds at or above the actual
    maxima. With the layer's `params` (its window, chunk and causality), also what each request reads
    (`check_block_reads`): no key position its queries attend lies in the null block, and no block it reads is
    written in this step for another request."""
    check_metadata(metadata)
    num_blocks = None if num_blocks is None else check_int("num_blocks", num_blocks)
    block_size = check_int("block_size", block_size)
    if params is not None:
        check_params(params)
    query_start_loc = _concrete("metadata.query_start_loc", metadata.query_start_loc)
    seq_lens = _concrete("metadata.seq_lens", metadata.seq_lens)
    block_tables = _concrete("metadata.block_tables", metadata.block_tables)
    slot_mapping = _concrete("metadata.slot_mapping", metadata.slot_mapping)
    num_actual_tokens = int(_concrete("metadata.num_actual_tokens", metadata.num_actual_tokens))
    query_lens = np.diff(query_start_loc)
    if query_start_loc[0] != 0 or np.any(query_lens < 0):
        raise ValueError(f"metadata.query_start_loc={query_start_loc.tolist()} must start at 0 and never decrease")
    if num_actual_tokens != query_start_loc[-1] or num_actual_tokens > metadata.num_tokens:
        raise ValueError(
            f"metadata.num_actual_tokens={num_actual_tokens} must equal query_start_loc[-1]={query_start_loc[-1]} "
            f"and be at most T={metadata.num_tokens}"
        )
    if np.any(query_lens > seq_lens):
        raise ValueError(f"query lengths {query_lens.tolist()} must not exceed metadata.seq_lens={seq_lens.tolist()}")
    capacity = block_tables.shape[1] * block_size
    if np.any(seq_lens > capacity):
        raise ValueError(f"metadata.seq_lens={seq_lens.tolist()} exceed the block tables' capacity {capacity} tokens")
    pool = INT32_MAX if num_blocks is None else num_blocks
    if block_tables.size and (block_tables.min() < 0 or block_tables.max() >= pool):
        raise ValueError(
            f"metadata.block_tables holds ids in [{block_tables.min()}, {block_tables.max()}], outside [0, {num_blocks=})"
        )
    check_slot_values("metadata.slot_mapping", slot_mapping, num_slots=pool * block_size, block_size=block_size)
    if params is not None:
        check_block_reads(query_start_loc, seq_lens, block_tables, slot_mapping, block_size=block_size, params=params)
    if query_lens.size and (
        metadata.max_query_len < query_lens.max() or metadata.max_seq_len < seq_lens.max()
    ):
        raise ValueError(
            f"metadata.max_query_len={metadata.max_query_len} / max_seq_len={metadata.max_seq_len} are below the "
            f"actual maxima {query_lens.max()} / {seq_lens.max()}"
        )


def check_block_reads(query_start_loc, seq_lens, block_tables, slot_mapping, *, block_size: int, params) -> None:
    """On host values: each request's attended key positions (from its first query's first allowed key to its
    last query's last, `masks.allowed_key_range`) lie in blocks of its table that are not `NULL_BLOCK_ID`, and
    none of those blocks is written in this step by another request's tokens. (A block several requests share, a
    cached prefix, is read by all and written by none.)"""
    writer = {}  # block -> the request writing into it this step
    for request in range(len(seq_lens)):
        slots = slot_mapping[query_start_loc[request] : query_start_loc[request + 1]]
        writer.update((int(block), request) for block in slots[slots != PAD_SLOT_ID] // block_size)
    query_lens = np.diff(query_start_loc)
    firsts = np.asarray(allowed_key_range(seq_lens - query_lens, seq_lens, params=params)[0])
    lasts = np.asarray(allowed_key_range(seq_lens - 1, seq_lens, params=params)[1])
    for request in np.flatnonzero(query_lens).tolist():
        first, last = int(firsts[request]), int(lasts[request])
        blocks = block_tables[request, first // block_size : last // block_size + 1]
        if np.any(blocks == NULL_BLOCK_ID):
            raise ValueError(
                f"metadata.block_tables[{request}] points key positions {first}..{last} that request "
                f"{request} attends at the null block {NULL_BLOCK_ID}: {blocks.tolist()}"
            )
        foreign = [(int(b), writer[int(b)]) for b in blocks if writer.get(int(b), request) != request]
        if foreign:
            block, other = foreign[0]
            raise ValueError(
                f"metadata.block_tables[{request}] reads block {block}, which this step writes for request {other}"
            )


def check_kv_cache(kv_cache) -> KVCache:
    """A `KVCache` (or an "NHD" cache's array or pair, `as_kv_cache`) whose arrays are one [B, 2, ...] array or a
    pair of [B, ...] arrays of one shape and dtype, with valid scales; returned as a `KVCache`."""
    typed = isinstance(kv_cache, KVCache)
    name = "kv_cache.data" if typed else "kv_cache"
    kv_cache = as_kv_cache(kv_cache)
    check_kv_layout(kv_cache.layout, name="kv_cache.layout")
    arrays = kv_cache.data
    if is_kv_pair(arrays):
        if len(arrays) != 2:
            raise ValueError(f"{name} as a sequence must be the pair (k_cache, v_cache), got {len(arrays)} items")
        k_cache, v_cache = arrays
        _check_array(f"{name}[0]", k_cache, ndim=4)
        _check_array(f"{name}[1]", v_cache, ndim=4)
        if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
            raise ValueError(
                f"the pair's k_cache ({tuple(k_cache.shape)}, {k_cache.dtype}) and v_cache ({tuple(v_cache.shape)}, "
                f"{v_cache.dtype}) must have one shape and dtype"
            )
        shape = tuple(k_cache.shape)
    else:
        _check_array(name, arrays, ndim=5)
        shape = tuple(arrays.shape)
        if shape[1] != 2:
            raise ValueError(f"{name}.shape={shape} must have 2 (K and V) on axis 1")
    if shape[0] == 0:
        raise ValueError(f"{name}.shape={shape} must hold at least the null block (B >= 1)")
    if kv_cache.dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{name}.dtype={kv_cache.dtype} must be one of {[str(d) for d in KV_CACHE_DTYPES]}")
    _check_kv_scales(kv_cache)
    return kv_cache


def _check_kv_scales(kv_cache: KVCache) -> None:
    """Scales belong to a float8_e4m3fn cache only, each a number or a float scalar array, finite and > 0 where
    concrete (a traced one is resolved to NaN where invalid: `KVCache.scales`)."""
    k_scale, v_scale = kv_cache.k_scale, kv_cache.v_scale
    if kv_cache.dtype != FP8_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise ValueError(
                f"kv_cache.k_scale={k_scale!r}, kv_cache.v_scale={v_scale!r} apply only to a {FP8_DTYPE} cache, "
                f"not {kv_cache.dtype}"
            )
        return
    for name, scale in (("kv_cache.k_scale", k_scale), ("kv_cache.v_scale", v_scale)):
        if scale is None:
            continue
        if isinstance(scale, (bool, np.bool_, str, bytes)) or not (
            isinstance(scale, numbers.Real) or isinstance(scale, (jax.Array, np.ndarray))
        ):
            raise ValueError(f"{name}={scale!r} must be a number (or a float scalar array)")
        if isinstance(scale, (jax.Array, np.ndarray)) and not jnp.issubdtype(scale.dtype, jnp.floating):
            raise ValueError(f"{name}.dtype={scale.dtype} must be a float dtype")
        if np.ndim(scale) != 0:
            raise ValueError(f"{name} must be a scalar (one scale per tensor), got shape {np.shape(scale)}")
        if not isinstance(scale, jax.core.Tracer) and not (math.isfinite(float(scale)) and float(scale) > 0):
            raise ValueError(f"{name}={float(scale)} must be finite and > 0")


def check_write_kv_args(kv_cache, k, v, slot_mapping, *, checked) -> KVCache:
    """All checks of `write_kv`; returns the cache as a `KVCache`."""
    checked = check_bool("checked", checked)
    kv_cache = check_kv_cache(kv_cache)
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.dims
    for name, x in (("k", k), ("v", v)):
        _check_array(name, x, ndim=3)
        if x.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be [T, K={num_kv_heads}, H={head_dim}]")
        if jnp.dtype(x.dtype) not in QUERY_DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} must be one of {[str(d) for d in QUERY_DTYPES]}")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k.shape={tuple(k.shape)}, k.dtype={k.dtype} and v.shape={tuple(v.shape)}, v.dtype={v.dtype} must match")
    _check_index_array("slot_mapping", slot_mapping, ndim=1)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping.shape={tuple(slot_mapping.shape)} must be [T={k.shape[0]}]")
    if checked:
        slots = _concrete("slot_mapping", slot_mapping)
        check_slot_values("slot_mapping", slots, num_slots=num_blocks * block_size, block_size=block_size)
    return kv_cache


def check_paged_attention_args(
    q, kv_cache, metadata, *, params, sinks, checked
) -> tuple[LayerAttentionParams, KVCache]:
    """All checks of `paged_attention`; returns ``(params, kv_cache)``: ``params.sm_scale`` resolved to a value,
    the cache as a `KVCache`."""
    check_params(params)
    checked = check_bool("checked", checked)
    _check_array("q", q, ndim=3)
    if jnp.dtype(q.dtype) not in QUERY_DTYPES:
        raise ValueError(f"q.dtype={q.dtype} must be one of {[str(d) for d in QUERY_DTYPES]}")
    kv_cache = check_kv_cache(kv_cache)
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.dims
    num_tokens, num_q_heads, q_head_dim = q.shape
    if q_head_dim != head_dim:
        raise ValueError(f"q.shape={tuple(q.shape)}: head_dim {q_head_dim} differs from the cache's H={head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    if kv_cache.dtype not in (jnp.dtype(q.dtype), FP8_DTYPE):
        raise ValueError(f"kv_cache.dtype={kv_cache.dtype} must equal q.dtype={q.dtype} or be {FP8_DTYPE}")
    check_metadata(metadata)
    if metadata.num_tokens != num_tokens:
        raise ValueError(
            f"q.shape={tuple(q.shape)} has T={num_tokens} tokens but metadata.slot_mapping.shape="
            f"{tuple(metadata.slot_mapping.shape)}: they must agree"
        )
    if metadata.causal != params.causal:
        raise ValueError(f"params.causal={params.causal} disagrees with metadata.causal={metadata.causal}")
    if sinks is not None:
        _check_array("sinks", sinks, ndim=1)
        if sinks.shape != (num_q_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"sinks (shape {tuple(sinks.shape)}, {sinks.dtype}) must be float [N={num_q_heads}]")
    if checked:
        check_metadata_values(metadata, num_blocks=num_blocks, block_size=block_size, params=params)
    concrete_sinks = sinks is not None and (checked or not isinstance(sinks, jax.core.Tracer))
    if concrete_sinks and not np.isfinite(_concrete("sinks", sinks)).all():
        raise ValueError(f"sinks={np.asarray(sinks).tolist()} must be finite")
    params = dataclasses.replace(params, sm_scale=resolve_sm_scale(params.sm_scale, head_dim))
    return params, kv_cache


def unservable_requests(metadata: AttentionMetadata, *, block_size: int, num_blocks: int) -> jax.Array:
    """[R] bool: requests the metadata cannot serve: a query longer than ``metadata.max_query_len`` or than its
    ``seq_lens``, a ``seq_lens`` beyond the block table's ``P * S`` positions, or a block id outside the pool's
    ``[0, B)`` (unless ``metadata.block_ids_in_range`` vouches for the ids). Traced metadata cannot be checked on
    the host, so the reference and the kernels give those requests' tokens NaN instead of a wrong number
    (``checked=True`` raises instead, on concrete values)."""
    query_lens, seq_lens, tables = metadata.query_lens, metadata.seq_lens, metadata.block_tables
    capacity = tables.shape[1] * block_size
    unservable = (query_lens > metadata.max_query_len) | (query_lens > seq_lens) | (seq_lens > capacity)
    if metadata.block_ids_in_range:
        return unservable
    return unservable | jnp.any((tables < 0) | (tables >= num_blocks), axis=1)
