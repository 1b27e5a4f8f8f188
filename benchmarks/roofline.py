"""The kernels against the H200's ceilings and their peers: every kernel workload and goal in one process.

Run from the repository root:  PYTHONPATH=. python benchmarks/roofline.py [--workloads P1,P0,...] [--json PATH]
[--match 'bf16|HND_VT'] (only the workloads whose name contains one of these texts)
[--variant num_stages=3] (ours again with those KernelConfig fields, beside the default)
(``--tiny`` runs ours only, at tiny shapes, in Mosaic GPU interpret mode: a CPU dry run of the script.)

1. Ceilings: memory bandwidth (a 4 GiB bf16 array copied, and read once) and the bf16 matmul (8,192³).
2. Workloads (bf16, 32 query / 8 KV heads, head_dim 128, block 16 unless named):
     P1 causal prefill, one 8,192-token request      P0 causal prefill, 8 × 4,096
     P2 prefill 8 × 8,192, window 1,024              P3 prefill 8 × 4,096, chunk 1,024
     F1 decode 64 × 8k, fp8 e4m3 KV (beside bf16)    D2 decode 64 × 32k, window 1,024
     F2 D2 with an fp8 KV cache                      F3 P0 with an fp8 KV cache
     (F1-F3 also with the fp8 cache in "HND_VT", V transposed per 64-token block)
     D0 decode 64 × 2k                               V  decode 64 × 8k variants (head_dim 64/256, blocks
                                                        32/64, GQA 8:1, MHA, soft cap, sinks, HND, K/V pair)
   Each is checked against the reference before it is timed. Peers in the same run: cuDNN (dense, through
   `jax.nn.dot_product_attention`, with its window; and its paged decode), torch SDPA (flash), JAX's
   Pallas-Triton paged decode.
3. Timing: the whole jitted call back to back, cycling through 3 copies of the inputs (so that L2 holds none
   of them), one sync at the end, per-call mean; beside it the CUPTI time of every kernel of the call (Mosaic
   GPU profiler, median). Prefill in TFLOP/s of the visible (query, key) pairs; decode in GB/s of the K/V bytes
   a query can see, and against the better of the two bandwidths (``ideal`` = those bytes at it).

Prints one table last and writes the rows as JSON (default: benchmarks/roofline.json).
"""

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import time
import traceback
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybrid_attn import CAUSAL, KVCache, LayerAttentionParams, make_attention_metadata, paged_attention, reference
from jax_hybrid_attn.masks import allowed_key_range
from jax_hybrid_attn.testing import TOLERANCES
from kernel_variants import configs_changed, parse_variant
from trace_summary import profiled

INPUT_COPIES = 3
FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Workload:
    id: str
    name: str
    num_reqs: int
    query_len: int
    seq_len: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    params: LayerAttentionParams = CAUSAL
    kv_dtype: object = jnp.bfloat16
    kv_layout: str = "NHD"
    kv_pair: bool = False
    sinks: bool = False

    @property
    def is_decode(self) -> bool:
        return self.query_len == 1

    def visible(self) -> tuple[int, int]:
        """(visible (query, key) pairs of one request, keys whose blocks a decode must read)."""
        q_pos = np.arange(self.seq_len - self.query_len, self.seq_len)
        first, last = (np.asarray(x) for x in allowed_key_range(q_pos, self.seq_len, params=self.params))
        pairs = int((last - first + 1).sum())
        read = self.seq_len - int(first[-1]) // self.block_size * self.block_size
        return pairs, read


