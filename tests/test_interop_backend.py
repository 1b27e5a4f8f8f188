"""The torch backend (`plan`/`run`) against the torch eager reference, on random data with NaN in unused blocks."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jax_hybrid_attn_torch import AttentionLayer, PagedAttentionBackend
from jax_hybrid_attn_torch.dlpack import same_memory

from .torch_reference import paged_attention_torch, write_kv_torch

TOLERANCES = {
    torch.float32: 2e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 2e-2,
}  # jax_hybrid_attn.testing's table
ON_CPU = dict(implementation="reference")
"""These tests are of the bridge, on CPU tensors: the reference path, on a GPU machine too (the kernels take
bf16/fp16 and heads of 64 or more; their test through the backend is the interpret-mode one below)."""
BLOCK_SIZE = 8
QUERY_LENS = (1, 9, 3, 1, 0)  # a decode, a prefill across a block edge, a short extend, a decode, an idle row
SEQ_LENS = (17, 9, 24, 8, 5)  # straddling the block (8) and chunk (8, 16) boundaries


def make_step(
    *, num_groups=1, dtype=torch.float32, num_heads=4, num_kv_heads=2, head_size=16, seed=0, kv_dtype=None,
    kv_layout="NHD", k_scale=None, v_scale=None,
):  # fmt: skip
    """A mixed batch: per KV-cache group a block table over shuffled blocks (0 is the null block, NaN) and the
    slot mapping of the step's tokens; a cache per group holding each request's context, NaN elsewhere."""
    generator = torch.Generator().manual_seed(seed)
    num_reqs = len(SEQ_LENS)
    blocks_per_req = max(math.ceil(s / BLOCK_SIZE) for s in SEQ_LENS) + 1
    num_blocks = 1 + num_reqs * blocks_per_req
    query_lens = torch.tensor(QUERY_LENS)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).to(torch.int32)])
    num_tokens = int(query_start_loc[-1]) + 2  # two padding tokens
    tables, slots, caches = [], [], []
    for _ in range(num_groups):
        ids = 1 + torch.randperm(num_blocks - 1, generator=generator)
        table = torch.zeros(num_reqs, blocks_per_req, dtype=torch.int32)
        slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)  # vLLM's dtype: converted explicitly
        shape = PagedAttentionBackend.get_kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
        if kv_layout != "NHD":
            shape = (shape[0], 2, num_kv_heads, BLOCK_SIZE, head_size)
        cache = torch.full(shape, float("nan"), dtype=kv_dtype or dtype)
        for r, (q_len, s_len) in enumerate(zip(QUERY_LENS, SEQ_LENS, strict=True)):
            used = math.ceil(s_len / BLOCK_SIZE)
            table[r, :used] = ids[r * blocks_per_req : r * blocks_per_req + used].to(torch.int32)
            positions = torch.arange(s_len)
            row_slots = (
                table[r, positions // BLOCK_SIZE].to(torch.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
            )
            context = s_len - q_len
            kv = torch.randn(2, context, num_kv_heads, head_size, generator=generator).to(dtype)
            write_kv_torch(
                cache,
                kv[0],
                kv[1],
                row_slots[:context],
                kv_layout=kv_layout,
                k_scale=k_scale,
                v_scale=v_scale,
            )
            start = int(query_start_loc[r])
            slot_mapping[start : start + q_len] = row_slots[context:]
        tables.append(table)
        slots.append(slot_mapping)
        caches.append(cache)
    step = {
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
        "block_tables": torch.stack(tables) if num_groups > 1 else tables[0],
        "slot_mapping": torch.stack(slots) if num_groups > 1 else slots[0],
    }
    q = torch.randn(num_tokens, num_heads, head_size, generator=generator).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_size, generator=generator).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_size, generator=generator).to(dtype)
    return step, caches, q, k, v


def expected(layer: AttentionLayer, step, cache, q, k, v, group=0, kv_layout="NHD"):
    """The torch reference: write the step's k/v into a copy of the cache, then attend."""
    cache = cache.clone()
    slots = step["slot_mapping"] if step["slot_mapping"].dim() == 1 else step["slot_mapping"][group]
    tables = step["block_tables"] if step["block_tables"].dim() == 2 else step["block_tables"][group]
    scales = {"k_scale": layer.k_scale, "v_scale": layer.v_scale}
    write_kv_torch(cache, k, v, slots, kv_layout=kv_layout, **scales)
    out = paged_attention_torch(
        q,
        cache,
        step["query_start_loc"],
        step["seq_lens"],
        tables,
        sm_scale=layer.scale,
        sliding_window=layer.sliding_window,
        attention_chunk_size=layer.attention_chunk_size,
        logits_soft_cap=layer.logits_soft_cap,
        sinks=layer.sinks,
        causal=layer.causal,
        kv_layout=kv_layout,
        **scales,
    )
    return out, cache


