"""Sampling parameters of a request, and the sampler: greedy, temperature, top-k, top-p, on the device.

Each request draws its i-th output token with the key ``fold_in(key(seed), i)``: the token depends on the
request's own seed and its index only, never on the batch it ran in, so a preempted and resumed request, or the
same request in another batch, samples the same tokens.

Shape letters: R rows (requests) of the step · V vocabulary.
"""

import dataclasses
import math
import numbers
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..integers import INT32_MAX, check_bool, check_int, is_int

__all__ = ["NO_TOP_K", "SamplingParams", "sample_tokens"]

NO_TOP_K = 0
"""``top_k`` that keeps the whole vocabulary (vLLM's -1 is accepted too and means the same)."""


def _check_float(name: str, value, *, low: float, high: float, low_open: bool) -> float:
    is_number = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    above = is_number and (value > low if low_open else value >= low)
    if not (is_number and math.isfinite(value) and above and value <= high):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ValueError(f"{name}={value!r} must be a number in {bound}")
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request's tokens are chosen, and when it stops (vLLM's names).

    Attributes:
      max_tokens: the most tokens to generate.
      temperature: 0 is greedy (argmax); otherwise logits are divided by it before top-k, top-p and sampling.
      top_k: keep the k most likely tokens (`NO_TOP_K` or -1: all).
      top_p: keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
      seed: this request's random seed (None: the engine derives one from its own seed and the request index).
      stop_token_ids: generation stops after any of these tokens (it is part of the output).
      ignore_eos: do not stop at the model's end-of-sequence tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = NO_TOP_K
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        top_k = NO_TOP_K if is_int(self.top_k) and self.top_k == -1 else self.top_k  # vLLM's -1, an int only
        values = dict(
            max_tokens=check_int("max_tokens", self.max_tokens),
            temperature=_check_float("temperature", self.temperature, low=0.0, high=1e6, low_open=False),
            top_k=check_int("top_k", top_k, minimum=0),
            top_p=_check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True),
            seed=None if self.seed is None else check_int("seed", self.seed, minimum=0, maximum=2**32 - 1),
            ignore_eos=check_bool("ignore_eos", self.ignore_eos),
        )
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes, Mapping)) or not hasattr(stop, "__iter__"):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a sequence of token ids")
        values["stop_token_ids"] = tuple(
            check_int("stop_token_ids", t, minimum=0, maximum=INT32_MAX) for t in self.stop_token_ids
        )
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _filter_top_k_top_p(logits: Float[Array, "R V"], top_k: Int[Array, "R"], top_p: Float[Array, "R"]):
    """Logits outside each row's top-k and top-p sets set to -inf (one descending sort per row)."""
    vocab = logits.shape[-1]
    ordered = -jnp.sort(-logits, axis=-1)  # descending
    k = jnp.where(top_k == NO_TOP_K, vocab, jnp.minimum(top_k, vocab))
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)  # [R, 1]
    ordered = jnp.where(ordered >= kth, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the strictly more likely tokens
    kept = before < top_p[:, None]  # the first token is always kept
    threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= jnp.maximum(threshold, kth), logits, -jnp.inf)


def sample_tokens(
    logits: Float[Array, "R V"],
    *,
    temperature: Float[Array, "R"],
    top_k: Int[Array, "R"],
    top_p: Float[Array, "R"],
    seeds: Int[Array, "R"],
    token_index: Int[Array, "R"],
    greedy_only: bool | None = None,
) -> Int[Array, "R"]:
    """One token per row: argmax where ``temperature == 0``, else a draw from the filtered, tempered softmax
    with the key ``fold_in(key(seeds[r]), token_index[r])``. Traceable.

    `greedy_only` (static): True when the caller knows every row is greedy (only the argmax is computed), False
    when some row may draw. None decides on the device and skips the sort when every row is greedy; on a GPU that
    branch makes the host wait for the logits before the call returns, so a caller that overlaps host work with
    the device passes a known value."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        filtered = _filter_top_k_top_p(scaled, top_k, top_p)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
            seeds.astype(jnp.uint32), token_index
        )
        drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    if greedy_only is None:
        return jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
    return greedy if check_bool("greedy_only", greedy_only) else draw(None)
