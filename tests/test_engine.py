"""The engine against the dense forward: for every family, greedy tokens through the allocator, chunked prefill,
prefix hits and preemption equal a plain dense JAX forward of the same model, token for token, in float32.

The dense forward recomputes the whole sequence for every token (`DenseAttention` over a fixed padded length:
causal layers never look at the padding), with no cache, allocator or metadata: nothing it shares with the
engine but the model's weights.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_hybrid_attn.engine import Engine, EngineConfig, SamplingParams
from jax_hybrid_attn.engine.prefix_estimate import CachedPrefixes
from jax_hybrid_attn.models import Decoder, DenseAttention, ModelConfig

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256)  # fmt: skip
FAMILIES = {
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **COMMON, num_hidden_layers=3, sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16),  # fmt: skip
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON, num_hidden_layers=2, sliding_window=8, attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
        query_pre_attn_scalar=16),  # fmt: skip
    "mistral": lambda: transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=12),
    "llama4_text": lambda: transformers.Llama4TextConfig(
        **COMMON, num_hidden_layers=2, attention_chunk_size=16, intermediate_size_mlp=64, num_local_experts=2,
        interleave_moe_layer_step=2, no_rope_layers=[1, 0]),  # fmt: skip
    "gpt_oss": lambda: transformers.GptOssConfig(
        **COMMON, num_hidden_layers=2, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"]),  # fmt: skip
}
SHARED = [5, 9, 2, 7, 1, 3, 8, 6] * 4  # 32 tokens: two full blocks of 16 that a later prompt hits
PROMPTS = [
    list(range(3, 8)),  # 5 tokens
    SHARED + [11, 12, 13],  # 35: crosses two blocks, and the windows and chunks
    [40 + i % 17 for i in range(23)],
    SHARED + [21, 22],  # a prefix hit on SHARED's two blocks
    [60, 61],
]
MAX_TOKENS = 7


def tiny_model(family: str, seed: int = 0):
    config = ModelConfig.from_hf(FAMILIES[family]().to_dict())
    return config, perturbed_decoder(config, seed)


def perturbed_decoder(config: ModelConfig, seed: int) -> Decoder:
    """A random `Decoder` of `config`, every parameter perturbed: norm weights start at one (or zero), biases and
    sinks at zero, so that each one matters."""
    model = Decoder(config, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@partial(jax.jit, static_argnums=0)
def _dense_next_token(graphdef, state, tokens, last):
    """The argmax of the logits at `last` by the dense forward over all of `tokens` (one compile per model structure
    and padded length, shared by every prompt and token)."""
    logits, _ = nnx.merge(graphdef, state)(tokens, DenseAttention(tokens.shape[0]), logits_indices=last[None])
    return jnp.argmax(logits[0])


def dense_greedy(model, prompt: list[int], num_tokens: int, *, length: int = 64) -> list[int]:
    """Greedy tokens by the dense forward: the whole (padded) sequence every time, the logits at its end."""
    graphdef, state = nnx.split(model)
    tokens = list(prompt)
    for _ in range(num_tokens):
        padded = jnp.asarray(tokens + [0] * (length - len(tokens)), jnp.int32)
        tokens.append(int(_dense_next_token(graphdef, state, padded, jnp.int32(len(tokens) - 1))))
    return tokens[len(prompt) :]


def tightest_engine(model, config, **options) -> Engine:
    """The engine with the smallest pool that still fits one request of `max_model_len` tokens."""
    for num_blocks in range(4, 256):
        try:
            return Engine(model, config, EngineConfig(num_blocks=num_blocks, **options))
        except ValueError as error:
            assert "max_model_len" in str(error)
    raise AssertionError("no pool fits")


def generate_within(engine, prompts, sampling, *, max_steps: int):
    """`Engine.generate`, failing after `max_steps` engine steps instead of looping on (a scheduler that makes no
    progress, e.g. a preempted request taking the budget that the requests holding the blocks need)."""
    ids = [engine.add_request(prompt, sampling) for prompt in prompts]
    outputs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        outputs.update((output.request_id, output) for output in engine.step())
    assert not engine.has_unfinished_requests(), f"unfinished after {max_steps} steps"
    engine.synchronize()
    return [outputs[i] for i in ids]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_greedy_equals_the_dense_forward_through_chunks_hits_and_preemption(family):
    config, model = tiny_model(family)
    want = [dense_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    # An 8-token budget: every prompt but the last is prefilled in chunks. The smallest pool that fits one request
    # of max_model_len tokens: four requests of up to 42 tokens run out of it, and running ones are preempted
    engine = tightest_engine(model, config, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    outputs = generate_within(engine, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), max_steps=200)
    got = [o.output_token_ids for o in outputs]
    assert got == want
    assert engine.stats.cached_prompt_tokens > 0, "the shared prefix was not hit"
    assert engine.stats.preemptions > 0, "nothing was preempted"
    assert not engine.has_unfinished_requests() and engine.manager.num_free_blocks == engine.layout.num_blocks - 1


@pytest.mark.parametrize("family", ["gemma3_text", "llama4_text"])
def test_calls_of_several_decode_steps_give_the_dense_forwards_greedy_tokens(family):
    """`EngineConfig.decode_steps=4` through chunks, prefix hits and preemption (a pool as tight as the one-step
    test's), windows or chunks: greedy tokens equal to the dense forward's, every block back in the pool."""
    config, model = tiny_model(family)
    want = [dense_greedy(model, p, MAX_TOKENS + 4) for p in PROMPTS]
    tight = tightest_engine(model, config, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                            decode_steps=4)  # fmt: skip
    got = generate_within(tight, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS + 4, temperature=0.0), max_steps=200)
    assert [o.output_token_ids for o in got] == want
    assert tight.stats.multi_step_calls > 0 and tight.stats.preemptions > 0 and tight.stats.cached_prompt_tokens > 0
    assert not tight.has_unfinished_requests() and tight.manager.num_free_blocks == tight.layout.num_blocks - 1


def test_calls_of_several_decode_steps_give_the_one_step_engines_samples():
    """Seeded samples equal to the one-step engine's, with max_tokens that are no multiple of the 4 steps per call
    (each row bounded within a call) and a stop token met mid-call (the call's later tokens dropped)."""
    config, model = tiny_model("gemma3_text")
    sizes = dict(block_size=4, max_num_seqs=5, max_num_batched_tokens=64, max_model_len=64)
    sampled = [SamplingParams(max_tokens=n, temperature=0.8, top_k=20, top_p=0.9, seed=7 + i)
               for i, n in enumerate((5, 11, 14, 9, 13))]  # seeds of their own: the engine runs twice  # fmt: skip
    one_step = Engine(model, config, EngineConfig(**sizes))
    stop = one_step.generate(PROMPTS, sampled)[2].output_token_ids[6]  # met mid-call by the request it ends
    sampled = [dataclasses.replace(s, stop_token_ids=(stop,)) for s in sampled]
    one_step.reset()
    one = one_step.generate(PROMPTS, sampled)
    several = Engine(model, config, EngineConfig(**sizes, decode_steps=4))
    got = several.generate(PROMPTS, sampled)
    assert [(o.output_token_ids, o.finish_reason) for o in got] == [(o.output_token_ids, o.finish_reason) for o in one]
    assert one[2].finish_reason == "stop" and several.stats.multi_step_calls > 0


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_cascade_decode_steps_give_the_same_greedy_tokens(family):
    """Decode steps with cascade attention on the full-attention layers (``cascade_attention="always"``): requests
    behind one prompt prefix (hit from the prefix cache) give the dense forward's greedy tokens, as with it off
    (checked on one family: the switch does not depend on the layer pattern)."""
    config, model = tiny_model(family)
    prompts = [SHARED + [11 + i, 30 + 2 * i, 50 - i][: 1 + i % 3] for i in range(4)]
    want = [dense_greedy(model, p, MAX_TOKENS) for p in prompts]
    sizes = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    modes = ("always", "off") if family == "gemma3_text" else ("always",)
    engines = {mode: Engine(model, config, EngineConfig(**sizes, cascade_attention=mode)) for mode in modes}
    got = {mode: [o.output_token_ids for o in engine.generate(prompts, sampling)] for mode, engine in engines.items()}
    assert all(tokens == want for tokens in got.values()) and len(got) == len(modes)
    cascade = engines["always"].stats
    assert cascade.cascade_steps > 0
    if "off" in engines:
        assert engines["off"].stats.cascade_steps == 0
    assert cascade.peak_common_prefix_tokens >= len(SHARED) - sizes["block_size"], "the rows shared no prefix"
    assert cascade.cached_prompt_tokens > 0
    for engine in engines.values():
        assert not engine.has_unfinished_requests() and engine.manager.num_free_blocks == engine.layout.num_blocks - 1


def test_an_fp8_kv_cache_gives_the_dense_forwards_greedy_tokens():
    """``kv_cache_dtype=float8_e4m3fn`` (``jha --kv-cache-dtype fp8``): the pool is float8 (a quarter of this float32
    model's bytes), K/V written with scale 1, through chunks, prefix hits and windows; the tiny model's greedy tokens
    hold. A dtype the kernels do not take, or one that is neither the model's nor float8, is refused."""
    config, model = tiny_model("gemma3_text")
    want = [dense_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    sizes = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    engine = Engine(model, config, EngineConfig(**sizes, kv_cache_dtype="float8_e4m3fn"))
    assert engine.runner.kv_cache.dtype == jnp.float8_e4m3fn
    got = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.output_token_ids for o in got] == want and engine.stats.cached_prompt_tokens > 0
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' must be None or one of"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype=bfloat16 must be the model's dtype \(float32\)"):
        Engine(model, config, EngineConfig(**sizes, kv_cache_dtype=jnp.bfloat16))


def test_an_fp8_cache_of_64_token_blocks_keeps_v_transposed_and_the_greedy_tokens():
    """Blocks of a multiple of 64 tokens give a float8 cache the "HND_VT" layout (V transposed per block, which the
    kernels' float8 PV product reads): the greedy tokens are the dense forward's, as with "NHD"."""
    config, model = tiny_model("gemma3_text")
    want = [dense_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    engine = Engine(model, config, EngineConfig(block_size=64, max_num_seqs=4, max_num_batched_tokens=64,
                                                max_model_len=128, kv_cache_dtype="float8_e4m3fn"))  # fmt: skip
    assert engine.layout.kv_layout == "HND_VT" and engine.runner.kv_cache.shape[3:5] == (config.num_kv_heads, 64)
    got = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.output_token_ids for o in got] == want
    assert engine.manager.num_free_blocks == engine.layout.num_blocks - 1


def test_float8_kv_cache_scales_divide_what_the_cache_stores():
    """A layer's ``k_scale`` / ``v_scale`` (a checkpoint's, `KVCacheScale`) reach its float8 cache writes and reads:
    with powers of two (exact in float) the cache holds K halved and V doubled where they are normal float8
    numbers (bit for bit but where a later layer's input rounds otherwise: within one float8 step), and the greedy
    tokens are those of scale 1. A cache in the model's dtype ignores the scales."""
    config, model = tiny_model("gemma3_text")
    sizes = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    runs = {}
    for k_scale, v_scale, dtype in ((1.0, 1.0, "float8_e4m3fn"), (2.0, 0.5, "float8_e4m3fn"), (2.0, 0.5, None)):
        scaled_model = nnx.clone(model)
        for layer in scaled_model.model.layers:
            layer.self_attn.k_scale[...] = jnp.float32(k_scale)
            layer.self_attn.v_scale[...] = jnp.float32(v_scale)
        engine = Engine(scaled_model, config, EngineConfig(**sizes, kv_cache_dtype=dtype, enable_prefix_caching=False))
        engine.add_request(PROMPTS[0], sampling)
        engine.step()  # the prompt's K/V in the cache
        engine.synchronize()
        cache = np.asarray(engine.runner.kv_cache.astype(jnp.float32))
        tokens = [o.output_token_ids for o in engine.generate(PROMPTS[1:], sampling)]
        runs[k_scale, dtype] = cache, tokens
    (plain, tokens), (scaled, scaled_tokens) = runs[1.0, "float8_e4m3fn"], runs[2.0, "float8_e4m3fn"]
    assert scaled_tokens == tokens == runs[2.0, None][1]
    for kv, factor in ((0, 2.0), (1, 0.5)):  # [num_tensors, B, 2, S, K, H]
        normal = np.abs(plain[:, :, kv]) >= 2.0**-5  # still normal once halved (float8 e4m3: from 2^-6)
        assert normal.any()
        rescaled, want = scaled[:, :, kv][normal] * factor, plain[:, :, kv][normal]
        np.testing.assert_allclose(rescaled, want, rtol=2.0**-3)  # float8 e4m3: 3 mantissa bits
        assert np.mean(rescaled == want) > 0.99


def test_cascade_attention_modes():
    assert not EngineConfig(cascade_attention="auto", implementation="reference").cascade_step
    assert EngineConfig(cascade_attention="auto", implementation="kernel").cascade_step
    assert not EngineConfig(cascade_attention="auto", implementation="kernel", interpret=True).cascade_step
    with pytest.raises(ValueError, match="cascade_attention='on' must be one of"):
        EngineConfig(cascade_attention="on")
    with pytest.raises(NotImplementedError, match="cascade_attention='always' with tensor_parallel=2"):
        EngineConfig(cascade_attention="always", tensor_parallel=2)


def test_new_requests_behind_a_cached_prefix_take_only_their_own_tokens_of_the_budget():
    """The scheduler expects the prefix cache's hits (`CachedPrefixes`): four prompts behind 32 cached tokens need
    2 tokens each, and one step of a 16-token budget prefills them all (without the estimate, 34 tokens each)."""
    config, model = tiny_model("gemma3_text")
    engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                                max_model_len=64))  # fmt: skip
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate([SHARED + [1]], greedy)
    prompts = [SHARED + [11 + i, 12 + i] for i in range(4)]
    steps = engine.stats.steps
    outputs = engine.generate(prompts, greedy)
    assert engine.stats.steps - steps == 1
    assert [o.num_cached_tokens for o in outputs] == [len(SHARED)] * 4
    assert [o.output_token_ids for o in outputs] == [dense_greedy(model, p, 1) for p in prompts]


