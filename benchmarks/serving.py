"""Serving benchmarks: how many 32k sequences fit (hybrid against full-attention allocation), the engine's
kernel path against its reference path, and throughput beside transformers' continuous batching.

Run from the repository root:  PYTHONPATH=. python benchmarks/serving.py [--sections capacity,parity,throughput,busy]

  capacity    (CPU is enough) at equal KV memory, concurrent 32,768-token sequences with hybrid allocation and
              with every layer allocated as full attention (`--no-hybrid`), for each family's published shape;
  parity      (GPU) the engine's greedy tokens with the Mosaic GPU kernels against its jnp reference path, bf16;
  fp8         (GPU) a float8 KV cache against bf16 on the Gemma-3-1B shape (random weights, 12 prompts x 32 tokens),
              "NHD" with blocks of 16 and "HND_VT" with blocks of 64: greedy tokens equal, and the logit error
              the float8 cache adds along the bf16 tokens;
  throughput  (GPU) a Gemma-3-1B-shaped model with random bf16 weights, 256 prompts of 128-1,024 random tokens,
              64 greedy tokens each: ours (a cold run, compiles included, then a warm one) and transformers'
              `generate_batch` with `paged|sdpa` on the same weights and prompts, in the same process;
  tp-capacity (CPU is enough) concurrent 32k sequences at equal KV memory per device, tensor parallel 1 and 2;
  tp          (two GPUs) the throughput model at tensor parallel 1 and 2: tokens/s, memory per GPU, same tokens;
  busy        (GPU) a 256-request decode step against its byte floor: the bytes it must read (weights, and the
              K/V each layer's window, chunk or context covers), the time they take at the read ceiling
              measured in the same run, the engine's wall time, the kernel time, kernels per layer and the
              share of the wall time the GPU runs kernels or copies (CUPTI profile); and the engine's step
              time against its jitted calls replayed back to back. ``--engine-variant FIELD=INT,...`` (repeatable):
              busy and throughput also with these EngineConfig fields changed, beside the default, e.g.
              ``--engine-variant cublas_matmuls=0 --engine-variant fuse_projections=0``;
  prefill     (GPU) where a prefill step's time goes: the throughput workload's prompts with one token each (every
              step a whole 8,192-token chunk of prefill): wall time per step, the model's FLOPs per second against
              the bf16 matmul ceiling, the layers' matmuls alone, kernel time by kind (CUPTI profile);
  shared-prefix (GPU) the Gemma-3-1B shape, 256 prompts of one 4,096-token system prompt (in the prefix cache
              from an earlier request) and 64-512 tokens of their own, 64 greedy tokens: the engine with cascade
              attention on (the cost rule picks per step) and off, a cold and a warm run each; decode step time
              and tokens equal. The two cold runs share one process: the first pays the process's own warm-up
              (`benchmarks/startup.py` compares new processes with cascade attention on and off);
  shared-prefix-full (GPU) the same workload on 8 full-attention layers of Mistral 7B's shape (32/8 heads, head
              128), where every layer can take the cascade.

Prints one line per measurement and a summary table last, and writes the rows as JSON by section (``--json PATH``,
default: benchmarks/serving.json; the capacity and fp8 rows as numbers, the others as their lines).
"""

import argparse
import collections
import gc
import itertools
import os
import tempfile
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # transformers shares the GPU

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_hybrid_attn.allocator import KVCacheManager, max_concurrency
from jax_hybrid_attn.engine import Engine, EngineConfig, KVCacheLayout, SamplingParams
from jax_hybrid_attn.models import DenseAttention, ModelConfig, embedded_config, load_model, random_model
from jax_hybrid_attn.models.layers import PRECISION
from jax_hybrid_attn.models.partitioning import tensor_parallel_config
from results_json import write_sections
from trace_summary import profiled

RECORDS: dict[str, list[dict]] = collections.defaultdict(list)  # section -> its rows as numbers, for --json
CAPACITY_LEN = 32_768
CAPACITY_MEMORY = 40 * 2**30
GEMMA3_1B = dict(
    model_type="gemma3_text", vocab_size=262_144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=32_768,
    query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
)  # fmt: skip
FULL_ATTENTION_8L = dict(  # Mistral 7B's layer (32/8 heads, head 128) with full attention, 8 layers: cascade's case
    model_type="mistral", vocab_size=32_000, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=8,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=None,
    max_position_embeddings=32_768, rms_norm_eps=1e-5, hidden_act="silu",
)  # fmt: skip
TINY = dict(GEMMA3_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=6, head_dim=64, vocab_size=512,
            layer_types=GEMMA3_1B["layer_types"][:6])  # --tiny: a dry run of the GPU sections on a CPU
