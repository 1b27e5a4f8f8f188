"""Attention metadata for one step of a mixed batch, and how it is built.

One `AttentionMetadata` serves every layer of one metadata group (see `params.metadata_group_key`).
Request r owns query tokens ``query_start_loc[r] : query_start_loc[r + 1]``; they are the last
``query_len`` of its ``seq_lens[r]`` positions, so its query at offset i sits at absolute position
``seq_lens[r] - query_len + i``. Its key position p lives in block ``block_tables[r, p // S]``.

`metadata_from_step` turns the allocator's `StepOutput` into one KV-cache group's metadata and
`metadata_from_lengths` builds it from lengths and block tables; both are traceable. `make_attention_metadata`
builds it from concrete host arrays, as vLLM builds it from its CPU copies. vLLM's helpers that reshape it are in
`metadata_reshaping`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from ._compat import register_pytree_dataclass
from .allocator import AllocatorConfig, StepOutput
from .constants import PAD_SLOT_ID
from .integers import INT32_MAX, check_bool, check_int

__all__ = [
    "AttentionMetadata",
    "make_attention_metadata",
    "metadata_from_lengths",
    "metadata_from_step",
    "token_requests",
]


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each query token of the step sits, and where its request's keys live.

    Attributes:
      query_start_loc: [R+1] int32, cumulative query lengths; request r's tokens are
        ``query_start_loc[r]:query_start_loc[r+1]``.
      seq_lens: [R] int32, context length of each request **including** this step's queries.
      block_tables: [R, P] int32 block ids; positions outside a window or chunk, and unused entries,
        hold `NULL_BLOCK_ID`.
      slot_mapping: [T] int32 cache slot (``block_id * S + offset``) of each query token's K/V;
        `PAD_SLOT_ID` for padding tokens.
      num_actual_tokens: [] int32, tokens that are not padding (``query_start_loc[-1]``).
      max_query_len: static upper bound of the query lengths. A request whose query is longer (or longer than
        its ``seq_lens``, or whose ``seq_lens`` exceed the block table's ``P * S`` positions) cannot be served:
        under jit its tokens come out NaN, never a wrong number; ``checked=True`` raises instead.
      max_seq_len: static upper bound of `seq_lens`.
      causal: static; whether keys after a query are masked.
      token_budget: static; the most tokens (T, padding included) of any step that shares these kernels, e.g.
        an engine's ``max_num_batched_tokens``, or None for T. The kernels size their query-tile tables for it,
        so steps of several T compile one kernel; the results do not depend on it.
      num_common_prefix_blocks: [] int32, or None: the leading block-table entries that every request holds
        alike; given, `attention.paged_attention` computes the step as cascade attention (`cascade`: the shared
        prefix once for every query, each request's suffix, merged).
      block_ids_in_range: static; the caller guarantees that every id in `block_tables` lies in the pool's
        ``[0, B)`` (the engine's `PagedCache` checks its tables once per step, outside its scans over layers, and
        flags a request with a bad id through its ``seq_lens``). Under jit the attention then skips that check
        per request, a reduction over the block table in every layer; ``checked=True`` checks on the host anyway.
      kernel_plan: None, or the kernels' launch plan for this metadata (`kernels.mixed_batch.plan_kernels`, built
        once per step from the same metadata with another layer's block tables): the layers that share it skip
        building their tile tables. The reference path ignores it.
    """

    query_start_loc: Int[Array, "R+1"]
    seq_lens: Int[Array, "R"]
    block_tables: Int[Array, "R P"]
    slot_mapping: Int[Array, "T"]
    num_actual_tokens: Int[Array, ""]
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    token_budget: int | None = None
    num_common_prefix_blocks: Int[Array, ""] | None = None
    block_ids_in_range: bool = False
    kernel_plan: object | None = None

    def __post_init__(self):
        # The static fields as Python scalars (numpy ones accepted): they key jit's caches and compare by value.
        for name in ("max_query_len", "max_seq_len", "token_budget"):
            value = getattr(self, name)
            if isinstance(value, np.integer):
                object.__setattr__(self, name, int(value))
        for name in ("causal", "block_ids_in_range"):
            if isinstance(getattr(self, name), np.bool_):
                object.__setattr__(self, name, bool(getattr(self, name)))

    @property
    def num_reqs(self) -> int:
        """R."""
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        """T, padding included."""
        return self.slot_mapping.shape[0]

    @property
    def query_lens(self) -> Int[Array, "R"]:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def replace(self, **changes) -> "AttentionMetadata":
        return dataclasses.replace(self, **changes)


register_pytree_dataclass(
    AttentionMetadata,
    data_fields=["query_start_loc", "seq_lens", "block_tables", "slot_mapping", "num_actual_tokens",
                 "num_common_prefix_blocks", "kernel_plan"],
    meta_fields=["max_query_len", "max_seq_len", "causal", "token_budget", "block_ids_in_range"],
)