def test_prefill_steps_defer_rows_unless_a_new_request_may_hit_the_prefix_cache():
    """Steps that prefill prompts which share no prefix, and the decode steps after them (whose first decodes free
    the blocks the prompts left behind the window, several at once), are deferring steps (no host sync on a GPU)
    and serve every row; a step that admits prompts behind a cached prefix serves every row at once instead."""
    config, model = tiny_model("gemma3_text")
    engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                                max_model_len=64))  # fmt: skip
    sent = []  # (decode-only, deferring) of each step
    run_step = engine.runner.run_step

    def recording(plan, shape, *, defer_rest, **options):
        sent.append((shape.decode_only, defer_rest))
        return run_step(plan, shape, defer_rest=defer_rest, **options)

    deferred = []  # rows each step read back deferred, in the order sent
    postprocess = engine.scheduler.postprocess

    def reading(rows, result, **options):
        deferred.append(int(np.sum(result.deferred)))
        return postprocess(rows, result, **options)

    engine.runner.run_step, engine.scheduler.postprocess = recording, reading
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    prompts = [SHARED[:20] + [1]] + [[(7 * i + j) % 90 + 1 for j in range(17 + 3 * i)] for i in range(3)]
    outputs = engine.generate(prompts, greedy)  # 81 prompt tokens over six steps of 16
    assert [o.output_token_ids for o in outputs] == [dense_greedy(model, p, 3) for p in prompts]
    assert sum(not decode_only for decode_only, _ in sent) >= 5, sent
    assert all(defer for _, defer in sent) and deferred == [0] * len(sent), (sent, deferred)
    sent.clear()
    behind = [SHARED[:20] + [2, 3]]
    outputs = engine.generate(behind, greedy)
    assert sent[0] == (False, False), "the prefix-hit admission serves every row"
    assert outputs[0].num_cached_tokens > 0 and outputs[0].output_token_ids == dense_greedy(model, behind[0], 3)


