"""Prefix hits of one request over all groups: lookups, then vLLM's hybrid fixed point.

Groups with identical specs form one attention group (looked up together: a block position hits only if it hits
in every member group), full attention first. Starting from ``L = max_length``, each pass runs every attention
group's finder with ``max_length = L`` and the lcm alignment, and L becomes its result; passes repeat until one
does not shrink L. A finder never grows L, and every finder is idempotent at its own result, so the lists of the
last pass all have ``L / S_g`` entries (vLLM's "simple hybrid" single pass gives the same L).
With one group this is vLLM's unitary coordinator (alignment = block size).

Deliberate difference from vLLM: every block position is looked up at once (vLLM stops at the first miss, or
the first long-enough run); the result is the same, the work is vectorised.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from ..constants import NULL_BLOCK_ID
from . import prefix_map
from .columns import RequestRows
from .config import CHUNKED_LOCAL, FULL, SLIDING_WINDOW, AllocatorConfig
from .group_rules import FINDERS, group_constants, hit_start_block
from .state import BlockPool, RequestTable

__all__ = ["compute_hits", "find_longest_cache_hit", "lookup_blocks", "may_hit"]


def lookup_blocks(config: AllocatorConfig, pool: BlockPool, requests: RequestTable, slot: Int[Array, ""]):
    """Cached block of every block position of one request in every group. Returns ([G, P] ids, [G, P] hit)."""
    c = group_constants(config)
    index = jnp.arange(config.max_blocks_per_row, dtype=jnp.int32)[None, :]
    key_index = (index + 1) * c.hash_scale - 1
    num_tokens = RequestRows(requests.rows, slot).num_tokens
    in_row = (index < c.blocks_per_row) & ((index + 1) * c.block_size <= num_tokens)
    key_index = jnp.clip(key_index, 0, config.hash_blocks_per_row - 1)
    keys = requests.block_hashes[slot][key_index]  # [G, P, 2]
    groups = jnp.broadcast_to(jnp.arange(config.num_groups, dtype=jnp.int32)[:, None], key_index.shape)
    blocks = prefix_map.lookup(pool.prefix_map, pool.info, keys, groups)
    hit = in_row & (blocks != prefix_map.NO_BLOCK)
    if config.verify_hits:
        width = config.stored_block_tokens
        offset = jnp.arange(width, dtype=jnp.int32)
        position = (index * c.block_size)[..., None] + offset  # [G, P, S_max]
        wanted = requests.token_ids[slot][jnp.clip(position, 0, config.max_model_len - 1)]
        stored = pool.block_tokens[jnp.maximum(blocks, 0)]
        same = (stored == wanted) | (offset >= c.block_size[..., None])
        hit = hit & jnp.all(same, axis=-1)
    return jnp.where(hit, blocks, prefix_map.NO_BLOCK), hit


def find_longest_cache_hit(config: AllocatorConfig, hit: Bool[Array, "G P"], max_length: Int[Array, ""]):
    """Common hit length in tokens (a multiple of the alignment) of all groups."""
    finders = []
    for members in config.attention_groups:
        g = members[0]
        kind, block_size = config.kinds[g], config.block_sizes[g]
        options = dict(block_size=block_size)
        if kind != CHUNKED_LOCAL:
            options["alignment"] = config.alignment
        if kind == SLIDING_WINDOW:
            options["window"] = config.sliding_windows[g]
        if kind == CHUNKED_LOCAL:
            options["chunk"] = config.chunk_sizes[g]
        mask = jnp.all(hit[jnp.asarray(members)], axis=0)
        finders.append((FINDERS[kind], mask, options))

    def one_pass(length):
        for finder, mask, options in finders:
            length = finder(mask, length, **options)
        return length

    def body(carry):
        length, _ = carry
        new_length = one_pass(length)
        return new_length, new_length != length

    start = jnp.maximum(jnp.asarray(max_length, jnp.int32), 0)
    length, _ = jax.lax.while_loop(lambda carry: carry[1], body, (start, jnp.asarray(True)))
    return length


def compute_hits(config: AllocatorConfig, pool: BlockPool, requests: RequestTable, slot, max_length):
    """Prefix hit of one request: (hit tokens, [G, P] hit block lists with null blocks, [G] first real block).

    Hit lists hold ``hit_tokens // S_g`` entries per group (the rest of a row is `NULL_BLOCK_ID`); entries before
    the first real block are null blocks (outside the window or before the current chunk).
    """
    c = group_constants(config)
    blocks, hit = lookup_blocks(config, pool, requests, slot)
    length = find_longest_cache_hit(config, hit, max_length)
    first_real = hit_start_block(c, length)[:, 0]  # [G]
    index = jnp.arange(config.max_blocks_per_row, dtype=jnp.int32)[None, :]
    real = (index >= first_real[:, None]) & (index < length // c.block_size)
    return length, jnp.where(real, blocks, NULL_BLOCK_ID), first_real


def may_hit(
    config: AllocatorConfig, pool: BlockPool, requests: RequestTable, slot, max_length
) -> Bool[Array, ""]:
    """False when `compute_hits` surely finds nothing: `max_length` is below the alignment, or a full-attention
    group misses the request's first block (its hits run left to right and every group's hit is capped by it).

    A few lookups instead of one per block position: a new prompt that shares no prefix skips the search.
    """
    possible = jnp.asarray(max_length) >= config.alignment
    full = [g for g, kind in enumerate(config.kinds) if kind == FULL]
    if not full:
        return possible
    c = group_constants(config)
    groups = jnp.asarray(full, jnp.int32)
    key_index = c.hash_scale[groups, 0] - 1  # the hash of each full group's block 0
    keys = requests.block_hashes[slot][key_index]  # [F, 2]
    blocks = prefix_map.lookup(pool.prefix_map, pool.info, keys, groups)
    return possible & jnp.all(blocks != prefix_map.NO_BLOCK)
