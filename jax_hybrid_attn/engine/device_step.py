"""The device half of an engine step, three jitted calls sent back to back: `allocate` (the allocator's step),
`forward` (the model over the paged caches, compiled per step shape: T tokens, decode-only or not), and `sample`
(sampling, the sampled tokens back into the allocator). Only `forward` depends on the step's shape: the other two
compile once per allocator configuration (and `allocate`'s `defer_rest`, `sample`'s `greedy_only`).

`decode_steps` runs several decode steps in one call (a scan of the three): the tokens each samples go into the
allocator's state, whence the next takes its inputs.

Everything a step needs from the steps before it stays on the device: the allocator's state (the known tokens
of each request, their block tables), the KV caches and each request's count of computed tokens. The host sends
only its plan (which requests, at most how many tokens each, their sampling values), so it can send step n+1
before it has read step n: where step n turned out otherwise than the host assumed (a request that got no
blocks), step n+1 computes from what step n really did.

Shape letters: R rows (request slots, ``max_num_seqs``) · T tokens of the step · V vocabulary.
"""

import operator
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from ..allocator import AllocatorConfig, AllocatorState, StepOutput, step_common_prefix_blocks
from ..allocator import requests as request_ops
from ..allocator import step as step_ops
from ..allocator.columns import RequestRows
from ..models.layer_scan import ScannedDecoder
from .kv_layout import KVCacheLayout
from .paged_cache import PagedCache, with_checked_block_tables
from .sampling import sample_tokens

__all__ = ["NO_SLOT", "StepPlan", "StepResult", "allocate", "decode_steps", "forward", "pack_result", "sample"]

NO_SLOT = -1
"""`StepPlan.slots` of a padding row."""


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

    def packed(self) -> np.ndarray:
        """(Host.) The plan as one int32 array [7, R], each field a row (the float and unsigned ones by their
        bits), so that it goes to the device in one transfer: each array sent is a copy and a host callback of
        its own. The device functions take it as it is (`unpacked`)."""
        fields = zip(self, PLAN_DTYPES, strict=True)
        return np.stack([np.asarray(field, dtype).view(np.int32) for field, dtype in fields])

    @classmethod
    def unpacked(cls, plan: "StepPlan | Int[Array, '7 R']") -> "StepPlan":
        """(Traceable.) The plan that `packed` packed (a `StepPlan` is returned as it is)."""
        if isinstance(plan, StepPlan):
            return plan
        return cls(*(jax.lax.bitcast_convert_type(row, dtype) for row, dtype in zip(plan, PLAN_DTYPES, strict=True)))

    @classmethod
    def idle(cls, rows: int) -> "StepPlan":
        """A plan of `rows` padding rows: a step of it computes nothing and changes no state."""
        return cls(slots=np.full(rows, NO_SLOT, np.int32), max_new_tokens=np.zeros(rows, np.int32),
                   prompt_lens=np.zeros(rows, np.int32), temperature=np.zeros(rows, np.float32),
                   top_k=np.zeros(rows, np.int32), top_p=np.ones(rows, np.float32),
                   seeds=np.zeros(rows, np.uint32))  # fmt: skip


PLAN_DTYPES = (np.int32, np.int32, np.int32, np.float32, np.int32, np.float32, np.uint32)
"""`StepPlan`'s fields' dtypes, in order."""


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
      common_prefix_blocks: [G] per KV-cache group, the leading blocks every scheduled row held alike, before
        every query (`step_common_prefix_blocks`): what the engine's cost rule for cascade attention reads.
    """

    success: Bool[Array, "R"]
    deferred: Bool[Array, "R"]
    seq_lens: Int[Array, "R"]
    num_hits: Int[Array, "R"]
    num_scheduled: Int[Array, "R"]
    sampled: Bool[Array, "R"]
    tokens: Int[Array, "R"]
    num_free_blocks: Int[Array, ""]
    common_prefix_blocks: Int[Array, "G"]

    @classmethod
    def unpacked(cls, packed: np.ndarray, *, num_rows: int) -> "StepResult":
        """(Host.) The result that `pack_result` packed into `packed` ([..., 7R + 1 + G], any leading axes: the
        steps of one call), R = `num_rows`; each field keeps the leading axes."""
        packed = np.asarray(packed)
        rows = packed[..., : ROW_FIELDS * num_rows].reshape(*packed.shape[:-1], ROW_FIELDS, num_rows)
        fields = [rows[..., i, :] for i in range(ROW_FIELDS)]
        for i in (0, 1, 5):  # success, deferred, sampled
            fields[i] = fields[i].astype(bool)
        tail = packed[..., ROW_FIELDS * num_rows :]
        return cls(*fields, num_free_blocks=tail[..., 0], common_prefix_blocks=tail[..., 1:])


ROW_FIELDS = 7
"""`StepResult`'s fields of one value per row, the first seven."""


