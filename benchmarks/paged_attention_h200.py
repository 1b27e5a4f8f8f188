"""Paged attention kernels on the H200: parity against the reference for every feature, then timings.

Run from the repository root:  PYTHONPATH=. python benchmarks/paged_attention_h200.py
(``--sections parity,decode,engine-decode,prefill`` picks parts; ``--sweep`` also times the configurations behind the
kernel defaults). Prints one line per parity case and per timed case, and a summary table last, and writes the rows
as JSON by section (``--json PATH``, default: benchmarks/paged_attention_h200.json). Timing: CUPTI kernel time
(Mosaic GPU profiler, every kernel of the jitted call), median of 30 runs, compile excluded. Decode is
reported in GB/s of the KV blocks a query can see, against the H200's copy ceiling (`COPY_CEILING_GBPS`); prefill
in TFLOP/s of the visible (query, key) pairs. Peers run side by side in the same process.
"""

import argparse
import re
import statistics
import time
import traceback
import warnings
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from jax_hybrid_attn import CAUSAL, KVCache, LayerAttentionParams, make_attention_metadata, paged_attention, reference
from jax_hybrid_attn.kernels.config import KernelConfig
from jax_hybrid_attn.layout import as_kv_cache
from jax_hybrid_attn.masks import allowed_key_range
from jax_hybrid_attn.testing import TOLERANCES, random_paged_inputs
from kernel_variants import configs_changed, parse_variant
from results_json import write_sections

COPY_CEILING_GBPS = 4280.0
MIXED = ([1, 1, 3, 300, 17], [1, 2049, 513, 1000, 17])  # decodes, a verification query, prefills with context
DECODES = ([1, 1, 1, 1, 1], [3, 99, 1000, 4096, 40])
PARITY_CASES = [  # (name, random_paged_inputs kwargs, attention options)
    ("gqa4 full bs16 d128", dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16), {}),
    ("mha d64 bs32 window 100 sm_scale 0.2", dict(num_q_heads=8, num_kv_heads=8, head_dim=64, block_size=32), dict(params=LayerAttentionParams(sliding_window=100, sm_scale=0.2))),
    ("mqa d256 bs64 chunk 256", dict(num_q_heads=8, num_kv_heads=1, head_dim=256, block_size=64), dict(params=LayerAttentionParams(attention_chunk_size=256))),
    ("gqa4 softcap+sinks w1", dict(num_q_heads=16, num_kv_heads=4, head_dim=128, block_size=16, with_sinks=True), dict(params=LayerAttentionParams(sliding_window=1, logits_soft_cap=30.0))),
    ("gqa2 HND window 1000 d256", dict(num_q_heads=16, num_kv_heads=8, head_dim=256, block_size=16, kv_layout="HND"), dict(params=LayerAttentionParams(sliding_window=1000))),
    ("fp16 gqa8 chunk 64 bs64", dict(num_q_heads=64, num_kv_heads=8, head_dim=128, block_size=64, dtype=jnp.float16), dict(params=LayerAttentionParams(attention_chunk_size=64))),
    ("non-causal gqa4 HND bs32", dict(num_q_heads=32, num_kv_heads=8, head_dim=64, block_size=32, causal=False, kv_layout="HND"), dict(params=LayerAttentionParams(causal=False))),
    ("gqa4 sinks chunk 128 softcap", dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=32, with_sinks=True), dict(params=LayerAttentionParams(attention_chunk_size=128, logits_soft_cap=50.0))),
    ("fp8 kv gqa4 bs16 d128 window 512", dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, kv_dtype=jnp.float8_e4m3fn), dict(params=LayerAttentionParams(sliding_window=512))),
    ("fp8 kv HND mqa d256 bs32 chunk 128 sinks", dict(num_q_heads=8, num_kv_heads=1, head_dim=256, block_size=32, kv_dtype=jnp.float8_e4m3fn, kv_layout="HND", with_sinks=True), dict(params=LayerAttentionParams(attention_chunk_size=128, logits_soft_cap=30.0))),
    ("fp8 kv fp16 q d64 bs64 non-causal", dict(num_q_heads=16, num_kv_heads=2, head_dim=64, block_size=64, kv_dtype=jnp.float8_e4m3fn, dtype=jnp.float16, causal=False), dict(params=LayerAttentionParams(causal=False))),
    ("K/V pair gqa4 d256 bs16 window 512", dict(num_q_heads=4, num_kv_heads=1, head_dim=256, block_size=16, kv_pair=True), dict(params=LayerAttentionParams(sliding_window=512))),
    ("K/V pair HND fp8 gqa8 d128 bs32 sinks", dict(num_q_heads=64, num_kv_heads=8, head_dim=128, block_size=32, kv_pair=True, kv_layout="HND", kv_dtype=jnp.float8_e4m3fn, with_sinks=True), {}),
    ("K/V pair gqa2 d64 bs256 softcap", dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=256, kv_pair=True), dict(params=LayerAttentionParams(logits_soft_cap=50.0))),
    ("fp8 kv HND_VT gqa4 bs64 d128 window 512", dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=64, kv_dtype=jnp.float8_e4m3fn, kv_layout="HND_VT"), dict(params=LayerAttentionParams(sliding_window=512))),
    ("fp8 kv HND_VT mqa d256 bs128 chunk 256 sinks", dict(num_q_heads=8, num_kv_heads=1, head_dim=256, block_size=128, kv_dtype=jnp.float8_e4m3fn, kv_layout="HND_VT", with_sinks=True), dict(params=LayerAttentionParams(attention_chunk_size=256, logits_soft_cap=30.0))),
    ("K/V pair fp8 HND_VT fp16 q d64 bs256 non-causal", dict(num_q_heads=16, num_kv_heads=2, head_dim=64, block_size=256, kv_pair=True, kv_layout="HND_VT", kv_dtype=jnp.float8_e4m3fn, dtype=jnp.float16, causal=False), dict(params=LayerAttentionParams(causal=False))),
]  # fmt: skip