def assert_close(actual, wanted):
    tolerance = TOLERANCES[wanted.dtype]
    valid = int(torch.tensor(QUERY_LENS).sum())
    torch.testing.assert_close(actual[:valid].float(), wanted[:valid].float(), atol=tolerance, rtol=tolerance)


SINKS = torch.linspace(-1.0, 2.0, 4)
LAYERS = {
    "full": {},
    "window 5": {"sliding_window": 5},
    "window 1": {"sliding_window": 1},
    "chunk 8": {"attention_chunk_size": 8},
    "soft cap 5, scale 0.3": {"logits_soft_cap": 5.0, "scale": 0.3},
    "sinks, window 9": {"sinks": SINKS, "sliding_window": 9},
    "non-causal": {"causal": False},
    "mha": {"num_kv_heads": 4},
    "mqa, chunk 16": {"num_kv_heads": 1, "attention_chunk_size": 16},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(LAYERS))
def test_run_matches_the_torch_reference_and_updates_the_torch_cache(name, dtype):
    options = {"num_heads": 4, "num_kv_heads": 2, "head_size": 16, **LAYERS[name]}
    layer = AttentionLayer(**options)
    step, (cache,), q, k, v = make_step(dtype=dtype, num_kv_heads=options["num_kv_heads"])
    wanted, wanted_cache = expected(layer, step, cache, q, k, v)
    backend = PagedAttentionBackend({"layer": layer}, block_size=BLOCK_SIZE, **ON_CPU)
    backend.plan(**step, causal=layer.causal)
    out = backend.run("layer", q, k, v, cache)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, wanted)
    torch.testing.assert_close(cache, wanted_cache, equal_nan=True, atol=0, rtol=0)  # in place, NaN kept


@pytest.mark.parametrize(
    ("kv_dtype", "kv_layout"),
    [(torch.float8_e4m3fn, "NHD"), (torch.float8_e4m3fn, "HND"), (None, "HND"), (torch.float8_e4m3fn, "HND_VT")],
)
def test_fp8_and_hnd_caches(kv_dtype, kv_layout):
    scales = {"k_scale": 0.5, "v_scale": 2.0} if kv_dtype else {}
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, sliding_window=9, **scales)
    step, (cache,), q, k, v = make_step(
        dtype=torch.bfloat16, kv_dtype=kv_dtype, kv_layout=kv_layout, **scales
    )
    wanted, wanted_cache = expected(layer, step, cache, q, k, v, kv_layout=kv_layout)
    backend = PagedAttentionBackend({"layer": layer}, block_size=BLOCK_SIZE, **ON_CPU, kv_layout=kv_layout)
    backend.plan(**step)
    assert_close(backend.run("layer", q, k, v, cache), wanted)
    torch.testing.assert_close(cache.float(), wanted_cache.float(), equal_nan=True, atol=0, rtol=0)


