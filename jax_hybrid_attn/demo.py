"""One serving step after another, through the join: allocator -> metadata -> layer attention.

A Gemma-3-like stack (sliding-window layers, a global layer) plus a Llama-4-like chunked-local layer. Three
requests share a system prompt; `KVCacheManager` schedules them under a token budget (prefill in chunks, then
decodes); every layer of every step writes its k/v by slot and attends (`layer_attention`: the jnp reference on
a CPU, the Mosaic GPU kernels on a GPU). Per step it prints the blocks each KV-cache group holds (the full group
holds what full attention needs), the prefix hits, and the largest difference from dense attention over each
request's own keys and values.

Run: python -m jax_hybrid_attn.demo --help  (scripts/demo runs the serving engine, `jha generate`)
"""

import argparse
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from . import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    LayerAttentionParams,
    SlidingWindowSpec,
    layer_attention,
    masks,
    metadata_from_step,
)
from .allocator import AllocatorConfig, KVCacheManager
from .constants import NULL_BLOCK_ID

BLOCK_SIZE, WINDOW, CHUNK = 16, 64, 64
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 128
GROUPS = ("sliding", "chunked", "full")  # KV-cache groups, in the allocator's order
LAYERS = (  # (name, KV-cache group, parameters): each layer keeps its own window, soft cap and scale
    ("local 0", 0, LayerAttentionParams(sliding_window=WINDOW, logits_soft_cap=50.0)),
    ("local 1", 0, LayerAttentionParams(sliding_window=WINDOW, logits_soft_cap=50.0)),
    ("chunked", 1, LayerAttentionParams(attention_chunk_size=CHUNK)),
    ("global", 2, LayerAttentionParams(logits_soft_cap=50.0)),
)
SYSTEM_PROMPT = [(7 * i) % 101 for i in range(96)]


def token_kv(prefix: tuple[int, ...], layer: int) -> np.ndarray:
    """K and V [2, K, H] of the last token of `prefix` in `layer`: a stand-in for a model, fixed by the prefix."""
    seed = zlib.crc32(np.asarray(prefix, np.int64).tobytes()) + 7919 * layer
    return np.random.default_rng(seed).standard_normal((2, NUM_KV_HEADS, HEAD_DIM)) * 0.5


