"""``paged|jax_hybrid`` inside transformers' continuous batching: tiny random models, chunked prefill forced,
prompts longer than the window; greedy tokens equal ``paged|eager``'s and plain eager ``generate``'s.

On a CPU: float32 and the jnp reference, tokens identical. On a GPU: bfloat16 and the Mosaic GPU kernels, where
random tiny models have near ties that bf16 rounding may flip: the first tokens must agree, and 90% of all.
A spy on the registered function counts its calls, so a test cannot pass through another implementation.
"""

import functools
import types

import numpy as np
import pytest

from jax_hybrid_attn import PAD_SLOT_ID

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jax_hybrid_attn_torch import transformers_cb
from transformers import AttentionInterface, AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

ON_GPU = torch.cuda.is_available()
DEVICE, DTYPE = ("cuda", torch.bfloat16) if ON_GPU else ("cpu", torch.float32)
NAME = transformers_cb.register(implementation=None if ON_GPU else "reference")
WINDOW, BLOCK_SIZE, MAX_BATCH_TOKENS, NEW_TOKENS = 8, 8, 16, 12
PROMPT_LENS = (5, 13, 21, 30)  # within one window, across it, several chunks of MAX_BATCH_TOKENS
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64)  # fmt: skip  # the kernels take head sizes that are multiples of 64


def gemma3():
    return transformers.Gemma3TextConfig(
        **TINY, num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )  # fmt: skip


def gemma2():
    return transformers.Gemma2Config(
        **TINY, num_hidden_layers=2, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16, attn_logit_softcapping=2.0, initializer_range=0.2,
    )  # fmt: skip


def mistral():
    return transformers.MistralConfig(**TINY, num_hidden_layers=2, sliding_window=WINDOW)


def gpt_oss():
    return transformers.GptOssConfig(
        **TINY, num_hidden_layers=2, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        num_local_experts=2, num_experts_per_tok=1,
    )  # fmt: skip


MODELS = {"gemma3": gemma3, "gemma2": gemma2, "mistral": mistral, "gpt_oss": gpt_oss}


@functools.cache
def build(name: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MODELS[name](), dtype=torch.float32).eval()
    if name == "gpt_oss":  # its init leaves the sinks at zero: make them matter
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    model = model.to(device=DEVICE, dtype=DTYPE)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    return model, prompts


def eager_greedy(model, prompt):
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def batch_config():
    return ContinuousBatchingConfig(block_size=BLOCK_SIZE, num_blocks=64, max_batch_tokens=MAX_BATCH_TOKENS,
                                    use_cuda_graph=False, use_async_batching=False)  # fmt: skip


def continuous_batching(model, prompts, implementation):
    model.set_attn_implementation(implementation)
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batch_config())
    ordered = sorted(out.values(), key=lambda o: int(str(o.request_id).split("_")[-1]))
    return [list(o.generated_tokens) for o in ordered]


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of ``paged|jax_hybrid`` (wrapping the registered function)."""
    counted = []
    registered = AttentionInterface._global_mapping[NAME]

    def spy(*args, **kwargs):
        counted.append(args[0].layer_idx)
        return registered(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, NAME, spy)
    return counted


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_equal_paged_eager_and_eager_generate(name, calls):
    model, prompts = build(name)
    ours = continuous_batching(model, prompts, NAME)
    assert calls, f"{NAME} was never called"
    assert set(calls) == set(range(model.config.num_hidden_layers)), "every layer went through it"
    assert [len(tokens) for tokens in ours] == [NEW_TOKENS] * len(prompts)
    assert_same_tokens(ours, [eager_greedy(model, prompt) for prompt in prompts])
    if name != "gemma2":  # transformers' paged|eager drops Gemma 2's logit soft cap; its eager applies it
        assert_same_tokens(ours, continuous_batching(model, prompts, "paged|eager"))


def assert_same_tokens(ours, theirs):
    if not ON_GPU:
        assert ours == theirs
        return
    assert [tokens[0] for tokens in ours] == [tokens[0] for tokens in theirs]
    same = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y)) / sum(map(len, theirs))
    assert same >= 0.9, f"{same:.0%} of the greedy tokens agree in bf16"


def test_streaming_and_cancel_through_the_manager(calls):
    model, prompts = build("gemma3")
    model.set_attn_implementation(NAME)
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batch_config())
    manager.start()
    try:
        streamed_id = manager.add_request(prompts[2], request_id="streamed", streaming=True)
        cancelled_id = manager.add_request(prompts[3], request_id="cancelled", max_new_tokens=10_000)
        streamed = [list(output.generated_tokens) for output in manager.request_id_iter(streamed_id)]
        manager.cancel_request(cancelled_id)
        assert manager.get_result(request_id=cancelled_id, timeout=2) is None, "a cancelled request never finishes"
    finally:
        manager.stop(block=True)
    assert len(streamed) >= 2
    assert_same_tokens([streamed[-1]], [eager_greedy(model, prompts[2])])
    assert all(a == b[: len(a)] for a, b in zip(streamed, streamed[1:])), "each update extends the last"
    assert calls


def test_outside_continuous_batching_it_refuses():
    model, prompts = build("mistral")
    model.set_attn_implementation(NAME)
    with pytest.raises(ValueError, match="PagedAttentionCache"), torch.no_grad():
        model(torch.tensor([prompts[0]], device=DEVICE))


def test_llama4_chunked_layers_fail_clearly():
    """transformers' cache refuses chunked attention; called on such a layer anyway, ours refuses it too."""
    config = transformers.Llama4TextConfig(**TINY, num_hidden_layers=2, intermediate_size_mlp=64, attention_chunk_size=8,
                                           no_rope_layers=[1, 0], num_local_experts=2, num_experts_per_tok=1)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(DEVICE)
    model.set_attn_implementation(NAME)
    generation = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with pytest.raises(ValueError, match="chunked_attention"):
        model.generate_batch([[5, 6, 7]], generation_config=generation, continuous_batching_config=batch_config())
    layer = model.model.layers[0].self_attn
    assert config.layer_types[layer.layer_idx] == "chunked_attention"
    cache = types.SimpleNamespace(layer_index_to_group_indices={0: (0, 0), 1: (1, 0)})
    q = torch.zeros(1, 4, 2, 64)
    kv = torch.zeros(1, 2, 2, 64)
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        transformers_cb.continuous_batching_attention(layer, q, kv, kv, None, cache=cache)


def test_each_step_writes_each_cache_slot_once(monkeypatch, calls):
    """transformers sends the tokens a sliding group drops to one trash slot; the step's writes name every slot
    at most once (many writes to one slot serialize the cache write on a GPU)."""
    planned = []

    def recording(*args, **kwargs):
        step = plan_step(*args, **kwargs)
        planned.append([np.asarray(index) for index in step.write_index])
        return step

    plan_step = transformers_cb._plan_step
    monkeypatch.setattr(transformers_cb, "_plan_step", recording)
    model, prompts = build("gemma3")
    continuous_batching(model, prompts[3:], NAME)  # 30 tokens: two chunks, most of them outside the window
    assert planned and calls
    for step in planned:
        for index in step:
            written = index[index != PAD_SLOT_ID]
            assert len(set(written.tolist())) == len(written), f"a slot named twice in {index}"
    assert any((index == PAD_SLOT_ID).sum() > 0 for step in planned for index in step[:1])
