"""The common prefix per KV-cache group, for cascade attention: of the running requests
(`num_common_prefix_blocks`), and of one step's scheduled rows (`step_common_prefix_blocks`)."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ..constants import NULL_BLOCK_ID
from ..integers import check_int
from .state import AllocatorState
from .step import StepOutput

__all__ = ["num_common_prefix_blocks", "step_common_prefix_blocks"]


@jax.jit
def num_common_prefix_blocks(state: AllocatorState) -> Int[Array, "G"]:
    """Per KV-cache group, the leading blocks that every running request holds: vLLM's
    ``get_num_common_prefix_blocks`` (the blocks of one running request, from the first, while a block's
    reference count equals the number of running requests), for cascade attention.

    vLLM reports 0 for sliding-window and chunked groups (its cascade does not take them); this reports what
    the tables hold in every group (a leading skipped block, the null block, ends the count), and the attention
    decides where a shared prefix is inside every query's window or chunk. 0 when no request runs.
    """
    requests = state.requests
    running = requests.running.astype(bool)
    num_running = jnp.sum(running, dtype=jnp.int32)
    row = jnp.argmax(running)  # the first running request: every running one holds the common prefix
    tables = requests.tables[:, row, :]  # [G, P_max]
    columns = jnp.arange(tables.shape[1])
    held = columns[None, :] < requests.num_table_blocks[:, row][:, None]
    shared = held & (tables != NULL_BLOCK_ID) & (state.pool.ref_counts[tables] == num_running)
    leading = jnp.sum(jnp.cumprod(shared.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)
    return jnp.where(num_running > 0, leading, 0)


def step_common_prefix_blocks(step: StepOutput, block_sizes: tuple[int, ...]) -> Int[Array, "G"]:
    """Per KV-cache group, the leading block-table entries that every row scheduled in `step` holds alike (not
    the null block), cut to the blocks before the earliest query: what cascade attention may split off for this
    step (`cascade.split_violations` holds for every row by construction, windows and chunks apart). 0 unless
    two rows or more are scheduled (one row's blocks are no common prefix). `block_sizes`: S of each group."""
    if not isinstance(step, StepOutput) or step.block_tables is None:
        got = f"{step!r:.60}"
        raise ValueError(f"step must be a StepOutput of allocate_slots with block tables, got {got}")
    num_groups = step.block_tables.shape[0]
    if not isinstance(block_sizes, (tuple, list)) or len(block_sizes) != num_groups:
        raise ValueError(f"block_sizes={block_sizes!r:.60} must give S of each of the {num_groups} groups")
    block_sizes = tuple(check_int("block_sizes", size) for size in block_sizes)
    scheduled = step.num_scheduled_tokens > 0
    lead = jnp.argmax(scheduled)
    tables = step.block_tables  # [G, R, P_max]
    first = tables[:, lead, :]  # [G, P_max]
    shared = jnp.all((tables == first[:, None, :]) | ~scheduled[None, :, None], axis=1) & (first != NULL_BLOCK_ID)
    leading = jnp.sum(jnp.cumprod(shared.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)
    before_queries = jnp.min(jnp.where(scheduled, step.num_computed_tokens, jnp.iinfo(jnp.int32).max))
    leading = jnp.minimum(leading, before_queries // jnp.asarray(block_sizes, jnp.int32))
    return jnp.where(jnp.sum(scheduled) >= 2, leading, 0)