def test_layers_with_different_windows_share_one_plan_over_two_kv_cache_groups():
    """Gemma-3-like: a full layer in group 0 and window layers in group 1; one plan, no error."""
    layers = {
        "global": AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, kv_cache_group=0),
        "local a": AttentionLayer(
            num_heads=4, num_kv_heads=2, head_size=16, sliding_window=5, kv_cache_group=1
        ),
        "local b": AttentionLayer(
            num_heads=4, num_kv_heads=2, head_size=16, sliding_window=12, kv_cache_group=1
        ),
    }
    step, caches, q, k, v = make_step(num_groups=2)
    backend = PagedAttentionBackend(layers, block_size=BLOCK_SIZE, **ON_CPU)
    assert len(backend.metadata_groups()) == 3
    backend.plan(**step)
    for name, layer in layers.items():
        cache = caches[layer.kv_cache_group]
        wanted, _ = expected(layer, step, cache, q, k, v, group=layer.kv_cache_group)
        assert_close(backend.run(name, q, k, v, cache), wanted)


def test_jax_owned_cache_is_updated_and_exported_for_inspection_only():
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, sliding_window=5)
    step, (cache,), q, k, v = make_step()
    backend = PagedAttentionBackend({"layer": layer}, block_size=BLOCK_SIZE, **ON_CPU, cache_owner="jax")
    backend.allocate_kv_caches(cache.shape[0], dtype=torch.float32)
    view = backend.kv_cache_as_torch("layer")
    view.copy_(cache)  # the test's context, written through the zero-copy view
    with pytest.raises(RuntimeError, match=r"kv_cache_as_torch\('layer'\) is still alive"):
        backend.plan(**step)
        backend.run("layer", q, k, v)
    del view
    out = backend.run("layer", q, k, v)
    wanted, wanted_cache = expected(layer, step, cache, q, k, v)
    assert_close(out, wanted)
    torch.testing.assert_close(
        backend.kv_cache_as_torch("layer"), wanted_cache, equal_nan=True, atol=0, rtol=0
    )


def test_out_argument_flat_shapes_and_a_layer_sharing_another_cache():
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16)
    step, (cache,), q, k, v = make_step()
    wanted, wanted_cache = expected(layer, step, cache, q, k, v)
    backend = PagedAttentionBackend({"writer": layer, "reader": layer}, block_size=BLOCK_SIZE, **ON_CPU)
    backend.plan(**step)
    out = torch.empty(q.shape[0], 4 * 16)
    result = backend.run(
        "writer",
        q.reshape(q.shape[0], -1),
        k.reshape(k.shape[0], -1),
        v.reshape(v.shape[0], -1),
        cache,
        out=out,
    )
    assert result is out
    assert_close(out.reshape(q.shape), wanted)
    shared = backend.run("reader", q, None, None, cache)  # vLLM's kv_sharing: nothing written
    assert_close(shared, wanted)
    torch.testing.assert_close(cache, wanted_cache, equal_nan=True, atol=0, rtol=0)


def test_the_output_shares_memory_with_jax():
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16)
    step, (cache,), q, k, v = make_step()
    backend = PagedAttentionBackend({"layer": layer}, block_size=BLOCK_SIZE, **ON_CPU)
    backend.plan(**step)
    import jax_hybrid_attn_torch.backend as backend_module

    exported = []
    original = backend_module.to_torch

    def recording(array, **kwargs):
        tensor = original(array, **kwargs)
        exported.append(same_memory(tensor, array))
        return tensor

    backend_module.to_torch = recording
    try:
        backend.run("layer", q, k, v, cache)
    finally:
        backend_module.to_torch = original
    assert exported[-1], "the output was copied"


def test_kernels_in_interpret_mode_through_the_backend():
    """The Mosaic GPU kernels (interpret mode) behind the torch API: bf16, window and sinks, block 16."""
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=64, sliding_window=9, sinks=SINKS)
    global BLOCK_SIZE
    saved, BLOCK_SIZE = BLOCK_SIZE, 16
    try:
        step, (cache,), q, k, v = make_step(dtype=torch.bfloat16, head_size=64)
        wanted, _ = expected(layer, step, cache, q, k, v)
        backend = PagedAttentionBackend({"layer": layer}, block_size=16, interpret=True)
        backend.plan(**step)
        assert_close(backend.run("layer", q, k, v, cache), wanted)
    finally:
        BLOCK_SIZE = saved


