"""Over a thousand mutated calls of the torch backend's `plan` and `run` and of `to_jax`, every one run: each gives
an error that names the mutated argument, or the valid call's result; after a rejected call the backend's plan and
the caller's cache are bit-identical to before. int64 index tensors, flat q/k/v and numpy bounds are valid input
and must give the valid result.

Device values (offsets, lengths, block ids, slots) are mutated with `plan`'s default arguments, which must
refuse them (``checked=False`` makes them the caller's promise).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jax_hybrid_attn_torch import AttentionLayer, PagedAttentionBackend, to_jax

from ..test_interop_backend import make_step

ERRORS = (ValueError, TypeError, NotImplementedError)
LAYER = "layers.0"
SEEDS = tuple(range(8))


def tensor_mutations(x: torch.Tensor, *, values: bool):
    """(label, value, equivalent) mutations of an index tensor; with `values`, also of its values."""
    out = [
        ("numpy", x.numpy(), False),
        ("list", x.tolist(), False),
        ("dict", {"x": 1}, False),
        ("none", None, False),
        ("float", x.float(), False),
        ("int16", x.short(), False),
        ("bool", x.bool(), False),
        ("int64" if x.dtype == torch.int32 else "int32", x.long() if x.dtype == torch.int32 else x.int(), True),
        ("shorter", x[:-1], False),
        ("rank+2", x[None, None], False),
        ("beyond int32", x.long() + 2**40, False),
    ]
    if values:
        out += [("negative", x - 1000, False), ("huge", x + 2**30, False)]
    return out


def case_list(step, cache, q, k, v):
    """Every (entry, argument, label, plan kwargs, run kwargs, equivalent) of one valid step."""
    plan = dict(step)
    run = dict(layer=LAYER, q=q, k=k, v=v, kv_cache=cache)
    cases = []
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        for label, value, eq in tensor_mutations(step[name], values=False):
            cases.append(("plan", name, label, dict(plan, **{name: value}), run, eq))
        for label, value, eq in tensor_mutations(step[name], values=True)[-2:]:
            cases.append(("plan", name, label, dict(plan, **{name: value}), run, eq))
    cases += [("plan", "block_tables", "one group's [G, R, P]", dict(plan, block_tables=step["block_tables"][None]), run, True),
              ("plan", "slot_mapping", "one group's [G, T]", dict(plan, slot_mapping=step["slot_mapping"][None]), run, True)]  # fmt: skip
    qsl, slots = step["query_start_loc"], step["slot_mapping"]
    real = (slots >= 0).nonzero().flatten()
    past_the_cache = torch.tensor(cache.shape[0] * cache.shape[2] + 3)
    values = [  # (argument, label, tensor): device values that only the (default) checked plan reads
        ("query_start_loc", "not from 0", qsl + 1),
        ("query_start_loc", "decreasing", torch.cat([qsl[:2], qsl[1:2] - 1, qsl[3:]])),
        ("seq_lens", "below the query", step["seq_lens"].clamp(max=2)),
        ("seq_lens", "beyond the table", step["seq_lens"] + 10**4),
        ("slot_mapping", "a slot twice", slots.clone().index_put_((real[1:2],), slots[real[:1]])),
        ("slot_mapping", "below the pad", slots.clone().index_put_((real[:1],), torch.tensor(-5))),
        ("slot_mapping", "past the cache", slots.clone().index_put_((real[:1],), past_the_cache)),
    ]
    cases += [("plan", name, label, dict(plan, **{name: value}), run, False) for name, label, value in values]
    for name, value in (("max_query_len", 9), ("max_seq_len", 24)):
        for label, mutated, eq in [("numpy", np.int64(value), True), ("python", value, True), ("negative", -1, False),
                                   ("float", value + 0.5, False), ("str", str(value), False), ("bool", True, False),
                                   ("below the actual", 1, False)]:  # fmt: skip
            cases.append(("plan", name, label, dict(plan, **{name: mutated}), run, eq))
    for name in ("causal", "checked"):
        for label, mutated, eq in [("numpy", np.bool_(name == "causal"), True), ("str", "no", False), ("int", 1, False)]:
            cases.append(("plan", name, label, dict(plan, **{name: mutated}), run, eq))

    cases.append(("run", "layer", "unknown", plan, dict(run, layer="layers.9"), False))
    for name, x in (("q", q), ("k", k), ("v", v)):
        for label, value, eq in [("numpy", x.numpy(), False), ("none", None, False), ("dict", {}, False),
                                 ("float16", x.half(), False), ("int32", x.int(), False), ("rank+1", x[None], False),
                                 ("shorter", x[:-1], False), ("flat", x.reshape(x.shape[0], -1), True),
                                 ("other heads", x.reshape(x.shape[0], -1, 8), False)]:  # fmt: skip
            if name == "q" or label != "none":  # k=v=None is a layer sharing another's cache, valid by itself
                cases.append(("run", name, label, plan, dict(run, **{name: value}), eq))
        for label, value in [("requires grad", x.clone().requires_grad_()), ("negated view", torch._neg_view(x))]:
            cases.append(("run", name, label, plan, dict(run, **{name: value}), False))
    for label, value in [("numpy", cache.numpy()), ("float16", cache.half()), ("none", None), ("rank-1", cache[0]),
                         ("fewer heads", cache[:, :, :, :1]),
                         ("requires grad", cache.clone().requires_grad_())]:  # fmt: skip  (call_run clones the cache)
        cases.append(("run", "kv_cache", label, plan, dict(run, kv_cache=value), False))
    cases.append(("run", "kv_cache", "too few blocks", plan, dict(run, kv_cache=cache[:2]), False))
    out = torch.empty_like(q)
    for label, value, eq in [("given", out, True), ("flat", out.reshape(out.shape[0], -1), True),
                             ("float16", out.half(), False), ("shorter", out[:-1], False),
                             ("other heads", out.reshape(out.shape[0], -1, 8), False),
                             ("transposed", out.reshape(out.shape[0], -1).t().contiguous().t(), False),
                             ("requires grad", out.clone().requires_grad_(), False)]:  # fmt: skip
        cases.append(("run", "out", label, plan, dict(run, out=value), eq))
    for label, value, eq in [("given", q, True), ("requires grad", q.clone().requires_grad_(), False),
                             ("negated view", torch._neg_view(q), False), ("slice", q[:, :2], False),
                             ("numpy", q.numpy(), False), ("sparse", q.to_sparse(), False),
                             ("meta", torch.empty_like(q, device="meta"), False)]:  # fmt: skip
        cases.append(("to_jax", "tensor", label, plan, dict(tensor=value), eq))
    return cases


def check_mutated_to_jax(seed, label, tensor, equivalent):
    """`to_jax` of a mutated q: the valid q's values, shared, or an error naming the tensor."""
    want = valid_step(seed)[2]
    try:
        got = to_jax(tensor, name="q")
    except ERRORS as error:
        assert not equivalent, f"to_jax({label}) is valid input, refused: {error!r}"
        assert str(error).startswith("q"), f"to_jax({label}): {error!r}"
        return
    assert equivalent, f"to_jax({label}) accepted"
    np.testing.assert_array_equal(np.asarray(got), want.numpy())