def workloads(tiny: bool) -> list[Workload]:
    window, chunk = LayerAttentionParams(sliding_window=1024), LayerAttentionParams(attention_chunk_size=1024)
    items = [
        Workload("P1", "causal prefill 1 x 8192", 1, 8192, 8192),
        Workload("P0", "causal prefill 8 x 4096", 8, 4096, 4096),
        Workload("F3", "causal prefill 8 x 4096, fp8 KV", 8, 4096, 4096, kv_dtype=FP8),
        Workload("F3", "causal prefill 8 x 4096, fp8 KV, HND_VT block 64", 8, 4096, 4096, kv_dtype=FP8,
                 kv_layout="HND_VT", block_size=64),  # fmt: skip
        Workload("P2", "prefill 8 x 8192, window 1024", 8, 8192, 8192, params=window),
        Workload("P3", "prefill 8 x 4096, chunk 1024", 8, 4096, 4096, params=chunk),
        Workload("F1", "decode 64 x 8k, bf16 KV", 64, 1, 8192),
        Workload("F1", "decode 64 x 8k, fp8 KV", 64, 1, 8192, kv_dtype=FP8),
        Workload("F1", "decode 64 x 8k, fp8 KV, HND_VT block 64", 64, 1, 8192, kv_dtype=FP8, kv_layout="HND_VT",
                 block_size=64),  # fmt: skip
        Workload("D2", "decode 64 x 32k, window 1024", 64, 1, 32768, params=window),
        Workload("F2", "decode 64 x 32k, window 1024, fp8 KV", 64, 1, 32768, params=window, kv_dtype=FP8),
        Workload("F2", "decode 64 x 32k, window 1024, fp8 KV, HND_VT block 64", 64, 1, 32768, params=window,
                 kv_dtype=FP8, kv_layout="HND_VT", block_size=64),  # fmt: skip
        Workload("D0", "decode 64 x 2k", 64, 1, 2048),
        Workload("V", "decode 64 x 8k, head_dim 64", 64, 1, 8192, head_dim=64),
        Workload("V", "decode 64 x 8k, head_dim 256", 64, 1, 8192, head_dim=256),
        Workload("V", "decode 64 x 8k, block 32", 64, 1, 8192, block_size=32),
        Workload("V", "decode 64 x 8k, block 64", 64, 1, 8192, block_size=64),
        Workload("V", "decode 64 x 8k, GQA 8:1", 64, 1, 8192, num_kv_heads=4),
        Workload("V", "decode 64 x 8k, MHA", 64, 1, 8192, num_kv_heads=32),
        Workload("V", "decode 64 x 8k, soft cap 30", 64, 1, 8192, params=LayerAttentionParams(logits_soft_cap=30.0)),
        Workload("V", "decode 64 x 8k, sinks", 64, 1, 8192, sinks=True),
        Workload("V", "decode 64 x 8k, HND", 64, 1, 8192, kv_layout="HND"),
        Workload("V", "decode 64 x 8k, K/V pair", 64, 1, 8192, kv_pair=True),
    ]
    if tiny:  # interpret mode on a CPU: the same cases at a size it runs in seconds
        items = [dataclasses.replace(w, name=f"{w.name} (tiny)", num_reqs=min(w.num_reqs, 2),
                                     query_len=min(w.query_len, 64), seq_len=min(w.seq_len, 160), num_q_heads=4,
                                     num_kv_heads=min(w.num_kv_heads, 2), head_dim=64) for w in items]  # fmt: skip
        items = [dataclasses.replace(w, params=_small_params(w.params)) for w in items]
    return items


def _small_params(params: LayerAttentionParams) -> LayerAttentionParams:
    return dataclasses.replace(
        params,
        sliding_window=params.sliding_window and 48,
        attention_chunk_size=params.attention_chunk_size and 64,
    )


def inputs(w: Workload, seed: int):
    """q, the paged cache (blocks scattered by a permutation), metadata and sinks of a workload, on the device."""
    blocks_per_req = math.ceil(w.seq_len / w.block_size)
    num_blocks = w.num_reqs * blocks_per_req + 1
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    shape = (num_blocks, w.block_size, w.num_kv_heads, w.head_dim)
    scale = 8.0 if w.kv_dtype == FP8 else 1.0
    k_cache, v_cache = (jax.random.normal(key, shape, jnp.bfloat16) * scale for key in (key_k, key_v))
    if w.kv_layout != "NHD":
        k_cache, v_cache = jnp.swapaxes(k_cache, 1, 2), jnp.swapaxes(v_cache, 1, 2)
    if w.kv_layout == "HND_VT":  # V transposed per block and head, in the same shape
        v_cache = jnp.swapaxes(v_cache, 2, 3).reshape(v_cache.shape)
    k_cache, v_cache = k_cache.astype(w.kv_dtype), v_cache.astype(w.kv_dtype)
    arrays = (k_cache, v_cache) if w.kv_pair else jnp.stack([k_cache, v_cache], axis=1)
    scales = (jnp.float32(1 / scale),) * 2 if w.kv_dtype == FP8 else (None, None)  # arrays, as an engine holds them
    kv_cache = KVCache(arrays, w.kv_layout, *scales)
    tables = 1 + np.random.default_rng(seed).permutation(num_blocks - 1).reshape(w.num_reqs, blocks_per_req)
    metadata = make_attention_metadata([w.query_len] * w.num_reqs, [w.seq_len] * w.num_reqs, tables,
                                       block_size=w.block_size)  # fmt: skip
    q = jax.random.normal(key_q, (w.num_reqs * w.query_len, w.num_q_heads, w.head_dim), jnp.bfloat16)
    sinks = jax.random.uniform(key_q, (w.num_q_heads,), jnp.float32, -1.0, 3.0) if w.sinks else None
    return q, kv_cache, metadata, sinks