SHAPES = {  # published configs (layer pattern, window or chunk, heads, head size)
    "gemma3 1B (5 sliding 512 : 1 full)": GEMMA3_1B,
    "gemma2 2B (1 sliding 4096 : 1 full)": dict(
        model_type="gemma2", vocab_size=256_000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=4096,
        max_position_embeddings=32_768, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rms_norm_eps=1e-6),  # fmt: skip
    "mistral 7B (sliding 4096 everywhere)": dict(
        model_type="mistral", vocab_size=32_000, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=4096,
        max_position_embeddings=32_768, rms_norm_eps=1e-5, hidden_act="silu"),  # fmt: skip
    "gpt-oss 20B (1 sliding 128 : 1 full)": dict(
        model_type="gpt_oss", vocab_size=201_088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128, num_local_experts=32,
        num_experts_per_tok=4, max_position_embeddings=131_072, rms_norm_eps=1e-5,
        layer_types=["sliding_attention", "full_attention"] * 12,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}),  # fmt: skip
    "llama4 Scout text (3 chunked 8192 : 1 full)": dict(
        model_type="llama4_text", vocab_size=202_048, hidden_size=5120, intermediate_size=8192,
        intermediate_size_mlp=16_384, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
        head_dim=128, attention_chunk_size=8192, max_position_embeddings=262_144, num_local_experts=16,
        num_experts_per_tok=1, interleave_moe_layer_step=1, rms_norm_eps=1e-5, use_qk_norm=True,
        no_rope_layers=[1, 1, 1, 0] * 12, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192}),  # fmt: skip
    # the published multimodal wrappers (served as text; their vision_config left out here, never read)
    "gemma3 27B wrapper (5 sliding 1024 : 1 full)": dict(
        model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"], boi_token_index=255_999,
        eoi_token_index=256_000, eos_token_id=[1, 106], image_token_index=262_144, mm_tokens_per_image=256,
        text_config=dict(
            head_dim=128, hidden_size=5376, intermediate_size=21_504, model_type="gemma3_text", num_attention_heads=32,
            num_hidden_layers=62, num_key_value_heads=16, query_pre_attn_scalar=168,
            rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024)),  # fmt: skip
    "llama4 Scout 17B-16E-Instruct wrapper (3 chunked 8192 : 1 full)": dict(
        model_type="llama4", architectures=["Llama4ForConditionalGeneration"], boi_token_index=200_080,
        eoi_token_index=200_081, image_token_index=200_092, tie_word_embeddings=False,
        text_config=dict(
            attention_bias=False, attention_chunk_size=8192, attn_scale=0.1, attn_temperature_tuning=4,
            bos_token_id=200_000, eos_token_id=[200_001, 200_007, 200_008], floor_scale=8192, head_dim=128,
            hidden_act="silu", hidden_size=5120, interleave_moe_layer_step=1, intermediate_size=8192,
            intermediate_size_mlp=16_384, max_position_embeddings=10_485_760, model_type="llama4_text",
            moe_layers=list(range(48)), no_rope_layers=[1, 1, 1, 0] * 12, num_attention_heads=40,
            num_experts_per_tok=1, num_hidden_layers=48, num_key_value_heads=8, num_local_experts=16,
            pad_token_id=200_018, rms_norm_eps=1e-5, rope_theta=500_000.0, use_qk_norm=True, vocab_size=202_048,
            rope_scaling={"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"})),  # fmt: skip
    # Qwen3-8B as published (no window) with windows turned on: sliding 4096 from layer 18 on (Qwen3Config's rule)
    "qwen3 8B windows on (18 full, then 18 sliding 4096)": dict(
        model_type="qwen3", vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, hidden_act="silu", tie_word_embeddings=False,
        use_sliding_window=True, sliding_window=4096, max_window_layers=18),  # fmt: skip
}


def resident_sequences(layout: KVCacheLayout, *, budget: int, in_window_only: bool) -> int:
    """Counted on the engine's allocator: requests of a 32,767-token prompt are prefilled one after another in
    chunks of `budget` tokens, then decode their 32,768th token (which frees what left the window) and stay
    resident, until one no longer fits; returns how many were resident at once."""
    max_seqs = 1024
    manager = KVCacheManager(layout.allocator_config(
        max_num_seqs=max_seqs, max_model_len=CAPACITY_LEN, max_num_batched_tokens=budget, enable_caching=False,
        sliding_window_in_window_only=in_window_only))  # fmt: skip
    for i in range(max_seqs):
        manager.add_request(i, [0] * (CAPACITY_LEN - 1))
        while (left := CAPACITY_LEN - 1 - manager.num_computed_tokens(i)) > 0:
            if not bool(manager.schedule([(i, min(budget, left))]).success[0]):
                return i
        manager.append_token_ids(i, [0])
        if not bool(manager.schedule([(i, 1)]).success[0]):
            return i
    return max_seqs


def capacity(rows: list, *, budget: int = 2048) -> None:
    """Concurrent 32k sequences at equal KV memory (40 GiB, block 16), bf16: hybrid against every layer
    allocated as full attention, counted on the allocator, and vLLM's startup bound (free blocks over the most
    blocks one request holds, its prefill chunk included); and hybrid with a float8_e4m3fn cache, counted."""
    for name, hf in SHAPES.items():
        config = ModelConfig.from_hf(hf)
        counted, bound = {}, {}
        for hybrid, dtype in ((True, jnp.bfloat16), (False, jnp.bfloat16), (True, jnp.float8_e4m3fn)):
            layout = KVCacheLayout.for_model(
                config, block_size=16, max_model_len=CAPACITY_LEN, max_num_batched_tokens=budget,
                dtype=dtype, kv_memory=CAPACITY_MEMORY, hybrid=hybrid,
            )  # fmt: skip
            key = (hybrid, jnp.dtype(dtype).name)
            bound[key] = max_concurrency(layout.kv_config, max_model_len=CAPACITY_LEN, max_num_batched_tokens=budget)
            counted[key] = resident_sequences(layout, budget=budget, in_window_only=False)
        hybrid, full, fp8 = counted[True, "bfloat16"], counted[False, "bfloat16"], counted[True, "float8_e4m3fn"]
        line = (f"{name} | counted {hybrid} vs {full}: {hybrid / full:.2f}x | vLLM's bound "
                f"{bound[True, 'bfloat16']:.1f} vs {bound[False, 'bfloat16']:.1f}: "
                f"{bound[True, 'bfloat16'] / bound[False, 'bfloat16']:.2f}x | fp8 KV, hybrid, counted {fp8}: "
                f"{fp8 / hybrid:.2f}x bf16's")  # fmt: skip
        print("capacity", line, flush=True)
        rows.append(("capacity", line))
        RECORDS["capacity"].append(dict(
            model=name, hybrid=hybrid, full=full, fp8=fp8, bound_hybrid=round(bound[True, "bfloat16"], 1),
            bound_full=round(bound[False, "bfloat16"], 1),
        ))  # fmt: skip


def tensor_parallel_capacity(rows: list, *, sizes=(1, 2), budget: int = 2048) -> None:
    """Counted on the allocator (any machine): concurrent 32k sequences at equal KV memory per device, at each
    tensor-parallel size, for the Gemma-3-1B shape (1 KV head: repeated on every device) and Mistral 7B's (8 KV
    heads: split)."""
    for name in ("gemma3 1B (5 sliding 512 : 1 full)", "mistral 7B (sliding 4096 everywhere)"):
        config = ModelConfig.from_hf(SHAPES[name])
        counts = {}
        for tp in sizes:
            layout = KVCacheLayout.for_model(
                tensor_parallel_config(config, tp), block_size=16, max_model_len=CAPACITY_LEN,
                max_num_batched_tokens=budget, dtype=jnp.bfloat16, kv_memory=CAPACITY_MEMORY * tp,
            )  # fmt: skip
            counts[tp] = resident_sequences(layout, budget=budget, in_window_only=False)
        line = f"{name} | concurrent 32k sequences at {CAPACITY_MEMORY / 2**30:.0f} GiB of KV per device: " + ", ".join(
            f"TP {tp}: {n}" for tp, n in counts.items())  # fmt: skip
        print("tp-capacity", line, flush=True)
        rows.append(("tp-capacity", line))