def test_the_cached_prefix_estimate():
    cached = CachedPrefixes(block_size=4, alignment=8, capacity=3, first_lookup_blocks=2)
    assert not cached.may_hit(list(range(20)))
    cached.insert(list(range(13)))  # blocks [0-3], [4-7], [8-11]; the partial last one is not cached
    assert cached.may_hit(list(range(9))) and cached.may_hit([0, 1, 2, 3, 4, 5, 6, 7, 50, 51])
    assert not cached.may_hit(list(range(8))), "no aligned hit before the last token"
    assert not cached.may_hit([0, 1, 2, 3, 9, 9, 9, 9, 8]), "its first full-attention block (8 tokens) is not cached"
    assert CachedPrefixes(block_size=4, alignment=8, capacity=3, first_lookup_blocks=0).may_hit(list(range(9))), (
        "without a full-attention group nothing rules a hit out")
    assert cached.hit_tokens(list(range(20))) == 8, "12 tokens of whole blocks, aligned down to 8"
    assert cached.hit_tokens(list(range(9))) == 8 and cached.hit_tokens(list(range(8))) == 0, "never the last token"
    assert cached.hit_tokens([0, 1, 2, 3, 9, 9, 9, 9, 8]) == 0, "a block after a different one is another chain"
    cached.insert([50, 51, 52, 53])  # four blocks in all: the least recently used one ([0-3]) goes
    assert cached.hit_tokens(list(range(20))) == 0 and cached.hit_tokens([50, 51, 52, 53, 1]) == 0
    cached.clear()
    assert cached.hit_tokens(list(range(20))) == 0