def make_backend():
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, sliding_window=12)
    return PagedAttentionBackend({LAYER: layer}, block_size=8, implementation="reference")  # CPU tensors


def valid_step(seed):
    step, caches, q, k, v = make_step(seed=seed)
    return step, caches[0], q, k, v


FLAT = [(seed, case) for seed in SEEDS for case in case_list(*valid_step(seed))]
_BACKENDS: dict = {}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for a NaN-safe bit-identity test."""
    return tensor.detach().contiguous().view(torch.uint8).clone()


def call_run(backend, run):
    """`run` on a copy of the run's cache and out; returns (output, the cache passed, its bytes before)."""
    cache, out = (x.clone() if isinstance(x, torch.Tensor) else x for x in (run["kv_cache"], run.get("out")))
    before = bits(cache) if isinstance(cache, torch.Tensor) else None
    options = {"out": out} if "out" in run else {}
    try:
        return backend.run(run["layer"], run["q"], run["k"], run["v"], cache, **options), cache, before
    except ERRORS as error:
        error.cache_before = (cache, before)
        raise


def test_over_a_thousand_mutated_calls_of_plan_run_and_to_jax():
    assert len(FLAT) >= 1000, len(FLAT)
    for index in range(len(FLAT)):
        check_mutated_call(index)


def check_mutated_call(index):
    seed, (entry, argument, label, plan, run, equivalent) = FLAT[index]
    if entry == "to_jax":
        check_mutated_to_jax(seed, label, run["tensor"], equivalent)
        return
    step, cache, q, k, v = valid_step(seed)
    valid_run = dict(layer=LAYER, q=q, k=k, v=v, kv_cache=cache)
    backend = _BACKENDS.setdefault(seed, make_backend())
    backend.plan(**step)
    want_out, want_cache, _ = call_run(backend, valid_run)
    planned = (backend._packed, backend._layout, backend._needed_blocks)
    where = f"{entry}({argument}: {label})"
    try:
        backend.plan(**plan)
        got_out, got_cache, before = call_run(backend, valid_run if entry == "plan" else run)
    except ERRORS as error:
        assert not equivalent, f"{where} is valid input, refused: {error!r}"
        assert argument in str(error), f"{where}: {error!r}"
        if hasattr(error, "cache_before"):  # run refused: the cache it was given is untouched
            case_cache, before = error.cache_before
            assert before is None or torch.equal(bits(case_cache), before), f"{where} changed the cache"
        else:  # plan refused: the previous plan stays in place
            assert all(a is b for a, b in zip(planned, (backend._packed, backend._layout, backend._needed_blocks))), where
        return
    where += " accepted, with another result"
    assert torch.equal(bits(got_out.reshape(want_out.shape)), bits(want_out)), where
    assert torch.equal(bits(got_cache), bits(want_cache)), where
