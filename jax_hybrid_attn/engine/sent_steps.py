"""The steps an engine has handed to its device worker and not yet read back: each step's rows and the worker's
call, whose packed `StepResult` (one device array; stacked for a call of several decode steps) is read back in one
transfer."""

import dataclasses
from concurrent.futures import Future

import jax

from .device_step import StepResult
from .requests import Request

__all__ = ["SentStep", "StackedResults"]


class StackedResults:
    """The `StepResult`s of a call of several decode steps, packed and stacked on the device: read back once, for
    all."""

    def __init__(self, call: Future, *, num_rows: int):
        self.call, self.num_rows = call, num_rows
        self._host: StepResult | None = None

    def step(self, index: int) -> StepResult:
        if self._host is None:
            self._host = StepResult.unpacked(jax.device_get(self.call.result()), num_rows=self.num_rows)
        return StepResult(*(values[index] for values in self._host))


@dataclasses.dataclass
class SentStep:
    """A step handed to the device worker: its rows (each request with its preemption count when sent), the
    worker's call (its packed `StepResult` of `num_rows` rows on the device; for a step of a call of several, the
    call's `StackedResults` and the step's `index` in it), and when it was handed over."""

    rows: list[tuple[Request, int] | None]
    call: Future | StackedResults
    sent_at: float
    num_rows: int
    index: int | None = None

    def result(self) -> StepResult:
        """The step's results on the host (waits for the device; one transfer)."""
        if self.index is None:
            return StepResult.unpacked(jax.device_get(self.call.result()), num_rows=self.num_rows)
        return self.call.step(self.index)
