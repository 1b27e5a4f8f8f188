"""A mixed batch on the kernels: decode tiles and prefill tiles, each request computed by exactly one launch.

Requests whose whole query fits one 64-row query tile (``64 // G`` tokens: decodes and short
speculative-verification queries) run as decode tiles, one per request with its keys split across CTAs
(flash-decoding) and one consumer warpgroup; longer queries run as prefill tiles of ``128 // G`` tokens with two
consumer warpgroups, which read q and write their output rows in [T, N, H] themselves when G is 1, 2, 4 or 8
(else through packed rows and a gather, as decode tiles do). The split is computed on the device, with no host
round trip. A float8_e4m3fn cache's k scale multiplies the logits in the kernel and its v scale the output; q is
scaled by a power of two into float16 (`float16_query_scale`) and split in the kernel into two float8 parts for
the QK product on float8 tensor cores. A batch of short queries only (``G * max_query_len <= 64``) over a float8
"HND_VT" cache runs on the narrow decode kernel instead (`narrow_decode`: the keys on the wgmma's 64-row side, the
query heads on its narrow side; it reads q, and unsplit writes the output, in [T, N, H] itself). `plan_kernels`
plans the launch that writes every token's output once per step, for the layers that share its metadata
(`launch_plan`).
"""

import contextlib
import dataclasses
import functools
import math
from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .._compat import check_interpret_threads, plgpu, resolve_interpret
from ..layout import FP8_DTYPE, V_TRANSPOSED_BLOCK, KVArrays, KVCache
from ..metadata import AttentionMetadata
from ..params import CAUSAL, LayerAttentionParams
from ..validation import check_paged_attention_args, unservable_requests
from . import tiles as query_tiles
from .config import SMEM_BUDGET_BYTES, default_config
from .cta_parts import power_of_two_scale
from .launch import direct_io_supported, launch_attention
from .launch_plan import KernelPlan, direct_launch_plan
from .narrow_decode import launch_narrow_decode, narrow_columns
from .narrow_decode import smem_bytes as narrow_smem_bytes

__all__ = [
    "KERNEL_DTYPES", "KernelPlan", "check_kernel_support", "decode_splits", "kernel_configs", "lowering_for_sms",
    "num_sms", "paged_attention_kernels", "paged_attention_parts_kernels", "plan_kernels",
]  # fmt: skip

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
FALLBACK_NUM_SMS = 132
"""The H200's streaming multiprocessors: the count where no GPU is visible (interpret mode on a CPU)."""
MAX_DECODE_SPLITS = 16
SPLIT_SLACK = 1.1  # more splits only where they save more than this factor: each adds a merge and pipeline fills