def tensor_parallel(rows: list, *, shape: dict, sizes=(1, 2), num_prompts: int = 64) -> None:
    """The throughput workload's model (`num_prompts` prompts, 64 greedy tokens each) at each tensor-parallel size
    on the same weights, warm: wall time, tokens/s, peak memory per device, and the greedy tokens against the
    first size's (needs as many devices as the largest size)."""
    devices = jax.devices()
    if len(devices) < max(sizes):
        raise SystemExit(f"tp: {len(devices)} device(s), TP {max(sizes)} needs {max(sizes)}")
    config = ModelConfig.from_hf(shape)
    model = random_model(config, seed=0, dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, shape["vocab_size"], int(n)).tolist() for n in rng.integers(128, 1025, num_prompts)]
    prompt_tokens = sum(map(len, prompts))
    first = None
    for tp in sizes:
        engine = Engine(model, config, EngineConfig(block_size=16, max_num_seqs=num_prompts, max_num_batched_tokens=8192,
                                                    max_model_len=2048, tensor_parallel=tp))  # fmt: skip
        greedy(engine, prompts, 64)  # compiles the step shapes
        engine.reset()
        tokens, seconds = greedy(engine, prompts, 64)
        first = tokens if first is None else first
        same = np.mean([a == b for x, y in zip(tokens, first) for a, b in zip(x, y)])
        peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30 for d in devices[:tp]]
        line = (f"TP {tp} | {num_prompts} prompts, {prompt_tokens:,} prompt tokens, 64 greedy each | {seconds:.2f} s | "
                f"total {(prompt_tokens + 64 * num_prompts) / seconds:,.0f} tok/s | peak memory per device "
                f"{', '.join(f'{p:.1f}' for p in peaks)} GiB | greedy tokens equal to TP {sizes[0]}'s {same:.0%}")  # fmt: skip
        print("tp", line, flush=True)
        rows.append(("tp", line))
        del engine


def greedy(engine: Engine, prompts, max_tokens: int) -> tuple[list[list[int]], float]:
    started = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outputs], time.perf_counter() - started


def parity(rows: list) -> None:
    """Kernels against the reference inside the engine, bf16: the share of greedy tokens that agree."""
    rng = np.random.default_rng(0)
    for name, config in (("embedded", embedded_config()), ("gemma3 1B shape", ModelConfig.from_hf(GEMMA3_1B))):
        model = random_model(config, seed=0, dtype=jnp.bfloat16)
        prompts = [rng.integers(1, config.vocab_size, int(n)).tolist() for n in rng.integers(20, 700, 12)]
        tokens = {}
        for implementation in ("kernel", "reference"):
            engine = Engine(model, config, EngineConfig(block_size=16, max_num_seqs=12, max_num_batched_tokens=1024,
                                                        max_model_len=1024, implementation=implementation))  # fmt: skip
            tokens[implementation], seconds = greedy(engine, prompts, 16)
        same = np.mean([a == b for ka, kb in zip(tokens["kernel"], tokens["reference"]) for a, b in zip(ka, kb)])
        first = np.mean([ka[0] == kb[0] for ka, kb in zip(tokens["kernel"], tokens["reference"])])
        line = f"{name} | first tokens equal {first:.0%} | all tokens equal {same:.0%}"
        print("parity", line, flush=True)
        rows.append(("parity", line))


FP8_ENGINES = {  # label: (kv_cache_dtype, block_size); the first is the reference
    "bf16": (None, 16),
    "fp8 NHD, block 16": ("float8_e4m3fn", 16),
    "fp8 HND_VT, block 64": ("float8_e4m3fn", 64),  # V transposed per block: the float8 PV product
}


def fp8_agreement(rows: list, *, shape: dict, num_prompts: int = 12, max_tokens: int = 32) -> None:
    """A float8 (e4m3) KV cache against the model's bfloat16 one, the same random-weight model on the kernels, in
    each of the engine's float8 layouts (`FP8_ENGINES`): the greedy tokens (each request's first, and all of them),
    and the logit error that the float8 cache adds, along the bfloat16 engine's tokens (teacher-forced): the dense
    forward with each layer's K/V read back as the float8 cache holds them (`DenseAttention(kv_dtype=...)`) against
    the plain one, at every generated position."""
    config = ModelConfig.from_hf(shape)
    model = random_model(config, seed=0, dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, int(n)).tolist() for n in rng.integers(20, 700, num_prompts)]
    tokens = {}
    for label, (dtype, block_size) in FP8_ENGINES.items():
        engine = Engine(model, config, EngineConfig(block_size=block_size, max_num_seqs=num_prompts,
                                                    max_model_len=1024, max_num_batched_tokens=1024,
                                                    kv_cache_dtype=dtype))  # fmt: skip
        tokens[label], _ = greedy(engine, prompts, max_tokens)
        del engine
    bf16 = tokens.pop("bf16")
    graphdef, state = nnx.split(model)

    @partial(jax.jit, static_argnames="kv_dtype")
    def logits(state, token_ids, *, kv_dtype):
        return nnx.merge(graphdef, state)(token_ids, DenseAttention(token_ids.shape[0], kv_dtype=kv_dtype))[0]

    errors, scales, argmax_equal = [], [], []
    length = max(map(len, prompts)) + max_tokens  # one padded length, one compile: the layers are causal
    for prompt, generated in zip(prompts, bf16):
        ids = prompt + generated[:-1]
        padded = jnp.asarray(ids + [0] * (length - len(ids)), jnp.int32)
        positions = slice(len(prompt) - 1, len(ids))  # where each generated token was drawn
        plain = logits(state, padded, kv_dtype=None)[positions]
        quantized = logits(state, padded, kv_dtype=jnp.float8_e4m3fn)[positions]
        errors.append(np.abs(np.asarray(quantized - plain, np.float32)))
        argmax_equal.append(np.asarray(jnp.argmax(quantized, -1) == jnp.argmax(plain, -1)))
        scales.append(float(jnp.abs(plain).max()))
    max_error, mean_error = max(e.max() for e in errors), np.mean([e.mean() for e in errors])
    # the flips that the float8 rounding alone causes, without the kernels: the dense model's argmax with the float8
    # K/V against without, at each request's first position and at every position (teacher-forced)
    dense_first = float(np.mean([equal[0] for equal in argmax_equal]))
    dense_all = float(np.mean(np.concatenate(argmax_equal)))
    line = (f"dense model, float8 K/V against bf16 (no kernels): argmax equal at the first position {dense_first:.0%}, "
            f"at every position {dense_all:.1%} of {sum(map(len, argmax_equal))}")  # fmt: skip
    print("fp8", line, flush=True)
    rows.append(("fp8", line))
    RECORDS["fp8"].append(dict(engine="dense model (no kernels)", first_argmax_equal=dense_first,
                               argmax_equal=dense_all, positions=int(sum(map(len, argmax_equal)))))  # fmt: skip
    for label, fp8 in tokens.items():
        first = np.mean([a[0] == b[0] for a, b in zip(bf16, fp8)])
        agreed = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(bf16, fp8)]
        line = (f"{label}: {len(prompts)} prompts x {max_tokens} tokens | first tokens equal {first:.0%} | tokens "
                f"equal before the first difference {sum(agreed) / (len(prompts) * max_tokens):.0%} | logit error "
                f"max {max_error:.3g} mean {mean_error:.3g} (largest |logit| {max(scales):.3g})")  # fmt: skip
        print("fp8", line, flush=True)
        rows.append(("fp8", line))
        RECORDS["fp8"].append(dict(engine=label, prompts=len(prompts), max_tokens=max_tokens,
                                   first_tokens_equal=float(first), tokens_agreed=sum(agreed),
                                   tokens=len(prompts) * max_tokens, logit_error_max=float(max_error),
                                   logit_error_mean=float(mean_error), largest_logit=max(scales)))  # fmt: skip


