"""The device half of an engine step, two jitted calls sent back to back: `allocate` (the allocator's step,
compiled once per allocator configuration), then `run_model` (each group's metadata, the model over the paged
caches, sampling, the sampled tokens back into the allocator; compiled per step shape).

Everything a step needs from the steps before it stays on the device: the allocator's state (the known tokens
of each request, their block tables), the KV caches and each request's count of computed tokens. The host sends
only its plan (which requests, at most how many tokens each, their sampling values), so it can send step n+1
before it has read step n: where step n turned out otherwise than the host assumed (a request that got no
blocks), step n+1 computes from what step n really did.

Shape letters: R rows (request slots, ``max_num_seqs``) · T tokens of the step · V vocabulary.
"""

from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.tree_util import PyTreeDef
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from ..allocator import AllocatorConfig, AllocatorState, StepOutput
from ..allocator import requests as request_ops
from ..allocator import step as step_ops
from ..allocator.columns import RequestRows
from ..metadata import metadata_from_step
from .kv_layout import KVCacheLayout
from .paged_cache import PagedCache
from .sampling import sample_tokens

__all__ = ["NO_SLOT", "STEP_SHAPE", "DeviceState", "StepPlan", "StepResult", "allocate", "run_model"]

NO_SLOT = -1
"""`StepPlan.slots` of a padding row."""
STEP_SHAPE = ("num_tokens", "max_query_len", "greedy_only")
"""`run_model`'s static arguments: a step's shape (each one compiles)."""


class DeviceState(NamedTuple):
    """What carries from step to step on the device (donated to each step).

    Attributes:
      kv_caches: one array per layer tensor of the `KVCacheLayout`.
      allocator: the allocator's `AllocatorState` (`KVCacheManager.state`).
      num_computed: [R] tokens in the cache of the request in each allocator slot; read only where the allocator
        says the request holds blocks (a preempted, freed or new request has none, hence 0).
    """

    kv_caches: tuple[Array, ...]
    allocator: AllocatorState
    num_computed: Int[Array, "R"]


class StepPlan(NamedTuple):
    """The host's plan for one step, one row per request in scheduling order (padding rows: `NO_SLOT`).

    Attributes:
      slots: [R] the request's allocator slot.
      max_new_tokens: [R] at most this many tokens to compute (the device clips it to the tokens known and not
        yet in the cache).
      prompt_lens: [R] the request's prompt length (its output tokens so far index its next draw).
      temperature, top_k, top_p, seeds: [R] its sampling values (`sample_tokens`).
    """

    slots: Int[Array, "R"]
    max_new_tokens: Int[Array, "R"]
    prompt_lens: Int[Array, "R"]
    temperature: Float[Array, "R"]
    top_k: Int[Array, "R"]
    top_p: Float[Array, "R"]
    seeds: Int[Array, "R"]


class StepResult(NamedTuple):
    """What the host reads back after a step, per row of its `StepPlan`.

    Attributes:
      success: [R] the row got its blocks.
      deferred: [R] the allocator did not try the row (`allocate`'s ``defer_rest``); it computed nothing.
      seq_lens: [R] its tokens in the cache after the step.
      num_hits: [R] of which prefix-cache hits found in this step.
      num_scheduled: [R] tokens computed in this step.
      sampled: [R] the row drew a token (its sequence now covers every known token).
      tokens: [R] the token drawn (where `sampled`).
      num_free_blocks: [] the allocator's free blocks after the step.
    """

    success: Bool[Array, "R"]
    deferred: Bool[Array, "R"]
    seq_lens: Int[Array, "R"]
    num_hits: Int[Array, "R"]
    num_scheduled: Int[Array, "R"]
    sampled: Bool[Array, "R"]
    tokens: Int[Array, "R"]
    num_free_blocks: Int[Array, ""]