def test_get_kv_cache_shape_is_vllms():
    assert PagedAttentionBackend.get_kv_cache_shape(10, 16, 8, 128) == (10, 2, 16, 8, 128)
    assert PagedAttentionBackend.get_kv_cache_shape(10, 16, 8, 128, "fp8") == (10, 2, 16, 8, 128)
    with pytest.raises(ValueError, match="cache_dtype_str='int4'"):
        PagedAttentionBackend.get_kv_cache_shape(10, 16, 8, 128, "int4")


def test_bad_input_is_named():
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16)
    step, (cache,), q, k, v = make_step()
    backend = PagedAttentionBackend({"layer": layer}, block_size=BLOCK_SIZE, **ON_CPU)
    with pytest.raises(RuntimeError, match=r"call plan\(...\)"):
        backend.run("layer", q, k, v, cache)
    backend.plan(**step)
    with pytest.raises(ValueError, match="layer='other'"):
        backend.run("other", q, k, v, cache)
    with pytest.raises(ValueError, match=r"q with shape .* is not compact"):
        wide = torch.randn(q.shape[0], 4, 32)
        backend.run("layer", wide[:, :, :16], k, v, cache)
    with pytest.raises(ValueError, match=r"k\.dtype=torch\.float16"):
        backend.run("layer", q, k.half(), v, cache)
    with pytest.raises(ValueError, match=r"kv_cache\.shape=.* must be"):
        backend.run("layer", q, k, v, cache[:, :, :4].contiguous())
    with pytest.raises(ValueError, match="both be given"):
        backend.run("layer", q, k, None, cache)
    with pytest.raises(ValueError, match=r"seq_lens\.dtype=torch\.float32"):
        backend.plan(**{**step, "seq_lens": step["seq_lens"].float()})
    with pytest.raises(ValueError, match=r"slot_mapping holds values in .* outside int32"):
        backend.plan(**{**step, "slot_mapping": step["slot_mapping"] + 2**40})
    with pytest.raises(ValueError, match="num_heads=4 must be a multiple of num_kv_heads=3"):
        AttentionLayer(num_heads=4, num_kv_heads=3, head_size=16)
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, sliding_window=0)
    for name, value in [("k_scale", -1.0), ("k_scale", float("nan")), ("k_scale", "1"), ("v_scale", 0.0),
                        ("v_scale", True), ("v_scale", float("inf"))]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"{name}=.* must be a finite number > 0"):
            AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, **{name: value})
    with pytest.raises(ValueError, match="kv_cache_group=True must be an int >= 0"):
        AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, kv_cache_group=True)
    for sinks, got in [(np.zeros(4, np.float32), "ndarray"), (torch.zeros(4, dtype=torch.int32), "torch.int32"),
                       ([0.0] * 4, "list"), (1.0, "float")]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"sinks must be a float torch.Tensor .*, got .*{got}"):
            AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, sinks=sinks)
    with pytest.raises(ValueError, match="cache_owner='numpy'"):
        PagedAttentionBackend({"layer": layer}, block_size=BLOCK_SIZE, cache_owner="numpy")
    for options, match in [(dict(implementation="gpu"), "implementation='gpu' must be one of"),
                           (dict(implementation="Reference"), "implementation='Reference' must be one of"),
                           (dict(implementation="kernel", interpret="yes"), "interpret='yes' must be a bool")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            PagedAttentionBackend({"layer": layer}, block_size=BLOCK_SIZE, **options)
    backend.run("layer", q, k, v, cache)
    with pytest.raises(ValueError, match="kv_cache is a negated view"):  # its memory is the cache just written
        backend.run("layer", q, k, v, torch._neg_view(cache))
    for out in (torch.empty(4 * 16, q.shape[0]).t(), torch.zeros(q.shape[0], 4, 32)[:, :, :16]):
        with pytest.raises(ValueError, match=r"out with strides .* must be contiguous"):
            backend.run("layer", q, k, v, cache, out=out)
    owner = PagedAttentionBackend({"layer": layer}, block_size=BLOCK_SIZE, cache_owner="jax", **ON_CPU)
    for dtype in ("bf16", torch.float64, torch.int8):
        with pytest.raises(ValueError, match=rf"dtype={dtype!r} must be one of"):
            owner.allocate_kv_caches(4, dtype=dtype)


def test_plan_refuses_int64_values_beyond_int32_and_run_checks_the_out_shape():
    step, caches, q, k, v = make_step()
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16)
    backend = PagedAttentionBackend({"l": layer}, block_size=BLOCK_SIZE, **ON_CPU)
    for field in ("block_tables", "seq_lens", "slot_mapping"):
        bad = dict(step, **{field: step[field].to(torch.int64).clone()})
        bad[field].view(-1)[0] = 2**31 + 5
        with pytest.raises(ValueError, match=field):
            backend.plan(**bad)
    backend.plan(**step)
    with pytest.raises(ValueError, match="out.shape"):
        backend.run("l", q, k, v, caches[0], out=torch.empty(q.shape[0], 16, 4, dtype=q.dtype))