def prefill_flops(config: ModelConfig, model, prompt_lens) -> float:
    """The FLOPs of prefilling prompts of these lengths, counted as a matmul ceiling counts them: 2 per weight of
    every layer's projections and MLP per prompt token; per layer and token, 4 per query head, head dimension and
    key its query attends (QK and PV; causal, within the window on sliding layers, the chunk on chunked ones);
    and the LM head on each prompt's last token."""
    from flax import nnx

    layers = jax.tree.leaves(nnx.state(model.model.layers, nnx.Param))
    layer_weights = sum(leaf.size for leaf in layers if leaf.ndim == 2)  # the matrices, not the norms' vectors
    flops = 2.0 * layer_weights * sum(prompt_lens) + 2.0 * config.hidden_size * config.vocab_size * len(prompt_lens)
    per_key = 4.0 * config.num_heads * config.head_dim
    for length in prompt_lens:
        positions = np.arange(1, length + 1)  # the keys of each token's query, its own included
        for layer_type in config.layer_types:
            if layer_type == "sliding_attention":
                keys = np.minimum(positions, config.sliding_window)
            elif layer_type == "chunked_attention":
                keys = (positions - 1) % config.attention_chunk_size + 1
            else:
                keys = positions
            flops += per_key * keys.sum()
    return flops


MATMUL_CEILING_SIZE = 8192
"""The square bf16 matmul that `matmul_ceiling_tflops` times (on a GPU; 256 on a CPU)."""


def matmul_ceiling_tflops(*, calls: int = 20) -> float:
    """The device's bf16 matmul rate as measured here: a square `MATMUL_CEILING_SIZE` product, back to back."""
    size = MATMUL_CEILING_SIZE if jax.default_backend() == "gpu" else 256
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    product = jax.jit(jnp.dot)
    jax.block_until_ready(product(a, a))
    started = time.perf_counter()
    for _ in range(calls):
        result = product(a, a)
    jax.block_until_ready(result)
    return 2.0 * size**3 * calls / ((time.perf_counter() - started) * 1e12)


def parse_engine_variant(text: str) -> dict:
    """``"cublas_matmuls=0,fuse_projections=0"`` -> those `EngineConfig` fields (bools from 0 / 1)."""
    defaults = EngineConfig()
    variant = {}
    for setting in text.split(","):
        name, value = setting.split("=")
        if not hasattr(defaults, name):
            raise SystemExit(f"--engine-variant: EngineConfig has no field {name!r}")
        variant[name] = bool(int(value)) if isinstance(getattr(defaults, name), bool) else int(value)
    return variant


def variant_label(variant: dict) -> str:
    return ",".join(f"{name}={int(value)}" for name, value in variant.items())