def dense_attention(q, kv, first_position: int, params: LayerAttentionParams) -> np.ndarray:
    """float64 attention of q [n, N, H] at positions ``first_position...`` over one request's kv [2, L, K, H]."""
    positions = first_position + np.arange(q.shape[0])
    allowed = np.asarray(masks.attention_mask(positions[:, None], np.arange(kv.shape[1]), kv.shape[1], params=params))
    k, v = (np.repeat(x, NUM_Q_HEADS // NUM_KV_HEADS, axis=1) for x in kv)  # [L, N, H]
    logits = np.einsum("qnh,lnh->nql", q, k) * (params.sm_scale or HEAD_DIM**-0.5)
    if params.logits_soft_cap:
        logits = params.logits_soft_cap * np.tanh(logits / params.logits_soft_cap)
    logits = np.where(allowed, logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.einsum("nql,lnh->qnh", weights / weights.sum(axis=-1, keepdims=True), v)


class Server:
    """The allocator, one NaN-filled cache per layer, and each request's tokens."""

    def __init__(self, *, dtype, budget: int):
        spec = dict(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=dtype)
        specs = (
            SlidingWindowSpec(sliding_window=WINDOW, **spec),
            ChunkedLocalAttentionSpec(attention_chunk_size=CHUNK, **spec),
            FullAttentionSpec(**spec),
        )
        self.config = AllocatorConfig(
            specs=specs, num_blocks=96, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=budget
        )
        self.manager = KVCacheManager(self.config)
        self.dtype = dtype
        shape = (self.config.num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.caches = [jnp.full(shape, jnp.nan, dtype) for _ in LAYERS]
        self.tokens: dict[str, list[int]] = {}
        self.rng = np.random.default_rng(0)

    def add(self, rid: str, prompt: list[int]) -> None:
        self.manager.add_request(rid, prompt)
        self.tokens[rid] = list(prompt)

    def next_batch(self) -> list[tuple[str, int]]:
        """vLLM's order: each request's remaining prompt (a token budget: the step clips it) or one new token."""
        batch, budget = [], self.config.max_num_batched_tokens
        for rid, tokens in self.tokens.items():
            left = len(tokens) - self.manager.num_computed_tokens(rid)
            if left == 0:
                tokens.append(int(self.rng.integers(0, 101)))  # the token "sampled" last step
                self.manager.append_token_ids(rid, tokens[-1:])
                left = 1
            if budget > 0:
                batch.append((rid, min(left, budget)))
                budget -= batch[-1][1]
        return batch

    def step(self, batch) -> tuple[dict, int, float]:
        """One step through the join. Returns ({request: (computed, scheduled)}, prefix-hit tokens,
        max |out - dense|)."""
        out = self.manager.schedule(batch)
        rows = {rid: row for row, (rid, _) in enumerate(batch)}
        computed, scheduled = np.asarray(out.num_computed_tokens), np.asarray(out.num_scheduled_tokens)
        starts = np.asarray(out.query_start_loc)
        num_tokens, error = self.config.max_num_batched_tokens, 0.0
        for layer, (_, group, params) in enumerate(LAYERS):
            q = self.rng.standard_normal((num_tokens, NUM_Q_HEADS, HEAD_DIM))
            kv = np.zeros((2, num_tokens, NUM_KV_HEADS, HEAD_DIM))
            history = {}
            for rid, row in rows.items():
                prefix = self.tokens[rid][: computed[row] + scheduled[row]]
                history[rid] = np.stack([token_kv(tuple(prefix[: p + 1]), layer) for p in range(len(prefix))], 1)
                kv[:, starts[row] : starts[row + 1]] = history[rid][:, computed[row] :]
            q, k, v = (jnp.asarray(x, self.dtype) for x in (q, kv[0], kv[1]))
            metadata = metadata_from_step(self.config, out, group)
            got, self.caches[layer] = layer_attention(q, k, v, self.caches[layer], metadata, params=params)
            got, q = np.asarray(got, np.float64), np.asarray(q, np.float64)
            for rid, row in rows.items():
                span = slice(starts[row], starts[row + 1])
                stored = np.asarray(jnp.asarray(history[rid], self.dtype), np.float64)
                want = dense_attention(q[span], stored, computed[row], params)
                error = max(error, float(np.abs(got[span] - want).max(initial=0.0)))
        hits = int(np.asarray(out.num_new_computed_tokens).sum())
        return {rid: (computed[row], scheduled[row]) for rid, row in rows.items()}, hits, error

    def blocks_held(self) -> list[int]:
        """Real blocks (not the null block) each group holds over all requests."""
        held = [0] * len(GROUPS)
        for rid in self.tokens:
            for group, blocks in enumerate(self.manager.get_block_ids(rid)):
                held[group] += sum(block != NULL_BLOCK_ID for block in blocks)
        return held


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--budget", type=int, default=64, help="max_num_batched_tokens: tokens per step")
    args = parser.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    server = Server(dtype=jnp.bfloat16 if on_gpu else jnp.float32, budget=args.budget)
    implementation = "Mosaic GPU kernels, bfloat16" if on_gpu else "the jnp reference, float32"
    print(f"jax {jax.__version__} on {jax.default_backend()}: {implementation}; block_size={BLOCK_SIZE}")
    print(f"groups: {GROUPS[0]} (window {WINDOW}), {GROUPS[1]} (chunk {CHUNK}), {GROUPS[2]}; "
          f"layers: {', '.join(f'{name} -> {GROUPS[g]}' for name, g, _ in LAYERS)}")  # fmt: skip
    print(f"three requests share a {len(SYSTEM_PROMPT)}-token system prompt; {args.budget} tokens per step\n")
    print(f"{'step':>4}  {'scheduled (computed + new)':<30} {'hits':>5}  "
          f"{'blocks held: ' + ' / '.join(GROUPS):<36} {'max |out - dense|':>17}")  # fmt: skip
    questions = {"a": [1, 2, 3] * 12, "b": [4, 5] * 20, "c": [6] * 30}
    for step in range(1, args.steps + 1):
        if step <= len(questions):  # a new request arrives in each of the first steps
            rid = list(questions)[step - 1]
            server.add(rid, SYSTEM_PROMPT + questions[rid])
        rows, hits, error = server.step(server.next_batch())
        held = server.blocks_held()
        scheduled = " ".join(f"{rid}:{c}+{n}" for rid, (c, n) in rows.items())
        print(f"{step:>4}  {scheduled:<30} {hits:>5}  {' / '.join(map(str, held)):<36} {error:>17.2e}")
    print(f"\nblocks held: real blocks of all requests per group; the {GROUPS[2]} group holds what full attention")
    print("needs, the window and chunk groups free the blocks their layers no longer read.")


if __name__ == "__main__":
    main()