def check(inputs_kwargs, options, query_lens, seq_lens):
    inputs = random_paged_inputs(0, query_lens=query_lens, seq_lens=seq_lens, **{"dtype": jnp.bfloat16, **inputs_kwargs})
    options = dict(options, sinks=inputs.sinks)
    out = paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, **options)
    ref = reference.paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, **options)
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    ok = bool(np.isfinite(out).all()) and np.allclose(out, ref, **TOLERANCES[jnp.dtype(inputs.q.dtype)])
    return ok, float(np.abs(out - ref).max())


def device_batch(seed, *, num_reqs, query_len, seq_len, **shape):
    """A large batch of `num_reqs` requests alike (`varied_batch`)."""
    return varied_batch(seed, [seq_len] * num_reqs, query_len=query_len, **shape)


def kernel_ms(fn, *args, repeats=30):
    jax.block_until_ready(fn(*args))
    return statistics.median(profiler.measure(fn)(*args)[1] for _ in range(repeats))


def kernel_breakdown(fn, *args, repeats=10) -> list[tuple[str, float]]:
    """Each kernel of one call of `fn` (in launch order): its name and median CUPTI time in ms."""
    jax.block_until_ready(fn(*args))
    runs = [profiler.measure(fn, aggregate=False)(*args)[1] for _ in range(repeats)]
    return [(name, statistics.median(run[i][1] for run in runs)) for i, (name, _) in enumerate(runs[0])]


