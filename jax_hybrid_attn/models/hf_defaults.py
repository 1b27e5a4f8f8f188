"""The transformers 5.17 config classes' defaults, for the keys a ``config.json`` may leave out (`hf_config` reads
a config as `from_pretrained` would, these filling what is absent).
"""

__all__ = ["CONFIG_DEFAULTS", "TEXT_CONFIG_SIZES", "WRAPPER_DEFAULTS"]

_GEMMA_SHARED = dict(  # what Gemma 2 and Gemma 3 text share
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    sliding_window=4096,
    query_pre_attn_scalar=256,
    attention_bias=False,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    head_dim=256,
    num_key_value_heads=4,
)

_QWEN3_SHARED = dict(  # what Qwen 3 and Qwen 3 MoE share
    hidden_act="silu",
    max_position_embeddings=32_768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_theta=10_000.0,
    attention_bias=False,
    use_sliding_window=False,
    sliding_window=4096,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# The transformers 5.17 config classes' defaults for the keys a config.json may leave out.
CONFIG_DEFAULTS = {
    "mistral": dict(
        hidden_act="silu",
        max_position_embeddings=4096 * 32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        sliding_window=4096,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    ),
    "gemma2": dict(
        **_GEMMA_SHARED,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
    "gemma3_text": dict(
        **_GEMMA_SHARED,
        max_position_embeddings=131_072,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    ),
    "gpt_oss": dict(
        hidden_act="silu",
        max_position_embeddings=131_072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=128,
        rope_theta=150000.0,
        attention_bias=True,
        num_experts_per_tok=4,
        head_dim=64,
        num_key_value_heads=8,
        num_local_experts=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    ),
    "llama4_text": dict(
        hidden_act="silu",
        max_position_embeddings=4096 * 32,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        attention_bias=False,
        num_experts_per_tok=1,
        num_local_experts=16,
        interleave_moe_layer_step=1,
        use_qk_norm=True,
        no_rope_layer_interval=4,
        attention_chunk_size=8192,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        intermediate_size_mlp=16384,
        head_dim=128,
        num_key_value_heads=8,
    ),
    "qwen3": dict(
        **_QWEN3_SHARED,
        head_dim=128,
        num_key_value_heads=32,
        max_window_layers=28,
    ),
    "qwen3_moe": dict(
        **_QWEN3_SHARED,
        num_key_value_heads=4,
        decoder_sparse_step=1,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        num_experts=128,
        norm_topk_prob=False,
    ),
}

# What a wrapper's text_config may leave out (sizes that the readers of a config.json of its own require):
# the text config classes' defaults.
TEXT_CONFIG_SIZES = {
    "gemma3_text": dict(
        vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8
    ),
    "llama4_text": dict(
        vocab_size=202_048, hidden_size=5120, intermediate_size=8192, num_hidden_layers=48, num_attention_heads=40
    ),
}

# The wrapper config classes' defaults (transformers 5.17 Gemma3Config, Llama4Config) for what is read of them.
WRAPPER_DEFAULTS = {
    "gemma3": dict(image_token_index=262_144, tie_word_embeddings=True),
    "llama4": dict(image_token_index=200_092, tie_word_embeddings=False),
}
