"""The main job for now: paged attention on a random mixed batch, layer by layer, printing what it computed.

A Gemma-3-like pattern: sliding-window layers and a global layer share one paged cache layout; each
layer uses its own window, so the same step's queries see different keys per layer.
Run: scripts/demo  (or python -m jax_hybrid_attn.demo --help)
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from . import metadata_group_key, paged_attention, split_decodes_and_prefills
from .params import LayerAttentionParams
from .testing import random_paged_inputs

LAYERS = {
    "local (window 64, soft cap 50)": LayerAttentionParams(sliding_window=64, logits_soft_cap=50.0),
    "global (soft cap 50)": LayerAttentionParams(logits_soft_cap=50.0),
    "chunked (chunk 128)": LayerAttentionParams(attention_chunk_size=128),
    "sinks + window 32": LayerAttentionParams(sliding_window=32, has_sinks=True),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)

    query_lens, seq_lens = [1, 1, 1, 37, 200], [300, 75, 513, 37, 260]
    inputs = random_paged_inputs(
        args.seed, query_lens=query_lens, seq_lens=seq_lens, num_q_heads=8, num_kv_heads=2, head_dim=128,
        block_size=args.block_size, dtype=jnp.bfloat16, with_sinks=True,
    )  # fmt: skip
    decodes, prefills, decode_tokens, prefill_tokens = split_decodes_and_prefills(inputs.metadata)
    implementation = "Mosaic GPU kernels" if jax.default_backend() == "gpu" else "the jnp reference (CPU)"
    print(f"jax {jax.__version__} on {jax.default_backend()}: {implementation}; block_size={args.block_size}")
    print(f"batch: query_lens={query_lens} seq_lens={seq_lens}")
    print(f"  {decodes} decodes ({decode_tokens} tokens), {prefills} prefills ({prefill_tokens} tokens)")
    print(f"  q {inputs.q.shape} {inputs.q.dtype}, kv_cache {inputs.kv_cache.shape} (NaN in unused blocks)")
    print(f"  metadata groups: {len({metadata_group_key(p) for p in LAYERS.values()})} for {len(LAYERS)} layers")
    for name, params in LAYERS.items():
        out = paged_attention(
            inputs.q, inputs.kv_cache, inputs.metadata, sm_scale=params.sm_scale,
            sliding_window=params.sliding_window, attention_chunk_size=params.attention_chunk_size,
            logits_soft_cap=params.logits_soft_cap, sinks=inputs.sinks if params.has_sinks else None,
            checked=True,
        )  # fmt: skip
        out = np.asarray(out.astype(jnp.float32))
        last = out[-1, 0, :4]
        print(f"{name:32s} out {out.shape} finite={np.isfinite(out).all()} "
              f"mean|out|={np.abs(out).mean():.4f}  last token head 0: {np.array2string(last, precision=3)}")  # fmt: skip


if __name__ == "__main__":
    main()