def _unused_slot(step, cache) -> int:
    """A slot of a block that no request's table holds."""
    unused = sorted(set(range(1, cache.shape[0])) - set(step["block_tables"].flatten().tolist()))
    return unused[0] * BLOCK_SIZE + 3


def _set(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


def _shared_block(step, cache):
    """Request 2 writes its positions 21..23 into the block where request 1 writes its position 8."""
    tables = _set(step["block_tables"], (2, 2), step["block_tables"][1, 1])
    slots = _set(step["slot_mapping"], slice(10, 13), tables[1, 1] * BLOCK_SIZE + torch.arange(5, 8))
    return {"block_tables": tables, "slot_mapping": slots}


def _mutation(argument, index, value):
    """The bad arguments: `argument` with `value` (or `value(step, cache)`) at `index`."""

    def bad(step, cache):
        got = value(step, cache) if callable(value) else value
        return {argument: _set(step[argument], index, got)}

    return bad


BAD_METADATA = {  # label -> (the argument named, the bad arguments from the step and its cache)
    "a slot twice": ("slot_mapping", _mutation("slot_mapping", 1, lambda step, _: step["slot_mapping"][0])),
    "a negative slot": ("slot_mapping", _mutation("slot_mapping", 0, -5)),
    "a slot past the cache": (
        "slot_mapping",
        _mutation("slot_mapping", 0, lambda _, cache: cache.shape[0] * BLOCK_SIZE + 3),
    ),
    "decreasing query_start_loc": (
        "query_start_loc",
        _mutation("query_start_loc", 2, lambda step, cache: step["query_start_loc"][1] - 1),
    ),
    "query_start_loc past T": ("query_start_loc", _mutation("query_start_loc", -1, 17)),
    "a slot not its position's": ("slot_mapping", _mutation("slot_mapping", 0, _unused_slot)),
    "a padding token's slot": ("slot_mapping", _mutation("slot_mapping", -1, _unused_slot)),
    "a token without a slot": ("slot_mapping", _mutation("slot_mapping", 0, -1)),
    "a query longer than seq_lens": ("seq_lens", _mutation("seq_lens", 1, 4)),
    "a negative seq_lens": ("seq_lens", _mutation("seq_lens", 4, -1)),
    "a negative block id": ("block_tables", _mutation("block_tables", (0, 3), -3)),
    "a read of the null block": ("block_tables", _mutation("block_tables", (2, 0), 0)),
    "a read of a block written for another request": (  # request 0 writes its position 16 into [0, 2]
        "block_tables",
        _mutation("block_tables", (2, 0), lambda step, cache: step["block_tables"][0, 2]),
    ),
    "a read of a block written at another column": (  # request 2 writes its positions 21..23 into [2, 2]
        "block_tables",
        _mutation("block_tables", (2, 0), lambda step, cache: step["block_tables"][2, 2]),
    ),
    "a block written for two requests": ("block_tables", _shared_block),
}


@pytest.mark.parametrize("label", list(BAD_METADATA))
def test_the_default_plan_refuses_metadata_that_would_give_a_wrong_number_and_keeps_the_previous_plan(label):
    """Each of these gave a wrong number (or NaN) from `run` with no error; now `plan` names the argument."""
    step, (cache,), *_ = make_step()
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16)
    backend = PagedAttentionBackend({"l": layer}, block_size=BLOCK_SIZE, **ON_CPU)
    backend.plan(**step)
    planned = (backend._packed, backend._layout, backend._needed_blocks)
    argument, bad = BAD_METADATA[label]
    with pytest.raises(ValueError, match=argument):
        backend.plan(**dict(step, **bad(step, cache)))
    assert (backend._packed, backend._layout, backend._needed_blocks) == planned  # the previous plan stays