def test_decode_rows_the_allocator_defers_run_in_a_later_step_with_the_same_tokens():
    """Steps let the allocator defer the rows its vectorised path cannot serve at once: here, without prefix
    caching, decodes that reach a new 16-token chunk and free the last chunk's four blocks, which no hash holds
    (uncached blocks go to the head of the free queue, where the rows after them would take them), and the rows
    after them."""
    config, model = tiny_model("llama4_text")
    prompts = [[(5 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((13, 14, 15, 30))]
    want = [dense_greedy(model, p, MAX_TOKENS) for p in prompts]
    engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                                max_model_len=64, enable_prefix_caching=False))  # fmt: skip
    got = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.output_token_ids for o in got] == want
    assert engine.stats.deferred_rows > 0 and engine.stats.preemptions == 0


@pytest.mark.parametrize("greedy_only", [True, False])
def test_a_deferring_step_has_no_loop_or_branch_on_device_values(greedy_only):
    """On a GPU, XLA reads such a predicate back before it launches what follows: with none in the three calls of
    a deferring decode or prefill step, nor in a call of several decode steps (the scans have static trip counts),
    the host sends the next call while this one runs."""
    from jax_hybrid_attn.testing import device_dependent_control_flow

    config, model = tiny_model("gemma3_text")
    engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                                max_model_len=64, decode_steps=3))  # fmt: skip
    runner = engine.runner
    decode = next(shape for shape in runner.shapes if shape.decode_only)
    prefill = max(runner.shapes)
    keys = [("allocate", True), ("forward", decode), ("forward", prefill), ("sample", greedy_only),
            ("decode_steps", (3, greedy_only))]  # fmt: skip
    for key in keys:
        jaxpr = runner.trace(key).jaxpr.jaxpr
        assert device_dependent_control_flow(jaxpr) == [], key