def throughput(rows: list, *, num_prompts: int, transformers_too: bool, shape: dict,
               decode_steps: tuple[int, ...] = (1,), variants: tuple[dict, ...] = ({},)) -> None:  # fmt: skip
    import torch
    import transformers

    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, shape["vocab_size"], int(n)).tolist() for n in rng.integers(128, 1025, num_prompts)]
    prompt_tokens = sum(map(len, prompts))
    max_tokens = 64
    summaries = []
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        hf_config = transformers.Gemma3TextConfig(**{k: v for k, v in shape.items() if k != "model_type"})
        hf_model = transformers.Gemma3ForCausalLM(hf_config).to(torch.bfloat16)
        hf_model.save_pretrained(directory)
        config, model = load_model(directory, dtype=jnp.bfloat16)
        results = {}
        if transformers_too:
            hf_model = hf_model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
            hf_model.set_attn_implementation("paged|sdpa")
            generation = transformers.GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1,
                                                       pad_token_id=0)  # fmt: skip
            batching = transformers.ContinuousBatchingConfig(use_cuda_graph=False, use_async_batching=False,
                                                             num_blocks=(prompt_tokens + 64 * len(prompts)) // 256 + 16,
                                                             max_batch_tokens=8192)  # fmt: skip  # its blocks: 256 tokens
            started = time.perf_counter()
            out = hf_model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            hf_tokens = [list(out[k].generated_tokens) for k in sorted(out, key=lambda k: int(str(k).split("_")[-1]))]
            results["transformers generate_batch paged|sdpa"] = (hf_tokens, seconds)
            del hf_model, out
            torch.cuda.empty_cache()
        for steps, variant in itertools.product(decode_steps, variants):
            engine = Engine(model, config, EngineConfig(block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                                                        max_model_len=2048, decode_steps=steps, **variant))  # fmt: skip
            label = "ours" if decode_steps == (1,) else f"ours, {steps} decode steps per call"
            if variant:
                label += f" ({variant_label(variant)})"
            results[f"{label}, cold (compiles included)"] = greedy(engine, prompts, max_tokens)
            stats_cold = engine.stats
            engine.reset()
            results[f"{label}, warm"] = greedy(engine, prompts, max_tokens)
            stats = engine.stats
            prefill_tflops = prefill_flops(config, model, list(map(len, prompts))) / stats.prefill_time / 1e12
            ceiling = matmul_ceiling_tflops()
            line = (f"{label} warm: {stats.steps} steps in {stats.steps - stats.multi_step_calls * (steps - 1)} calls, "
                    f"prefill {stats.prefill_tokens_per_s or 0:,.0f} tok/s = {prefill_tflops:.3g} TFLOP/s of the "
                    f"model's FLOPs, {prefill_tflops / ceiling:.0%} of the bf16 matmul ceiling measured here "
                    f"({ceiling:.3g} TFLOP/s), decode {stats.decode_tokens_per_s or 0:,.0f}"
                    f" tok/s; cold run compiled {stats_cold.compiled_executables} executables in "
                    f"{stats_cold.compile_time:.0f} s")  # fmt: skip
            print("throughput", line, flush=True)
            summaries.append(("throughput", line))
    default = results.get("ours, warm", (None,))[0]
    for variant in variants:
        if variant and default is not None and decode_steps == (1,):
            tokens = results[f"ours ({variant_label(variant)}), warm"][0]
            line = (f"ours ({variant_label(variant)}): greedy tokens equal to the default's "
                    f"{np.mean([a == b for x, y in zip(tokens, default) for a, b in zip(x, y)]):.1%}")  # fmt: skip
            print("throughput", line, flush=True)
            summaries.append(("throughput", line))
    one_step = results.get("ours, 1 decode steps per call, warm", (None,))[0]
    for steps in decode_steps:
        if steps != 1 and one_step is not None:
            tokens = results[f"ours, {steps} decode steps per call, warm"][0]
            line = (f"ours, {steps} decode steps per call: greedy tokens equal to one step per call's "
                    f"{np.mean([a == b for x, y in zip(tokens, one_step) for a, b in zip(x, y)]):.1%}")  # fmt: skip
            print("throughput", line, flush=True)
            summaries.append(("throughput", line))
    reference = results.get("transformers generate_batch paged|sdpa", (None, None))[0]
    for name, (tokens, seconds) in results.items():
        output = sum(map(len, tokens))
        agree = "" if reference is None else f" | greedy tokens equal to transformers' {np.mean([a == b for x, y in zip(tokens, reference) for a, b in zip(x, y)]):.0%}"
        line = (f"{name} | {seconds:.1f} s | total {(prompt_tokens + output) / seconds:,.0f} tok/s | "
                f"output {output / seconds:,.0f} tok/s{agree}")  # fmt: skip
        print("throughput", line, flush=True)
        rows.append(("throughput", line))
    rows.extend(summaries)


def shared_prefix(rows: list, *, shape: dict, num_prompts: int, prefix_len: int = 4096,
                  own_lens: tuple[int, int] = (64, 512), label: str = "shared-prefix") -> None:  # fmt: skip
    config = ModelConfig.from_hf(shape)
    model = random_model(config, seed=0, dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    system = rng.integers(1, config.vocab_size, prefix_len).tolist()
    prompts = [system + rng.integers(1, config.vocab_size, int(n)).tolist()
               for n in rng.integers(own_lens[0], own_lens[1] + 1, num_prompts)]  # fmt: skip
    sizes = dict(block_size=16, max_num_seqs=num_prompts, max_num_batched_tokens=8192,
                 max_model_len=prefix_len + own_lens[1] + 64)  # fmt: skip
    tokens = {}
    for mode in ("auto", "off"):
        engine = Engine(model, config, EngineConfig(**sizes, cascade_attention=mode))
        decisions = []  # (rows, shared prefix tokens) of each decode step the rule looked at
        rule = engine._cascade
        engine._cascade = lambda rows, rule=rule, engine=engine: (
            decisions.append((len(rows), engine._common_prefix_tokens)) or rule(rows))  # fmt: skip
        for run in ("cold", "warm"):
            if run == "warm":
                engine.reset()
            started = time.perf_counter()
            greedy(engine, [system], 1)  # the system prompt in the prefix cache, as earlier traffic leaves it
            tokens[mode], seconds = greedy(engine, prompts, 64)
            seconds = time.perf_counter() - started
            stats = engine.stats
            step_ms = stats.decode_time / stats.num_decode_steps * 1e3
            line = (f"cascade {mode}, {run}: {seconds:.1f} s; decode {step_ms:.2f} ms per step "
                    f"({stats.num_decode_steps} steps, {stats.cascade_steps} with cascade), decode "
                    f"{stats.decode_tokens_per_s:,.0f} tok/s, prefill {stats.prefill_tokens_per_s:,.0f} tok/s, "
                    f"shared prefix up to {stats.peak_common_prefix_tokens} tokens, cached prompt tokens "
                    f"{stats.cached_prompt_tokens:,}")  # fmt: skip
            if run == "cold":
                line += f"; {stats.compiled_executables} executables compiled first, in {stats.compile_time:.1f} s"
            print(label, line, flush=True)
            rows.append((label, line))
            if decisions:
                counts, prefixes = np.array(decisions).T
                print(f"{label}   decode steps seen by the rule: {len(decisions)}, rows min/median/max "
                      f"{counts.min()}/{np.median(counts):.0f}/{counts.max()}, prefix tokens min/max "
                      f"{prefixes.min()}/{prefixes.max()}; steps with >= 128 rows: {(counts >= 128).sum()}", flush=True)
                decisions.clear()
        del engine, rule  # its KV pool, before the next engine allocates one
        gc.collect()
    # The control: how far greedy tokens drift on this random-weight model when only the float order changes
    # (prefill chunks of another budget, no cascade), as a yardstick for the agreement of auto against off
    engine = Engine(model, config, EngineConfig(**dict(sizes, max_num_batched_tokens=4096), cascade_attention="off"))
    greedy(engine, [system], 1)
    tokens["control"], _ = greedy(engine, prompts, 64)
    del engine
    gc.collect()

    def agreement(a, b):
        same = np.mean([x == y for p, q in zip(tokens[a], tokens[b]) for x, y in zip(p, q)])
        first = np.median([next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p))
                           for p, q in zip(tokens[a], tokens[b])])  # fmt: skip
        return f"{same:.1%} (median first difference at token {first:.0f})"

    line = (f"greedy tokens equal, cascade auto against off: {agreement('auto', 'off')}; off against off with a "
            f"4,096-token budget (another float order): {agreement('control', 'off')}")  # fmt: skip
    rows.append((label, line))
    print(label, rows[-1][1], flush=True)


