"""The prefix map: block hash (and group) -> cached block, as a two-choice bucketed hash table in arrays.

``prefix_map[NB, W + 1]`` holds W block ids per bucket and a bit mask of the used slots; a key may live in either of
two buckets chosen from its hash, and an insert goes to the emptier one. The keys themselves are read from the
pool's per-block rows (hash, group), so a slot is one int32. Deleting is clearing a slot: no tombstones, no probing.

Like vLLM's `BlockHashToBlockMap`, equal keys are not deduplicated: every cached block is inserted, and a lookup
returns the first inserted (smallest stamp) of the live blocks with that key. With ``NB * W`` about four times the
number of blocks and two choices, a bucket overflows with negligible probability (the most loaded of n buckets
holds about ``2 + log2(log(n))`` keys, against W = 8 slots); an insert that finds both buckets full is dropped and
counted (`BlockPool.dropped_inserts`): the block keeps its hash, so free order is unchanged, but it cannot be hit.
Inserts of one call are placed in rounds; when two of them pick the same slot the earlier one wins and the other
retries, so the table is the same on every device.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, UInt32

from .._compat import register_pytree_dataclass
from .columns import NO_MAP_SLOT, BlockRows
from .hashing import hash_words

__all__ = [
    "BUCKET_WIDTH",
    "EMPTY_SLOT",
    "NO_BLOCK",
    "Inserts",
    "bucket_pair",
    "delete",
    "finish_inserts",
    "insert",
    "lookup",
]

BUCKET_WIDTH = 8
"""W: slots per bucket."""

EMPTY_SLOT = -1
"""Prefix-map slot holding no block."""

NO_BLOCK = -1
"""`lookup` result of a miss."""

_INT32_MAX = jnp.iinfo(jnp.int32).max

_CLAIM_BASE = jnp.iinfo(jnp.int32).min
"""Claims of one placement round are ``_CLAIM_BASE + order``: below every block id and `EMPTY_SLOT`."""


def bucket_pair(keys: UInt32[Array, "... 2"], groups: Int[Array, "..."], num_buckets: int):
    """The two candidate buckets of each (hash, group) key."""
    mixed = hash_words(jnp.concatenate([keys, groups.astype(jnp.uint32)[..., None]], axis=-1))
    mask = jnp.uint32(num_buckets - 1)
    return (mixed[..., 0] & mask).astype(jnp.int32), (mixed[..., 1] & mask).astype(jnp.int32)


def lookup(
    prefix_map: Int[Array, "NB W+1"],
    info: Int[Array, "B 8"],
    keys: UInt32[Array, "... 2"],
    groups: Int[Array, "..."],
) -> Int[Array, "..."]:
    """The first-inserted cached block with each key, or `NO_BLOCK` (`info`: `state.BlockPool.info`)."""
    width = prefix_map.shape[1] - 1
    b1, b2 = bucket_pair(keys, groups, prefix_map.shape[0])
    candidates = jnp.concatenate([prefix_map[b1, :width], prefix_map[b2, :width]], axis=-1)  # [..., 2W]
    rows = BlockRows(info[jnp.maximum(candidates, 0)])  # [..., 2W, 8]
    words = jax.lax.bitcast_convert_type(keys, jnp.int32)
    match = (
        (candidates != EMPTY_SLOT)
        & (rows.hash_hi == words[..., None, 0])
        & (rows.hash_lo == words[..., None, 1])
        & (rows.group == groups[..., None])
    )
    stamp = jnp.where(match, rows.stamp, _INT32_MAX)
    best = jnp.argmin(stamp, axis=-1)
    found = jnp.take_along_axis(candidates, best[..., None], axis=-1)[..., 0]
    return jnp.where(jnp.any(match, axis=-1), found, NO_BLOCK)


def insert(
    prefix_map: Int[Array, "NB W+1"],
    blocks: Int[Array, "E"],
    keys: UInt32[Array, "E 2"],
    groups: Int[Array, "E"],
    mask: Bool[Array, "E"],
    *,
    finish: bool = True,
) -> tuple[Int[Array, "NB W+1"], "Inserts"]:
    """Insert ``blocks[mask]`` under their keys. Returns (prefix_map, `Inserts`).

    The last column of a bucket has bit j set when slot j is used, so its load and first free slot come from one
    int32. With ``finish=False`` only the first round is placed: inserts that lost their slot to another insert of
    the call stay `Inserts.pending` for `finish_inserts` (the retry loop's condition costs a host sync on a GPU,
    so the step runs it only on its rare path).
    """
    slot_of = jnp.full(blocks.shape, NO_MAP_SLOT, jnp.int32)
    started = Inserts(blocks, keys, groups, mask, slot_of, jnp.zeros((), jnp.int32))
    placed = _place_round((prefix_map, started))
    return finish_inserts(*placed) if finish else placed


def finish_inserts(
    prefix_map: Int[Array, "NB W+1"], inserts: "Inserts", *, max_rounds: int | None = None
) -> tuple[Int[Array, "NB W+1"], "Inserts"]:
    """Place the pending inserts, in rounds, until none is left.

    `max_rounds`: at most that many rounds, a number known when compiling (no host sync on a GPU); the inserts
    still pending after them are dropped, as those that find both buckets full are (their blocks stay uncached:
    a later request misses them)."""
    if max_rounds is None:
        return jax.lax.while_loop(lambda carry: jnp.any(carry[1].pending), _place_round, (prefix_map, inserts))
    # unrolled: one straight-line program, with no loop for a GPU runtime to step through
    table, inserts = jax.lax.fori_loop(
        0, max_rounds, lambda _, carry: _place_round(carry), (prefix_map, inserts), unroll=True
    )
    left = inserts.pending
    return table, dataclasses.replace(
        inserts, pending=jnp.zeros_like(left), dropped=inserts.dropped + jnp.sum(left, dtype=jnp.int32)
    )


@dataclasses.dataclass(frozen=True)
class Inserts:
    """One call's inserts, [E] each: block, key, group, whether it still waits for a slot, and its flat slot
    ``bucket * W + column`` (`NO_MAP_SLOT` until placed, and for dropped ones); `dropped` counts the inserts that
    found both buckets full."""

    blocks: Int[Array, "E"]
    keys: UInt32[Array, "E 2"]
    groups: Int[Array, "E"]
    pending: Bool[Array, "E"]
    slot_of: Int[Array, "E"]
    dropped: Int[Array, ""]

    @classmethod
    def none(cls, size: int) -> "Inserts":
        """`size` slots with nothing pending."""
        zeros = jnp.zeros(size, jnp.int32)
        return cls(zeros, jnp.zeros((size, 2), jnp.uint32), zeros, zeros != 0, zeros + NO_MAP_SLOT, zeros[0])


register_pytree_dataclass(Inserts, data_fields=[f.name for f in dataclasses.fields(Inserts)], meta_fields=[])


def _place_round(carry: tuple[Int[Array, "NB W+1"], Inserts]) -> tuple[Int[Array, "NB W+1"], Inserts]:
    """Each pending insert takes the lowest free slot of the emptier of its two buckets; of two that pick the
    same slot the earlier wins and the other stays pending. Inserts that find both buckets full are dropped."""
    table, inserts = carry
    blocks, pending = inserts.blocks, inserts.pending
    num_buckets, width = table.shape[0], table.shape[1] - 1
    b1, b2 = bucket_pair(inserts.keys, inserts.groups, num_buckets)
    bits1, bits2 = table[b1, width], table[b2, width]
    load1, load2 = jax.lax.population_count(bits1), jax.lax.population_count(bits2)
    first = load1 <= load2
    bucket, used = jnp.where(first, b1, b2), jnp.where(first, bits1, bits2)
    free_bits = ~used & ((1 << width) - 1)
    column = jax.lax.population_count((free_bits & -free_bits) - 1)  # lowest free slot
    full = free_bits == 0
    go = pending & ~full
    # Inserts into one bucket pick the same slot (its lowest free one); the earliest wins. A scatter with repeated
    # indices would leave the winner to the device, and CPU and GPU would place blocks differently. So each claims
    # the slot with a scatter-min of its order (below `EMPTY_SLOT`, which a free slot holds), and the one that reads
    # its own claim back writes its block over it: no per-bucket scratch array.
    claim = _CLAIM_BASE + jnp.arange(blocks.shape[0], dtype=jnp.int32)
    claimed = jnp.where(go, bucket, num_buckets)
    table = table.at[claimed, column].min(claim, mode="drop")
    won = go & (table[bucket, column] == claim)
    target = jnp.where(won, bucket, num_buckets)
    table = table.at[target, column].set(blocks, mode="drop")
    table = table.at[target, width].add(1 << column, mode="drop")
    return table, dataclasses.replace(
        inserts,
        pending=pending & ~won & ~full,
        slot_of=jnp.where(won, bucket * width + column, inserts.slot_of),
        dropped=inserts.dropped + jnp.sum(pending & full, dtype=jnp.int32),
    )


def delete(
    prefix_map: Int[Array, "NB W+1"], blocks: Int[Array, "E"], slots: Int[Array, "E"], mask: Bool[Array, "E"]
) -> Int[Array, "NB W+1"]:
    """Clear the flat slots (distinct) that hold `blocks`, in one scatter-add."""
    num_buckets, width = prefix_map.shape[0], prefix_map.shape[1] - 1
    bucket = jnp.where(mask & (slots >= 0), slots // width, num_buckets)
    column = slots % width
    rows = jnp.concatenate([bucket, bucket])
    columns = jnp.concatenate([column, jnp.full_like(column, width)])
    delta = jnp.concatenate([EMPTY_SLOT - blocks, -(1 << column)])  # slot -> EMPTY_SLOT, its bit cleared
    return prefix_map.at[rows, columns].add(delta, mode="drop")