def breakdown_text(kernels, rate) -> str:
    """The Mosaic GPU kernels with `rate(ms)` of their total (the attention kernels' own rate), then the other
    kernels: how many, their total and the largest by time."""
    mosaic = [ms for name, ms in kernels if "mosaic" in name]
    rest = sorted(((ms, name) for name, ms in kernels if "mosaic" not in name), reverse=True)
    parts = [f"Mosaic GPU kernels {' + '.join(f'{ms:.3f}' for ms in mosaic)} ms ({rate(sum(mosaic))})"]
    parts.append(f"{len(rest)} other kernels {sum(ms for ms, _ in rest):.3f} ms: " + ", ".join(f"{name[:40]} {ms:.3f}" for ms, name in rest[:4]))
    return "; ".join(parts)


def visible_keys(query_len, seq_len, params=CAUSAL):
    """Per query of one request: number of keys it attends to, and the blocks' worth of keys loaded."""
    q_pos = np.arange(seq_len - query_len, seq_len)
    first, last = allowed_key_range(q_pos, seq_len, params=params)
    return np.asarray(last) - np.asarray(first) + 1, np.asarray(first)


def record(rows, *fields):
    """Print one result line now (a long run reports as it goes) and keep it for the summary."""
    print(" | ".join(fields), flush=True)
    rows.append(("time", *fields))