def pack_result(result: StepResult) -> Int[Array, "7R+1+G"]:
    """`result` as one int32 array (the row fields, then the free blocks and each group's common prefix), so that
    the host reads a step back in one transfer (`StepResult.unpacked`): each array read back is a copy, a host
    callback and a wait of its own."""
    rows = jnp.stack([field.astype(jnp.int32) for field in result[:ROW_FIELDS]])
    tail = [result.num_free_blocks.astype(jnp.int32).reshape(1), result.common_prefix_blocks.astype(jnp.int32)]
    return jnp.concatenate([rows.reshape(-1), *tail])


@partial(jax.jit, static_argnames=("allocator_config", "defer_rest"), donate_argnames=("allocator",))
def allocate(
    allocator_config: AllocatorConfig,
    allocator: AllocatorState,
    num_computed: Int[Array, "R"],
    plan: StepPlan | Int[Array, "7 R"],
    *,
    defer_rest: bool = False,
) -> tuple[AllocatorState, StepOutput, Int[Array, "R"]]:
    """A step's allocation on the device (jitted, `allocator` donated; engines with equal allocator
    configurations share its executables): each row's new tokens are the tokens known and not yet in the cache,
    at most `plan.max_new_tokens`. `num_computed` [R] holds the tokens in the cache of the request in each
    allocator slot, read only where the allocator says the request holds blocks. Returns (the allocator's state,
    its `StepOutput` of T = ``max_num_batched_tokens`` tokens, [R] tokens known before the step). `plan` may be
    packed (`StepPlan.packed`), as the host sends it.

    `defer_rest` (`step.allocate_slots` with ``first_chunk_multi_block``): rows the allocator's vectorised path
    does not serve at once are deferred, and the call makes the host wait for nothing. That path serves decodes,
    prefill chunks, new requests that surely miss the prefix cache and rows that free several cached blocks (a
    request's first decode after a prompt longer than a window): in the common step, every row."""
    plan = StepPlan.unpacked(plan)
    slots = plan.slots
    valid = slots != NO_SLOT
    rows = RequestRows(allocator.requests.rows, jnp.where(valid, slots, 0))
    known = rows.num_tokens
    computed = jnp.where(valid & rows.running, num_computed[jnp.maximum(slots, 0)], 0)
    new_tokens = jnp.where(valid, jnp.clip(known - computed, 0, plan.max_new_tokens), 0)
    allocator, out = step_ops.allocate_slots(
        allocator_config, allocator, slots, computed, new_tokens, defer_rest=defer_rest,
        first_chunk_multi_block=defer_rest,
    )
    return allocator, out, known


def forward(
    layout: KVCacheLayout,
    allocator_config: AllocatorConfig,
    implementation: str | None,
    interpret: bool,
    model: ScannedDecoder,
    kv_cache: Array,
    out: StepOutput,
    *,
    num_tokens: int,
    max_query_len: int,
    cascade: bool = False,
    mesh: Mesh | None = None,
    axis: str | None = None,
    queries: tuple[int, int, str] | None = None,
) -> tuple[Array, Float[Array, "R V"]]:
    """The model's forward over the first T = `num_tokens` tokens of `out` (jit it with `num_tokens`,
    `max_query_len` and `cascade` static, `kv_cache` donated): T bounds the step's tokens, `max_query_len` each
    row's (1 for a decode-only step). Each layer writes its K/V into `kv_cache` ([num_tensors, B, 2, S, K, H]) and
    attends (`PagedCache`). With `cascade`, the full-attention layers split off the blocks that every scheduled
    row's table starts with (`step_common_prefix_blocks`) as cascade attention. Returns (the cache, the logits of
    each row's last token, in the LM head's dtype unless the model soft-caps them: `sample` converts them to
    float32 as it reads them).

    Nothing in it makes the host wait for the device: the scans over layers have static trip counts and no
    branch depends on device values. With a `mesh`, attention runs per device over `axis`. `queries`: the
    layers' query heads, head size and dtype, for which the kernels' launches are planned once per step
    (`PagedCache.with_kernel_plans`); None: each layer plans its own."""
    checked = with_checked_block_tables(
        out, num_blocks=kv_cache.shape[1],
        max_keys=max(map(operator.mul, allocator_config.blocks_per_row, allocator_config.block_sizes)),
    )  # fmt: skip
    cache = PagedCache(
        kv=kv_cache, step=checked, positions=out.positions[:num_tokens], layer=None, layer_group=layout.layer_group,
        layer_tensor=layout.layer_tensor, blocks_per_row=allocator_config.blocks_per_row,
        max_query_len=max_query_len, max_seq_len=allocator_config.max_model_len,
        token_budget=allocator_config.max_num_batched_tokens, implementation=implementation,
        interpret=interpret, mesh=mesh, axis=axis, kv_layout=layout.kv_layout,
        common_prefix_blocks=step_common_prefix_blocks(out, allocator_config.block_sizes) if cascade else None,
        block_ids_in_range=True,
    )  # fmt: skip
    if queries is not None:
        num_q_heads, head_dim, q_dtype = queries
        cache = cache.with_kernel_plans(num_q_heads=num_q_heads, head_dim=head_dim, q_dtype=q_dtype)
    last_token = jnp.maximum(out.query_start_loc[1:] - 1, 0)
    logits, cache = model(out.token_ids[:num_tokens], cache, logits_indices=last_token, pack_vectors=mesh is None,
                          float32_logits=False)  # fmt: skip
    if mesh is not None:  # replicated, as `sample` takes them whatever the shape
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
    return cache.kv, logits