def paged_attention_kernels(
    q: Float[Array, "T N H"],
    kv_cache: KVCache | KVArrays,
    metadata: AttentionMetadata,
    *,
    params: LayerAttentionParams = CAUSAL,
    sinks: Float[Array, "N"] | None = None,
    checked: bool = False,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> Float[Array, "T N H"]:
    """`reference.paged_attention` on the Mosaic GPU kernels (same arguments); `interpret` runs them in Mosaic GPU
    interpret mode on a CPU (True, or `plgpu.InterpretGPUParams`).

    Raises:
      NotImplementedError: the kernels do not support this combination (named in the message).
    """
    params, kv_cache = check_paged_attention_args(q, kv_cache, metadata, params=params, sinks=sinks, checked=checked)
    check_kernel_support(q, kv_cache)
    if resolve_interpret(interpret) is not None:
        check_interpret_threads()
    return _paged_attention_kernels(q, kv_cache, metadata, sinks, params=params, interpret=interpret)


def kernel_configs(head_dim: int, q_dtype, kv_dtype, *, decode_ctas: int = 1, max_seq_len: int = 0,
                   kv_layout: str = "NHD", block_size: int | None = None):  # fmt: skip
    """The decode (one consumer, keys split over `decode_splits` CTAs for a launch of `decode_ctas` tiles × KV
    heads whose requests hold at most `max_seq_len` keys) and prefill (two consumers, or one where two do not fit
    in shared memory: head_dim 256 with a float8 cache) kernel configurations. An "HND_VT" cache's steps stay
    within one block of `block_size` keys (its transposed V pieces cannot sit side by side in a swizzled tile)."""
    itemsizes = (jnp.dtype(q_dtype).itemsize, jnp.dtype(kv_dtype).itemsize)
    v_transposed = kv_layout == "HND_VT"
    options = dict(max_block_kv=block_size if v_transposed else None, v_transposed=v_transposed)
    decode = default_config(head_dim, *itemsizes, num_splits=1, num_consumers=1, **options)
    splits = decode_splits(decode_ctas, max_key_steps=math.ceil(max_seq_len / decode.block_kv))
    decode = dataclasses.replace(decode, num_splits=splits)
    try:
        prefill = default_config(head_dim, *itemsizes, num_splits=1, num_consumers=2, **options)
    except NotImplementedError:
        prefill = default_config(head_dim, *itemsizes, num_splits=1, num_consumers=1, **options)
    return decode, prefill


def decode_splits(ctas_per_split: int, *, max_key_steps: int = MAX_DECODE_SPLITS) -> int:
    """How many CTAs share each decode tile's keys (flash-decoding), for a launch of `ctas_per_split` CTAs
    (tiles × KV heads) unsplit whose requests have at most `max_key_steps` steps of keys.

    Decodes stream their keys, each CTA at about one SM's share of the bandwidth, so s splits of C CTAs take
    ``ceil(s * C / num_sms())`` waves of 1/s the keys. The fewest splits whose time is within `SPLIT_SLACK` of the
    best: a batch that fills whole waves is not split (512 CTAs: 3.9 waves either way), one that leaves SMs idle
    is (64 CTAs: 2 splits, half the time). Splits divide key steps, so never more than `max_key_steps`: the rest
    would have no keys."""
    candidates = range(1, max(1, min(MAX_DECODE_SPLITS, max_key_steps)) + 1)

    def waves(splits):
        return math.ceil(splits * ctas_per_split / num_sms()) / splits

    best = min(waves(splits) for splits in candidates)
    return next(splits for splits in candidates if waves(splits) <= SPLIT_SLACK * best)


_sm_count: int | None = None  # set by `lowering_for_sms`


def num_sms() -> int:
    """The streaming multiprocessors of the GPU the kernels launch on (one wave of CTAs): the count that
    `lowering_for_sms` sets, else the first visible GPU's, else `FALLBACK_NUM_SMS`."""
    return _sm_count or _visible_gpu_sms() or FALLBACK_NUM_SMS


@functools.cache
def _visible_gpu_sms() -> int | None:
    if jax.default_backend() != "gpu":
        return None
    return getattr(jax.devices()[0], "core_count", None)


@contextlib.contextmanager
def lowering_for_sms(count: int):
    """Trace the kernels for a GPU of `count` SMs inside the block: processes that lower a GPU's step functions
    on their CPU (`engine.step_cache`) take the count of the GPU they lower for."""
    global _sm_count
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"{count=} must be a positive int")
    before, _sm_count = _sm_count, count
    try:
        yield
    finally:
        _sm_count = before


def float16_query_scale(q: Float[Array, "..."]) -> Float[Array, ""]:
    """The power of two that q is multiplied by on its way to float16, for a float8 cache (the logits are
    multiplied by its inverse): `cta_parts.power_of_two_scale` of q's largest magnitude.

    sm90 converts e4m3 to float16 in one instruction, to bfloat16 only through float32, so the kernels convert
    each V step more cheaply when they compute in float16. Scaled by this power of two (exact), q's largest
    magnitude lies in [2^QUERY_EXPONENT, 2^(QUERY_EXPONENT + 1)): its float8 parts hold it (up to 448), and
    float16 keeps 10 mantissa bits, more than bfloat16's 7. A q holding inf or NaN is not scaled (1), so they
    reach the output as on the reference path."""
    return power_of_two_scale(jnp.max(jnp.abs(q)).astype(jnp.float32))