def test_a_table_beyond_the_cache_is_refused_by_run_and_a_group_is_named():
    step, caches, q, k, v = make_step(num_groups=2)
    head = {"num_heads": 4, "num_kv_heads": 2, "head_size": 16}
    layers = {f"l{g}": AttentionLayer(**head, kv_cache_group=g) for g in (0, 1)}
    backend = PagedAttentionBackend(layers, block_size=BLOCK_SIZE, **ON_CPU)
    with pytest.raises(ValueError, match=r"KV-cache group 1's metadata.slot_mapping holds \[-5\]"):
        backend.plan(**dict(step, slot_mapping=_set(step["slot_mapping"], (1, 0), -5)))
    with pytest.raises(ValueError, match=r"slot_mapping\[1, 0\]=171 must be"):
        backend.plan(**dict(step, slot_mapping=_set(step["slot_mapping"], (1, 0), 171)))
    backend.plan(**step)
    with pytest.raises(ValueError, match="kv_cache of 'l1' holds 2"):  # ids and slots against the run's cache
        backend.run("l1", q, k, v, caches[1][:2].clone())


def test_a_windowed_group_may_hold_the_null_block_where_its_layers_do_not_read():
    """Request 2 (positions 21..23 of 24) attends keys from 17 on under a window of 5, from 0 without."""
    step, (cache,), q, k, v = make_step()
    step = dict(step, block_tables=_set(step["block_tables"], (2, 0), 0))  # positions 0..7
    windowed = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, sliding_window=5)
    backend = PagedAttentionBackend({"l": windowed}, block_size=BLOCK_SIZE, **ON_CPU)
    backend.plan(**step)
    wanted, _ = expected(windowed, step, cache, q, k, v)
    assert_close(backend.run("l", q, k, v, cache.clone()), wanted)
    full = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16)
    backend = PagedAttentionBackend({"w": windowed, "f": full}, block_size=BLOCK_SIZE, **ON_CPU)
    with pytest.raises(ValueError, match=r"block_tables\[2, 0\] is the null block"):
        backend.plan(**step)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_layer_refuses_sinks_that_are_not_finite(value):
    """A NaN sink gave finite wrong numbers from `run`; the library's checked mode refuses them too."""
    with pytest.raises(ValueError, match=r"sinks=\[.*\] must be finite"):
        AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, sinks=torch.tensor([0.0, value, 0.0, 0.0]))


def test_checked_false_reads_no_value_and_plans_as_the_checked_plan(monkeypatch):
    """The caller vouches for the values: nothing reads them (no wait on a GPU); valid input plans alike."""
    import jax_hybrid_attn_torch.plan as plan_module

    step, (cache,), q, k, v = make_step()
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16)
    backend = PagedAttentionBackend({"l": layer}, block_size=BLOCK_SIZE, **ON_CPU)
    backend.plan(**step)
    checked = np.asarray(backend._packed)
    monkeypatch.setattr(plan_module, "_host_values", lambda fields: pytest.fail("checked=False read values"))
    backend.plan(**step, max_query_len=9, max_seq_len=24, checked=False)
    np.testing.assert_array_equal(np.asarray(backend._packed), checked)
    assert backend._needed_blocks is None
    wanted, _ = expected(layer, step, cache, q, k, v)
    assert_close(backend.run("l", q, k, v, cache.clone()), wanted)
    backend.plan(**dict(step, **BAD_METADATA["a slot twice"][1](step, cache)), checked=False)


