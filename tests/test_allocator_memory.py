"""Memory on a Gemma-3-like model: five 1,024-window layers per full layer, block 16, 32,768-token contexts.

A request is prefilled in chunks of up to 2,048 tokens and decoded to 32,768 tokens. Its blocks per group never
exceed the bound vLLM sizes memory with (``cdiv(1023 + chunk, 16) + 1`` per window group, ``cdiv(len, 16)`` for
full attention) and reach it; the ratio to full-attention allocation in every group is about 0.19 while decoding.
"""

import jax.numpy as jnp
import numpy as np

from jax_hybrid_attn import FullAttentionSpec, SlidingWindowSpec
from jax_hybrid_attn.allocator import AllocatorConfig, KVCacheManager

CONTEXT, WINDOW, BLOCK, CHUNK = 32768, 1024, 16, 2048
LAYER = dict(block_size=BLOCK, num_kv_heads=8, head_size=256, dtype=jnp.bfloat16)
SPECS = (FullAttentionSpec(**LAYER),) + (SlidingWindowSpec(**LAYER, sliding_window=WINDOW),) * 5


def bound(max_num_batched_tokens):
    return [
        s.max_num_blocks_per_request(max_model_len=CONTEXT, max_num_batched_tokens=max_num_batched_tokens)
        for s in SPECS
    ]


def held(manager, request_id):
    return [sum(1 for b in blocks if b) for blocks in manager.get_block_ids(request_id)]


def one_request_config(**options) -> AllocatorConfig:
    return AllocatorConfig(
        specs=SPECS,
        num_blocks=2048 + 5 * 200 + 1,
        max_num_seqs=1,
        max_model_len=CONTEXT,
        max_num_batched_tokens=CHUNK,
        **options,
    )


def test_blocks_held_at_32k_equal_the_bound():
    manager = KVCacheManager(one_request_config())
    rng = np.random.default_rng(0)
    decode_steps = 40
    manager.add_request("r", rng.integers(0, 256_000, CONTEXT - decode_steps).tolist())
    # Prefill: a first chunk of 2,001 tokens puts the window start mid-block, the worst case for the bound.
    prefill_peak = np.zeros(6, int)
    first = True
    while manager.num_computed_tokens("r") < CONTEXT - decode_steps:
        left = CONTEXT - decode_steps - manager.num_computed_tokens("r")
        assert manager.allocate_slots("r", min(2001 if first else CHUNK, left)) is not None
        first = False
        now = np.array(held(manager, "r"))
        assert np.all(now <= bound(CHUNK)), (now, bound(CHUNK))
        prefill_peak = np.maximum(prefill_peak, now)
    assert prefill_peak[1:].tolist() == bound(CHUNK)[1:] == [193] * 5
    decode_peak = np.zeros(6, int)
    for step in range(decode_steps):
        manager.append_token_ids("r", [step])
        assert manager.allocate_slots("r", 1) is not None
        now = np.array(held(manager, "r"))
        assert np.all(now <= bound(1)), (now, bound(1))
        decode_peak = np.maximum(decode_peak, now)
    assert manager.num_computed_tokens("r") == CONTEXT
    assert decode_peak.tolist() == bound(1) == [2048] + [65] * 5
    full_everywhere = len(SPECS) * CONTEXT // BLOCK
    assert round(sum(bound(1)) / full_everywhere, 3) == 0.193  # decoding: 2,373 of 12,288 blocks
    assert round(sum(bound(CHUNK)) / full_everywhere, 3) == 0.245  # prefill chunks of 2,048 tokens


def test_in_window_only_holds_at_most_two_windows_whatever_the_budget():
    """With ``sliding_window_in_window_only`` chunks are clipped to the window, so a window group holds at most
    ``2 * (cdiv(W - 1, S) + 1)`` = 130 blocks while prefilling with a 2,048-token budget (vLLM's bound: 193)."""
    config = one_request_config(sliding_window_in_window_only=True)
    assert config.admission_caps[1:] == (130,) * 5
    manager = KVCacheManager(config)
    manager.add_request("r", np.random.default_rng(1).integers(0, 256_000, CONTEXT).tolist())
    peak, steps = np.zeros(6, int), 0
    while manager.num_computed_tokens("r") < CONTEXT:
        before = manager.num_computed_tokens("r")
        assert manager.allocate_slots("r", min(CHUNK, CONTEXT - before)) is not None
        assert manager.num_computed_tokens("r") - before <= WINDOW - 2 + BLOCK - before % BLOCK
        peak = np.maximum(peak, held(manager, "r"))
        steps += 1
    assert np.all(peak[1:] <= 130) and peak[1:].min() >= 129, peak
    assert peak[0] == CONTEXT // BLOCK and steps >= CONTEXT // (WINDOW - 1 + BLOCK)
