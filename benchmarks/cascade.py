"""Cascade attention on the H200: decodes behind a shared prefix, the attention call alone, with and without the
split (``metadata.num_common_prefix_blocks``).

    PYTHONPATH=.:benchmarks python benchmarks/cascade.py          # the H200
    PYTHONPATH=.:benchmarks python benchmarks/cascade.py --tiny   # a dry run on the CPU (interpret mode)

Per head shape (Gemma-3-1B's 4 query / 1 KV heads of 256; 32 / 8 heads of 128) and batch (16, 64 and 256
decodes behind a 4,096-token prefix with 128 tokens of their own; 256 with no prefix in common), bf16, blocks of
16: first each call's output against the call without the split (and, on the smallest batch, the reference),
then both timed as a user calls them: the jitted call back to back (wall per call), with its kernels' time
(CUPTI) beside it, and which of the two the cost rule (`cascade.cascade_pays`) picks; the cascade call's
kernels for the largest batch. A table last. ``--sections grid`` times both over more batches and prefixes
(kernel time only): the data the rule's constants come from.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybrid_attn import make_attention_metadata, paged_attention, reference
from jax_hybrid_attn.cascade import cascade_pays
from jax_hybrid_attn.testing import TOLERANCES
from paged_attention_h200 import kernel_breakdown, kernel_ms

BLOCK_SIZE = 16
SHAPES = {"4/1 heads, D256": (4, 1, 256), "32/8 heads, D128": (32, 8, 128)}
BATCHES = [(16, 4096), (64, 4096), (256, 4096), (256, 0)]  # (requests, tokens of the prefix they share)
OWN_TOKENS = 128
GRID_REQUESTS = (8, 16, 32, 64, 128, 256)
GRID_PREFIXES = (256, 1024, 4096)
TINY = {"shapes": {"4/1 heads, D64": (4, 1, 64)}, "batches": [(4, 64), (4, 0)], "own": 16,
        "grid": ((4, 20), (64,))}  # fmt: skip
CALLS = 50


def shared_prefix_batch(seed, *, num_reqs, prefix_len, own_len, num_q_heads, num_kv_heads, head_dim):
    """Decodes whose block tables start with the same `prefix_len // BLOCK_SIZE` blocks, then `own_len` tokens
    of their own; the cache random on the device. (q, cache, metadata without the split, its shared blocks)."""
    shared, own = prefix_len // BLOCK_SIZE, -(-own_len // BLOCK_SIZE)
    num_blocks = 1 + shared + num_reqs * own
    key_cache, key_q = jax.random.split(jax.random.key(seed))
    kv_cache = jax.random.normal(key_cache, (num_blocks, 2, BLOCK_SIZE, num_kv_heads, head_dim), jnp.bfloat16)
    ids = 1 + np.random.default_rng(seed).permutation(num_blocks - 1)
    tables = np.concatenate([np.tile(ids[:shared], (num_reqs, 1)), ids[shared:].reshape(num_reqs, own)], axis=1)
    metadata = make_attention_metadata([1] * num_reqs, [prefix_len + own_len] * num_reqs, tables, block_size=BLOCK_SIZE)
    q = jax.random.normal(key_q, (num_reqs, num_q_heads, head_dim), jnp.bfloat16)
    return q, kv_cache, metadata, shared


def wall_ms(fn, *args, calls=CALLS) -> float:
    """Per call, `calls` calls sent back to back after a warm one."""
    jax.block_until_ready(fn(*args))
    started = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - started) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small shapes in interpret mode (CPU)")
    parser.add_argument("--sections", default="check", help="comma-separated: check (the table), grid "
                        "(plain against cascade over requests x prefix lengths, kernel time)")
    args = parser.parse_args()
    shapes, batches, own = (TINY["shapes"], TINY["batches"], TINY["own"]) if args.tiny else (SHAPES, BATCHES, OWN_TOKENS)
    options = {"interpret": True} if args.tiny else {}
    attend = jax.jit(lambda q, cache, metadata: paged_attention(q, cache, metadata, **options))
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    sections = args.sections.split(",")
    rows = []
    for shape_name, (num_q_heads, num_kv_heads, head_dim) in shapes.items() if "check" in sections else ():
        for num_reqs, prefix_len in batches:
            q, cache, plain, shared = shared_prefix_batch(0, num_reqs=num_reqs, prefix_len=prefix_len, own_len=own,
                                                          num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                                          head_dim=head_dim)  # fmt: skip
            split = plain.replace(num_common_prefix_blocks=jnp.int32(shared))
            out, expected = attend(q, cache, split), attend(q, cache, plain)
            error = float(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32)).max())
            ok = bool(jnp.isfinite(out).all()) and np.allclose(out.astype(jnp.float32), expected.astype(jnp.float32),
                                                                 **TOLERANCES[jnp.dtype(jnp.bfloat16)])  # fmt: skip
            if num_reqs == min(b for b, _ in batches):
                oracle = reference.paged_attention(q, cache, plain).astype(jnp.float32)
                ok &= np.allclose(out.astype(jnp.float32), oracle, **TOLERANCES[jnp.dtype(jnp.bfloat16)])
            timed = {name: (wall_ms(attend, q, cache, m), float("nan") if args.tiny else kernel_ms(attend, q, cache, m))
                     for name, m in (("plain", plain), ("cascade", split))}  # fmt: skip
            pick = cascade_pays(num_reqs=num_reqs, num_query_tokens=num_reqs, prefix_len=prefix_len,
                                num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, kv_itemsize=2)
            row = (shape_name, num_reqs, prefix_len, *timed["plain"], *timed["cascade"],
                   timed["plain"][0] / timed["cascade"][0], "cascade" if pick else "plain",
                   timed["plain"][0] / timed["cascade" if pick else "plain"][0], error,
                   "PASS" if ok else "FAIL")  # fmt: skip
            print(" | ".join(map(str, row)), flush=True)
            rows.append(row)
            if not args.tiny and num_reqs == max(b for b, _ in batches) and prefix_len:
                for name, ms in kernel_breakdown(attend, q, cache, split):
                    print(f"  cascade kernel {ms * 1e3:8.1f} us  {name[:100]}", flush=True)
    grid = grid_timings(attend, shapes, *(TINY["grid"] if args.tiny else (GRID_REQUESTS, GRID_PREFIXES)), own,
                        timer=wall_ms if args.tiny else kernel_ms) if "grid" in sections else []  # fmt: skip
    print("\n| heads | decodes | shared prefix | plain: wall / kernels ms | cascade: wall / kernels ms | plain / cascade "
          "(wall) | rule picks | plain / picked (wall) | max abs diff | check |\n"
          "|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for (shape_name, num_reqs, prefix_len, plain_wall, plain_kernels, wall, kernels, ratio, pick, gain, error,
         verdict) in rows:  # fmt: skip
        print(f"| {shape_name} | {num_reqs} | {prefix_len:,} + {own} own | {plain_wall:.3f} / {plain_kernels:.3f} | "
              f"{wall:.3f} / {kernels:.3f} | {ratio:.2f}x | {pick} | {gain:.2f}x | {error:.3g} | {verdict} |")  # fmt: skip


    if grid:
        print("\n| heads | decodes | shared prefix | plain kernels ms | cascade kernels ms | plain / cascade |\n"
              "|---|---|---|---|---|---|")  # fmt: skip
        for shape_name, num_reqs, prefix_len, plain_ms, cascade_ms in grid:
            print(f"| {shape_name} | {num_reqs} | {prefix_len:,} | {plain_ms:.4f} | {cascade_ms:.4f} | "
                  f"{plain_ms / cascade_ms:.2f}x |")


def grid_timings(attend, shapes, requests, prefixes, own, *, timer):
    """(heads, requests, prefix, plain ms, cascade ms) over the grid: the data the cost rule is set from."""
    grid = []
    for shape_name, (num_q_heads, num_kv_heads, head_dim) in shapes.items():
        for num_reqs in requests:
            for prefix_len in prefixes:
                q, cache, plain, shared = shared_prefix_batch(1, num_reqs=num_reqs, prefix_len=prefix_len,
                                                              own_len=own, num_q_heads=num_q_heads,
                                                              num_kv_heads=num_kv_heads, head_dim=head_dim)  # fmt: skip
                split = plain.replace(num_common_prefix_blocks=jnp.int32(shared))
                grid.append((shape_name, num_reqs, prefix_len, timer(attend, q, cache, plain),
                             timer(attend, q, cache, split)))  # fmt: skip
                print("grid |", " | ".join(map(str, grid[-1])), flush=True)
    return grid


if __name__ == "__main__":
    main()