@partial(jax.jit, static_argnames=("allocator_config", "greedy_only"), donate_argnames=("allocator", "num_computed"))
def sample(
    allocator_config: AllocatorConfig,
    allocator: AllocatorState,
    num_computed: Int[Array, "R"],
    out: StepOutput,
    known: Int[Array, "R"],
    plan: StepPlan | Int[Array, "7 R"],
    logits: Float[Array, "R V"],
    *,
    greedy_only: bool,
) -> tuple[AllocatorState, Int[Array, "R"], Int[Array, "7R+1+G"]]:
    """Sampling (`greedy_only`: no row has a temperature) of the rows whose sequence now covers every known token,
    the sampled tokens into the allocator and the computed counts into `num_computed` (jitted, the state donated).
    Returns (the allocator's state, the computed counts, the `StepResult` packed: `pack_result`). `plan` may be
    packed (`StepPlan.packed`)."""
    plan = StepPlan.unpacked(plan)
    sampled = out.success & (out.seq_lens == known) & (out.num_scheduled_tokens > 0)
    tokens = sample_tokens(
        logits, temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p, seeds=plan.seeds,
        token_index=known - plan.prompt_lens, greedy_only=greedy_only,
    )  # fmt: skip
    allocator = request_ops.append_token_ids(
        allocator_config, allocator, plan.slots, tokens[:, None], sampled.astype(jnp.int32)
    )
    num_computed = num_computed.at[jnp.where(out.success, plan.slots, allocator_config.max_num_seqs)].set(
        out.seq_lens, mode="drop"
    )
    result = StepResult(
        success=out.success, deferred=out.deferred, seq_lens=out.seq_lens, num_hits=out.num_new_computed_tokens,
        num_scheduled=out.num_scheduled_tokens, sampled=sampled, tokens=tokens, num_free_blocks=allocator.pool.num_free,
        common_prefix_blocks=step_common_prefix_blocks(out, allocator_config.block_sizes),
    )  # fmt: skip
    return allocator, num_computed, pack_result(result)


def decode_steps(
    allocator_config: AllocatorConfig,
    run_forward: Callable,
    allocator: AllocatorState,
    num_computed: Int[Array, "R"],
    model: ScannedDecoder,
    kv_cache: Array,
    plan: StepPlan | Int[Array, "7 R"],
    row_steps: Int[Array, "R"],
    *,
    num_steps: int,
    num_tokens: int,
    greedy_only: bool,
) -> tuple[AllocatorState, Int[Array, "R"], Array, Int[Array, "num_steps 7R+1+G"]]:
    """`num_steps` decode steps in one call (jit it with the keywords static, `allocator`, `num_computed` and
    `kv_cache` donated): each is `allocate` (rows it cannot serve at once deferred: nothing makes the host wait),
    `run_forward` (`forward` with its static configuration bound) at the decode shape of T = `num_tokens`, and
    `sample`; the tokens one step samples are the next one's inputs. `plan` is every step's (one new token per
    row); row r takes part in the first `row_steps[r]` steps only (then computes nothing: a request that would
    reach its length limit). Returns (the allocator's state, the computed counts, the cache, each step's packed
    `StepResult` stacked on a leading axis of `num_steps`). `plan` may be packed (`StepPlan.packed`)."""
    plan = StepPlan.unpacked(plan)

    def one(carry, index):
        allocator, num_computed, kv_cache = carry
        step_plan = plan._replace(max_new_tokens=jnp.where(index < row_steps, plan.max_new_tokens, 0))
        allocator, out, known = allocate(allocator_config, allocator, num_computed, step_plan, defer_rest=True)
        kv_cache, logits = run_forward(model, kv_cache, out, num_tokens=num_tokens, max_query_len=1)
        allocator, num_computed, result = sample(
            allocator_config, allocator, num_computed, out, known, step_plan, logits, greedy_only=greedy_only
        )
        return (allocator, num_computed, kv_cache), result

    (allocator, num_computed, kv_cache), results = jax.lax.scan(
        one, (allocator, num_computed, kv_cache), jnp.arange(num_steps, dtype=jnp.int32)
    )
    return allocator, num_computed, kv_cache, results
