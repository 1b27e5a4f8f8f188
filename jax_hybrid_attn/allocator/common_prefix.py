"""The running requests' common prefix per KV-cache group, for cascade attention (`num_common_prefix_blocks`)."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ..constants import NULL_BLOCK_ID
from .state import AllocatorState

__all__ = ["num_common_prefix_blocks"]


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
