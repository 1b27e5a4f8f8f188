"""Paged attention kernels on the H200: parity against the reference for every feature, then timings.

Run from the repository root:  PYTHONPATH=. python benchmarks/paged_attention_h200.py
Prints one line per parity case and per timed case, and a summary table last. Timing: CUPTI kernel time
(Mosaic GPU profiler, every kernel of the jitted call), median of 30 runs, compile excluded. Decode is
reported in GB/s of the KV blocks a query can see, against the measured 4.28 TB/s copy ceiling; prefill
in TFLOP/s of the visible (query, key) pairs. Peers run side by side in the same process.
"""

import statistics
import time
import traceback
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from jax_hybrid_attn import make_attention_metadata, paged_attention, reference
from jax_hybrid_attn.masks import allowed_key_range
from jax_hybrid_attn.testing import TOLERANCES, random_paged_inputs

COPY_CEILING_GBPS = 4280.0
MIXED = ([1, 1, 3, 300, 17], [1, 2049, 513, 1000, 17])  # decodes, a verification query, prefills with context
DECODES = ([1, 1, 1, 1, 1], [3, 99, 1000, 4096, 40])
PARITY_CASES = [  # (name, random_paged_inputs kwargs, attention options)
    ("gqa4 full bs16 d128", dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16), {}),
    ("mha d64 bs32 window 100", dict(num_q_heads=8, num_kv_heads=8, head_dim=64, block_size=32), dict(sliding_window=100)),
    ("mqa d256 bs64 chunk 256", dict(num_q_heads=8, num_kv_heads=1, head_dim=256, block_size=64), dict(attention_chunk_size=256)),
    ("gqa4 softcap+sinks w1", dict(num_q_heads=16, num_kv_heads=4, head_dim=128, block_size=16, with_sinks=True), dict(sliding_window=1, logits_soft_cap=30.0)),
    ("gqa2 HND window 1000 d256", dict(num_q_heads=16, num_kv_heads=8, head_dim=256, block_size=16, kv_layout="HND"), dict(sliding_window=1000, kv_layout="HND")),
    ("fp16 gqa8 chunk 64 bs64", dict(num_q_heads=64, num_kv_heads=8, head_dim=128, block_size=64, dtype=jnp.float16), dict(attention_chunk_size=64)),
    ("non-causal gqa4 HND bs32", dict(num_q_heads=32, num_kv_heads=8, head_dim=64, block_size=32, causal=False, kv_layout="HND"), dict(causal=False, kv_layout="HND")),
    ("gqa4 sinks chunk 128 softcap", dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=32, with_sinks=True), dict(attention_chunk_size=128, logits_soft_cap=50.0)),
]  # fmt: skip


def check(inputs_kwargs, options, query_lens, seq_lens):
    inputs = random_paged_inputs(0, query_lens=query_lens, seq_lens=seq_lens, **{"dtype": jnp.bfloat16, **inputs_kwargs})
    out = paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, sinks=inputs.sinks, **options)
    ref = reference.paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, sinks=inputs.sinks, **options)
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    ok = bool(np.isfinite(out).all()) and np.allclose(out, ref, **TOLERANCES[jnp.dtype(inputs.q.dtype)])
    return ok, float(np.abs(out - ref).max())