def options(w: Workload, sinks) -> dict:
    return dict(params=w.params, sinks=sinks)


def per_call_ms(fn, argument_sets, *, calls: int) -> float:
    """Mean wall time of back-to-back calls cycling through the argument sets, one sync at the end."""
    jax.block_until_ready([fn(*args) for args in argument_sets])
    started = time.perf_counter()
    results = [fn(*argument_sets[i % len(argument_sets)]) for i in range(calls)]
    jax.block_until_ready(results)
    return (time.perf_counter() - started) / calls * 1e3


def cupti_ms(fn, args, *, repeats: int) -> float | None:
    """Median CUPTI time of every kernel of one call (None off the GPU)."""
    if jax.default_backend() != "gpu":
        return None
    from jax.experimental.mosaic.gpu import profiler

    return statistics.median(profiler.measure(fn)(*args)[1] for _ in range(repeats))


def kernel_breakdown(fn, args, *, repeats: int) -> list[tuple[str, float]]:
    """Each kernel of one call in launch order, its name shortened and its median CUPTI time in ms (GPU only)."""
    from jax.experimental.mosaic.gpu import profiler

    runs = [profiler.measure(fn, aggregate=False)(*args)[1] for _ in range(repeats)]
    return [(name[:60], statistics.median(run[i][1] for run in runs)) for i, (name, _) in enumerate(runs[0])]


def parity_error(w: Workload, fn, q, kv_cache, metadata, sinks) -> float:
    """Max |ours - reference| over the first request's tokens (the reference on the whole batch is too slow)."""
    first = metadata.replace(
        query_start_loc=metadata.query_start_loc[:2], seq_lens=metadata.seq_lens[:1],
        block_tables=metadata.block_tables[:1], slot_mapping=metadata.slot_mapping[: w.query_len],
        num_actual_tokens=jnp.asarray(w.query_len, jnp.int32),
    )  # fmt: skip
    expected = reference.paged_attention(q[: w.query_len], kv_cache, first, **options(w, sinks))
    ours = fn(q, kv_cache, metadata)[: w.query_len]
    return float(jnp.abs(ours.astype(jnp.float32) - expected.astype(jnp.float32)).max())


def run_ours(w: Workload, *, ceiling_gbps: float | None, interpret: bool, calls: int, trace: str | None,
             variant: str = "", kernels: bool = False) -> dict:  # fmt: skip
    argument_sets = []
    for seed in range(1 if interpret else INPUT_COPIES):
        q, kv_cache, metadata, sinks = inputs(w, seed)
        argument_sets.append((q, kv_cache, metadata))
    fn = jax.jit(partial(paged_attention, **options(w, sinks), interpret=interpret))
    error = parity_error(w, fn, *argument_sets[0], sinks)
    tolerance = TOLERANCES[jnp.dtype(jnp.bfloat16)]["atol"] * (4 if w.kv_dtype == FP8 else 1)
    impl = f"ours ({variant})" if variant else "ours"
    row = dict(id=w.id, name=w.name, impl=impl, parity_error=error, parity="PASS" if error <= tolerance else "FAIL")
    row["ms"] = per_call_ms(fn, argument_sets, calls=calls)
    row["kernel_ms"] = cupti_ms(fn, argument_sets[0], repeats=10)
    if kernels and row["kernel_ms"] is not None:
        row["kernels"] = kernel_breakdown(fn, argument_sets[0], repeats=10)
    if trace:  # what the host does per call, and how many GPU ops a call runs
        directory = f"{trace}/{re.sub(r'[^0-9A-Za-z]+', '_', w.name)}"
        summary = profiled(directory, lambda: per_call_ms(fn, argument_sets, calls=calls))
        profiled_calls = calls + len(argument_sets)  # per_call_ms warms each argument set first
        row["gpu_ops_per_call"] = summary.gpu_ops / profiled_calls
        row["host_per_call"] = summary.host_lines(per=profiled_calls, top=10)
    return _rates(w, row, ceiling_gbps)


