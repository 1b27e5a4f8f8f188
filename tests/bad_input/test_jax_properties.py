"""Mutated calls of the public entry points: each gives an error that names the mutated argument, or the valid
call's result (for attention, whole tokens may instead be NaN: a value only the device sees, such as a block id
outside a shorter cache, flags its request); after a rejected call the state (allocator) is bit-identical to
before.

A valid call per entry point, and mutations per argument (types, dtypes, ranks, shapes, ranges, numpy scalars);
hypothesis draws (entry point, argument, mutation) triples.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_hybrid_attn import (
    FullAttentionSpec,
    KVCache,
    LayerAttentionParams,
    SlidingWindowSpec,
    layer_attention,
    make_attention_metadata,
    metadata_from_step,
    reference,
    write_kv,
)
from jax_hybrid_attn.allocator import AllocatorConfig, KVCacheManager
from jax_hybrid_attn.testing import random_paged_inputs

ERRORS = (ValueError, TypeError, NotImplementedError)
NUM_SEEDS = 8
"""Each mutation is applied to the valid call of each of these seeds (random values, same shapes)."""
PARAMS = LayerAttentionParams(sliding_window=6)


def array_mutations(x):
    """Mutations of an array argument: (label, value, whether the value is equivalent to `x`)."""
    x = np.asarray(x)
    out = [
        ("dict", {"x": 1}, False),
        ("str", "x", False),
        ("none", None, False),
        ("list", x.tolist(), False),
        ("rank+1", x[None], False),
        ("rank-1", x.reshape(-1)[:1].reshape(()) if x.ndim == 1 else x.reshape(-1), False),
        ("complex", x.astype(np.complex64), False),
        ("bool", x.astype(bool), False),
        ("numpy", x, True),
    ]
    if x.ndim and x.shape[0] > 1:
        out.append(("shorter", x[:-1], False))
    if np.issubdtype(x.dtype, np.integer):
        out += [("int64", x.astype(np.int64), False), ("float", x.astype(np.float32), False),
                ("negative", x - 1000, False), ("huge", x + 2**30, False)]  # fmt: skip
    else:
        with np.errstate(invalid="ignore"):  # NaN-filled caches cast to int
            out += [("int", x.astype(np.int32), False), ("float16", x.astype(np.float16), False)]
    return out


def scalar_mutations(value, *, kind):
    """Mutations of a scalar option: (label, value, equivalent)."""
    out = [("str", "1", False), ("list", [value], False), ("dict", {}, False), ("nan", float("nan"), False)]
    if kind == "int":
        out += [("numpy", np.int64(value), True), ("negative", -value, False), ("zero", 0, False),
                ("float", float(value) + 0.5, False), ("huge", 2**40, False), ("bool", True, False)]  # fmt: skip
    if kind == "bool":
        out += [("numpy", np.bool_(value), True), ("int", int(value), False), ("str-no", "no", False)]
    return out


STEP_CONFIG = AllocatorConfig(
    specs=(SlidingWindowSpec(sliding_window=8, block_size=4, num_kv_heads=1, head_size=4, dtype=jnp.float32),
           FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype=jnp.float32)),
    num_blocks=32, max_num_seqs=3, max_model_len=32, max_num_batched_tokens=8,
)  # fmt: skip


@functools.cache
def step_output():
    """A `StepOutput` of a real step: two requests, a 5-token and a 3-token prompt."""
    manager = KVCacheManager(STEP_CONFIG)
    manager.add_request("a", list(range(5)))
    manager.add_request("b", list(range(10, 13)))
    return manager.schedule([("a", 5), ("b", 3)])


def bases(seed: int) -> dict:
    """The valid call of each entry point for `seed`."""
    x = random_paged_inputs(seed, query_lens=[1, 6], seq_lens=[9, 20], num_q_heads=4, num_kv_heads=2, head_dim=8,
                            block_size=4, dtype=jnp.float32)  # fmt: skip
    cache = x.kv_cache.data  # an "NHD" cache's array alone
    # slots of any block but the null block 0
    slots = jnp.asarray(4 + np.random.default_rng(seed).permutation((cache.shape[0] - 1) * 4)[:5], jnp.int32)
    kv = jax.random.normal(jax.random.key(seed), (2, x.q.shape[0], 2, 8), jnp.float32)
    return {
        "paged_attention": dict(q=x.q, kv_cache=cache, metadata=x.metadata),
        "layer_attention": dict(q=x.q, k=kv[0], v=kv[1], kv_cache=cache, metadata=x.metadata, params=PARAMS),
        "write_kv": dict(kv_cache=cache, k=x.q[:5, :2], v=x.q[:5, 2:], slot_mapping=slots),
        "make_attention_metadata": dict(query_lens=[1, 6], seq_lens=[9 + seed % 4, 20], num_tokens=8, block_size=4,
                                        block_tables=[[1, 2, 3, 0, 0], [4, 5, 6, 7, 8 + seed]]),  # fmt: skip
        "metadata_from_step": dict(config=STEP_CONFIG, out=step_output(), group=seed % 2, max_query_len=8,
                                   causal=True),  # fmt: skip
        "LayerAttentionParams": dict(sm_scale=0.25 + seed, sliding_window=6 + seed, attention_chunk_size=None,
                                     logits_soft_cap=30.0, causal=seed % 2 == 0),  # fmt: skip
    }


BASES = [bases(seed) for seed in range(NUM_SEEDS)]


def attention_cases(base):
    m = base["metadata"]
    cases = []
    for name in ("q", "kv_cache"):
        cases += [(name, label, dict(base, **{name: v}), eq) for label, v, eq in array_mutations(base[name])]
    for field in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        for label, v, eq in array_mutations(getattr(m, field)):
            if label in ("numpy", "list", "dict", "str", "none"):
                continue  # metadata holds arrays; these are covered on the arguments above
            # Device values are read only with checked=True (unchecked, they are the caller's promise)
            cases.append((f"metadata.{field}", label, dict(base, metadata=m.replace(**{field: v}), checked=True), eq))
    for label, v, eq in scalar_mutations(True, kind="bool"):
        cases.append(("checked", label, dict(base, checked=v), eq))
    cache = base["kv_cache"]
    cases += [("params", "dict", dict(base, params={"sliding_window": 6}), False),
              ("kv_cache", "bad layout", dict(base, kv_cache=KVCache(cache, "NDH")), False),
              ("kv_cache", "HND copy", dict(base, kv_cache=KVCache(jnp.swapaxes(cache, 2, 3), "HND")), True),
              ("sinks", "shape", dict(base, sinks=jnp.ones(3)), False),
              ("kv_cache", "scale, not fp8", dict(base, kv_cache=KVCache(cache, k_scale=2.0)), False)]  # fmt: skip
    return cases


def layer_cases(base):
    cases = []
    for name in ("q", "k", "v", "kv_cache"):
        cases += [(name, label, dict(base, **{name: v}), eq) for label, v, eq in array_mutations(base[name])]
    m = base["metadata"]
    for field in ("query_start_loc", "slot_mapping"):  # static checks only: layer_attention runs under jit
        for label, v, eq in array_mutations(getattr(m, field)):
            if label in ("rank+1", "shorter", "float", "int64", "complex", "bool"):
                cases.append((f"metadata.{field}", label, dict(base, metadata=m.replace(**{field: v})), eq))
    cases += [("params", "dict", dict(base, params={"sliding_window": 6}), False),
              ("params", "none", dict(base, params=None), False),
              ("sinks", "shape", dict(base, sinks=jnp.ones(3)), False),
              ("k", "none alone", dict(base, k=None), False),
              ("kv_cache", "bad layout", dict(base, kv_cache=KVCache(base["kv_cache"], "NDH")), False),
              ("implementation", "bad", dict(base, implementation="triton"), False)]  # fmt: skip
    return cases


def step_metadata_cases(base):
    cases = [("config", "dict", dict(base, config={}), False), ("config", "none", dict(base, config=None), False),
             ("out", "dict", dict(base, out={}), False),
             ("out", "no tables", dict(base, out=dataclasses.replace(base["out"], block_tables=None)), False)]  # fmt: skip
    for label, v, eq in scalar_mutations(base["group"] + 1, kind="int"):  # + 1: "negative" is never group 0
        if label == "numpy":
            v = np.int64(base["group"])
        if label != "zero":  # group 0 is valid, with another result
            cases.append(("group", label, dict(base, group=v), eq))
    cases.append(("group", "past the groups", dict(base, group=STEP_CONFIG.num_groups), False))
    for label, v, eq in scalar_mutations(8, kind="int"):
        if label not in ("zero", "huge"):  # 0 is a valid bound (no prefill); huge is valid too
            cases.append(("max_query_len", label, dict(base, max_query_len=v), eq))
    for label, v, eq in scalar_mutations(True, kind="bool"):
        cases.append(("causal", label, dict(base, causal=v), eq))
    return cases


def params_cases(base):
    cases = []
    for name, kind in (("sliding_window", "int"), ("sm_scale", "float"), ("logits_soft_cap", "float"),
                       ("attention_chunk_size", "int"), ("causal", "bool")):  # fmt: skip
        value = base[name] if base[name] is not None else 16
        for label, v, eq in scalar_mutations(value, kind=kind):
            if not (label == "numpy" and base[name] is None):  # a numpy value is no equivalent of None
                cases.append((name, label, dict(base, **{name: v}), eq))
        if kind == "float":
            cases += [(name, "numpy", dict(base, **{name: np.float32(value)}), True),  # exact in float32
                      (name, "inf", dict(base, **{name: float("inf")}), False),
                      (name, "negative", dict(base, **{name: -value}), False), (name, "zero", dict(base, **{name: 0.0}), False),
                      (name, "bool", dict(base, **{name: True}), False)]  # fmt: skip
    return cases


def write_cases(base):
    cases = []
    for name in ("k", "v", "slot_mapping"):
        checked = {"checked": True} if name == "slot_mapping" else {}  # slots are device values
        cases += [(name, label, dict(base, **{name: v}, **checked), eq) for label, v, eq in array_mutations(base[name])]
    for label, v, eq in scalar_mutations(True, kind="bool"):
        cases.append(("checked", label, dict(base, checked=v), eq))
    return cases


def metadata_cases(base):
    cases = []
    for name in ("query_lens", "seq_lens", "block_tables"):
        for label, v, eq in array_mutations(np.asarray(base[name], np.int32)):
            cases.append((name, label, dict(base, **{name: v}), eq or label in ("list", "int64")))
    for label, v, eq in scalar_mutations(4, kind="int"):
        cases.append(("block_size", label, dict(base, block_size=v), eq))
    for label, v, eq in scalar_mutations(8, kind="int"):
        if label != "huge":
            cases.append(("num_tokens", label, dict(base, num_tokens=v), eq))
    return cases


def with_copied_cache(kw):
    """The arguments with a copy of the cache, which `write_kv` and `layer_attention` donate."""
    cache = kw.get("kv_cache")
    if isinstance(cache, KVCache) and isinstance(cache.data, jax.Array):
        return {**kw, "kv_cache": cache.replace(data=jnp.array(cache.data))}
    return {**kw, "kv_cache": jnp.array(cache)} if isinstance(cache, jax.Array) else kw


CALLS = {
    "paged_attention": (lambda kw: reference.paged_attention(**kw, params=PARAMS) if "params" not in kw
                        else reference.paged_attention(**kw)),  # fmt: skip
    "layer_attention": lambda kw: layer_attention(**with_copied_cache(kw)),
    "write_kv": lambda kw: write_kv(**with_copied_cache(kw)),
    "make_attention_metadata": lambda kw: make_attention_metadata(**kw),
    "metadata_from_step": lambda kw: metadata_from_step(**kw),
    "LayerAttentionParams": lambda kw: LayerAttentionParams(**kw),
}
MUTATIONS = {
    "paged_attention": attention_cases,
    "layer_attention": layer_cases,
    "write_kv": write_cases,
    "make_attention_metadata": metadata_cases,
    "metadata_from_step": step_metadata_cases,
    "LayerAttentionParams": params_cases,
}
FLAT = [  # (seed, entry point, case): every mutation of every entry point on every seed's valid call
    (seed, entry, case) for seed in range(NUM_SEEDS) for entry, cases in MUTATIONS.items()
    for case in cases(BASES[seed][entry])
]  # fmt: skip


def leaves(result):
    if isinstance(result, LayerAttentionParams):  # equal parameters must also hash alike (a static argument)
        return [np.asarray(hash(result)), *(np.asarray(x, object) for x in dataclasses.astuple(result))]
    return [np.asarray(x) for x in jax.tree.leaves(result)]


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(index=st.integers(0, len(FLAT) - 1))
def test_a_mutated_call_names_its_argument_or_equals_the_valid_call(index):
    seed, entry, (argument, label, kwargs, equivalent) = FLAT[index]
    call = CALLS[entry]
    try:
        got = call(kwargs)
    except ERRORS as error:
        assert not equivalent, f"{entry}({argument}: {label}) is valid input, refused: {error!r}"
        root = argument.split(".")[0] if argument.startswith("metadata") else argument
        assert root in str(error) or argument in str(error), f"{entry}({argument}: {label}): {error!r}"
        return
    want = call(BASES[seed][entry])
    for a, b in zip(leaves(got), leaves(want), strict=True):
        message = f"{entry}({argument}: {label}) accepted, with another result"
        if a.ndim == 5 and a.shape[0] < b.shape[0]:  # a shorter cache is valid: slots past it are dropped
            b = b[: a.shape[0]]
        assert a.shape == b.shape, message
        if entry in ("paged_attention", "layer_attention") and a.ndim == 3:  # a value only the device sees is
            flagged = np.isnan(a).all(axis=(1, 2))  # flagged: whole tokens of NaN
            assert not np.isnan(a[~flagged]).any(), message
            a, b = a[~flagged], b[~flagged]
        np.testing.assert_array_equal(a, b, err_msg=message)


def manager_snapshot(m):
    return [np.asarray(x).copy() for x in jax.tree.leaves(m.state)], dict(m._slot_of), list(m._free_slots)


MANAGER_CALLS = [
    ("token_ids", lambda m, v: m.add_request("new", v), [[], [1.5], [-1], [2**31], "abc", {"a": 1}, [[1, 2], [3]]]),
    ("cache_salt", lambda m, v: m.add_request("new", [1, 2], cache_salt=v), [1.5, 7, [1], {}]),
    ("adapter_id", lambda m, v: m.add_request("new", [1, 2], adapter_id=v), [-1, 2**31, 1.5, "a", True]),
    ("request_id", lambda m, v: m.add_request(v, [1, 2]), [["list"], {"d": 1}, "kept"]),
    ("token_ids", lambda m, v: m.append_token_ids("kept", v), [[1.5], [-3], [2**31], "x"]),
    ("num_new_tokens", lambda m, v: m.schedule([("kept", v)]), [0, -1, 1.5, "1", 10**6]),
    ("new_tokens", lambda m, v: m.schedule(v), ["kept", [("kept",)], [("kept", 1, 2)], 3]),
    ("num_lookahead_tokens", lambda m, v: m.schedule([("kept", 1)], num_lookahead_tokens=v),
     [[1.5], ["1"], [-1], [1, 1], 2, [np.nan]]),
    ("full_sequence_must_fit", lambda m, v: m.schedule([("kept", 1)], full_sequence_must_fit=v),
     [["yes"], [1], [True, False], True]),
    ("token_ids", lambda m, v: m.add_request("new", v), [[[1, 2], [3, 4]], 5, [True, 2]]),
]
MANAGER_FLAT = [(name, call, value) for name, call, values in MANAGER_CALLS for value in values]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(index=st.integers(0, len(MANAGER_FLAT) - 1))
def test_a_rejected_allocator_call_changes_nothing(index):
    name, call, value = MANAGER_FLAT[index]
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype=jnp.float32)
    m = _MANAGERS.setdefault("m", KVCacheManager(AllocatorConfig(specs=(spec,), num_blocks=16, max_num_seqs=3,
                                                                 max_model_len=32, max_num_batched_tokens=8)))  # fmt: skip
    if "kept" not in m._slot_of:
        m.add_request("kept", [5, 6, 7])
    before = manager_snapshot(m)
    try:
        call(m, value)
    except ERRORS as error:
        assert name in str(error), f"{name}={value!r}: {error!r}"
        after = manager_snapshot(m)
        for a, b in zip(before[0], after[0], strict=True):
            np.testing.assert_array_equal(a, b)
        assert before[1:] == after[1:]
        return
    raise AssertionError(f"{name}={value!r} was accepted")


_MANAGERS: dict = {}