def busy_share(rows: list, *, shape: dict, num_requests: int = 256, steps: int = 20, trace: str | None = None,
               variant: dict | None = None) -> None:  # fmt: skip
    """The share of a decode step's wall time that the GPU is busy: `num_requests` requests decode together.
    Timed: the engine's steps (wall), and the same step's jitted calls replayed back to back on copies of its
    inputs (no host work in between but XLA's own). Profiled (CUPTI, under `trace` or a temporary directory): the
    time the GPU runs kernels or copies during `steps` engine steps and `steps` replays."""
    trace = trace or tempfile.mkdtemp()
    config = ModelConfig.from_hf(shape)
    model = random_model(config, seed=0, dtype=jnp.bfloat16)
    engine = Engine(model, config, EngineConfig(block_size=16, max_num_seqs=num_requests, max_num_batched_tokens=8192,
                                                max_model_len=2048, **(variant or {})))  # fmt: skip
    rng = np.random.default_rng(0)
    sampling = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for n in rng.integers(128, 1025, num_requests):
        engine.add_request(rng.integers(1, config.vocab_size, int(n)).tolist(), sampling)
    scheduler = engine.scheduler
    while scheduler.waiting or not all(request.output_token_ids for request in scheduler.running):
        engine.step()  # every prompt prefilled
    engine.synchronize()
    floor_before = decode_step_bytes(engine, model)
    line, timed = _busy_variant(engine, f"{trace}/{len(rows)}", steps=steps)
    floor = {key: (value + decode_step_bytes(engine, model)[key]) / 2 for key, value in floor_before.items()}
    read_gbps, matmul_tflops = read_ceiling_gbps(), matmul_ceiling_tflops()
    read_ms = lambda num_bytes: num_bytes / (read_gbps * 1e6)
    floor_ms = read_ms(floor["total"])
    flops = decode_step_matmul_flops(engine, model)
    # The weights' matmuls at R rows are as much compute as reading: each part takes the longer of the two.
    step_floor_ms = max(read_ms(floor["weights"]), flops / (matmul_tflops * 1e9)) + read_ms(floor["kv"])
    label = f" ({variant_label(variant)})" if variant else ""
    line = (f"decode step of {num_requests} requests{label}: must read "
            f"{floor['weights'] / 1e9:.2f} GB of weights + "
            f"{floor['kv'] / 1e9:.2f} GB of covered K/V = {floor['total'] / 1e9:.2f} GB, {floor_ms:.2f} ms at the "
            f"read ceiling measured here ({read_gbps:,.0f} GB/s); the weights' matmuls {flops / 1e12:.3f} TFLOP, "
            f"{flops / (matmul_tflops * 1e9):.2f} ms at the bf16 matmul ceiling measured here ({matmul_tflops:.0f} "
            f"TFLOP/s), so the step's floor (the weights' bytes or FLOPs, whichever takes longer, then the K/V) is "
            f"{step_floor_ms:.2f} ms; the engine's step {timed['step_ms']:.2f} ms = {timed['step_ms'] / floor_ms:.2f}x "
            f"the byte floor, {timed['step_ms'] / step_floor_ms:.2f}x the step's floor, kernel time "
            f"{timed['kernel_ms']:.2f} ms, {timed['ops'] / config.num_layers:.1f} kernels and copies per layer; "
            f"{line}")  # fmt: skip
    print("busy", line, flush=True)
    rows.append(("busy", line))


def prefill_share(rows: list, *, shape: dict, num_prompts: int = 256, trace: str | None = None,
                  variant: dict | None = None) -> None:  # fmt: skip
    """Where a prefill step's time goes: `num_prompts` prompts of 128-1,024 random tokens, one token each, so that
    every step but the last is a whole ``max_num_batched_tokens`` chunk of prefill and nothing else. Timed warm
    (the same prompts once before, the prefix cache reset): wall time per step and the model's FLOPs per second
    against the bf16 matmul ceiling measured here; the same layer's matmuls alone, at the step's token count;
    profiled (CUPTI): kernel time per step by kind of kernel."""
    trace = trace or tempfile.mkdtemp()
    config = ModelConfig.from_hf(shape)
    model = random_model(config, seed=0, dtype=jnp.bfloat16)
    budget = 8192 if jax.default_backend() == "gpu" else 512
    engine = Engine(model, config, EngineConfig(block_size=16, max_num_seqs=256, max_num_batched_tokens=budget,
                                                max_model_len=2048, **(variant or {})))  # fmt: skip
    rng = np.random.default_rng(0)
    low, high = (128, 1025) if jax.default_backend() == "gpu" else (16, 129)
    prompts = [rng.integers(1, config.vocab_size, int(n)).tolist() for n in rng.integers(low, high, num_prompts)]
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prefill():
        engine.reset()  # no prefix hits from the run before
        engine.generate(prompts, sampling)

    prefill()  # compiles
    started = time.perf_counter()
    prefill()
    seconds = time.perf_counter() - started
    steps = engine.stats.steps
    profile = profiled(f"{trace}/prefill-{len(rows)}", prefill)
    tokens = sum(map(len, prompts))
    ceiling = matmul_ceiling_tflops()
    tflops = prefill_flops(config, model, list(map(len, prompts))) / seconds / 1e12
    matmuls_ms = {precision: layer_matmuls_ms(config, num_tokens=budget, precision=precision) * config.num_layers
                  for precision in (None, PRECISION)}  # XLA's default, and the models' (float32 at full precision)
    label = f" ({variant_label(variant)})" if variant else ""
    line = (f"prefill of {num_prompts} prompts{label}, {tokens:,} tokens in {steps} steps of up to {budget:,}: "
            f"{seconds / steps * 1e3:.2f} ms per step, {tokens / seconds:,.0f} tok/s = {tflops:.3g} TFLOP/s of the "
            f"model's FLOPs, {tflops / ceiling:.0%} of the bf16 matmul ceiling measured here ({ceiling:.3g} "
            f"TFLOP/s); the layers' matmuls alone at {budget:,} tokens {matmuls_ms[None]:.2f} ms (with the models' "
            f"precision={PRECISION.name} {matmuls_ms[PRECISION]:.2f} ms); kernels and copies "
            f"{profile.gpu_busy_ms / steps:.2f} ms per step ({profile.gpu_ops / steps:.0f} of them), GPU busy "
            f"{profile.gpu_busy_ms / profile.gpu_span_ms:.0%}; GPU idle per step: "
            + ", ".join(profile.idle_lines(per=steps)) + "; host per step by profiler event: "
            + "; ".join(profile.host_lines(per=steps, top=12)) + "; GPU per step by kind of kernel: "
            + "; ".join(profile.kernel_lines(per=steps, top=16)))  # fmt: skip
    print("prefill", line, flush=True)
    rows.append(("prefill", line))


