"""One serving step end to end, many times: the allocator schedules, `metadata_from_step` gives each KV-cache group
its metadata, `layer_attention` writes each layer's k/v by slot and attends.

Three groups (sliding window, chunked-local, full), one layer each, over a trace with chunked prefill, a prefix
hit, a request finishing while others continue, and a preemption with its resume. After every step, every
scheduled token's output equals float64 attention over its own request's K/V history, which the test keeps apart
from the cache. K/V of a position are a fixed function of the token prefix up to it (as in a real model), so blocks
that a prefix hit shares hold the right values. Caches start as NaN: a read of a slot nobody wrote shows.
"""

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_hybrid_attn import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    LayerAttentionParams,
    SlidingWindowSpec,
    layer_attention,
    metadata_from_step,
)
from jax_hybrid_attn.allocator import AllocatorConfig, KVCacheManager
from jax_hybrid_attn.testing import TOLERANCES

from .oracle import attention_float64

BLOCK_SIZE, WINDOW, CHUNK = 16, 24, 32
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64
SPEC = dict(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=jnp.float32)
SPECS = (
    SlidingWindowSpec(sliding_window=WINDOW, **SPEC),
    ChunkedLocalAttentionSpec(attention_chunk_size=CHUNK, **SPEC),
    FullAttentionSpec(**SPEC),
)
LAYERS = (  # layer g uses KV-cache group g; its parameters are its own, never the group's
    LayerAttentionParams(sliding_window=WINDOW, logits_soft_cap=20.0),
    LayerAttentionParams(attention_chunk_size=CHUNK, sm_scale=0.1),
    LayerAttentionParams(),
)
SHARED_PREFIX = [7, 3, 5, 1] * 16  # 64 tokens: four full blocks that a later prompt hits


def make_config(*, in_window_only: bool) -> AllocatorConfig:
    return AllocatorConfig(
        specs=SPECS,
        num_blocks=48,
        max_num_seqs=4,
        max_model_len=160,
        max_num_batched_tokens=48,
        sliding_window_in_window_only=in_window_only,
    )


def token_kv(prefix: tuple[int, ...], layer: int) -> np.ndarray:
    """K and V [2, K, H] of the last token of `prefix` in `layer`: a fixed function of the prefix."""
    seed = zlib.crc32(np.asarray(prefix, np.int64).tobytes()) + 7919 * layer
    return np.random.default_rng(seed).standard_normal((2, NUM_KV_HEADS, HEAD_DIM))