def _rates(w: Workload, row: dict, ceiling_gbps: float | None) -> dict:
    pairs, keys_read = w.visible()
    ms = row["kernel_ms"] or row["ms"]
    if w.is_decode:
        kv_bytes = w.num_reqs * keys_read * w.num_kv_heads * w.head_dim * 2 * jnp.dtype(w.kv_dtype).itemsize
        row["gbps"] = kv_bytes / (row["ms"] * 1e6)
        row["kernel_gbps"] = kv_bytes / (ms * 1e6)
        if ceiling_gbps:
            row["ideal_ms"] = kv_bytes / (ceiling_gbps * 1e6)
    else:
        flops = 4 * w.num_reqs * pairs * w.num_q_heads * w.head_dim
        row["tflops"] = flops / (row["ms"] * 1e9)
        row["kernel_tflops"] = flops / (ms * 1e9)
    return row


# ------------------------------------------------------------------------------------------------ peers


def peer_rows(w: Workload, ceiling_gbps: float | None, *, calls: int) -> list[dict]:
    """The peers that serve this workload, each timed like ours (no parity: they are the yardstick)."""
    rows = []
    plain = w.kv_dtype == jnp.bfloat16 and w.kv_layout == "NHD" and not w.kv_pair and not w.sinks
    if not plain or w.params.logits_soft_cap is not None:
        return rows
    if not w.is_decode and w.params.attention_chunk_size is None:
        rows += [_timed_peer(w, "cuDNN dense", _cudnn_dense(w), ceiling_gbps, calls=calls)]
        if w.params.sliding_window is None:
            rows += [_timed_peer(w, "torch SDPA flash", _torch_sdpa(w), ceiling_gbps, calls=calls)]
    if w.is_decode and w.params.attention_chunk_size is None:
        rows += [_timed_peer(w, "cuDNN paged", _cudnn_paged(w), ceiling_gbps, calls=calls)]
        if w.params.sliding_window is None and w.id in ("F1", "D0"):
            rows += [_timed_peer(w, "Pallas-Triton paged", _triton_paged(w), ceiling_gbps, calls=calls)]
    return rows


def _timed_peer(w: Workload, impl: str, prepared, ceiling_gbps, *, calls: int) -> dict:
    row = dict(id=w.id, name=w.name, impl=impl)
    try:
        fn, argument_sets, is_torch = prepared()
        if is_torch:
            row["ms"], row["kernel_ms"] = _torch_ms(fn, argument_sets, calls=calls), None
        else:
            row["ms"] = per_call_ms(fn, argument_sets, calls=calls)
            row["kernel_ms"] = cupti_ms(fn, argument_sets[0], repeats=10)
    except Exception as error:  # keep going: one run reports every case
        traceback.print_exc(limit=2)
        row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        return row
    return _rates(w, row, ceiling_gbps)


def _dense(w: Workload, seed: int):
    key_q, key_k, key_v = jax.random.split(jax.random.key(100 + seed), 3)
    q = jax.random.normal(key_q, (w.num_reqs, w.query_len, w.num_q_heads, w.head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (w.num_reqs, w.seq_len, w.num_kv_heads, w.head_dim), jnp.bfloat16)
            for key in (key_k, key_v))  # fmt: skip
    return q, k, v


def _cudnn_dense(w: Workload):
    def prepare():
        window = w.params.sliding_window
        fn = jax.jit(partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn",
                             local_window_size=None if window is None else (window - 1, 0)))  # fmt: skip
        return fn, [_dense(w, seed) for seed in range(INPUT_COPIES)], False

    return prepare


