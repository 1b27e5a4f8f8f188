"""Request slots: their token ids and chained block hashes (jitted).

vLLM computes a request's block hashes as its tokens arrive (``Request.block_hashes``, one per full block);
`add_requests` does it for prompts and `append_token_ids` for tokens sampled later, so that `allocate_slots` can
cache full blocks and look up prefixes without leaving the device. Hashes are computed at
``hash_block_size`` (the gcd of the groups' block sizes).
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, UInt32

from ..integers import cdiv
from .columns import ADAPTER, NUM_TOKENS, ROOT_HI, ROOT_LO, RequestRows
from .config import AllocatorConfig, check_config
from .hashing import chain_block_hash, root_hash
from .state import AllocatorState, RequestTable

MAX_UNROLLED_HASH_BLOCKS = 4
"""A step that fills at most this many hash blocks per row hashes them in straight-line code."""

__all__ = ["add_requests", "append_token_ids"]


def _extend_hashes(
    config: AllocatorConfig, req: RequestTable, slots, old_len, new_len, *, max_new_blocks: int | None = None
) -> RequestTable:
    """Hash the hash blocks that became full between `old_len` and `new_len` tokens, in chain order.

    `max_new_blocks`: a static bound on the blocks any row fills; the loop then has that many trips, known when
    compiling. Without it the trip count is the largest row's, which a GPU reads back to the host before it
    launches what follows."""
    size = config.hash_block_size
    first, last = old_len // size, new_len // size
    offset = jnp.arange(size, dtype=jnp.int32)
    drop = config.max_num_seqs

    def one(j, hashes):
        k = first + j
        active = k < last
        stored = RequestRows(req.rows, slots)
        parent = jnp.where((k == 0)[:, None], stored.root, hashes[slots, jnp.maximum(k - 1, 0)])
        position = jnp.clip(k[:, None] * size + offset, 0, config.max_model_len - 1)
        tokens = req.token_ids[slots[:, None], position]
        block_hash = chain_block_hash(parent, tokens, stored.adapter_id)
        index = jnp.clip(k, 0, config.hash_blocks_per_row - 1)
        return hashes.at[jnp.where(active, slots, drop), index].set(block_hash, mode="drop")

    if max_new_blocks is None:
        steps = jnp.max(last - first, initial=0)
        return dataclasses.replace(req, block_hashes=jax.lax.fori_loop(0, steps, one, req.block_hashes))
    # a trip count known when compiling; a short loop is unrolled (no loop for a GPU runtime to step through)
    unroll = max_new_blocks <= MAX_UNROLLED_HASH_BLOCKS
    hashes = jax.lax.fori_loop(0, max_new_blocks, one, req.block_hashes, unroll=unroll)
    return dataclasses.replace(req, block_hashes=hashes)


@partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def add_requests(
    config: AllocatorConfig,
    state: AllocatorState,
    slots: Int[Array, "R"],
    token_ids: Int[Array, "R L"],
    num_tokens: Int[Array, "R"],
    cache_salt: UInt32[Array, "R 2"] | None = None,
    adapter_id: Int[Array, "R"] | None = None,
) -> AllocatorState:
    """Put each request's prompt in its slot and hash its full blocks. Rows whose slot is negative, holds
    blocks, or whose length is outside ``[0, max_model_len]`` are ignored.

    Args:
      token_ids: [R, L'] prompt token ids (L' <= max_model_len; entries past ``num_tokens`` are ignored).
      cache_salt: [R, 2] uint32 (`hashing.cache_salt_words`); (0, 0) for none.
      adapter_id: [R] int32 adapter (LoRA) id, `hashing.NO_ADAPTER` for none.
    """
    check_config(config)
    req = state.requests
    slots = jnp.asarray(slots, jnp.int32)
    num_rows, width = token_ids.shape
    if width > config.max_model_len:
        raise ValueError(
            f"token_ids.shape={token_ids.shape} is wider than max_model_len={config.max_model_len}"
        )
    cache_salt = (
        jnp.zeros((num_rows, 2), jnp.uint32) if cache_salt is None else jnp.asarray(cache_salt, jnp.uint32)
    )
    adapter_id = jnp.zeros(num_rows, jnp.int32) if adapter_id is None else jnp.asarray(adapter_id, jnp.int32)
    num_tokens = jnp.asarray(num_tokens, jnp.int32)
    safe = jnp.clip(slots, 0, config.max_num_seqs - 1)
    ok = (
        (slots >= 0)
        & (slots < config.max_num_seqs)
        & ~RequestRows(req.rows, safe).running
        & (num_tokens >= 0)
    )
    ok = ok & (num_tokens <= width)
    slots = jnp.where(ok, safe, config.max_num_seqs)
    row = (
        jnp.zeros((num_rows, config.max_model_len), jnp.int32)
        .at[:, :width]
        .set(jnp.asarray(token_ids, jnp.int32))
    )
    row = jnp.where(jnp.arange(config.max_model_len)[None, :] < num_tokens[:, None], row, 0)
    root = jax.lax.bitcast_convert_type(root_hash(cache_salt), jnp.int32)
    info = jnp.zeros((num_rows, req.rows.shape[1]), jnp.int32)  # not running, no blocks
    info = (
        info.at[:, NUM_TOKENS]
        .set(num_tokens)
        .at[:, ADAPTER]
        .set(adapter_id)
        .at[:, ROOT_HI : ROOT_LO + 1]
        .set(root)
    )
    req = dataclasses.replace(
        req,
        token_ids=req.token_ids.at[slots].set(row, mode="drop"),
        rows=req.rows.at[slots].set(info, mode="drop"),
    )
    req = _extend_hashes(
        config,
        req,
        jnp.clip(slots, 0, config.max_num_seqs - 1),
        jnp.zeros_like(num_tokens),
        jnp.where(ok, num_tokens, 0),
    )
    return dataclasses.replace(state, requests=req)


@partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def append_token_ids(
    config: AllocatorConfig,
    state: AllocatorState,
    slots: Int[Array, "R"],
    token_ids: Int[Array, "R A"],
    counts: Int[Array, "R"],
) -> AllocatorState:
    """Append ``token_ids[r, :counts[r]]`` to each request (e.g. the tokens sampled this step) and hash the blocks
    they fill. Rows with a negative slot, or that would pass ``max_model_len``, are ignored."""
    check_config(config)
    req = state.requests
    slots = jnp.asarray(slots, jnp.int32)
    counts = jnp.asarray(counts, jnp.int32)
    safe = jnp.clip(slots, 0, config.max_num_seqs - 1)
    old_len = RequestRows(req.rows, safe).num_tokens
    ok = (
        (slots >= 0)
        & (slots < config.max_num_seqs)
        & (counts >= 0)
        & (old_len + counts <= config.max_model_len)
    )
    new_len = jnp.where(ok, old_len + counts, old_len)
    width = token_ids.shape[1]
    offset = jnp.arange(width, dtype=jnp.int32)
    write = ok[:, None] & (offset[None, :] < counts[:, None])
    position = jnp.clip(old_len[:, None] + offset, 0, config.max_model_len - 1)
    req = dataclasses.replace(
        req,
        token_ids=req.token_ids.at[jnp.where(write, safe[:, None], config.max_num_seqs), position].set(
            jnp.asarray(token_ids, jnp.int32), mode="drop"
        ),
        rows=req.rows.at[jnp.where(ok, safe, config.max_num_seqs), NUM_TOKENS].set(new_len, mode="drop"),
    )
    # appending A tokens fills at most ceil(A / hash_block_size) blocks of a row
    req = _extend_hashes(config, req, safe, old_len, new_len, max_new_blocks=cdiv(width, config.hash_block_size))
    return dataclasses.replace(state, requests=req)