@partial(jax.jit, static_argnames=("allocator_config", "defer_rest"), donate_argnames=("state",))
def allocate(
    allocator_config: AllocatorConfig, state: DeviceState, plan: StepPlan, *, defer_rest: bool = False
) -> tuple[DeviceState, StepOutput, Int[Array, "R"]]:
    """A step's allocation on the device (jitted, `state` donated; engines with equal allocator configurations
    share its executables): each row's new tokens are the tokens known and not yet in the cache, at most
    `plan.max_new_tokens`. Returns (the state, the allocator's `StepOutput` of T = ``max_num_batched_tokens``
    tokens, [R] tokens known before the step).

    `defer_rest` (`step.allocate_slots`): rows the allocator's vectorised path does not serve at once are
    deferred, and the call makes the host wait for nothing; for decode steps, where that path serves every row
    in the common case."""
    slots = plan.slots
    valid = slots != NO_SLOT
    rows = RequestRows(state.allocator.requests.rows, jnp.where(valid, slots, 0))
    known = rows.num_tokens
    computed = jnp.where(valid & rows.running, state.num_computed[jnp.maximum(slots, 0)], 0)
    new_tokens = jnp.where(valid, jnp.clip(known - computed, 0, plan.max_new_tokens), 0)
    allocator, out = step_ops.allocate_slots(
        allocator_config, state.allocator, slots, computed, new_tokens, defer_rest=defer_rest
    )
    return state._replace(allocator=allocator), out, known


def run_model(
    graphdef: nnx.GraphDef,
    weights_treedef: PyTreeDef,
    allocator_config: AllocatorConfig,
    layout: KVCacheLayout,
    implementation: str | None,
    interpret: bool,
    weights: Sequence[Array],
    state: DeviceState,
    out: StepOutput,
    known: Int[Array, "R"],
    plan: StepPlan,
    *,
    num_tokens: int,
    max_query_len: int,
    greedy_only: bool,
    mesh: Mesh | None = None,
    axis: str | None = None,
) -> tuple[DeviceState, StepResult]:
    """The rest of the step (jit it with `num_tokens` (T), `max_query_len` and `greedy_only` static, `state`
    donated): each group's metadata, the model's forward over the first T tokens of `out` (T bounds the sum of
    `plan.max_new_tokens`, `max_query_len` each of them: 1 for a decode-only step), sampling (`greedy_only`: no
    row has a temperature), the sampled tokens into the allocator and the computed counts into
    `state.num_computed`. `weights` are the leaves of the model's `nnx.State`, `weights_treedef` its structure.

    Nothing in it makes the host wait for the device: no loop or branch depends on device values, so on a GPU
    the call returns once everything is launched. With a `mesh`, attention runs per device over `axis` (`PagedCache`).
    """
    model = nnx.merge(graphdef, jax.tree.unflatten(weights_treedef, weights))
    metadata = tuple(
        metadata_from_step(allocator_config, out, group, max_query_len=max_query_len).replace(
            slot_mapping=out.slot_mappings[group, :num_tokens]
        )
        for group in range(allocator_config.num_groups)
    )
    cache = PagedCache(
        tensors=tuple(state.kv_caches), metadata=metadata, positions=out.positions[:num_tokens],
        layer_group=layout.layer_group, layer_tensor=layout.layer_tensor, implementation=implementation,
        interpret=interpret, mesh=mesh, axis=axis,
    )  # fmt: skip
    last_token = jnp.maximum(out.query_start_loc[1:] - 1, 0)
    logits, cache = model(out.token_ids[:num_tokens], cache, logits_indices=last_token)
    sampled = out.success & (out.seq_lens == known) & (out.num_scheduled_tokens > 0)
    tokens = sample_tokens(
        logits, temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p, seeds=plan.seeds,
        token_index=known - plan.prompt_lens, greedy_only=greedy_only,
    )  # fmt: skip

    allocator = request_ops.append_token_ids(
        allocator_config, state.allocator, plan.slots, tokens[:, None], sampled.astype(jnp.int32)
    )
    num_computed = state.num_computed.at[jnp.where(out.success, plan.slots, allocator_config.max_num_seqs)].set(
        out.seq_lens, mode="drop"
    )
    result = StepResult(
        success=out.success, deferred=out.deferred, seq_lens=out.seq_lens, num_hits=out.num_new_computed_tokens,
        num_scheduled=out.num_scheduled_tokens, sampled=sampled, tokens=tokens, num_free_blocks=allocator.pool.num_free,
    )  # fmt: skip
    return DeviceState(cache.tensors, allocator, num_computed), result