def layer_matmuls_ms(config: ModelConfig, *, num_tokens: int, precision=None, calls: int = 20) -> float:
    """Milliseconds of one layer's four matmuls (fused q/k/v, output, fused gate/up, down) on `num_tokens` random
    bf16 rows at `precision`, each alone and back to back, as XLA runs them."""
    hidden, q_width = config.hidden_size, config.num_heads * config.head_dim
    qkv_width = q_width + 2 * config.num_kv_heads * config.head_dim
    shapes = [(hidden, qkv_width), (q_width, hidden), (hidden, 2 * config.intermediate_size),
              (config.intermediate_size, hidden)]  # fmt: skip
    product = jax.jit(partial(jnp.dot, precision=precision))
    total = 0.0
    for k, n in shapes:
        x = jax.random.normal(jax.random.key(0), (num_tokens, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
        jax.block_until_ready(product(x, w))
        started = time.perf_counter()
        for _ in range(calls):
            result = product(x, w)
        jax.block_until_ready(result)
        total += (time.perf_counter() - started) / calls
    return total * 1e3


def decode_step_matmul_flops(engine: Engine, model) -> float:
    """The FLOPs of the weights' matmuls in the next decode step of `engine`'s running requests: 2 per weight
    of every matrix (the embedding only where it is also the LM head) per request."""
    from flax import nnx

    config = engine.model_config
    matrices = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)) if leaf.ndim >= 2)
    if not config.tie_word_embeddings:
        matrices -= model.model.embed_tokens.weight.value.size
    return 2.0 * len(engine.scheduler.running) * matrices


def decode_step_bytes(engine: Engine, model) -> dict[str, float]:
    """The bytes the next decode step of `engine`'s running requests must read at least: the weights (the
    embedding table only where it is also the LM head; a decode gathers R rows of it otherwise) and, per layer,
    the K and V of the positions each request's query attends (its context on a full layer, the last W on a
    sliding one, its chunk so far on a chunked one). Keys ``weights``, ``kv`` and ``total``."""
    from flax import nnx

    config = engine.model_config
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if not config.tie_word_embeddings:
        weights -= model.model.embed_tokens.weight.value.nbytes
    per_position = 2 * config.num_kv_heads * config.head_dim * np.dtype(engine.layout.dtype).itemsize
    kv = 0
    for request in engine.scheduler.running:
        length = request.num_tokens  # the positions the next step's query attends, its own included
        for layer_type in config.layer_types:
            if layer_type == "sliding_attention":
                covered = min(length, config.sliding_window)
            elif layer_type == "chunked_attention":
                covered = (length - 1) % config.attention_chunk_size + 1
            else:
                covered = length
            kv += covered * per_position
    return {"weights": weights, "kv": kv, "total": weights + kv}


READ_CEILING_BYTES = 4 << 30
"""The array `read_ceiling_gbps` reads (a read stream of this size runs at the HBM's rate, not the L2's)."""


def read_ceiling_gbps(*, calls: int = 10) -> float:
    """The device's read bandwidth as measured here: a max over a `READ_CEILING_BYTES` bf16 array, per call."""
    size = READ_CEILING_BYTES // 2 if jax.default_backend() == "gpu" else 1 << 20
    x = jnp.ones(size, jnp.bfloat16)
    read = jax.jit(jnp.max)
    jax.block_until_ready(read(x))
    started = time.perf_counter()
    for _ in range(calls):
        result = read(x)
    jax.block_until_ready(result)
    return x.nbytes * calls / ((time.perf_counter() - started) * 1e9)


def _busy_variant(engine: Engine, trace: str, *, steps: int) -> tuple[str, dict]:
    """(the line of `steps` decode steps: wall time, GPU busy share, the same calls replayed, host phases; and
    its figures: ``step_ms``, ``kernel_ms`` and ``ops`` per step)."""
    for _ in range(3):  # decode steps (the decode shape compiles)
        engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_time = (time.perf_counter() - started) / steps * 1e3

    def engine_steps():
        for _ in range(steps):
            engine.step()
        engine.synchronize()

    engine_trace = profiled(f"{trace}/engine", engine_steps)
    phases = _host_phases(engine, steps=steps)

    runner, recorded = engine.runner, {}
    run_step = runner.run_step

    def recording(plan, shape, **options):  # the allocator's state before one step, copied
        recorded.update(allocator=jax.tree.map(jnp.copy, runner.manager.state), num_computed=jnp.copy(runner.num_computed),
                        plan=plan, shape=shape, options=options)  # fmt: skip
        return run_step(plan, shape, **options)

    runner.run_step = recording
    engine.step()
    engine.synchronize()  # the step is sent (by the engine's device worker)
    runner.run_step = run_step

    def replay(allocator):  # the step's calls, as the engine sends them (a replay rewrites its K/V, in the same slots)
        runner.manager.state, runner.num_computed = allocator, jnp.copy(recorded["num_computed"])
        return run_step(recorded["plan"], recorded["shape"], **recorded["options"])

    def replays():
        allocators = [jax.tree.map(jnp.copy, recorded["allocator"]) for _ in range(steps)]
        jax.block_until_ready(allocators)
        started = time.perf_counter()
        for allocator in allocators:
            result = replay(allocator)
        jax.block_until_ready(result)
        return (time.perf_counter() - started) / steps * 1e3

    replays()  # warm
    replay_time = replays()
    replay_trace = profiled(f"{trace}/replay", replays)
    busy = engine_trace.gpu_busy_ms
    figures = {"step_ms": step_time, "kernel_ms": busy / steps, "ops": engine_trace.gpu_ops / steps}
    return (f"engine {step_time:.2f} ms per step, its kernels and copies {busy / steps:.2f} ms of it "
            f"({busy / steps / step_time:.0%}; {engine_trace.gpu_ops / steps:.0f} of them); profiled, the GPU busy "
            f"{busy / engine_trace.gpu_span_ms:.0%} of {engine_trace.gpu_span_ms / steps:.2f} ms per step; "
            f"the step's calls replayed back to back {replay_time:.2f} ms, GPU busy "
            f"{replay_trace.gpu_busy_ms / replay_trace.gpu_span_ms:.0%}; GPU idle per engine step: "
            + ", ".join(engine_trace.idle_lines(per=steps)) + "; replayed: "
            + ", ".join(replay_trace.idle_lines(per=steps))
            + f"; the engine's thread per step: {phases}; "
            "host per engine step by profiler event: " + "; ".join(engine_trace.host_lines(per=steps, top=8)) +
            "; GPU per engine step by kind of kernel: " + "; ".join(engine_trace.kernel_lines(per=steps, top=20)),
            figures)  # fmt: skip