def host_int32(name: str, values) -> np.ndarray:
    """Concrete int32 copy of `values`; int64 and friends are converted only when every value fits."""
    if isinstance(values, jax.core.Tracer):
        raise ValueError(f"{name} must be concrete (this helper runs on host values, outside jax.jit)")
    try:
        array = np.asarray(values)
    except ValueError as error:  # a ragged nested list
        raise ValueError(f"{name} must be a rectangular array of integers: {error}") from None
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name} has values outside int32: [{array.min()}, {array.max()}]")
    return array.astype(np.int32)


def make_attention_metadata(
    query_lens,
    seq_lens,
    block_tables,
    *,
    block_size: int,
    num_tokens: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    causal: bool = True,
) -> AttentionMetadata:
    """Build metadata from per-request lengths and block tables, with vLLM's slot mapping.

    Args:
      query_lens: [R] new tokens per request this step.
      seq_lens: [R] context length including the new tokens (``seq_lens >= query_lens``).
      block_tables: [R, P] block ids; must cover ``seq_lens`` positions.
      block_size: S, tokens per block.
      num_tokens: T; tokens past ``sum(query_lens)`` are padding (`PAD_SLOT_ID`). Default: no padding.
      max_query_len, max_seq_len: static upper bounds (e.g. bucketed to limit recompiles); default exact.
      causal: whether the layers that read this metadata are causal.

    Everything is checked on the host, always (`ValueError` naming the argument): integer arrays whose values
    fit int32 (numpy integers accepted), matching shapes, ``0 <= query_lens <= seq_lens``, block ids >= 0 whose
    slots fit int32, tables that cover `seq_lens`, and bounds at or above the actual maxima. Not checked, because
    the pool size is not an argument: block ids below the cache's block count (``paged_attention(checked=True)``
    checks it; unchecked, a request with an id outside the pool gets NaN output).
    """
    check_int("block_size", block_size)
    query_lens = host_int32("query_lens", query_lens)
    seq_lens = host_int32("seq_lens", seq_lens)
    block_tables = host_int32("block_tables", block_tables)
    if query_lens.ndim != 1 or seq_lens.shape != query_lens.shape:
        raise ValueError(f"query_lens {query_lens.shape} and seq_lens {seq_lens.shape} must both be [R]")
    if block_tables.ndim != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables.shape={block_tables.shape} must be [R={seq_lens.shape[0]}, P]")
    if np.any(query_lens < 0) or np.any(query_lens > seq_lens):
        raise ValueError(f"query_lens={query_lens.tolist()} must satisfy 0 <= query_lens <= seq_lens={seq_lens.tolist()}")
    if block_tables.size and block_tables.min() < 0:
        raise ValueError(f"block_tables holds {block_tables.min()}: block ids must be >= 0 (NULL_BLOCK_ID for none)")
    if block_tables.size and (int(block_tables.max()) + 1) * block_size > INT32_MAX:
        raise ValueError(
            f"block_tables holds block {block_tables.max()}: its slots (block * {block_size=} + offset) pass int32"
        )
    if np.any(seq_lens > block_tables.shape[1] * block_size):
        raise ValueError(
            f"seq_lens={seq_lens.tolist()} exceed the block tables' capacity "
            f"{block_tables.shape[1]} blocks * {block_size=}"
        )
    num_actual_tokens = int(query_lens.sum())
    num_tokens = num_actual_tokens if num_tokens is None else check_int("num_tokens", num_tokens, minimum=0)
    if max_query_len is not None:
        max_query_len = check_int("max_query_len", max_query_len, minimum=0)
    if max_seq_len is not None:
        max_seq_len = check_int("max_seq_len", max_seq_len, minimum=0)
    causal = check_bool("causal", causal)
    if num_tokens < num_actual_tokens:
        raise ValueError(f"{num_tokens=} is smaller than the {num_actual_tokens} query tokens")
    exact_max_query_len = int(query_lens.max(initial=0))
    exact_max_seq_len = int(seq_lens.max(initial=0))
    if max_query_len is not None and max_query_len < exact_max_query_len:
        raise ValueError(f"{max_query_len=} is below the longest query, {exact_max_query_len}")
    if max_seq_len is not None and max_seq_len < exact_max_seq_len:
        raise ValueError(f"{max_seq_len=} is below the longest sequence, {exact_max_seq_len}")
    return metadata_from_lengths(
        jnp.asarray(query_lens),
        jnp.asarray(seq_lens),
        jnp.asarray(block_tables),
        block_size=block_size,
        num_tokens=num_tokens,
        max_query_len=exact_max_query_len if max_query_len is None else max_query_len,
        max_seq_len=exact_max_seq_len if max_seq_len is None else max_seq_len,
        causal=causal,
    )


