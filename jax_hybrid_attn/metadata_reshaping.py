"""vLLM's helpers that reshape a step's attention metadata: the decode/prefill split and the decode-first order
of its requests, chunked-local attention as virtual requests, and block tables of smaller kernel blocks.

`split_decodes_and_prefills`, `reorder_decodes_first` and `make_local_attention_virtual_batches` take concrete
arrays, as vLLM computes them from its CPU copies, and check the metadata they read first (`ValueError` naming
the field): its types, dtypes and shapes as `paged_attention` does, a ``query_start_loc`` that starts at 0,
never decreases and ends at ``num_actual_tokens`` (at most T), and the lengths each helper reads.
`expand_block_tables` is traceable.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from .integers import INT32_MAX, cdiv, check_bool, check_int
from .metadata import AttentionMetadata, host_int32
from .validation import check_metadata

__all__ = [
    "expand_block_tables",
    "make_local_attention_virtual_batches",
    "reorder_decodes_first",
    "split_decodes_and_prefills",
]


def split_decodes_and_prefills(
    metadata: AttentionMetadata, *, decode_threshold: int = 1, require_uniform: bool = False
) -> tuple[int, int, int, int]:
    """vLLM's split of a decode-first batch: ``(num_decodes, num_prefills, num_decode_tokens,
    num_prefill_tokens)``.

    Decodes are the leading requests whose query length is at most `decode_threshold`; everything from
    the first longer request on is a prefill. With `require_uniform`, decodes must also all have the
    query length of request 0. The batch must already be decode-first (`reorder_decodes_first`).
    """
    check_int("decode_threshold", decode_threshold)
    require_uniform = check_bool("require_uniform", require_uniform)
    query_start_loc, query_lens = _query_offsets(metadata)
    num_reqs, num_tokens = len(query_lens), int(query_start_loc[-1])
    if num_reqs and query_lens.max() <= decode_threshold and (not require_uniform or decode_threshold == 1):
        return num_reqs, 0, num_tokens, 0
    if num_reqs == 0 or query_lens[0] > decode_threshold:
        return 0, num_reqs, 0, num_tokens
    if require_uniform:  # padding requests (query length 0) do not break uniformity
        is_prefill = (query_lens != query_lens[0]) & (query_lens != 0)
    else:
        is_prefill = query_lens > decode_threshold
    if not is_prefill.any():
        return num_reqs, 0, num_tokens, 0
    num_decodes = int(np.argmax(is_prefill))
    num_decode_tokens = int(query_start_loc[num_decodes])
    return num_decodes, num_reqs - num_decodes, num_decode_tokens, num_tokens - num_decode_tokens


def reorder_decodes_first(
    metadata: AttentionMetadata, *, decode_threshold: int = 1, is_prefilling=None
) -> tuple[AttentionMetadata, np.ndarray]:
    """Reorder requests as vLLM does before splitting: decodes, short extends, long extends, prefills.

    Decode: query length <= `decode_threshold` and not prefilling. Short extend: that short but still
    prefilling. Long extend: longer, with cached context. Prefill: no cached context. `is_prefilling` [R]
    defaults to "has no cached context". The order is stable within each class.

    Returns the reordered metadata and ``token_order`` [T]: the reordered batch's token i is the
    original token ``token_order[i]`` (``q_reordered = q[token_order]``). Padding tokens stay last.
    """
    check_int("decode_threshold", decode_threshold)
    query_start_loc, query_lens = _query_offsets(metadata)
    seq_lens = _seq_lens(metadata, query_lens)
    has_context = seq_lens > query_lens
    if is_prefilling is None:
        is_prefilling = ~has_context
    else:
        is_sequence = isinstance(is_prefilling, (list, tuple, np.ndarray, jax.Array))
        flags = np.asarray(is_prefilling) if is_sequence else None
        if flags is None or flags.dtype != np.bool_ or flags.shape != seq_lens.shape:
            raise ValueError(f"is_prefilling={is_prefilling!r:.80} must be [R={len(seq_lens)}] bools")
        is_prefilling = flags
    short = query_lens <= decode_threshold
    request_class = np.select(
        [short & ~is_prefilling, short & is_prefilling, ~short & has_context], [0, 1, 2], default=3
    )
    request_order = np.argsort(request_class, kind="stable")
    token_order = np.concatenate(
        [np.arange(query_start_loc[r], query_start_loc[r + 1]) for r in request_order]
        + [np.arange(query_start_loc[-1], metadata.num_tokens)]
    ).astype(np.int32)
    new_query_lens = query_lens[request_order]
    reordered = metadata.replace(
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(new_query_lens)]), jnp.int32),
        seq_lens=jnp.asarray(seq_lens[request_order]),
        block_tables=jnp.asarray(np.asarray(metadata.block_tables)[request_order]),
        slot_mapping=jnp.asarray(np.asarray(metadata.slot_mapping)[token_order]),
    )
    return reordered, token_order


def make_local_attention_virtual_batches(
    attention_chunk_size: int, metadata: AttentionMetadata, block_size: int
) -> AttentionMetadata:
    """vLLM's rewrite of chunked-local attention as causal attention over "virtual" requests.

    Each virtual request is the part of one real request's queries that falls in one chunk, attending to
    that chunk's keys. Query tokens and `slot_mapping` keep their order; block-table rows take
    ``attention_chunk_size // block_size`` columns from the chunk's first block, clipped to the last
    column (so short rows repeat their last block id, as vLLM's do).
    """
    chunk = check_int("attention_chunk_size", attention_chunk_size)
    block_size = check_int("block_size", block_size)
    if chunk % block_size:
        raise ValueError(f"attention_chunk_size={chunk} must be a multiple of {block_size=}")
    _, query_lens = _query_offsets(metadata)
    seq_lens = _seq_lens(metadata, query_lens)
    block_tables = host_int32("metadata.block_tables", metadata.block_tables)
    capacity = block_tables.shape[1] * block_size
    if np.any(seq_lens > capacity):
        raise ValueError(
            f"metadata.seq_lens={seq_lens.tolist()} exceed the block tables' capacity {capacity} tokens "
            f"({block_tables.shape[1]} blocks * {block_size=})"
        )

    # Queries in the chunk holding each request's first new token, and keys in its last chunk.
    first_chunk_queries = np.minimum(chunk - (seq_lens - query_lens) % chunk, query_lens)
    last_chunk_keys = seq_lens - chunk * ((seq_lens - 1) // chunk)
    num_virtual = 1 + cdiv(query_lens - first_chunk_queries, chunk)

    # Within each request: index of the virtual request from the front (arange) and from the back.
    starts = np.repeat(np.cumsum(num_virtual) - num_virtual, num_virtual)
    arange = np.arange(num_virtual.sum()) - starts
    rarange = np.repeat(num_virtual, num_virtual) - arange - 1
    owner = np.repeat(np.arange(len(seq_lens)), num_virtual)

    virtual_query_lens = np.where(arange == 0, first_chunk_queries[owner], chunk)
    remaining = query_lens[owner] - first_chunk_queries[owner] - chunk * (arange - 1)
    virtual_query_lens = np.where(arange > 0, np.minimum(remaining, chunk), virtual_query_lens)
    virtual_seq_lens = np.where(rarange == 0, last_chunk_keys[owner], chunk)
    key_starts = seq_lens[owner] - (rarange * chunk + last_chunk_keys[owner])

    blocks_per_chunk = chunk // block_size
    columns = key_starts[:, None] // block_size + np.arange(blocks_per_chunk)
    columns = np.clip(columns, 0, block_tables.shape[1] - 1)  # below 0: a request without keys
    virtual_block_tables = block_tables[owner[:, None], columns]

    return metadata.replace(
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(virtual_query_lens)]), jnp.int32),
        seq_lens=jnp.asarray(virtual_seq_lens, jnp.int32),
        block_tables=jnp.asarray(virtual_block_tables, jnp.int32),
        max_query_len=int(virtual_query_lens.max(initial=0)),
        max_seq_len=int(virtual_seq_lens.max(initial=0)),
        causal=True,
    )


def _query_offsets(metadata) -> tuple[np.ndarray, np.ndarray]:
    """The metadata's ``query_start_loc`` [R+1] and query lengths [R] on the host, the metadata checked as
    `paged_attention` checks it: ``query_start_loc`` must start at 0, never decrease and end at
    ``num_actual_tokens <= T``."""
    check_metadata(metadata)
    query_start_loc = host_int32("metadata.query_start_loc", metadata.query_start_loc)
    num_actual_tokens = int(host_int32("metadata.num_actual_tokens", metadata.num_actual_tokens))
    query_lens = np.diff(query_start_loc)
    if query_start_loc[0] != 0 or np.any(query_lens < 0) or query_start_loc[-1] > metadata.num_tokens:
        raise ValueError(
            f"metadata.query_start_loc={query_start_loc.tolist()} must start at 0, never decrease and end at "
            f"most at T={metadata.num_tokens}"
        )
    if num_actual_tokens != query_start_loc[-1]:
        raise ValueError(
            f"metadata.num_actual_tokens={num_actual_tokens} must equal query_start_loc[-1]="
            f"{query_start_loc[-1]}"
        )
    return query_start_loc, query_lens


def _seq_lens(metadata: AttentionMetadata, query_lens: np.ndarray) -> np.ndarray:
    """The metadata's ``seq_lens`` [R] on the host, each at least its request's query length."""
    seq_lens = host_int32("metadata.seq_lens", metadata.seq_lens)
    if np.any(query_lens > seq_lens):
        raise ValueError(
            f"metadata.seq_lens={seq_lens.tolist()} must be >= the query lengths {query_lens.tolist()}"
        )
    return seq_lens


def expand_block_tables(block_tables: Int[Array, "R P"], *, allocator_block_size: int, kernel_block_size: int):
    """Block table of the allocator's blocks -> table of the kernel's smaller blocks: [R, P * ratio], int32.

    Allocator block b becomes kernel blocks ``b * ratio ... b * ratio + ratio - 1`` (vLLM's "hybrid
    blocks"), where ``ratio = allocator_block_size // kernel_block_size``. A concrete table's ids must be >= 0
    and their kernel blocks must fit int32 (`ValueError` otherwise); a traced one's are not checked.
    """
    check_int("allocator_block_size", allocator_block_size)
    check_int("kernel_block_size", kernel_block_size)
    if kernel_block_size > allocator_block_size or allocator_block_size % kernel_block_size:
        raise ValueError(f"{allocator_block_size=} must be a multiple of {kernel_block_size=} > 0")
    if not isinstance(block_tables, (jax.Array, np.ndarray)) or block_tables.ndim != 2:
        got = f"shape {block_tables.shape}" if hasattr(block_tables, "shape") else type(block_tables).__name__
        raise ValueError(f"block_tables must be an [R, P] integer array, got {got}")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(f"block_tables.dtype={block_tables.dtype} must be an integer dtype")
    ratio = allocator_block_size // kernel_block_size
    largest = (INT32_MAX - ratio + 1) // ratio  # the largest id whose kernel blocks fit int32
    if not isinstance(block_tables, jax.core.Tracer) and block_tables.size:
        low, high = int(block_tables.min()), int(block_tables.max())
        if low < 0 or high > largest:
            raise ValueError(
                f"block_tables holds ids in [{low}, {high}]: they must lie in [0, {largest}], so that their "
                f"kernel blocks (id * {ratio} + j) fit int32"
            )
    num_reqs, num_cols = block_tables.shape
    expanded = jnp.asarray(block_tables, jnp.int32)[:, :, None] * ratio + jnp.arange(ratio, dtype=jnp.int32)
    return expanded.reshape(num_reqs, num_cols * ratio)
