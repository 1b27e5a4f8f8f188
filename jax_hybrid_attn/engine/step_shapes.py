"""The engine's step shapes: the few token counts a step is padded to, each compiled once before serving.

A step's forward is compiled per (T tokens, decode-only or not). The engine owns a small, fixed set of them,
chosen from its sizes alone, and compiles every one before it admits a request (`ModelRunner.compile`):

  * decode-only steps (one token per row, ``max_query_len`` 1): one shape of ``max_num_seqs`` tokens rounded up
    to a power of two. A decode step reads every weight once whatever its row count, so padding rows cost a GPU
    almost nothing, and the attention kernels skip them;
  * mixed steps (prompt chunks, with or without decodes): powers of two from `MIN_MIXED_TOKENS` up to the token
    budget (the budget itself last), so a step computes at most twice its tokens;
  * with `EngineConfig.cascade_step`, the decode shape again with cascade attention on its full-attention layers
    (the engine picks it per step).
"""

import dataclasses

from ..integers import check_int, next_power_of_two

__all__ = ["MIN_DECODE_TOKENS", "MIN_MIXED_TOKENS", "StepShape", "select_step_shape", "step_shapes"]

MIN_DECODE_TOKENS = 8
"""The decode shape's fewest tokens."""
MIN_MIXED_TOKENS = 256
"""The smallest mixed shape (or the budget, when smaller): below it a GPU step costs about the same."""


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """One compiled step shape: `num_tokens` (T), `max_query_len` (1: decode-only; else T) and `cascade` (the
    full-attention layers split off the prefix every request shares: `device_step.forward`)."""

    num_tokens: int
    max_query_len: int
    cascade: bool = False

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    def __str__(self) -> str:
        return f"{self.num_tokens}{' decode' if self.decode_only else ''}{' cascade' if self.cascade else ''}"


def step_shapes(*, max_num_seqs: int, max_num_batched_tokens: int, cascade: bool = False) -> tuple[StepShape, ...]:
    """The step shapes of an engine with these sizes: the decode shape first, then the mixed ones, ascending; with
    `cascade`, the decode shape with cascade attention last."""
    check_int("max_num_seqs", max_num_seqs)
    budget = check_int("max_num_batched_tokens", max_num_batched_tokens)
    decode = min(next_power_of_two(max_num_seqs, minimum=MIN_DECODE_TOKENS), budget)
    mixed, tokens = [], min(MIN_MIXED_TOKENS, budget)
    while tokens < budget:
        mixed.append(tokens)
        tokens *= 2
    mixed.append(budget)
    cascade_shapes = (StepShape(decode, 1, cascade=True),) if cascade else ()
    return (StepShape(decode, 1), *(StepShape(t, t) for t in mixed), *cascade_shapes)


def select_step_shape(
    shapes: tuple[StepShape, ...], num_tokens: int, *, decode_only: bool, cascade: bool = False
) -> StepShape:
    """The smallest shape of `shapes` for a step of `num_tokens` tokens (`decode_only`: one token per row; `cascade`:
    the decode shape with cascade attention)."""
    for shape in sorted(shapes):
        if shape.decode_only == decode_only and shape.cascade == cascade and shape.num_tokens >= num_tokens:
            return shape
    raise ValueError(f"no step shape holds {num_tokens=} ({decode_only=}, {cascade=}); the shapes: "
                     f"{', '.join(map(str, shapes))}")  # fmt: skip