def _host_phases(engine: Engine, *, steps: int) -> str:
    """Wall time per step of the engine's own thread in planning, sending (handing over to its device worker) and
    reading back, of the reading the part spent waiting for the device, and of the device worker in sending the
    step's calls."""
    timed = {  # phase: the function it is the time of (`jax.device_get`: the engine's one read of a step)
        "plan": (engine.scheduler, "schedule"), "send": (engine, "_send"), "read": (engine, "_read"),
        "of it waiting": (jax, "device_get"), "worker sending the calls": (engine, "_dispatch"),
    }  # fmt: skip
    spent = dict.fromkeys(timed, 0.0)
    originals = {name: getattr(owner, attribute) for name, (owner, attribute) in timed.items()}

    def timing(name):
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return originals[name](*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - started

        return call

    for name, (owner, attribute) in timed.items():
        setattr(owner, attribute, timing(name))
    try:
        for _ in range(steps):
            engine.step()
        engine.synchronize()
    finally:
        for name, (owner, attribute) in timed.items():
            setattr(owner, attribute, originals[name])
    return ", ".join(f"{name} {seconds / steps * 1e3:.2f} ms" for name, seconds in spent.items())


def write_json(path, rows, sections) -> None:
    """The rows of the sections run into `path` (`results_json.write_sections`): as numbers where `RECORDS` has
    them, else as their lines."""
    lines = collections.defaultdict(list)
    for section, line in rows:
        lines[section].append({"line": line})
    write_sections(path, {section: RECORDS.get(section) or lines[section] for section in sections})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="capacity,parity,throughput,busy")
    parser.add_argument("--json", default=str(Path(__file__).with_name("serving.json")),
                        help="the JSON file of the rows, by section")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--trace", metavar="DIR", help="busy, prefill: keep the profiles' Perfetto traces in DIR")
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of the 1B shape (a dry run on a CPU)")
    parser.add_argument("--decode-steps", default="1",
                        help="throughput: ours with each of these EngineConfig.decode_steps, e.g. 1,8 (default: 1)")  # fmt: skip
    parser.add_argument("--engine-variant", action="append", default=[],
                        help="busy, prefill, throughput: also the engine with these EngineConfig fields, beside the "
                             "default, e.g. cublas_matmuls=0 (comma-separated FIELD=INT; repeatable)")  # fmt: skip
    args = parser.parse_args()
    variants = ({}, *map(parse_engine_variant, args.engine_variant))
    rows: list = []
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    for section in args.sections.split(","):
        started = time.perf_counter()
        if section == "capacity":
            capacity(rows)
        elif section == "parity":
            parity(rows)
        elif section == "fp8":
            fp8_agreement(rows, shape=TINY if args.tiny else GEMMA3_1B)
        elif section == "prefill":
            for variant in variants:
                prefill_share(rows, shape=TINY if args.tiny else GEMMA3_1B, num_prompts=16 if args.tiny else 256,
                              trace=args.trace, variant=variant)  # fmt: skip
        elif section == "busy":
            for variant in variants:
                busy_share(rows, shape=TINY if args.tiny else GEMMA3_1B, num_requests=8 if args.tiny else 256,
                           trace=args.trace, variant=variant)  # fmt: skip
        elif section in ("shared-prefix", "shared-prefix-full"):
            shape = GEMMA3_1B if section == "shared-prefix" else FULL_ATTENTION_8L
            if args.tiny:
                shape = dict(shape, hidden_size=64, intermediate_size=128, num_hidden_layers=6, vocab_size=512,
                             **({"layer_types": TINY["layer_types"]} if "layer_types" in shape else {}))  # fmt: skip
                shared_prefix(rows, shape=shape, num_prompts=4, prefix_len=64, own_lens=(8, 24), label=section)
            else:
                shared_prefix(rows, shape=shape, num_prompts=256, label=section)
        elif section == "tp-capacity":
            tensor_parallel_capacity(rows)
        elif section == "tp":
            tensor_parallel(rows, shape=TINY if args.tiny else GEMMA3_1B, num_prompts=8 if args.tiny else 64)
        elif section == "throughput":
            shape = TINY if args.tiny else GEMMA3_1B
            throughput(rows, num_prompts=args.num_prompts, transformers_too=not args.no_transformers, shape=shape,
                       decode_steps=tuple(int(k) for k in args.decode_steps.split(",")),
                       variants=variants)  # fmt: skip
        else:
            raise SystemExit(f"unknown section {section!r}")
        print(f"{section}: {time.perf_counter() - started:.0f} s", flush=True)
    print("\n== summary ==")
    for section, line in rows:
        print(f"{section} | {line}")
    if not args.tiny:  # a dry run's figures are not the benchmark's
        write_json(args.json, rows, args.sections.split(","))


if __name__ == "__main__":
    main()
