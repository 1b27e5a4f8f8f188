"""Named columns of the packed state arrays, the sentinels stored in them, and small control-flow helpers."""

import jax
import jax.numpy as jnp

# `BlockPool.info`: one row per block.
REF, FREE_POS, HASHED, GROUP, MAP_SLOT, STAMP, HASH_HI, HASH_LO = range(8)
NUM_BLOCK_FIELDS = 8

# `BlockPool.counters`.
RING_HEAD, RING_SPAN, NUM_FREE, STAMP_COUNTER, DROPPED, STAT_REQUESTS, STAT_QUERIES, STAT_HITS = range(8)
NUM_COUNTERS = 8

# `RequestTable.rows`: one row per request slot; then G columns each of num_table_blocks, num_null and num_cached,
# from `ROW_GROUP_COLUMNS`.
NUM_TOKENS, RUNNING, ADAPTER, ROOT_HI, ROOT_LO = range(5)
ROW_GROUP_COLUMNS = 5

NOT_FREE = -1
"""`FREE_POS` of a block that is not in the free queue."""

NO_MAP_SLOT = -1
"""`MAP_SLOT` of a block that is not in the prefix map."""

NO_GROUP = -1
"""`GROUP` of a block without a hash."""

FULL, SLIDING_WINDOW, CHUNKED_LOCAL = 0, 1, 2
"""Manager kinds of a KV-cache group, in `AllocatorConfig.kinds`."""


def updated(vector, values: dict):
    """`vector` (1-D, e.g. `BlockPool.counters`) with ``vector[i] = values[i]`` for each i, as elementwise selects.

    XLA fuses a chain of these into its consumers; a chain of ``.at[i].set`` is a dynamic-update-slice each, with
    copies in between (an operation each on the CPU runtime)."""
    index = jnp.arange(vector.shape[0])
    for i, value in values.items():
        vector = jnp.where(index == i, value, vector)
    return vector


def run_if(pred, fn, *operands):
    """``fn(*operands)`` if `pred` else `operands`, as a 0-or-1-trip `lax.while_loop`.

    Unlike `lax.cond`, whose pass-through branch makes XLA copy large operands on the CPU, a loop updates its
    carry in place: the state arrays are never copied.
    """

    def body(carry):
        return False, fn(*carry[1])

    return jax.lax.while_loop(lambda carry: carry[0], body, (pred, operands))[1]


def cpu_cond(pred, general_fn, shortcut_fn):
    """``general_fn()``, except on the CPU, where ``shortcut_fn()`` runs instead when `pred` is False.

    For a check whose general branch is a few cheap array operations: on a GPU, a `lax.cond` costs a host sync of
    its predicate, more than the general branch itself; on the CPU, the shortcut saves its (block-sized) arrays.
    Both functions must return the same values whenever `pred` is False.
    """
    return jax.lax.platform_dependent(
        cpu=lambda: jax.lax.cond(pred, general_fn, shortcut_fn), default=general_fn
    )


CUMSUM_TILE = 16


def cumsum(x):
    """Inclusive int32 prefix sum of a 1-D array: two reduce-windows up to 1,024 elements (XLA's CPU lowering of
    `jnp.cumsum` takes about seven operations, each paying the runtime's per-operation cost)."""
    x = jnp.asarray(x, jnp.int32)
    n = x.shape[0]
    if n <= CUMSUM_TILE:
        return jax.lax.reduce_window(x, 0, jax.lax.add, (n,), (1,), ((n - 1, 0),))
    rows = -(-n // CUMSUM_TILE)
    tiles = jnp.pad(x, (0, rows * CUMSUM_TILE - n)).reshape(rows, CUMSUM_TILE)
    inner = jax.lax.reduce_window(
        tiles, 0, jax.lax.add, (1, CUMSUM_TILE), (1, 1), ((0, 0), (CUMSUM_TILE - 1, 0))
    )
    totals = inner[:, -1]
    if rows <= 4 * CUMSUM_TILE:  # one quadratic window over the tile totals
        outer = jax.lax.reduce_window(totals, 0, jax.lax.add, (rows,), (1,), ((rows - 1, 0),)) - totals
    else:  # large arrays (ring compaction): recurse, a factor 16 per level
        outer = cumsum(totals) - totals
    return (inner + outer[:, None]).reshape(-1)[:n]