def _torch_sdpa(w: Workload):
    def prepare():
        import torch
        import torch.nn.functional as F

        sets = []
        for seed in range(INPUT_COPIES):
            generator = torch.Generator(device="cuda").manual_seed(seed)
            q = torch.randn(w.num_reqs, w.num_q_heads, w.query_len, w.head_dim, device="cuda", dtype=torch.bfloat16,
                            generator=generator)  # fmt: skip
            k, v = (torch.randn(w.num_reqs, w.num_kv_heads, w.seq_len, w.head_dim, device="cuda",
                                dtype=torch.bfloat16, generator=generator) for _ in range(2))  # fmt: skip
            sets.append((q, k, v))
        fn = partial(F.scaled_dot_product_attention, is_causal=True, enable_gqa=True)
        return fn, sets, True

    return prepare


def _torch_ms(fn, argument_sets, *, calls: int) -> float:
    import torch

    for args in argument_sets:
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        fn(*argument_sets[i % len(argument_sets)])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def _paged_peer_inputs(w: Workload, seed: int):
    q, kv_cache, metadata, _ = inputs(w, seed)
    return q, kv_cache.data[:, 0], kv_cache.data[:, 1], metadata


def _cudnn_paged(w: Workload):
    def prepare():
        from jax._src.cudnn.fused_attention_stablehlo import MaskType
        from jax._src.cudnn.fused_attention_stablehlo import paged_attention as cudnn_paged_attention

        sets = []
        for seed in range(INPUT_COPIES):
            q, k_pages, v_pages, metadata = _paged_peer_inputs(w, seed)
            # cuDNN wants exactly batch x blocks-per-request pages: drop the null block and renumber.
            tables = jnp.maximum(metadata.block_tables - 1, 0)[:, None, :, None]
            k_pages, v_pages = k_pages[1:], v_pages[1:]
            sets.append((q[:, None], k_pages, v_pages, jnp.ones(w.num_reqs, jnp.int32), metadata.seq_lens, tables))
        fn = jax.jit(lambda q, k, v, q_lens, kv_lens, tables: cudnn_paged_attention(
            q, k, v, q_lens, kv_lens, tables, tables, scale=w.head_dim**-0.5, mask_type=MaskType.PADDING,
            sliding_window_length=w.params.sliding_window))  # fmt: skip
        return fn, sets, False

    return prepare


def _triton_paged(w: Workload):
    def prepare():
        from jax.experimental.pallas.ops.gpu import paged_attention as triton_paged

        sets = []
        for seed in range(INPUT_COPIES):
            q, k_pages, v_pages, metadata = _paged_peer_inputs(w, seed)
            heads_first = (jnp.transpose(k_pages, (2, 0, 1, 3)), jnp.transpose(v_pages, (2, 0, 1, 3)))
            sets.append((q, *heads_first, metadata.block_tables, metadata.seq_lens))
        fn = jax.jit(partial(triton_paged.paged_attention, pages_per_compute_block=8, k_splits=16))
        return fn, sets, False

    return prepare


# -------------------------------------------------------------------------------------------- ceilings


def ceilings(*, tiny: bool) -> dict:
    """Memory bandwidth (GB/s) of a copy (read + write counted) and of a read-only stream (a max over the array),
    and the bf16 matmul (TFLOP/s); CUPTI time on a GPU. ``stream_gbps``, the better of the two bandwidths, is what
    a decode's bytes are held against."""
    size = 1 << (20 if tiny else 31)  # bf16 elements: 4 GiB on the GPU
    x = jnp.ones(size, jnp.bfloat16)
    copy = jax.jit(lambda x: x * 2)  # one read, one write (XLA drops a multiply by one)
    copy_ms = cupti_ms(copy, (x,), repeats=10) or per_call_ms(copy, [(x,)], calls=10)
    read = jax.jit(jnp.max)
    read_ms = cupti_ms(read, (x,), repeats=10) or per_call_ms(read, [(x,)], calls=10)
    n = 256 if tiny else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: a @ b)
    matmul_ms = cupti_ms(matmul, (a, a), repeats=10) or per_call_ms(matmul, [(a, a)], calls=10)
    copy_gbps, read_gbps = 2 * x.nbytes / (copy_ms * 1e6), x.nbytes / (read_ms * 1e6)
    return dict(copy_gbps=copy_gbps, read_gbps=read_gbps, stream_gbps=max(copy_gbps, read_gbps),
                matmul_tflops=2 * n**3 / (matmul_ms * 1e9))  # fmt: skip


# ------------------------------------------------------------------------------------------------ main