def token_requests(query_start_loc: Int[Array, "R+1"], tokens: Int[Array, "..."]) -> Int[Array, "..."]:
    """The request each token index of `tokens` belongs to: the last one whose query starts at or before it,
    clipped to [0, R-1] (padding tokens past the last query: the last request).

    A comparison with every request's start, not a binary search: `jnp.searchsorted`'s default is a loop of
    log2(R) steps, which a GPU runs as a launch per step."""
    found = jnp.searchsorted(query_start_loc, tokens, side="right", method="compare_all")
    return jnp.clip(found - 1, 0, query_start_loc.shape[0] - 2)


def metadata_from_lengths(
    query_lens: Int[Array, "R"],
    seq_lens: Int[Array, "R"],
    block_tables: Int[Array, "R P"],
    *,
    block_size: int,
    num_tokens: int,
    max_query_len: int,
    max_seq_len: int,
    causal: bool = True,
) -> AttentionMetadata:
    """Traceable: metadata from int32 lengths and block tables, with vLLM's slot mapping. Tokens past
    ``sum(query_lens)`` are padding. Checked: the arrays' kinds, dtypes and shapes and the static options
    (`ValueError` naming them); not the arrays' values, which may be traced (`make_attention_metadata` is the
    checked host version)."""
    arrays = (("query_lens", query_lens, 1), ("seq_lens", seq_lens, 1), ("block_tables", block_tables, 2))
    for name, x, ndim in arrays:
        if not isinstance(x, (jax.Array, np.ndarray)) or x.ndim != ndim or x.dtype != np.int32:
            got = f"{x.dtype} array of shape {tuple(x.shape)}" if hasattr(x, "shape") else type(x).__name__
            raise ValueError(f"{name} must be an int32 array of {ndim} dimensions, got {got}")
    if seq_lens.shape != query_lens.shape or block_tables.shape[0] != query_lens.shape[0]:
        raise ValueError(
            f"query_lens.shape={query_lens.shape}, seq_lens.shape={seq_lens.shape} and block_tables.shape="
            f"{block_tables.shape} must be [R], [R] and [R, P]"
        )
    block_size = check_int("block_size", block_size)
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    max_query_len = check_int("max_query_len", max_query_len, minimum=0)
    max_seq_len = check_int("max_seq_len", max_seq_len, minimum=0)
    causal = check_bool("causal", causal)
    query_start_loc = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(query_lens, dtype=jnp.int32)])
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    if min(block_tables.shape) == 0:  # no request, or no block: every token is padding
        slot_mapping = jnp.full(num_tokens, PAD_SLOT_ID, jnp.int32)
    else:
        request = token_requests(query_start_loc, token)
        position = seq_lens[request] - query_lens[request] + token - query_start_loc[request]
        block = block_tables[request, jnp.clip(position // block_size, 0, block_tables.shape[1] - 1)]
        is_query = token < query_start_loc[-1]
        slot_mapping = jnp.where(is_query, block * block_size + position % block_size, PAD_SLOT_ID)
    return AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping.astype(jnp.int32),
        num_actual_tokens=query_start_loc[-1],
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        causal=causal,
    )


def metadata_from_step(
    config: AllocatorConfig,
    out: StepOutput,
    group: int,
    *,
    max_query_len: int | None = None,
    causal: bool = True,
) -> AttentionMetadata:
    """The metadata of KV-cache group `group` for the step the allocator just scheduled (traceable: call it
    inside the model step's jit, no host round trip).

    Row r of `out` is request r of the metadata: a row that got no tokens (failed or padding) has query length
    0 and is skipped by the kernels. Its block table is group `group`'s table of the row (`NULL_BLOCK_ID` outside
    the window or chunk) and its slots the group's slot mapping.

    Args:
      config: the allocator's configuration (static: gives P of the group and the length bounds).
      out: the `StepOutput` of `allocate_slots` (with ``return_block_tables=True``).
      group: the KV-cache group (static int).
      max_query_len: static bound of the query lengths; default ``config.max_num_batched_tokens`` (a
        decode-only step may pass 1, which skips the kernels' prefill launch).
      causal: whether the group's layers are causal.
    """
    if not isinstance(config, AllocatorConfig):
        raise ValueError(f"config must be an AllocatorConfig, got {type(config).__name__}")
    group = check_int("group", group, minimum=0, maximum=config.num_groups - 1)
    if not isinstance(out, StepOutput):
        raise ValueError(f"out must be the StepOutput of allocate_slots, got {type(out).__name__}")
    if out.block_tables is None:
        raise ValueError("out.block_tables is None: call allocate_slots with return_block_tables=True")
    max_query_len = config.max_num_batched_tokens if max_query_len is None else max_query_len
    max_query_len = check_int("max_query_len", max_query_len, minimum=0)
    causal = check_bool("causal", causal)
    return AttentionMetadata(
        query_start_loc=out.query_start_loc,
        seq_lens=out.seq_lens,
        block_tables=out.block_tables[group, :, : config.blocks_per_row[group]],
        slot_mapping=out.slot_mappings[group],
        num_actual_tokens=out.query_start_loc[-1],
        max_query_len=max_query_len,
        max_seq_len=config.max_model_len,
        causal=causal,
    )