def test_a_device_plan_copies_its_values_to_the_host_in_one_piece():
    """How a checked plan reads CUDA tensors (one copy, one wait), on CPU tensors: values and shapes kept."""
    from jax_hybrid_attn_torch.plan import _copied_to_host

    step, _, _, _, _ = make_step(num_groups=2)
    tables = step["block_tables"][0].expand(3, -1, -1)  # one table for three groups: a view
    fields = [step["query_start_loc"], step["seq_lens"], tables, step["slot_mapping"]]
    for got, field in zip(_copied_to_host(fields), fields, strict=True):
        np.testing.assert_array_equal(got, field.numpy())


FIRST_KEY_PARAMS = [
    {},
    {"sliding_window": 5},
    {"attention_chunk_size": 8},
    {"sliding_window": 12, "attention_chunk_size": 8},
]


@pytest.mark.parametrize("params", FIRST_KEY_PARAMS, ids=str)
def test_the_first_key_a_plan_checks_is_allowed_key_ranges(params):
    from jax_hybrid_attn_torch.plan import _first_keys

    from jax_hybrid_attn import LayerAttentionParams
    from jax_hybrid_attn.masks import allowed_key_range

    params = LayerAttentionParams(**params)
    positions = np.arange(40, dtype=np.int32)
    wanted = np.asarray(allowed_key_range(positions, positions + 1, params=params)[0])
    np.testing.assert_array_equal(_first_keys(positions, params), wanted)


@pytest.fixture
def imported(monkeypatch) -> list:
    """The names of the tensors the backend imports into JAX, in order."""
    import jax_hybrid_attn_torch.backend as backend_module

    names = []
    real_to_jax = backend_module.to_jax

    def counting_to_jax(tensor, **kwargs):
        names.append(kwargs.get("name"))
        return real_to_jax(tensor, **kwargs)

    monkeypatch.setattr(backend_module, "to_jax", counting_to_jax)
    return names


def test_a_cache_xla_updated_in_place_is_not_imported_again(monkeypatch, imported):
    """On a GPU XLA writes a donated torch cache in place; the layer's next run takes the array it returned
    (as here, where aliasing is stated) and imports nothing, until another tensor comes."""
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16)
    step, (cache,), q, k, v = make_step()
    backend = PagedAttentionBackend({"layer": layer}, block_size=BLOCK_SIZE, **ON_CPU)
    backend.plan(**step)
    monkeypatch.setattr(backend, "_aliased", lambda key, tensor, array: True)  # as XLA does on a GPU
    first = backend.run("layer", q, k, v, cache)
    second = backend.run("layer", q, k, v, cache)  # the same k/v into the same slots: the same output
    assert imported.count("kv_cache") == 1
    torch.testing.assert_close(second, first)
    backend.run("layer", q, k, v, cache.clone())
    assert imported.count("kv_cache") == 2, "another tensor is imported"