def test_preemption_happens_and_does_not_change_sampled_outputs():
    config, model = tiny_model("gemma3_text")
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, top_p=0.9)
    roomy = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=5, max_num_batched_tokens=64, max_model_len=64))
    tight = tightest_engine(model, config, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    want = [o.output_token_ids for o in roomy.generate(PROMPTS, sampling)]
    got = tight.generate(PROMPTS, sampling)
    assert tight.stats.preemptions > 0 and roomy.stats.preemptions == 0
    assert [o.output_token_ids for o in got] == want
    assert sum(o.num_preemptions for o in got) == tight.stats.preemptions


def test_hybrid_allocation_holds_less_kv_memory_with_the_same_tokens():
    """The hybrid engine's greedy tokens are the dense forward's (as the engine's with every layer in one full
    group are: test_engine_greedy_equals_the_dense_forward_through_chunks_hits_and_preemption), and at its peak it
    holds less KV memory than one group of full attention must hold at the end: every computed token's block in
    every layer."""
    config, model = tiny_model("gemma3_text")
    long_prompts = [[(7 * i + j) % 90 + 1 for j in range(48)] for i in range(3)]
    engines = {hybrid: Engine(model, config, EngineConfig(block_size=4, max_num_seqs=3, max_num_batched_tokens=16,
                                                          max_model_len=64, hybrid=hybrid))
               for hybrid in (True, False)}  # fmt: skip
    outputs = engines[True].generate(long_prompts, SamplingParams(max_tokens=4, temperature=0.0))
    assert [o.output_token_ids for o in outputs] == [dense_greedy(model, prompt, 4) for prompt in long_prompts]
    hybrid_bytes = engines[True].stats.peak_blocks_in_use * engines[True].layout.block_bytes
    computed = 48 + 4 - 1  # the last sampled token is never computed
    full_bytes = len(long_prompts) * -(-computed // 4) * engines[False].layout.block_bytes
    # 2 of 3 layers keep a window of 8 tokens (and the blocks of one 16-token chunk) of the 51
    assert hybrid_bytes < 0.7 * full_bytes, (hybrid_bytes, full_bytes)


def test_a_bad_request_is_refused_while_the_others_run_and_tokens_stream():
    config, model = tiny_model("mistral")
    engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32))
    streamed = []
    prompts = [[1, 2, 3], list(range(40)), [5, 500], [4, 5]]  # too long; a token outside the vocabulary
    outputs = engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0),
                              on_token=lambda rid, tok: streamed.append((rid, tok)))  # fmt: skip
    assert [o.error is None for o in outputs] == [True, False, False, True]
    assert "max_model_len=32" in outputs[1].error and "prompt_token_ids" in outputs[2].error
    for o in (outputs[0], outputs[3]):
        assert len(o.output_token_ids) == 3 and o.finish_reason == "length"
        assert [tok for rid, tok in streamed if rid == o.request_id] == o.output_token_ids
        assert o.time_to_first_token > 0 and len(o.inter_token_latencies) == 2
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request([1, 2], SamplingParams(top_p=2.0))