def float16_query(q: Float[Array, "..."], scale: Float[Array, ""]) -> Float[Array, "..."]:
    """q (or packed rows of it) times its `float16_query_scale`, in float16."""
    return (q.astype(jnp.float32) * scale).astype(jnp.float16)


def check_kernel_support(q, kv_cache: KVCache) -> None:
    """Raise NotImplementedError naming what the kernels cannot do yet."""
    _, block_size, num_kv_heads, head_dim = kv_cache.dims
    if jnp.dtype(q.dtype) not in KERNEL_DTYPES:
        raise NotImplementedError(f"kernel with q.dtype={q.dtype}: supported are bfloat16 and float16")
    if head_dim % 64:
        raise NotImplementedError(f"kernel with {head_dim=}: must be a multiple of 64")
    if kv_cache.layout == "HND_VT":
        if kv_cache.dtype != FP8_DTYPE:
            raise NotImplementedError(f"kernel with kv_cache.layout='HND_VT' and kv_cache.dtype={kv_cache.dtype}: "
                                      f"the transposed V is for {FP8_DTYPE} caches")  # fmt: skip
        if block_size % V_TRANSPOSED_BLOCK:
            raise NotImplementedError(f"kernel with kv_cache.layout='HND_VT' and {block_size=}: must be a "
                                      f"multiple of {V_TRANSPOSED_BLOCK}")  # fmt: skip
    for config in kernel_configs(head_dim, q.dtype, kv_cache.dtype, kv_layout=kv_cache.layout, block_size=block_size):
        if config.block_kv % block_size and block_size % config.block_kv:
            raise NotImplementedError(
                f"kernel with {block_size=}: must divide {config.block_kv} or be a multiple of it"
            )
    if q.shape[1] // num_kv_heads > query_tiles.ROWS:
        raise NotImplementedError(
            f"kernel with {q.shape[1] // num_kv_heads} query heads per KV head: at most {query_tiles.ROWS}"
        )


