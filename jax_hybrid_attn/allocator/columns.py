"""The packed layout of the state arrays: column indices, the sentinels stored in them, and named views to read them.

The state keeps the fields of a block (`BlockPool.info`) and of a request slot (`RequestTable.rows`) side by side
in one int32 row, so that one scatter writes every field of a block or request. Writes name the columns below;
reads go through `BlockRows` and `RequestRows`, which name the fields of a whole array, of rows gathered from it
(any leading shape), or of the rows at an index array (``RequestRows(rows, slots).num_tokens`` reads
``rows[slots, NUM_TOKENS]``, gathering only that column).
"""

import jax
import jax.numpy as jnp

__all__ = [
    "ADAPTER",
    "DROPPED",
    "FREE_POS",
    "GROUP",
    "HASHED",
    "HASH_HI",
    "HASH_LO",
    "MAP_SLOT",
    "NOT_FREE",
    "NO_GROUP",
    "NO_MAP_SLOT",
    "NUM_BLOCK_FIELDS",
    "NUM_COUNTERS",
    "NUM_FREE",
    "NUM_GROUP_COUNTERS",
    "NUM_TOKENS",
    "REF",
    "RING_HEAD",
    "RING_SPAN",
    "ROOT_HI",
    "ROOT_LO",
    "ROW_GROUP_COLUMNS",
    "RUNNING",
    "STAMP",
    "STAMP_COUNTER",
    "STAT_HITS",
    "STAT_QUERIES",
    "STAT_REQUESTS",
    "BlockRows",
    "RequestRows",
]

# `BlockPool.info`: one row per block.
REF, FREE_POS, HASHED, GROUP, MAP_SLOT, STAMP, HASH_HI, HASH_LO = range(8)
NUM_BLOCK_FIELDS = 8

NOT_FREE = -1
"""`FREE_POS` of a block that is not in the free queue."""

NO_MAP_SLOT = -1
"""`MAP_SLOT` of a block that is not in the prefix map."""

NO_GROUP = -1
"""`GROUP` of a block without a hash."""

# `BlockPool.counters`.
RING_HEAD, RING_SPAN, NUM_FREE, STAMP_COUNTER, DROPPED, STAT_REQUESTS, STAT_QUERIES, STAT_HITS = range(8)
NUM_COUNTERS = 8

# `RequestTable.rows`: one row per request slot; then, from `ROW_GROUP_COLUMNS`, G columns each of
# num_table_blocks, num_null and num_cached.
NUM_TOKENS, RUNNING, ADAPTER, ROOT_HI, ROOT_LO = range(5)
ROW_GROUP_COLUMNS = 5
NUM_GROUP_COUNTERS = 3


class _PackedRows:
    """Named columns of a packed array's rows: all of them, or those at `index` (any shape)."""

    __slots__ = ("index", "packed")

    def __init__(self, packed, index=None):
        self.packed, self.index = packed, index

    def _column(self, column):
        """``packed[..., column]``, or ``packed[index, column]`` (one gather of just that column)."""
        return self.packed[..., column] if self.index is None else self.packed[self.index, column]


class BlockRows(_PackedRows):
    """Named fields of `BlockPool.info` ([B, 8]): ``BlockRows(info)``, ``BlockRows(info[blocks])`` or
    ``BlockRows(info, blocks)``; each field has the rows' leading shape."""

    __slots__ = ()

    ref = property(lambda self: self._column(REF))
    """Requests holding the block."""
    free_pos = property(lambda self: self._column(FREE_POS))
    """Its ring index while it is free, `NOT_FREE` otherwise."""
    hashed = property(lambda self: self._column(HASHED) != 0)
    """Whether it holds a full cached block (vLLM's ``block_hash is not None``)."""
    group = property(lambda self: self._column(GROUP))
    """Group of its hash (`NO_GROUP` without one)."""
    map_slot = property(lambda self: self._column(MAP_SLOT))
    """Its flat slot in the prefix map (`NO_MAP_SLOT` if not in it)."""
    stamp = property(lambda self: self._column(STAMP))
    """Insertion order of its hash."""
    hash_hi = property(lambda self: self._column(HASH_HI))
    hash_lo = property(lambda self: self._column(HASH_LO))
    hash = property(
        lambda self: jax.lax.bitcast_convert_type(self._column(slice(HASH_HI, HASH_LO + 1)), jnp.uint32)
    )
    """Its hash as uint32 words ``[..., (hi, lo)]``."""


class RequestRows(_PackedRows):
    """Named fields of `RequestTable.rows` ([R, 5 + 3G]): ``RequestRows(rows)``, ``RequestRows(rows[slots])`` or
    ``RequestRows(rows, slots)``. Per-group fields put the group first: [G, ...] (e.g. [G, R] for R rows)."""

    __slots__ = ()

    @property
    def num_groups(self) -> int:
        return (self.packed.shape[-1] - ROW_GROUP_COLUMNS) // NUM_GROUP_COUNTERS

    num_tokens = property(lambda self: self._column(NUM_TOKENS))
    """Known tokens (prompt and output so far)."""
    running = property(lambda self: self._column(RUNNING) != 0)
    """Whether the request holds its first allocation (vLLM: it is in ``num_cached_block``)."""
    adapter_id = property(lambda self: self._column(ADAPTER))
    root = property(
        lambda self: jax.lax.bitcast_convert_type(self._column(slice(ROOT_HI, ROOT_LO + 1)), jnp.uint32)
    )
    """Parent hash of block 0 (from the cache salt), as uint32 words ``[..., (hi, lo)]``."""

    def _per_group(self, counter: int):
        start = ROW_GROUP_COLUMNS + counter * self.num_groups
        return jnp.moveaxis(self._column(slice(start, start + self.num_groups)), -1, 0)

    num_table_blocks = property(lambda self: self._per_group(0))
    """[G, ...] table length per group (vLLM's ``len(req_blocks)``), null blocks included."""
    num_null = property(lambda self: self._per_group(1))
    """[G, ...] leading columns that hold the null block."""
    num_cached = property(lambda self: self._per_group(2))
    """[G, ...] leading blocks offered to the prefix cache (vLLM's ``num_cached_block``)."""