def varied_batch(seed, seq_lens, *, query_len=1, num_q_heads, num_kv_heads, head_dim, block_size,
                 dtype=jnp.bfloat16):  # fmt: skip
    """A large batch generated on the device: `query_len` new tokens per request of `seq_lens` keys; blocks
    scattered by a random permutation, the rest of each block table the null block 0."""
    blocks = [-(-int(n) // block_size) for n in seq_lens]
    key_cache, key_q = jax.random.split(jax.random.key(seed))
    kv_cache = jax.random.normal(key_cache, (sum(blocks) + 1, 2, block_size, num_kv_heads, head_dim), dtype)
    pages = iter(1 + np.random.default_rng(seed).permutation(sum(blocks)))
    tables = np.zeros((len(seq_lens), max(blocks)), np.int32)
    for row, count in enumerate(blocks):
        tables[row, :count] = [next(pages) for _ in range(count)]
    metadata = make_attention_metadata([query_len] * len(seq_lens), list(map(int, seq_lens)), tables,
                                       block_size=block_size)  # fmt: skip
    q = jax.random.normal(key_q, (len(seq_lens) * query_len, num_q_heads, head_dim), dtype)
    return q, kv_cache, metadata


def time_decode(rows, name, q, kv_cache, metadata, options, full_ms, *, breakdown=False):
    """One decode timing line: GB/s of the K and V blocks a query can see, and with `breakdown` a line of the
    call's kernels; returns the time."""
    cache = as_kv_cache(kv_cache)
    _, block_size, num_kv_heads, head_dim = cache.dims
    keys = 0
    for seq_len in np.asarray(metadata.seq_lens)[: q.shape[0]].tolist():
        _, first = visible_keys(1, seq_len, options.get("params", CAUSAL))
        keys += seq_len - int(first[0]) // block_size * block_size
    needed = keys * num_kv_heads * head_dim * 2 * cache.dtype.itemsize
    fn = jax.jit(partial(paged_attention, **options))
    try:
        expected = reference.paged_attention(q, kv_cache, metadata, **options).astype(jnp.float32)
        error = float(jnp.abs(fn(q, kv_cache, metadata).astype(jnp.float32) - expected).max())
        ms = kernel_ms(fn, q, kv_cache, metadata)
    except Exception as exc:
        record(rows, name, f"ERROR {type(exc).__name__}: {str(exc)[:200]}")
        return full_ms
    gbps = needed / ms / 1e6
    speedup = f"{full_ms / ms:.1f}x vs full" if full_ms else ""
    record(rows, name, f"{ms:.3f} ms", f"{gbps:.0f} GB/s ({100 * gbps / COPY_CEILING_GBPS:.0f}%)", speedup, f"err {error:.3g}")
    if breakdown:
        rate = lambda ms: f"{needed / ms / 1e6:.0f} GB/s"  # noqa: E731
        record(rows, f"  {name}: per kernel", breakdown_text(kernel_breakdown(fn, q, kv_cache, metadata), rate))
    return full_ms or ms


def time_prefill(rows, q, kv_cache, metadata, name, params, *, num_reqs, seq_len, breakdown=False):
    """One prefill timing line: TFLOP/s of the visible (query, key) pairs, and with `breakdown` a line of the
    call's kernels (the attention kernels' own rate beside the packing and merging around them); returns the
    flop count."""
    counts, _ = visible_keys(seq_len, seq_len, params)
    flops = 4 * num_reqs * 32 * 128 * int(counts.sum())
    fn = jax.jit(partial(paged_attention, params=params))
    first = metadata.replace(query_start_loc=metadata.query_start_loc[:2], seq_lens=metadata.seq_lens[:1],
                             block_tables=metadata.block_tables[:1], slot_mapping=metadata.slot_mapping[:seq_len],
                             num_actual_tokens=jnp.asarray(seq_len, jnp.int32))  # fmt: skip
    try:
        expected = reference.paged_attention(q[:seq_len], kv_cache, first, params=params).astype(jnp.float32)
        error = float(jnp.abs(fn(q, kv_cache, metadata)[:seq_len].astype(jnp.float32) - expected).max())
        ms = kernel_ms(fn, q, kv_cache, metadata, repeats=10)
    except Exception as exc:
        record(rows, name, f"ERROR {type(exc).__name__}: {str(exc)[:200]}")
        return flops
    record(rows, name, f"{ms:.3f} ms", f"{flops / ms / 1e9:.0f} TFLOP/s", f"err(request 0) {error:.3g}")
    if breakdown:
        rate = lambda ms: f"{flops / ms / 1e9:.0f} TFLOP/s"  # noqa: E731
        record(rows, f"  {name}: per kernel", breakdown_text(kernel_breakdown(fn, q, kv_cache, metadata), rate))
    return flops


SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
MASKS = [("full", CAUSAL), ("window 1024", LayerAttentionParams(sliding_window=1024)),
         ("chunk 1024", LayerAttentionParams(attention_chunk_size=1024))]


def parity_section(rows, *, match: str = "", variant: str = ""):
    """Every parity case (those whose name holds `match`) on both batches, then the mixed batch against its parts;
    with `variant` (``"p_parts=1"``: `KernelConfig` fields), every kernel in that configuration."""
    with configs_changed(decode=parse_variant(variant), prefill=parse_variant(variant)) if variant else nullcontext():
        _parity_cases(rows, match=match, label=f" ({variant})" if variant else "")


def _parity_cases(rows, *, match: str, label: str):
    for name, inputs_kwargs, options in (case for case in PARITY_CASES if match in case[0]):
        name += label
        for batch_name, (query_lens, seq_lens) in [("mixed", MIXED), ("decodes", DECODES)]:
            start = time.time()
            try:
                ok, error = check(inputs_kwargs, options, query_lens, seq_lens)
                status = "PASS" if ok else "FAIL"
            except Exception as exc:  # keep going: one run reports every case
                ok, error, status = False, float("nan"), f"ERROR {type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc(limit=2)
            print(f"parity {name:30s} {batch_name:8s}: {status} max|err|={error:.3g} ({time.time() - start:.1f}s)", flush=True)
            rows.append(("parity", name, batch_name, status, f"{error:.3g}"))

    # Mixed batch == its parts, on the device.
    inputs = random_paged_inputs(1, query_lens=MIXED[0], seq_lens=MIXED[1], num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    window = LayerAttentionParams(sliding_window=256)
    whole = paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, params=window)
    starts = np.asarray(inputs.metadata.query_start_loc)
    worst = 0.0
    for r, query_len in enumerate(MIXED[0]):
        part = inputs.metadata.replace(
            query_start_loc=jnp.asarray([0, query_len], jnp.int32), seq_lens=inputs.metadata.seq_lens[r : r + 1],
            block_tables=inputs.metadata.block_tables[r : r + 1], slot_mapping=inputs.metadata.slot_mapping[starts[r] : starts[r + 1]],
            num_actual_tokens=jnp.asarray(query_len, jnp.int32), max_query_len=query_len)  # fmt: skip
        alone = paged_attention(inputs.q[starts[r] : starts[r + 1]], inputs.kv_cache, part, params=window)
        worst = max(worst, float(jnp.abs(whole[starts[r] : starts[r + 1]].astype(jnp.float32) - alone.astype(jnp.float32)).max()))
    print(f"mixed batch vs its parts: max|diff|={worst:.3g}", flush=True)
    rows.append(("parity", f"mixed batch == parts (window 256){label}", "", "PASS" if worst <= 2e-2 else "FAIL",
                 f"{worst:.3g}"))  # fmt: skip


def decode_section(rows, *, sweep):
    q, kv_cache, metadata = device_batch(1, num_reqs=64, query_len=1, seq_len=2048, **SHAPE)  # short: launch-bound
    time_decode(rows, "decode B=64 ctx=2048 full", q, kv_cache, metadata, {}, None, breakdown=True)
    if sweep:
        with configs_changed(decode=dict(direct_io=False)):  # q packed into tiles, the output gathered per token
            time_decode(rows, "sweep decode B=64 ctx=2048 full direct_io=False", q, kv_cache, metadata, {}, None,
                        breakdown=True)  # fmt: skip
    for seq_len in [8192, 32768]:
        q, kv_cache, metadata = device_batch(1, num_reqs=64, query_len=1, seq_len=seq_len, **SHAPE)
        full_ms = None
        for label, params in MASKS:
            full_ms = time_decode(rows, f"decode B=64 ctx={seq_len} {label}", q, kv_cache, metadata, dict(params=params), full_ms,
                                  breakdown=seq_len == 32768 and label != "full")  # fmt: skip
        fp8_cache = KVCache((kv_cache * 0.5).astype(jnp.float8_e4m3fn), k_scale=jnp.float32(2), v_scale=jnp.float32(2))
        time_decode(rows, f"decode B=64 ctx={seq_len} full, fp8 KV", q, fp8_cache, metadata, {}, None)
        time_decode(rows, f"decode B=64 ctx={seq_len} full, fp8 KV, fp16 q", q.astype(jnp.float16), fp8_cache, metadata, {}, None)
        del fp8_cache
        if seq_len == 8192:  # peer: JAX's stock Pallas (Triton) paged decode kernel, full attention
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from jax.experimental.pallas.ops.gpu import paged_attention as triton_paged
            k_pages = jnp.transpose(kv_cache[:, 0], (2, 0, 1, 3))
            v_pages = jnp.transpose(kv_cache[:, 1], (2, 0, 1, 3))
            peer = jax.jit(partial(triton_paged.paged_attention, pages_per_compute_block=8, k_splits=16))
            ms = kernel_ms(peer, q, k_pages, v_pages, metadata.block_tables, metadata.seq_lens)
            gbps = 64 * seq_len * 8 * 128 * 4 / ms / 1e6
            record(rows, f"peer pallas-triton paged decode ctx={seq_len} full", f"{ms:.3f} ms", f"{gbps:.0f} GB/s")
            del k_pages, v_pages
        if sweep and seq_len == 32768:  # the split and block_kv sweep behind the decode defaults
            window = dict(params=LayerAttentionParams(sliding_window=1024))
            for splits, block_kv, stages in [(1, 128, 2), (2, 128, 2), (4, 128, 2), (2, 64, 3), (4, 64, 3), (8, 64, 3)]:
                config = KernelConfig(block_kv=block_kv, num_stages=stages, num_splits=splits)
                with configs_changed(decode=config):
                    time_decode(rows, f"sweep decode ctx={seq_len} window 1024 splits={splits} block_kv={block_kv} stages={stages}", q, kv_cache, metadata, window, None)
            with configs_changed(decode=dict(direct_io=False)):
                time_decode(rows, f"sweep decode ctx={seq_len} window 1024 direct_io=False", q, kv_cache, metadata,
                            window, None, breakdown=True)  # fmt: skip
        del q, kv_cache


ENGINE_DECODE_REQUESTS, ENGINE_DECODE_KEYS = 256, (129, 1089)
GEMMA3_1B_HEADS = dict(num_q_heads=4, num_kv_heads=1, head_dim=256, block_size=16)  # the engine's block size
GEMMA3_1B_WINDOW = 512


def engine_decode_section(rows, *, sweep):
    """The attention calls of `serving.py --sections busy`'s decode step, one layer each: 256 requests of
    128-1,088 keys (seeded), Gemma-3-1B's heads (4 query, 1 KV, head_dim 256), block size 16, full and within
    its 512-key window; the requests as drawn and longest first (what scheduling the longest CTAs first could
    give). With `sweep`, also with the keys split over 2 and 4 CTAs, and the same 128k keys as 64 to 512 requests
    of equal length (what each request's CTA costs beyond its bytes)."""
    seq_lens = np.random.default_rng(0).integers(*ENGINE_DECODE_KEYS, ENGINE_DECODE_REQUESTS)
    for order, lens in (("as drawn", seq_lens), ("longest first", np.sort(seq_lens)[::-1])):
        q, kv_cache, metadata = varied_batch(1, lens, **GEMMA3_1B_HEADS)
        for label, params in (("full", CAUSAL), (f"window {GEMMA3_1B_WINDOW}",
                                                 LayerAttentionParams(sliding_window=GEMMA3_1B_WINDOW))):
            name = f"engine decode {label}, {order}"
            time_decode(rows, name, q, kv_cache, metadata, dict(params=params), None, breakdown=order == "as drawn")
            for splits in (2, 4) if sweep else ():
                with configs_changed(decode=dict(num_splits=splits)):
                    time_decode(rows, f"{name}, splits={splits}", q, kv_cache, metadata, dict(params=params), None)
        del q, kv_cache
    for num_reqs in (64, 128, 256, 512) if sweep else ():
        q, kv_cache, metadata = varied_batch(1, [131_072 // num_reqs] * num_reqs, **GEMMA3_1B_HEADS)
        time_decode(rows, f"engine decode full, {num_reqs} x {131_072 // num_reqs} keys", q, kv_cache, metadata, {},
                    None)  # fmt: skip
        del q, kv_cache


def decode_variant_sweep(rows):
    """The decodes that move half the plain case's bytes per key (head_dim 64; GQA 8:1, half the KV heads) under
    other pipelines and splits, 64 requests x 8,192 keys."""
    q, kv_cache, metadata = device_batch(1, num_reqs=64, query_len=1, seq_len=8192, **dict(SHAPE, head_dim=64))
    time_decode(rows, "sweep decode B=64 ctx=8192 head_dim 64 default", q, kv_cache, metadata, {}, None)
    for block_kv, stages in [(128, 3), (128, 4), (256, 2)]:
        with configs_changed(decode=KernelConfig(block_kv=block_kv, num_stages=stages)):
            time_decode(rows, f"sweep decode B=64 ctx=8192 head_dim 64 block_kv={block_kv} stages={stages}", q, kv_cache,
                        metadata, {}, None)  # fmt: skip
    del q, kv_cache
    q, kv_cache, metadata = device_batch(1, num_reqs=64, query_len=1, seq_len=8192, **dict(SHAPE, num_kv_heads=4))
    time_decode(rows, "sweep decode B=64 ctx=8192 GQA 8:1 default", q, kv_cache, metadata, {}, None)
    for splits in (1, 2):
        with configs_changed(decode=KernelConfig(num_splits=splits)):
            time_decode(rows, f"sweep decode B=64 ctx=8192 GQA 8:1 splits={splits}", q, kv_cache, metadata, {}, None)


def stock_mgpu_prefill(rows, q, k, flops):
    """`jax.experimental.pallas.ops.gpu.attention_mgpu` (two consumer warpgroups taking turns, K/V by TMA, dense
    [batch, seq, heads, head_dim]) on the causal prefill, checked against cuDNN's output. Its shared-memory
    buffers are float16 whatever the inputs, so it runs on float16 copies (same speed on the tensor cores), and
    it does not scale the logits, so cuDNN is called with scale 1."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    q, k = q.astype(jnp.float16), k.astype(jnp.float16)

    name = "peer JAX attention_mgpu dense prefill 8x4096 full"
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    stock = jax.jit(partial(attention_mgpu.attention, config=config))
    cudnn = jax.jit(partial(jax.nn.dot_product_attention, is_causal=True, scale=1.0, implementation="cudnn"))
    try:
        error = float(jnp.abs(stock(q, k, k).astype(jnp.float32) - cudnn(q, k, k).astype(jnp.float32)).max())
        ms = kernel_ms(stock, q, k, k, repeats=10)
        record(rows, name, f"{ms:.3f} ms", f"{flops / ms / 1e9:.0f} TFLOP/s", f"max|diff| vs cuDNN {error:.3g}")
    except Exception as exc:
        record(rows, name, f"ERROR {type(exc).__name__}: {str(exc)[:200]}")


def prefill_section(rows, *, sweep):
    # Prefill: 8 requests of 4096 new tokens; TFLOP/s over the visible pairs. Peer: cuDNN on contiguous K/V.
    num_reqs, seq_len = 8, 4096
    q, kv_cache, metadata = device_batch(2, num_reqs=num_reqs, query_len=seq_len, seq_len=seq_len, **SHAPE)
    k_dense = kv_cache[1:, 0].reshape(num_reqs, seq_len, 8, 128)  # not the same blocks as the table: timing only
    q_dense = q.reshape(num_reqs, seq_len, 32, 128)
    prefill = partial(time_prefill, rows, q, kv_cache, metadata, num_reqs=num_reqs, seq_len=seq_len)
    for label, params in MASKS:
        flops = prefill(f"prefill 8x4096 {label}", params, breakdown=True)
        if params.attention_chunk_size is None:
            window = params.sliding_window
            peer = jax.jit(partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn",
                                   local_window_size=None if window is None else (window - 1, 0)))  # fmt: skip
            name = f"peer cuDNN dense prefill 8x4096 {label}"
            try:
                ms = kernel_ms(peer, q_dense, k_dense, k_dense, repeats=10)
                record(rows, name, f"{ms:.3f} ms", f"{flops / ms / 1e9:.0f} TFLOP/s")
            except Exception as exc:
                record(rows, name, f"ERROR {type(exc).__name__}")
            if window is None:  # JAX's stock Mosaic GPU flash attention (dense): what the same toolchain reaches
                stock_mgpu_prefill(rows, q_dense, k_dense, flops)
    # The tilings behind the default (each checked against the reference)
    prefill_sweep = [
        dict(block_kv=128, num_stages=2, ping_pong=False),
        dict(block_kv=64, num_stages=3),
        dict(block_kv=64, num_stages=4),
        dict(consumer_registers=224, producer_registers=56),  # against ptxas's spills at 232 / 40
        dict(direct_io=False),  # q packed into tiles, the output gathered per token
    ]
    for options in prefill_sweep if sweep else []:
        config = KernelConfig(num_consumers=2, **options)
        label = " ".join(f"{name}={value}" for name, value in options.items())
        with configs_changed(prefill=config):
            prefill(f"sweep prefill 8x4096 full {label}", CAUSAL)


def prefill_block_size_sweep(rows):
    """The default kernel on 8 x 4096 causal prefills with larger cache blocks: a step of 128 keys takes one TMA
    copy per block, 128 // S of them (8 at S = 16)."""
    num_reqs, seq_len = 8, 4096
    for block_size in (64, 128, 256):
        shape = dict(SHAPE, block_size=block_size)
        q, kv_cache, metadata = device_batch(2, num_reqs=num_reqs, query_len=seq_len, seq_len=seq_len, **shape)
        time_prefill(rows, q, kv_cache, metadata, f"sweep prefill 8x4096 full block_size={block_size}", CAUSAL,
                     num_reqs=num_reqs, seq_len=seq_len)  # fmt: skip
        del q, kv_cache


JSON_FIGURES = {  # a timing row's figures, as its fields print them
    "ms": r"^([\d.]+) ms$",
    "gbps": r"^([\d.]+) GB/s",
    "tflops": r"^([\d.]+) TFLOP/s",
    "error": r"^(?:err|err\(request 0\)|max\|diff\| vs cuDNN) (\S+)$",
}


def row_section(row) -> str:
    """The section a summary row comes from."""
    kind, name = row[:2]
    if kind == "parity":
        return "parity"
    return "prefill" if "prefill" in name else "engine-decode" if "engine decode" in name else "decode"


def json_row(row) -> dict:
    """A summary row as JSON: a parity row's case, batch, status and max |err|; a timing row's figures (None where
    it has none; status "OK" or its error); a per-kernel line's text."""
    kind, name, *fields = row
    if kind == "parity":
        batch, status, error = fields
        return dict(kind=kind, name=name, batch=batch, status=status, error=float(error))
    if name.endswith(": per kernel"):
        return dict(kind="kernels", name=name.strip().removesuffix(": per kernel"), text=" | ".join(fields))
    figures = dict.fromkeys(JSON_FIGURES)
    for field in fields:
        for key, pattern in JSON_FIGURES.items():
            match = re.match(pattern, field)
            if match and figures[key] is None:
                figures[key] = float(match.group(1))
    status = fields[0] if fields and fields[0].startswith("ERROR") else "OK"
    return dict(kind=kind, name=name, status=status, **figures)


def write_json(path, rows, sections, *, sweep: bool) -> None:
    """The rows of the sections run into `path` (`results_json.write_sections`)."""
    rows_by_section = {section: [json_row(row) for row in rows if row_section(row) == section] for section in sections}
    write_sections(path, rows_by_section, sweep=sweep)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="parity,decode,prefill",
                        help="comma-separated: parity, decode, engine-decode, prefill")  # fmt: skip
    parser.add_argument("--sweep", action="store_true", help="also time the configurations behind the defaults")
    parser.add_argument("--match", default="", help="parity: only the cases whose name contains this text")
    parser.add_argument("--variant", default="", help="parity: every kernel with these KernelConfig fields, e.g. "
                        "p_parts=1 (comma-separated FIELD=INT)")  # fmt: skip
    parser.add_argument("--json", default=str(Path(__file__).with_name("paged_attention_h200.json")),
                        help="the JSON file of the rows, by section")  # fmt: skip
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    rows = []
    sections = args.sections.split(",")
    if "parity" in sections:
        parity_section(rows, match=args.match, variant=args.variant)
    if "decode" in sections:
        decode_section(rows, sweep=args.sweep)
        if args.sweep:
            decode_variant_sweep(rows)
    if "engine-decode" in sections:
        engine_decode_section(rows, sweep=args.sweep)
    if "prefill" in sections:
        prefill_section(rows, sweep=args.sweep)
        if args.sweep:
            prefill_block_size_sweep(rows)
    print("\n== summary ==")
    for row in rows:
        print(" | ".join(row))
    write_json(args.json, rows, sections, sweep=args.sweep)



if __name__ == "__main__":
    main()