def paged_attention_parts_kernels(
    q: Float[Array, "T N H"],
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    flagged: Bool[Array, "R"],
    *,
    params: LayerAttentionParams,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[Float[Array, "T N H"], Float[Array, "T N"]]:
    """`reference.attention_parts` on the kernels, arguments checked by the caller: each token's output without
    sinks and the log-sum-exp of its logits (`tiles.token_parts`), for `softmax_merge.merge_splits`. The requests
    of `flagged` (and no others: the caller decides what it cannot serve) get NaN; a query may be longer than its
    request's keys (a non-causal layer's queries over keys they are not among)."""
    check_kernel_support(q, kv_cache)
    if resolve_interpret(interpret) is not None:
        check_interpret_threads()
    return _paged_attention_kernels(q, kv_cache, metadata, None, flagged, params=params, interpret=interpret,
                                    parts=True)  # fmt: skip


@partial(jax.jit, static_argnames=("params", "interpret", "parts"))
def _paged_attention_kernels(q, kv_cache: KVCache, metadata, sinks, flagged=None, *, params, interpret, parts=False):
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = kv_cache.dims
    k_scale, v_scale = kv_cache.scales()
    group_size = num_q_heads // num_kv_heads
    query_lens = metadata.query_lens
    # Keys past the block table do not exist: the kernels never read past it (those requests are flagged below).
    seq_lens = jnp.minimum(metadata.seq_lens, metadata.block_tables.shape[1] * block_size)
    decode_config, prefill_config = kernel_configs(
        head_dim, q.dtype, kv_cache.dtype, decode_ctas=max(1, metadata.num_reqs * num_kv_heads),
        max_seq_len=metadata.max_seq_len, kv_layout=kv_cache.layout, block_size=block_size,
    )  # fmt: skip
    scaled_q = kv_cache.dtype == FP8_DTYPE  # q scaled into float16, split into float8 parts in the kernel
    compute_dtype, q_scale = q.dtype, jnp.float32(1)
    if scaled_q:
        compute_dtype, q_scale = jnp.dtype(jnp.float16), float16_query_scale(q)
    # the kernels' scalars: logit scale (sm_scale * k_scale, over q's scale), v scale, q scale
    scales = jnp.stack([params.sm_scale * k_scale / q_scale, v_scale, q_scale]).astype(jnp.float32)
    unservable = unservable_requests(metadata, block_size=block_size, num_blocks=num_blocks) if flagged is None else flagged
    block_tables = jnp.clip(metadata.block_tables, 0, num_blocks - 1)  # never a page outside the pool
    # K and V come from one array [B, 2, ...] (passed twice, indexed on axis 1) or from the pair's two arrays
    stacked = not kv_cache.is_pair
    k_source, v_source = (kv_cache.data, kv_cache.data) if stacked else kv_cache.data
    v_transposed = kv_cache.layout == "HND_VT"
    if v_transposed:  # the V the kernel reads: [..., K, H, S] (`layout.v_transposed`; the same memory)
        v_source = v_source.reshape(*v_source.shape[:-2], head_dim, block_size)

    sinks = None if sinks is None else sinks.astype(jnp.float32)
    requests = query_tiles.Requests(metadata.query_start_loc, query_lens, seq_lens, block_tables, unservable)

    def run(tiles, config, requests, *, direct=False):  # partials and log-sum-exps per tile; with `direct` [T, N, H]
        if direct:  # the kernel scales and converts q itself
            q_source = q
        else:
            tokens, heads = query_tiles.tile_rows(
                tiles, requests.query_start_loc, group_size=group_size, num_kv_heads=num_kv_heads,
                num_tokens=num_tokens, rows=config.rows,
            )  # fmt: skip
            q_source = query_tiles.pack_query_rows(q, tokens, heads)
            if scaled_q:
                q_source = float16_query(q_source, q_scale)
        return launch_attention(
            q_source, k_source, v_source, tiles, *requests, metadata.num_actual_tokens, scales,
            sinks if direct else None, block_size=block_size, group_size=group_size, num_kv_heads=num_kv_heads,
            params=params, kv_layout=kv_cache.layout, stacked=stacked, direct=direct, compute_dtype=compute_dtype,
            config=config, interpret=interpret,
        )  # fmt: skip

    def writes_tokens(config):  # whether the launch can read q and write the output in [T, N, H] itself
        return _writes_tokens(config, head_dim, q.dtype, kv_cache.dtype, group_size, v_transposed=v_transposed)

    def all_tokens(config, tiled):  # every token's output from one launch whose tiles hold the requests of `tiled`
        plan = metadata.kernel_plan
        if plan is not None and not isinstance(plan, KernelPlan):
            raise ValueError(f"metadata.kernel_plan must be a KernelPlan (plan_kernels) or None, got "
                             f"{type(plan).__name__}")  # fmt: skip
        if plan is None:
            plan = direct_launch_plan(metadata, tiled, num_tokens=num_tokens, block_size=block_size,
                                       num_blocks=num_blocks, group_size=group_size, rows=config.rows)  # fmt: skip
        else:
            plan.check(num_tokens=num_tokens, num_blocks=num_blocks, block_size=block_size, group_size=group_size,
                       rows=config.rows, num_reqs=metadata.num_reqs, blocks_per_row=metadata.block_tables.shape[1],
                       max_query_len=metadata.max_query_len, block_ids_in_range=metadata.block_ids_in_range)
        return run(plan.tiles, config, plan.requests(metadata.block_tables, clip=not metadata.block_ids_in_range),
                   direct=True)

    columns = None
    if not parts:
        columns = _narrow_launch_columns(decode_config, kv_cache.layout, group_size, metadata, head_dim, q.dtype)
    if columns is not None:  # short queries only, over a float8 "HND_VT" cache: the narrow decode kernel
        # It checks the lengths itself; the block ids only where the metadata does not vouch for them
        out_of_pool = jnp.zeros(metadata.num_reqs, jnp.int32)
        if not metadata.block_ids_in_range:
            out_of_pool = jnp.any((metadata.block_tables < 0) | (metadata.block_tables >= num_blocks), axis=1)
        # the scales as they are (the kernel makes a bad one NaN, as `KVCache.scales` does): each a [1] view
        raw_scales = (params.sm_scale, *(1.0 if x is None else x for x in (kv_cache.k_scale, kv_cache.v_scale)))
        kernel_scales = tuple(jnp.reshape(jnp.asarray(x, jnp.float32), (1,)) for x in raw_scales)
        out = launch_narrow_decode(
            q, k_source, v_source, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
            out_of_pool.astype(jnp.int32), jnp.reshape(metadata.num_actual_tokens, (1,)).astype(jnp.int32),
            kernel_scales, sinks, columns=columns, block_size=block_size, group_size=group_size,
            max_query_len=metadata.max_query_len, params=params, stacked=stacked, config=decode_config,
            interpret=interpret,
        )  # fmt: skip
        if decode_config.num_splits == 1:  # the kernel wrote every token's output
            return out
        out_t, lse = out
        return query_tiles.token_outputs(
            (jnp.swapaxes(out_t, -1, -2), lse), None, requests, metadata.num_actual_tokens, sinks, v_scale,
            group_size=group_size, num_tokens=num_tokens, dtype=q.dtype,
        )  # fmt: skip
    is_decode = query_lens <= query_tiles.tokens_per_tile(group_size)
    prefill_launch = metadata.max_query_len > query_tiles.tokens_per_tile(group_size)  # static
    if parts:  # each launch's partial outputs and log-sum-exps, gathered per token
        decode = run(query_tiles.decode_tiles(query_lens, group_size), decode_config, requests)
        prefill = None
        if prefill_launch:
            table_tokens = metadata.token_budget or num_tokens
            tiles = query_tiles.prefill_tiles(query_lens, group_size, table_tokens, rows=prefill_config.rows)
            # the parts are merged per token anyway: a launch of few tiles (a shared prefix) splits its keys too
            splits = decode_splits(tiles.request.shape[0] * num_kv_heads,
                                   max_key_steps=math.ceil(metadata.max_seq_len / prefill_config.block_kv))
            prefill = run(tiles, dataclasses.replace(prefill_config, num_splits=splits), requests)
        return query_tiles.token_parts(decode, prefill, requests, metadata.num_actual_tokens, v_scale,
                                       group_size=group_size, num_tokens=num_tokens)  # fmt: skip
    if not prefill_launch and writes_tokens(decode_config):  # decodes only, unsplit: the one launch writes it all
        return all_tokens(decode_config, jnp.ones_like(is_decode))
    decode = run(query_tiles.decode_tiles(query_lens, group_size), decode_config, requests)
    prefill_rows = None
    if prefill_launch:
        if writes_tokens(prefill_config):  # every token's output but the decodes'
            prefill_rows = all_tokens(prefill_config, ~is_decode)
        else:
            # tables sized for the budget, not T: every step shape up to it shares this kernel
            table_tokens = metadata.token_budget or num_tokens
            tiles = query_tiles.prefill_tiles(query_lens, group_size, table_tokens, rows=prefill_config.rows)
            prefill_rows = query_tiles.prefill_token_rows(
                run(tiles, prefill_config, requests), requests, metadata.num_actual_tokens, sinks, v_scale,
                group_size=group_size, num_tokens=num_tokens, dtype=q.dtype,
            )  # fmt: skip
    return query_tiles.token_outputs(
        decode, prefill_rows, requests, metadata.num_actual_tokens, sinks, v_scale, group_size=group_size,
        num_tokens=num_tokens, dtype=q.dtype,
    )  # fmt: skip


def _narrow_launch_columns(decode_config, kv_layout: str, group_size: int, metadata: AttentionMetadata,
                           head_dim: int, q_dtype) -> int | None:  # fmt: skip
    """The query columns C of the narrow decode kernel where it serves the batch (short queries only over an
    "HND_VT" cache, `KernelConfig.narrow_decode` on, within shared memory), else None."""
    if kv_layout != "HND_VT" or not decode_config.narrow_decode:
        return None
    columns = narrow_columns(group_size, metadata.max_query_len)
    if columns is None or narrow_smem_bytes(decode_config, head_dim, columns,
                                            q_itemsize=jnp.dtype(q_dtype).itemsize) > SMEM_BUDGET_BYTES:
        return None
    return columns


def _writes_tokens(config, head_dim: int, q_dtype, kv_dtype, group_size: int, *, v_transposed: bool) -> bool:
    """Whether a launch of `config` can read q and write the output in [T, N, H] itself (`launch.direct_io`)."""
    smem = config.smem_bytes(head_dim, jnp.dtype(q_dtype).itemsize, jnp.dtype(kv_dtype).itemsize, direct=True,
                             v_transposed=v_transposed)  # fmt: skip
    return (config.direct_io and config.num_splits == 1 and direct_io_supported(group_size)
            and smem <= SMEM_BUDGET_BYTES)  # fmt: skip


def plan_kernels(
    metadata: AttentionMetadata, *, num_q_heads: int, head_dim: int, q_dtype, kv_cache: KVCache
) -> KernelPlan | None:
    """The `KernelPlan` of `metadata` for the layers whose q has `num_q_heads` heads of `head_dim` in `q_dtype`
    over caches shaped and typed like `kv_cache` (any of them: only its dims, dtype and layout count), or None
    where their calls have no launch that writes every token's output (the plan would not be used) or the metadata
    does not vouch for its block ids (``block_ids_in_range``: each layer's would have to be checked). Traceable;
    build it once per step, outside a scan over layers, and pass it as ``metadata.kernel_plan``."""
    if not metadata.block_ids_in_range:
        return None
    num_blocks, block_size, num_kv_heads, _ = kv_cache.dims
    group_size = num_q_heads // num_kv_heads
    decode_config, prefill_config = kernel_configs(
        head_dim, q_dtype, kv_cache.dtype, decode_ctas=max(1, metadata.num_reqs * num_kv_heads),
        max_seq_len=metadata.max_seq_len, kv_layout=kv_cache.layout, block_size=block_size,
    )  # fmt: skip
    v_transposed = kv_cache.layout == "HND_VT"
    if _narrow_launch_columns(decode_config, kv_cache.layout, group_size, metadata, head_dim, q_dtype) is not None:
        return None  # the narrow decode kernel reads its requests as they are
    per_tile = query_tiles.tokens_per_tile(group_size)
    is_decode = metadata.query_lens <= per_tile
    if metadata.max_query_len > per_tile:  # a prefill launch: it writes every token's but the decodes'
        config, tiled = prefill_config, ~is_decode
    else:
        config, tiled = decode_config, jnp.ones_like(is_decode)
    if not _writes_tokens(config, head_dim, q_dtype, kv_cache.dtype, group_size, v_transposed=v_transposed):
        return None
    return direct_launch_plan(metadata.replace(kernel_plan=None), tiled, num_tokens=metadata.num_tokens,
                               block_size=block_size, num_blocks=num_blocks, group_size=group_size,
                               rows=config.rows)  # fmt: skip