def device_batch(seed, *, num_reqs, query_len, seq_len, num_q_heads, num_kv_heads, head_dim, block_size, dtype=jnp.bfloat16):
    """A large batch generated on the device; blocks scattered by a random permutation."""
    blocks_per_req = -(-seq_len // block_size)
    key_cache, key_q = jax.random.split(jax.random.key(seed))
    kv_cache = jax.random.normal(key_cache, (num_reqs * blocks_per_req + 1, 2, block_size, num_kv_heads, head_dim), dtype)
    tables = 1 + np.random.default_rng(seed).permutation(num_reqs * blocks_per_req).reshape(num_reqs, blocks_per_req)
    metadata = make_attention_metadata([query_len] * num_reqs, [seq_len] * num_reqs, tables, block_size=block_size)
    q = jax.random.normal(key_q, (num_reqs * query_len, num_q_heads, head_dim), dtype)
    return q, kv_cache, metadata


def kernel_ms(fn, *args, repeats=30):
    jax.block_until_ready(fn(*args))
    return statistics.median(profiler.measure(fn)(*args)[1] for _ in range(repeats))


def visible_keys(query_len, seq_len, **mask):
    """Per query of one request: number of keys it attends to, and the blocks' worth of keys loaded."""
    q_pos = np.arange(seq_len - query_len, seq_len)
    first, last = allowed_key_range(q_pos, seq_len, **mask)
    return np.asarray(last) - np.asarray(first) + 1, np.asarray(first)


def main():
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    rows = []
    for name, inputs_kwargs, options in PARITY_CASES:
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
    whole = paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, sliding_window=256)
    starts = np.asarray(inputs.metadata.query_start_loc)
    worst = 0.0
    for r, query_len in enumerate(MIXED[0]):
        part = inputs.metadata.replace(
            query_start_loc=jnp.asarray([0, query_len], jnp.int32), seq_lens=inputs.metadata.seq_lens[r : r + 1],
            block_tables=inputs.metadata.block_tables[r : r + 1], slot_mapping=inputs.metadata.slot_mapping[starts[r] : starts[r + 1]],
            num_actual_tokens=jnp.asarray(query_len, jnp.int32), max_query_len=query_len)  # fmt: skip
        alone = paged_attention(inputs.q[starts[r] : starts[r + 1]], inputs.kv_cache, part, sliding_window=256)
        worst = max(worst, float(jnp.abs(whole[starts[r] : starts[r + 1]].astype(jnp.float32) - alone.astype(jnp.float32)).max()))
    print(f"mixed batch vs its parts: max|diff|={worst:.3g}", flush=True)
    rows.append(("parity", "mixed batch == parts (window 256)", "", "PASS" if worst <= 2e-2 else "FAIL", f"{worst:.3g}"))

    shape = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    masks = [("full", {}), ("window 1024", dict(sliding_window=1024)), ("chunk 1024", dict(attention_chunk_size=1024))]
    for seq_len in [8192, 32768]:
        q, kv_cache, metadata = device_batch(1, num_reqs=64, query_len=1, seq_len=seq_len, **shape)
        full_ms = None
        for label, mask in masks:
            _, first = visible_keys(1, seq_len, **mask)
            needed = 64 * (seq_len - int(first[0]) // 16 * 16) * 8 * 128 * 2 * 2  # bytes of K and V, whole blocks
            fn = jax.jit(partial(paged_attention, **mask))
            error = float(jnp.abs(fn(q, kv_cache, metadata).astype(jnp.float32) - reference.paged_attention(q, kv_cache, metadata, **mask).astype(jnp.float32)).max())
            ms = kernel_ms(fn, q, kv_cache, metadata)
            full_ms = full_ms or ms
            gbps = needed / ms / 1e6
            line = (f"decode B=64 ctx={seq_len} {label}", f"{ms:.3f} ms", f"{gbps:.0f} GB/s ({100 * gbps / COPY_CEILING_GBPS:.0f}%)",
                    f"{full_ms / ms:.1f}x vs full", f"err {error:.3g}")  # fmt: skip
            print(" | ".join(line), flush=True)
            rows.append(("time",) + line)
        if seq_len == 8192:  # peer: JAX's stock Pallas (Triton) paged decode kernel, full attention
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from jax.experimental.pallas.ops.gpu import paged_attention as triton_paged
            k_pages = jnp.transpose(kv_cache[:, 0], (2, 0, 1, 3))
            v_pages = jnp.transpose(kv_cache[:, 1], (2, 0, 1, 3))
            peer = jax.jit(partial(triton_paged.paged_attention, pages_per_compute_block=8, k_splits=16))
            ms = kernel_ms(peer, q, k_pages, v_pages, metadata.block_tables, metadata.seq_lens)
            gbps = 64 * seq_len * 8 * 128 * 4 / ms / 1e6
            line = (f"peer pallas-triton paged decode ctx={seq_len} full", f"{ms:.3f} ms", f"{gbps:.0f} GB/s", "", "")
            print(" | ".join(line), flush=True)
            rows.append(("time",) + line)
        del q, kv_cache

    # Prefill: 8 requests of 4096 new tokens; TFLOP/s over the visible pairs. Peer: cuDNN on contiguous K/V.
    num_reqs, seq_len = 8, 4096
    q, kv_cache, metadata = device_batch(2, num_reqs=num_reqs, query_len=seq_len, seq_len=seq_len, **shape)
    k_dense = kv_cache[1:, 0].reshape(num_reqs, seq_len, 8, 128)  # not the same blocks as the table: timing only
    q_dense = q.reshape(num_reqs, seq_len, 32, 128)
    for label, mask in masks:
        counts, _ = visible_keys(seq_len, seq_len, **mask)
        flops = 4 * num_reqs * 32 * 128 * int(counts.sum())
        fn = jax.jit(partial(paged_attention, **mask))
        first = metadata.replace(query_start_loc=metadata.query_start_loc[:2], seq_lens=metadata.seq_lens[:1],
                                 block_tables=metadata.block_tables[:1], slot_mapping=metadata.slot_mapping[:seq_len],
                                 num_actual_tokens=jnp.asarray(seq_len, jnp.int32))  # fmt: skip
        expected = reference.paged_attention(q[:seq_len], kv_cache, first, **mask).astype(jnp.float32)
        error = float(jnp.abs(fn(q, kv_cache, metadata)[:seq_len].astype(jnp.float32) - expected).max())
        ms = kernel_ms(fn, q, kv_cache, metadata, repeats=10)
        line = (f"prefill 8x4096 {label}", f"{ms:.3f} ms", f"{flops / ms / 1e9:.0f} TFLOP/s", "", f"err(request 0) {error:.3g}")
        print(" | ".join(line), flush=True)
        rows.append(("time",) + line)
        if "attention_chunk_size" not in mask:
            window = mask.get("sliding_window")
            peer = jax.jit(partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn",
                                   local_window_size=None if window is None else (window - 1, 0)))  # fmt: skip
            try:
                ms = kernel_ms(peer, q_dense, k_dense, k_dense, repeats=10)
                line = (f"peer cuDNN dense prefill 8x4096 {label}", f"{ms:.3f} ms", f"{flops / ms / 1e9:.0f} TFLOP/s", "", "")
            except Exception as exc:
                line = (f"peer cuDNN dense prefill 8x4096 {label}", f"ERROR {type(exc).__name__}", "", "", "")
            print(" | ".join(line), flush=True)
            rows.append(("time",) + line)

    print("\n== summary ==")
    for row in rows:
        print(" | ".join(row))


if __name__ == "__main__":
    main()