def test_stop_tokens_and_eos_end_a_request():
    config, model = tiny_model("mistral")
    engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32))
    free_run = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0.0))[0].output_token_ids
    stop = free_run[2]
    stopped = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop]))[0]
    assert stopped.output_token_ids == free_run[: free_run.index(stop) + 1] and stopped.finish_reason == "stop"
    eos_engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                                                    max_model_len=32), eos_token_ids=[stop])  # fmt: skip
    assert eos_engine.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0.0))[0].finish_reason == "stop"
    ignoring = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert eos_engine.generate([[1, 2, 3]], ignoring)[0].output_token_ids == free_run


def test_engine_config_names_what_is_wrong():
    for kwargs, name in [(dict(block_size=0), "block_size"), (dict(num_blocks=4, kv_memory=10**6), "kv_memory"),
                         (dict(hybrid="yes"), "hybrid"), (dict(max_num_seqs=1.5), "max_num_seqs")]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            EngineConfig(**kwargs)
    config, model = tiny_model("mistral")
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(model, config, EngineConfig(block_size=4, max_model_len=64, num_blocks=3))


def test_the_kernel_path_in_interpret_mode_gives_the_reference_paths_tokens():
    """The Mosaic GPU kernels (interpreted on the CPU) inside the engine: bf16, head size 64 as the kernels need;
    warmed up first, as on a GPU (every kernel launch of an idle plan, no row to attend). Both give the dense
    forward's greedy tokens, and the bf16 forward hands the sampler the LM head's bf16 logits (the sampler converts
    them as it reads them)."""
    config = ModelConfig.from_hf(dict(FAMILIES["gemma3_text"]().to_dict(), head_dim=64, query_pre_attn_scalar=64))
    model = Decoder(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    prompts = [PROMPTS[1], PROMPTS[4]]
    tokens = {}
    for implementation, interpret in (("reference", False), ("kernel", True)):
        engine = Engine(model, config, EngineConfig(block_size=16, max_num_seqs=2, max_num_batched_tokens=32,
                                                    max_model_len=64, implementation=implementation,
                                                    interpret=interpret))  # fmt: skip
        for shape in engine.runner.shapes:
            assert engine.runner.trace(("forward", shape)).out_info[1].dtype == jnp.bfloat16
        engine.compile(warm_up=interpret)  # the kernels' warm-up launches, as on a GPU
        tokens[implementation] = [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0))]
    assert tokens["kernel"] == tokens["reference"] == [dense_greedy(model, p, 3) for p in prompts]


def test_a_soft_capping_model_hands_the_sampler_float32_logits():
    """Where the model soft-caps its logits (Gemma 2), a bf16 engine's forward returns them in float32; the greedy
    tokens are the dense forward's."""
    config = ModelConfig.from_hf(FAMILIES["gemma2"]().to_dict())
    model = Decoder(config, rngs=nnx.Rngs(3), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                                                max_model_len=64))  # fmt: skip
    for shape in engine.runner.shapes:
        assert engine.runner.trace(("forward", shape)).out_info[1].dtype == jnp.float32
    prompts = PROMPTS[:2]
    got = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    assert [o.output_token_ids for o in got] == [dense_greedy(model, p, 4) for p in prompts]


def test_the_pool_can_be_sized_in_bytes():
    config, model = tiny_model("gemma3_text")
    budget = 200_000
    engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=8,
                                                max_model_len=64, kv_memory=budget))  # fmt: skip
    assert budget - engine.layout.block_bytes < engine.layout.total_bytes <= budget
    assert engine.runner.kv_cache.nbytes == engine.layout.total_bytes
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(model, config, EngineConfig(block_size=4, max_model_len=64, kv_memory=4_000))


