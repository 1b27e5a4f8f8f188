"""The sampler: greedy rows, temperature, top-k and top-p filters, per-request keys; and SamplingParams' checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_hybrid_attn.engine import NO_TOP_K, SamplingParams, sample_tokens


def draw(logits, *, temperature=1.0, top_k=NO_TOP_K, top_p=1.0, seed=0, token_index=None):
    rows = logits.shape[0]
    full = lambda value, dtype: jnp.full(rows, value, dtype)  # noqa: E731
    return np.asarray(
        sample_tokens(
            jnp.asarray(logits, jnp.float32), temperature=full(temperature, jnp.float32), top_k=full(top_k, jnp.int32),
            top_p=full(top_p, jnp.float32), seeds=full(seed, jnp.uint32),
            token_index=jnp.arange(rows, dtype=jnp.int32) if token_index is None else token_index,
        )
    )  # fmt: skip


PROBS = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
MANY = np.tile(np.log(PROBS), (20_000, 1))


def test_greedy_rows_take_the_argmax():
    logits = np.random.default_rng(0).standard_normal((6, 50))
    np.testing.assert_array_equal(draw(logits, temperature=0.0), logits.argmax(-1))
    np.testing.assert_array_equal(draw(logits, temperature=0.7, top_k=1), logits.argmax(-1))
    np.testing.assert_array_equal(draw(logits, temperature=2.0, top_p=1e-6), logits.argmax(-1))


def test_a_known_greedy_only_gives_the_tokens_the_device_branch_gives():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((8, 40)), jnp.float32)
    mixed = jnp.asarray([0.0, 0.9, 0.0, 1.3, 0.0, 0.5, 0.0, 2.0], jnp.float32)
    rows = dict(top_k=jnp.full(8, 5, jnp.int32), top_p=jnp.full(8, 0.9, jnp.float32),
                seeds=jnp.arange(8, dtype=jnp.uint32), token_index=jnp.arange(8, dtype=jnp.int32))  # fmt: skip
    decided = sample_tokens(logits, temperature=mixed, **rows)
    np.testing.assert_array_equal(sample_tokens(logits, temperature=mixed, greedy_only=False, **rows), decided)
    zeros = jnp.zeros(8, jnp.float32)
    greedy = sample_tokens(logits, temperature=zeros, greedy_only=True, **rows)
    np.testing.assert_array_equal(greedy, sample_tokens(logits, temperature=zeros, **rows))
    np.testing.assert_array_equal(greedy, np.asarray(logits).argmax(-1))
    assert not np.array_equal(decided, greedy), "the drawn rows should differ from the argmax somewhere"
    with pytest.raises(ValueError, match="greedy_only"):
        sample_tokens(logits, temperature=zeros, greedy_only=1, **rows)


@pytest.mark.parametrize(
    "options, expected",
    [
        (dict(), PROBS),
        (dict(temperature=0.5), PROBS**2 / (PROBS**2).sum()),
        (dict(top_k=2), np.r_[PROBS[:2] / PROBS[:2].sum(), 0, 0, 0]),
        (dict(top_p=0.8), np.r_[PROBS[:3] / PROBS[:3].sum(), 0, 0]),  # 0.5 + 0.25 < 0.8: the third is needed
        (dict(top_p=0.75), np.r_[PROBS[:2] / PROBS[:2].sum(), 0, 0, 0]),  # 0.5 + 0.25 reaches 0.75
    ],
)
def test_draws_follow_the_filtered_tempered_distribution(options, expected):
    counts = np.bincount(draw(MANY, **options), minlength=len(PROBS)) / len(MANY)
    np.testing.assert_allclose(counts, expected, atol=0.015)
    assert np.all(counts[expected == 0] == 0)


def test_a_draw_depends_only_on_the_seed_and_the_token_index():
    logits = np.tile(np.log(PROBS), (64, 1))
    index = jnp.arange(64, dtype=jnp.int32)
    first = draw(logits, seed=7, token_index=index)
    np.testing.assert_array_equal(first, draw(logits, seed=7, token_index=index))
    shuffled = np.random.default_rng(1).permutation(64)  # another batch order: the same token per (seed, index)
    np.testing.assert_array_equal(draw(logits[shuffled], seed=7, token_index=index[shuffled]), first[shuffled])
    assert (first != draw(logits, seed=8, token_index=index)).any()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=[1, -3]), "stop_token_ids"),
        (dict(stop_token_ids="ab"), "stop_token_ids"),
        (dict(ignore_eos="no"), "ignore_eos"),
    ],
)
def test_sampling_params_name_what_is_wrong(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_numpy_values_and_vllms_minus_one_are_valid():
    params = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.5), top_k=-1, seed=np.uint32(3))
    assert (params.max_tokens, params.top_k, params.seed) == (4, NO_TOP_K, 3)
    assert SamplingParams(temperature=0).greedy
