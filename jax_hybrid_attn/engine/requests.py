"""One request's life on the host: its tokens, its state, its outputs and its timings."""

import collections
import dataclasses
import enum
import time
from collections.abc import Hashable

from .sampling import SamplingParams

__all__ = ["FinishReason", "InFlightWork", "Request", "RequestOutput"]


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # max_tokens, or the model's max_model_len
    ABORT = "abort"  # `Engine.abort_request`


@dataclasses.dataclass
class InFlightWork:
    """What one step sent to the device for a request, until the host reads the step back.

    Attributes:
      num_tokens: the tokens it computes if it gets its blocks (0 once the request is preempted: they are freed).
      samples: whether it then draws a token.
      expected_hits: the prompt tokens the prefix cache is expected to supply before them (a new request's).
    """

    num_tokens: int
    samples: bool
    expected_hits: int = 0


@dataclasses.dataclass(eq=False)
class Request:
    """A request the engine holds: waiting (not yet admitted, or preempted) or running.

    Attributes:
      request_id: the caller's id.
      index: arrival order (FCFS priority; the newest running request is preempted first).
      prompt_token_ids, output_token_ids: its tokens.
      sampling: its `SamplingParams`; seed: the resolved seed.
      admitted: it holds a request slot in the allocator (`KVCacheManager.add_request`).
      num_computed_tokens: tokens in the cache (the allocator's count), as of the last step read back.
      in_flight: the work of the steps sent and not yet read back, oldest first.
    """

    request_id: Hashable
    index: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    admitted: bool = False
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    token_times: list[float] = dataclasses.field(default_factory=list)
    in_flight: collections.deque[InFlightWork] = dataclasses.field(default_factory=collections.deque)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def expected_num_computed_tokens(self) -> int:
        """Tokens in the cache once the steps in flight are done, if they go as planned."""
        return self.num_computed_tokens + sum(work.num_tokens + work.expected_hits for work in self.in_flight)

    @property
    def expected_num_outputs(self) -> int:
        """Output tokens once the steps in flight are done, if they go as planned."""
        return len(self.output_token_ids) + sum(work.samples for work in self.in_flight)


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A finished request, or one the engine refused (`error` set, no tokens).

    Attributes:
      request_id, prompt_token_ids, output_token_ids: the request and what it generated.
      finish_reason: why it stopped (None when refused).
      error: why it was refused (None when it ran).
      time_to_first_token: seconds from arrival to its first token.
      inter_token_latencies: seconds between consecutive tokens.
      num_preemptions: how often it was preempted (and recomputed).
      num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: Hashable
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: FinishReason | None
    error: str | None = None
    time_to_first_token: float | None = None
    inter_token_latencies: tuple[float, ...] = ()
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @classmethod
    def of(cls, request: Request) -> "RequestOutput":
        times = request.token_times
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            time_to_first_token=times[0] - request.arrival_time if times else None,
            inter_token_latencies=tuple(b - a for a, b in zip(times, times[1:])),
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens,
        )