def test_an_aborted_request_frees_its_blocks_at_once_and_the_others_run_unchanged():
    """Abort a waiting request and a running one with steps in flight: the others' tokens are those of a run
    without aborts, the running one's tokens are a prefix of its own run, and every block is back in the pool."""
    config, model = tiny_model("gemma3_text")
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    options = dict(block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    engine = Engine(model, config, EngineConfig(**options))
    want = [o.output_token_ids for o in engine.generate(PROMPTS[:4], sampling)]
    ids = [engine.add_request(prompt, sampling) for prompt in PROMPTS[:4]]  # two run, two wait
    outputs = {}
    for _ in range(4):  # the first two are running, with steps in flight
        outputs.update((o.request_id, o) for o in engine.step())
    waiting = engine.abort_request(ids[3])
    running = engine.abort_request(ids[1])
    assert waiting.finish_reason == running.finish_reason == "abort" and waiting.output_token_ids == []
    assert running.output_token_ids == want[1][: len(running.output_token_ids)]
    assert len(running.output_token_ids) < MAX_TOKENS  # it was stopped, not finished
    assert engine.abort_request(ids[1]) is None and engine.abort_request("unknown") is None
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    engine.synchronize()
    assert [outputs[ids[i]].output_token_ids for i in (0, 2)] == [want[0], want[2]]
    assert ids[1] not in outputs and ids[3] not in outputs
    assert engine.manager.num_free_blocks == engine.layout.num_blocks - 1
    assert [o.output_token_ids for o in engine.generate(PROMPTS[:4], sampling)] == want  # it serves on


def test_an_image_prompt_is_refused_by_name_and_nothing_compiles():
    """A multimodal checkpoint is served as text: a prompt holding its image token is refused with
    NotImplementedError (by `add_request`; `generate` reports it as that prompt's error)."""
    wrapper = {"model_type": "gemma3", "text_config": FAMILIES["gemma3_text"]().to_dict(), "image_token_index": 90}
    config = ModelConfig.from_hf(wrapper)
    engine = Engine(Decoder(config, rngs=nnx.Rngs(0)), config,
                    EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32))  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"image token 90 .*model_type='gemma3'.* at positions \[1\]"):
        engine.add_request([3, 90, 4])
    outputs = engine.generate([[5, 6, 90]], SamplingParams(max_tokens=2, temperature=0.0))
    assert "images are not supported" in outputs[0].error and outputs[0].output_token_ids == []
    assert not engine.runner.compiled and not engine.has_unfinished_requests()


def test_warming_up_runs_every_executable_once_and_changes_no_state():
    """`ModelRunner.warm_up` (an idle plan through every executable, decode-step calls and the cascade shape
    included) leaves the allocator, the token counts and the KV cache bit for bit as they were, prefix cache and
    all; the engine then gives the dense forward's greedy tokens, as one that never warmed up does."""
    config, model = tiny_model("gemma3_text")
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    options = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64, decode_steps=2,
                   cascade_attention="always")  # fmt: skip
    want = [dense_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS]
    engine = Engine(model, config, EngineConfig(**options))
    engine.compile(warm_up=False)
    assert [o.output_token_ids for o in engine.generate(PROMPTS[:3], sampling)] == want[:3]  # fills the cache
    runner = engine.runner
    runs = dict.fromkeys(runner._executables, 0)

    def counted(key, executable):
        def call(*args):
            runs[key] += 1
            return executable(*args)

        return call

    runner._executables = {key: counted(key, fn) for key, fn in runner._executables.items()}
    before = jax.tree.map(np.asarray, (runner.manager.state, runner.num_computed, runner.kv_cache))
    assert runner.warm_up() > 0
    after = jax.tree.map(np.asarray, (runner.manager.state, runner.num_computed, runner.kv_cache))
    assert [key for key, n in runs.items() if n == 0] == [] and len(runs) >= 8
    assert any(kind == "decode_steps" for kind, _ in runs) and any(
        kind == "forward" and shape.cascade for kind, shape in runs)  # fmt: skip
    for (path, was), now in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after), strict=True):
        assert np.array_equal(was, now, equal_nan=True), jax.tree_util.keystr(path)
    assert [o.output_token_ids for o in engine.generate(PROMPTS[3:], sampling)] == want[3:]  # PROMPTS[3] hits