@pytest.mark.parametrize("flat", [False, True], ids=["heads", "flat"])
def test_q_k_v_split_from_one_projection_output_enter_jax_as_one_tensor(imported, flat):
    """vLLM splits its QKV projection output into column views; they are imported once, as that tensor."""
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, sliding_window=9)
    step, (cache,), q, k, v = make_step()
    num_tokens = q.shape[0]
    qkv = torch.cat([x.reshape(num_tokens, -1) for x in (q, k, v)], dim=1)  # [T, (N + 2K) * H]
    views = qkv.split([4 * 16, 2 * 16, 2 * 16], dim=1)
    if not flat:
        views = [x.view(num_tokens, -1, 16) for x in views]
    wanted, wanted_cache = expected(layer, step, cache, q, k, v)
    backend = PagedAttentionBackend({"layer": layer}, block_size=BLOCK_SIZE, **ON_CPU)
    backend.plan(**step)
    out = backend.run("layer", *views, cache)
    assert [name for name in imported if name in ("q", "k", "v", "qkv")] == ["qkv"]
    assert_close(out.reshape(q.shape), wanted)
    torch.testing.assert_close(cache, wanted_cache, equal_nan=True, atol=0, rtol=0)
    with pytest.raises(ValueError, match="not compact"):  # a column view with k and v elsewhere is still refused
        backend.run("layer", views[0], k.clone(), v.clone(), cache)


def test_steps_of_other_token_and_request_counts_in_one_bucket_compile_once():
    """plan rounds the counts up to powers of two (padding requests empty, padding tokens writing nowhere)."""
    import jax_hybrid_attn_torch.backend as backend_module

    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16)
    step, (cache,), q, k, v = make_step()  # 16 tokens (two of them padding) of 5 requests
    wanted, wanted_cache = expected(layer, step, cache, q, k, v)
    backend = PagedAttentionBackend({"layer": layer}, block_size=BLOCK_SIZE, **ON_CPU)
    backend.plan(**step)
    backend.run("layer", q, k, v, cache.clone())
    compiled = backend_module._layer_step._cache_size()
    other = dict(  # one padding token less, one idle request more: 15 tokens of 6 requests
        query_start_loc=torch.cat([step["query_start_loc"], step["query_start_loc"][-1:]]),
        seq_lens=torch.cat([step["seq_lens"], torch.zeros(1, dtype=step["seq_lens"].dtype)]),
        block_tables=torch.cat([step["block_tables"], torch.zeros_like(step["block_tables"][:1])]),
        slot_mapping=step["slot_mapping"][:-1],
    )
    assert int(step["query_start_loc"][-1]) < 15 and int(step["slot_mapping"][-1]) == -1
    backend.plan(**other)
    out = backend.run("layer", q[:-1], k[:-1], v[:-1], cache)
    assert backend_module._layer_step._cache_size() == compiled, "both steps are 16 tokens of 8 requests"
    assert_close(out, wanted[:-1])
    torch.testing.assert_close(cache, wanted_cache, equal_nan=True, atol=0, rtol=0)


def test_plan_with_a_common_prefix_runs_cascade_attention():
    """Requests 0 and 2 share their first block (request 0's); requests 1 and 3 have queries inside it: the
    split serves them NaN, a checked plan refuses it, and the others equal the torch reference."""
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, sinks=SINKS)
    step, (cache,), q, k, v = make_step()
    tables = step["block_tables"].clone()
    tables[:4, 0] = tables[0, 0]
    step = dict(step, block_tables=tables)
    wanted, _ = expected(layer, step, cache, q, k, v)
    backend = PagedAttentionBackend({"layer": layer}, block_size=BLOCK_SIZE, **ON_CPU)
    with pytest.raises(ValueError, match=r"num_common_prefix_blocks=\[1\] does not split group 0's requests \[1, 3\]"):
        backend.plan(**step, num_common_prefix_blocks=[1], checked=True)
    with pytest.raises(ValueError, match=r"num_common_prefix_blocks=\[1, 1\] must be 1 ints"):
        backend.plan(**step, num_common_prefix_blocks=[1, 1])
    backend.plan(**step, num_common_prefix_blocks=[1], checked=False)  # 1 and 3 write into the prefix
    out = backend.run("layer", q, k, v, cache.clone())
    starts = step["query_start_loc"].tolist()
    for r, served in enumerate([True, False, True, False]):
        rows = out[starts[r] : starts[r + 1]]
        if served:
            torch.testing.assert_close(rows, wanted[starts[r] : starts[r + 1]], atol=2e-5, rtol=2e-5)
        else:
            assert rows.isnan().all()