class Driver:
    """A `KVCacheManager`, one NaN-filled cache per layer, and each request's tokens; runs steps through the join."""

    def __init__(self, config: AllocatorConfig):
        self.config = config
        self.manager = KVCacheManager(config)
        shape = (config.num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.caches = [jnp.full(shape, jnp.nan, jnp.float32) for _ in LAYERS]
        self.tokens: dict[str, list[int]] = {}
        self.rng = np.random.default_rng(0)
        self.steps = 0
        self.hit_tokens = 0

    def add(self, rid: str, prompt: list[int]) -> None:
        self.manager.add_request(rid, prompt)
        self.tokens[rid] = list(prompt)

    def sample(self, rid: str) -> None:
        """Append a 'sampled' token to a request whose known tokens are all computed."""
        token = int(self.rng.integers(0, 100))
        self.manager.append_token_ids(rid, [token])
        self.tokens[rid].append(token)

    def step(self, batch: list[tuple[str, int]], *, kernels: bool = False) -> dict:
        """Schedule `batch`, run every layer through the join on the reference, and check each scheduled token
        against float64 attention over its request's history; with `kernels`, first run the kernels (interpret
        mode) on a bfloat16 copy of the caches too, checked the same way. Returns {rid: tokens scheduled}."""
        out = self.manager.schedule(batch)
        self.steps += 1
        scheduled = np.asarray(out.num_scheduled_tokens)
        computed = np.asarray(out.num_computed_tokens)
        starts = np.asarray(out.query_start_loc)
        self.hit_tokens += int(np.sum(np.asarray(out.num_new_computed_tokens)))
        num_tokens = self.config.max_num_batched_tokens
        for layer, params in enumerate(LAYERS):
            q = self.rng.standard_normal((num_tokens, NUM_Q_HEADS, HEAD_DIM))
            kv = np.zeros((2, num_tokens, NUM_KV_HEADS, HEAD_DIM))
            for row, (rid, _) in enumerate(batch):
                for i in range(scheduled[row]):
                    kv[:, starts[row] + i] = token_kv(tuple(self.tokens[rid][: computed[row] + i + 1]), layer)
            metadata = metadata_from_step(self.config, out, layer)
            runs = [("kernel", jnp.bfloat16)] if kernels else []
            for implementation, dtype in runs + [("reference", jnp.float32)]:
                q_in, k, v = (jnp.asarray(x, dtype) for x in (q, kv[0], kv[1]))
                cache = self.caches[layer].astype(dtype)  # a copy for the kernels, the cache itself otherwise
                got, cache = layer_attention(
                    q_in, k, v, cache, metadata, params=params, implementation=implementation,
                    interpret=implementation == "kernel" and jax.default_backend() != "gpu",
                )  # fmt: skip
                self._check(batch, out, layer, q_in, np.asarray(got.astype(jnp.float32)), dtype)
            self.caches[layer] = cache
        return {rid: int(scheduled[row]) for row, (rid, _) in enumerate(batch)}

    def _check(self, batch, out, layer, q, got, dtype) -> None:
        scheduled = np.asarray(out.num_scheduled_tokens)
        seq_lens = np.asarray(out.seq_lens)
        starts = np.asarray(out.query_start_loc)
        params = dataclasses.asdict(LAYERS[layer])
        for row, (rid, _) in enumerate(batch):
            if not scheduled[row]:
                continue
            history = np.stack([token_kv(tuple(self.tokens[rid][: p + 1]), layer) for p in range(seq_lens[row])])
            history = np.asarray(jnp.asarray(history, dtype).astype(jnp.float32), np.float64)  # as stored
            rows = slice(starts[row], starts[row] + scheduled[row])
            want = attention_float64(
                np.asarray(q[rows].astype(jnp.float32)), [history[:, 0]], [history[:, 1]], [scheduled[row]], **params
            )
            np.testing.assert_allclose(
                got[rows], want, **TOLERANCES[jnp.dtype(dtype)],
                err_msg=f"step {self.steps}, layer {layer} ({LAYERS[layer]}), request {rid}",
            )  # fmt: skip


def run_trace(driver: Driver, *, kernel_steps=()) -> None:
    """At least 12 steps: chunked prefill, a prefix hit, decodes across block, window and chunk edges, a request
    finishing while others continue, a preemption and its resume. Steps in `kernel_steps` also run the kernels."""
    left = {}

    def step(batch):
        done = driver.step(batch, kernels=driver.steps + 1 in kernel_steps)
        for rid in done:
            left[rid] = driver.manager.num_tokens(rid) - driver.manager.num_computed_tokens(rid)

    def decode_or_continue(rids):
        """Each request's next tokens: the rest of its prompt, or one newly sampled token."""
        batch = []
        for rid in rids:
            if left.get(rid, 1) == 0:
                driver.sample(rid)
                batch.append((rid, 1))
            else:
                batch.append((rid, left.get(rid, driver.manager.num_tokens(rid))))
        return batch

    driver.add("a", SHARED_PREFIX + [11, 12, 13, 14, 15, 16])  # 70 tokens
    while driver.manager.num_computed_tokens("a") < 70:  # chunked prefill under a 48-token budget
        step([("a", min(48, 70 - driver.manager.num_computed_tokens("a")))])
    driver.add("b", SHARED_PREFIX + [21, 22, 23])
    hits_before = driver.hit_tokens
    step(decode_or_continue(["a"]) + [("b", 40)])
    assert driver.hit_tokens - hits_before >= 48, "b's prompt must hit a's cached prefix"
    driver.add("c", [31 + i for i in range(20)])
    for _ in range(4):
        step(decode_or_continue(["a", "b", "c"]))
    driver.manager.free("c")  # c finishes; a and b continue
    step(decode_or_continue(["a", "b"]))
    driver.manager.preempt("b")  # b's blocks go back; it recomputes later, hitting what is still cached
    left["b"] = driver.manager.num_tokens("b")
    step(decode_or_continue(["a"]))
    while left["b"]:
        step(decode_or_continue(["a"]) + [("b", min(left["b"], 40))])
    for _ in range(3):
        step(decode_or_continue(["a", "b"]))
    assert driver.steps >= 12


@pytest.mark.parametrize("in_window_only", [False, True], ids=["vllm_rule", "in_window_only"])
def test_serving_steps_through_the_join_equal_dense_attention(in_window_only):
    """Under vLLM's rule the prefix-hit step (a decode beside a prefill over a shared prefix) also runs the kernels
    (interpret mode on a CPU); the other rule changes the block tables, not what the kernels do."""
    run_trace(Driver(make_config(in_window_only=in_window_only)), kernel_steps=() if in_window_only else (3,))


def test_one_jit_from_the_step_output_to_every_layer():
    """metadata_from_step and layer_attention trace: a whole step's attention (every group and layer) runs as one
    jitted function of the StepOutput, with no host round trip, and gives what the eager calls give."""
    config = make_config(in_window_only=False)
    manager = KVCacheManager(config)
    manager.add_request("a", SHARED_PREFIX[:40])
    manager.add_request("b", SHARED_PREFIX[:20] + [1, 2, 3])
    out = manager.schedule([("a", 40), ("b", 8)])
    rng = np.random.default_rng(1)
    num_tokens = config.max_num_batched_tokens
    q = jnp.asarray(rng.standard_normal((len(LAYERS), num_tokens, NUM_Q_HEADS, HEAD_DIM)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((len(LAYERS), 2, num_tokens, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
    shape = (config.num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    fresh = lambda: [jnp.zeros(shape, jnp.float32) for _ in LAYERS]  # noqa: E731

    def attention_of_step(out, caches, q, kv):
        outputs = []
        for layer, params in enumerate(LAYERS):
            metadata = metadata_from_step(config, out, layer)
            y, caches[layer] = layer_attention(
                q[layer], kv[layer, 0], kv[layer, 1], caches[layer], metadata, params=params, implementation="reference"
            )
            outputs.append(y)
        return jnp.stack(outputs), caches

    eager, _ = attention_of_step(out, fresh(), q, kv)
    jitted, caches = jax.jit(attention_of_step)(out, fresh(), q, kv)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), **TOLERANCES[jnp.dtype(jnp.float32)])
    assert np.all(np.isfinite(np.asarray(jitted))) and float(jnp.abs(caches[0]).sum()) > 0


def test_join_refuses_bad_arguments():
    config = make_config(in_window_only=False)
    manager = KVCacheManager(config)
    manager.add_request("a", [1, 2, 3])
    out = manager.schedule([("a", 3)])
    with pytest.raises(ValueError, match="group=3"):
        metadata_from_step(config, out, 3)
    with pytest.raises(ValueError, match="return_block_tables"):
        metadata_from_step(config, dataclasses.replace(out, block_tables=None), 0)
    with pytest.raises(ValueError, match="max_query_len"):
        metadata_from_step(config, out, 0, max_query_len=-1)
    with pytest.raises(ValueError, match="causal"):
        metadata_from_step(config, out, 0, causal="yes")
    metadata = metadata_from_step(config, out, 0)
    same = metadata_from_step(config, out, np.int64(0), max_query_len=np.int64(config.max_num_batched_tokens))
    assert (same.max_query_len, type(same.max_query_len)) == (metadata.max_query_len, int)  # numpy ints are valid
    shape = (config.num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    q = jnp.zeros((config.max_num_batched_tokens, NUM_Q_HEADS, HEAD_DIM))
    k = jnp.zeros((config.max_num_batched_tokens, NUM_KV_HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match="k and v"):
        layer_attention(q, k, None, jnp.zeros(shape), metadata)
    with pytest.raises(ValueError, match="params"):
        layer_attention(q, k, k, jnp.zeros(shape), metadata, params=dict(sliding_window=4))


def test_the_engine_cache_checks_its_block_tables_once_per_step_and_flags_a_bad_row():
    """`with_checked_block_tables` (once per step, before the layers): a row whose table holds an id outside its
    tensor comes out NaN, flagged through its ``seq_lens``, as the per-layer check flags it without it; the other
    rows are unchanged; each layer's metadata vouches for its ids, so none checks them again."""
    from jax_hybrid_attn.engine.paged_cache import PagedCache, with_checked_block_tables

    config = make_config(in_window_only=False)
    manager = KVCacheManager(config)
    manager.add_request("a", SHARED_PREFIX[:30])
    manager.add_request("b", SHARED_PREFIX[:20] + [1, 2, 3])
    out = manager.schedule([("a", 30), ("b", 12)])
    full = 2  # the full-attention group and layer
    bad = dataclasses.replace(out, block_tables=out.block_tables.at[full, 0, 0].set(config.num_blocks + 5))
    rng = np.random.default_rng(3)
    num_tokens = int(out.query_start_loc[-1])
    q = jnp.asarray(rng.standard_normal((num_tokens, NUM_Q_HEADS, HEAD_DIM)), jnp.float32)
    k, v = jnp.asarray(rng.standard_normal((2, num_tokens, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((3, config.num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
    max_keys = max(config.blocks_per_row) * BLOCK_SIZE

    def attend(step, in_range):
        cache = PagedCache(
            kv=kv, step=step, positions=step.positions[:num_tokens], layer=None, layer_group=(0, 1, 2),
            layer_tensor=(0, 1, 2), blocks_per_row=config.blocks_per_row, max_query_len=num_tokens,
            max_seq_len=config.max_model_len, implementation="reference", block_ids_in_range=in_range,
        )  # fmt: skip
        y, _ = cache.attend(full, q, k, v, params=LAYERS[full])
        return cache.metadata(full, full), np.asarray(y)

    _, clean = attend(out, False)
    checked = with_checked_block_tables(bad, num_blocks=config.num_blocks, max_keys=max_keys)
    assert np.asarray(checked.seq_lens).tolist()[:2] == [max_keys + 1, int(out.seq_lens[1])]
    assert int(checked.block_tables.max()) < config.num_blocks
    for step, in_range in ((bad, False), (checked, True)):
        metadata, y = attend(step, in_range)
        assert metadata.block_ids_in_range == in_range
        first = int(out.query_start_loc[1])
        assert np.isnan(y[:first]).all()
        np.testing.assert_array_equal(y[first:], clean[first:])
    same = with_checked_block_tables(out, num_blocks=config.num_blocks, max_keys=max_keys)
    np.testing.assert_array_equal(np.asarray(same.seq_lens), np.asarray(out.seq_lens))