def test_cublas_matmuls_compile_the_model_steps_with_xla_options_and_keep_the_tokens(monkeypatch):
    """``cublas_matmuls`` (the default) compiles the executables that run the model (forward shapes, decode-step
    calls) with `CUBLAS_MATMUL_OPTIONS` and the others with none; off, none has options; on a CPU the tokens are
    the dense forward's."""
    from jax_hybrid_attn.engine.model_runner import CUBLAS_MATMUL_OPTIONS, ModelRunner

    config, model = tiny_model("gemma3_text")
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    options = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64, decode_steps=2)
    triton = Engine(model, config, EngineConfig(**options, cublas_matmuls=False))
    assert all(triton.runner.compiler_options(key) == {} for key in triton.runner.executable_keys())
    want = [dense_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS]
    compiled_with = {}
    compile_one = ModelRunner._compile_one

    def recording(lowered, options):
        compiled_with[lowered.as_text()] = options
        return compile_one(lowered, options)

    monkeypatch.setattr(ModelRunner, "_compile_one", staticmethod(recording))
    engine = Engine(model, config, EngineConfig(**options))
    assert [o.output_token_ids for o in engine.generate(PROMPTS, sampling)] == want
    by_kind = {kind: engine.runner.compiler_options((kind, variant)) for kind, variant in engine.runner._executables}
    assert by_kind == {"allocate": {}, "sample": {}, "forward": CUBLAS_MATMUL_OPTIONS,
                       "decode_steps": CUBLAS_MATMUL_OPTIONS}  # fmt: skip
    assert sorted(map(len, compiled_with.values())) == sorted(
        len(engine.runner.compiler_options(key)) for key in engine.runner._executables)  # fmt: skip


def test_the_engine_warms_up_after_compiling_on_a_gpu_unless_told(monkeypatch):
    """`Engine.compile`'s `warm_up` defaults to the backend being a GPU; an explicit value wins."""
    from jax_hybrid_attn.engine.model_runner import CompileReport, ModelRunner

    warmed = []
    monkeypatch.setattr(ModelRunner, "compile", lambda self, **_: CompileReport())
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: warmed.append(self) or 0.25)
    config, model = tiny_model("gemma2")
    engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                                                max_model_len=32))  # fmt: skip
    for backend, warm_up, warms in [("cpu", None, False), ("gpu", None, True), ("gpu", False, False),
                                    ("cpu", True, True)]:  # fmt: skip
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        warmed.clear()
        report = engine.compile(warm_up=warm_up)
        assert (warmed == [engine.runner], report.warm_up_s) == ((True, 0.25) if warms else (False, 0.0))


def test_a_step_plan_and_its_results_cross_in_one_array_each():
    """The host sends a step's plan as one int32 array and reads its results back as one (on a GPU each array is a
    transfer with a host callback of its own): every field comes back as it was, its dtype too, also for the
    stacked results of several steps."""
    from jax_hybrid_attn.engine.device_step import StepPlan, StepResult, pack_result

    rng = np.random.default_rng(0)
    rows = 5
    plan = StepPlan(
        slots=np.array([3, -1, 0, 2, -1], np.int32), max_new_tokens=rng.integers(0, 9, rows, dtype=np.int32),
        prompt_lens=rng.integers(1, 2048, rows, dtype=np.int32), temperature=rng.random(rows, np.float32) * 2,
        top_k=rng.integers(0, 50, rows, dtype=np.int32), top_p=rng.random(rows, np.float32),
        seeds=np.array([0, 2**32 - 1, 2**31, 7, 1], np.uint32),
    )  # fmt: skip
    on_device = jax.jit(StepPlan.unpacked)(jnp.asarray(plan.packed()))
    for name, sent, got in zip(StepPlan._fields, plan, on_device, strict=True):
        assert got.dtype == sent.dtype, name
        np.testing.assert_array_equal(np.asarray(got), sent, err_msg=name)

    flags = lambda: jnp.asarray(rng.random(rows) < 0.5)  # noqa: E731
    counts = lambda: jnp.asarray(rng.integers(0, 262_144, rows, dtype=np.int32))  # noqa: E731
    result = StepResult(success=flags(), deferred=flags(), seq_lens=counts(), num_hits=counts(),
                        num_scheduled=counts(), sampled=flags(), tokens=counts(), num_free_blocks=jnp.int32(41),
                        common_prefix_blocks=jnp.asarray([2, 0, 5], jnp.int32))  # fmt: skip
    packed = np.asarray(jax.jit(pack_result)(result))
    for host, leading in ((StepResult.unpacked(packed, num_rows=rows), ()),
                          (StepResult.unpacked(np.stack([packed, packed]), num_rows=rows), (2,))):  # fmt: skip
        for name, sent, got in zip(StepResult._fields, result, host, strict=True):
            assert got.dtype == sent.dtype and got.shape == leading + sent.shape, name
            np.testing.assert_array_equal(got, np.broadcast_to(np.asarray(sent), got.shape), err_msg=name)