def _ceilings_line(limits: dict) -> str:
    return (f"copy {limits['copy_gbps']:.0f} GB/s, read {limits['read_gbps']:.0f} GB/s, bf16 matmul "
            f"{limits['matmul_tflops']:.0f} TFLOP/s")  # fmt: skip


def _line(row: dict) -> str:
    fields = [row["id"], row["name"], row["impl"]]
    if "error" in row:
        return " | ".join(fields + [f"ERROR {row['error']}"])
    fields.append(f"{row['ms']:.3f} ms per call")
    if row.get("kernel_ms") is not None:
        fields.append(f"kernels {row['kernel_ms']:.3f} ms")
    if "tflops" in row:
        fields.append(f"{row['kernel_tflops']:.0f} TFLOP/s (call {row['tflops']:.0f})")
    if "gbps" in row:
        fields.append(f"{row['kernel_gbps']:.0f} GB/s (call {row['gbps']:.0f})")
    if "ideal_ms" in row:
        fields.append(f"{(row['kernel_ms'] or row['ms']) / row['ideal_ms']:.2f}x ideal {row['ideal_ms']:.3f} ms")
    if "gpu_ops_per_call" in row:
        fields.append(f"{row['gpu_ops_per_call']:.1f} GPU ops per call")
    if "parity" in row:
        fields.append(f"parity {row['parity']} ({row['parity_error']:.3g})")
    return " | ".join(fields)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="P1,P0,P2,P3,F1,F2,F3,D2,D0,V", help="comma-separated workload ids")
    parser.add_argument("--match", default="", help="only the workloads whose name contains one of these "
                        "'|'-separated texts, e.g. 'bf16|HND_VT'")  # fmt: skip
    parser.add_argument("--json", default=str(Path(__file__).with_name("roofline.json")))
    parser.add_argument("--calls", type=int, default=50, help="back-to-back calls per timing")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="ours only, tiny shapes, interpret mode (CPU dry run)")
    parser.add_argument("--trace", metavar="DIR", help="also profile ours per workload into DIR: GPU ops and host "
                        "time per call")  # fmt: skip
    parser.add_argument("--kernels", action="store_true", help="also each kernel of ours' call, its CUPTI time")
    parser.add_argument("--variant", action="append", default=[], help="also ours with these KernelConfig fields "
                        "on both kernels, beside the default, e.g. num_stages=3 (comma-separated FIELD=INT; repeatable)")
    args = parser.parse_args()
    if args.tiny:
        os.environ.setdefault("PJRT_NPROC", "8")
    wanted = set(args.workloads.split(","))
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    limits = ceilings(tiny=args.tiny)
    print(f"ceilings: {_ceilings_line(limits)}", flush=True)
    rows = []
    texts = [text for text in args.match.split("|") if text]
    chosen = [w for w in workloads(args.tiny) if w.id in wanted and (not texts or any(t in w.name for t in texts))]
    for w in chosen:
        for variant in ["", *args.variant]:
            options = parse_variant(variant) if variant else {}
            try:
                with configs_changed(decode=options, prefill=options):
                    rows.append(run_ours(w, ceiling_gbps=limits["stream_gbps"], interpret=args.tiny, calls=args.calls,
                                         trace=args.trace, variant=variant, kernels=args.kernels))  # fmt: skip
            except Exception as error:
                traceback.print_exc(limit=2)
                impl = f"ours ({variant})" if variant else "ours"
                rows.append(dict(id=w.id, name=w.name, impl=impl, error=f"{type(error).__name__}: {str(error)[:200]}"))
            print(_line(rows[-1]), flush=True)
            for line in rows[-1].get("host_per_call", ()):
                print(f"    host per call: {line}", flush=True)
            for name, ms in rows[-1].get("kernels", ()):
                print(f"    kernel {ms * 1e3:8.1f} us  {name}", flush=True)
        if not (args.no_peers or args.tiny):
            for row in peer_rows(w, limits["stream_gbps"], calls=args.calls):
                rows.append(row)
                print(_line(row), flush=True)
    print("\n== summary ==")
    print(f"ceilings | {_ceilings_line(limits)}")
    for row in rows:
        print(_line(row))
    record = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d"),
                  ceilings=limits, rows=rows)  # fmt: skip
    Path(args.json).write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
