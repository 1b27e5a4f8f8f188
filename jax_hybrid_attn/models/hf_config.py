"""Reading a transformers ``config.json`` into the fields of a `ModelConfig`, one reader per family.

Supported ``model_type`` values (`SUPPORTED_ARCHITECTURES`):
  * ``mistral``      MistralForCausalLM: a sliding window on every layer (``sliding_window``; null: full);
  * ``gemma2``       Gemma2ForCausalLM: sliding/full per ``layer_types``, attention and final logit soft caps;
  * ``gemma3_text``  Gemma3ForCausalLM: sliding/full per ``layer_types``, a RoPE per layer type, q/k norms;
  * ``gemma3``       Gemma3ForConditionalGeneration, served as text: its ``text_config`` is a ``gemma3_text``
                     (no final logit soft cap: the wrapper never applies it);
  * ``gpt_oss``      GptOssForCausalLM: sliding/full, learned sinks, YaRN RoPE, a top-k MoE MLP;
  * ``llama4_text``  Llama4ForCausalLM: chunked-local RoPE layers and global NoPE layers, MoE with a shared
                     expert or dense MLPs per layer;
  * ``llama4``       Llama4ForConditionalGeneration, served as text: its ``text_config`` is a ``llama4_text``;
  * ``qwen3``        Qwen3ForCausalLM: q/k RMSNorms per head, full layers or sliding ones from ``max_window_layers``
                     on (``use_sliding_window``) or per ``layer_types``;
  * ``qwen3_moe``    Qwen3MoeForCausalLM: Qwen 3's attention (a window on every layer when
                     ``use_sliding_window``), a softmax top-k MoE on the layers ``decoder_sparse_step`` and
                     ``mlp_only_layers`` leave, dense MLPs on the others.

A multimodal wrapper (``gemma3``, ``llama4``) is read as its language model: ``text_config`` with the text config
class's defaults for what it leaves out (transformers saves a sub-config as its difference from them: Gemma 3
27B's leaves out ``vocab_size``), the wrapper's special token ids where it sets them (transformers' generation
config takes them from the wrapper first), the LM head tied as transformers ties it (Gemma 3: the wrapper's
``tie_word_embeddings``; Llama 4: its language model's own), and ``quantization_config`` from either. The
wrapper's ``image_token_index`` is kept so that prompts holding it are refused; its vision tower is never read.
A quantized checkpoint (``quantization_config``) is refused with `NotImplementedError`, except gpt-oss's MXFP4
experts, which `load_model` dequantizes.

Where a key is absent the default of the transformers 5.17 config class applies (as `from_pretrained` would
do; `hf_defaults`), and legacy spellings are read as transformers reads them (``rope_theta`` / ``rope_scaling``
beside or instead of ``rope_parameters``, Gemma 3's ``rope_local_base_freq`` and ``sliding_window_pattern``).
"""

import json
import os
from pathlib import Path

from ..integers import check_int
from .hf_defaults import CONFIG_DEFAULTS, TEXT_CONFIG_SIZES, WRAPPER_DEFAULTS
from .rope import RopeParameters

__all__ = [
    "LANGUAGE_MODEL_TYPES",
    "LAYER_TYPES",
    "MULTIMODAL_WRAPPERS",
    "SUPPORTED_ARCHITECTURES",
    "read_config_dir",
    "read_hf_config",
]

LANGUAGE_MODEL_TYPES = ("mistral", "gemma2", "gemma3_text", "gpt_oss", "llama4_text", "qwen3", "qwen3_moe")
"""The ``model_type`` values of the decoders a `Decoder` computes (`ModelConfig.architecture`)."""

MULTIMODAL_WRAPPERS = {"gemma3": "gemma3_text", "llama4": "llama4_text"}
"""Each multimodal wrapper's ``model_type`` and the ``model_type`` of its language model (its ``text_config``)."""

SUPPORTED_ARCHITECTURES = (
    "mistral",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "gpt_oss",
    "llama4_text",
    "llama4",
    "qwen3",
    "qwen3_moe",
)
"""The transformers ``model_type`` values `read_hf_config` reads (`LANGUAGE_MODEL_TYPES`, `MULTIMODAL_WRAPPERS`)."""

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""transformers' names of the attention types a layer may have (``layer_types``)."""

def _get(config: dict, key: str, architecture: str, *, required: bool = False):
    """`config[key]`, else the family default; `ValueError` naming `key` when it is required and absent."""
    if key in config:
        return config[key]
    defaults = CONFIG_DEFAULTS[architecture]
    if required or key not in defaults:
        raise ValueError(f"config.json has no {key!r}, which model_type={architecture!r} needs")
    return defaults[key]


def _token_ids(value) -> tuple[int, ...]:
    """An ``eos_token_id``-like value (None, an int or a list of ints) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def read_config_dir(path: str | os.PathLike) -> dict:
    """The `ModelConfig` fields of the checkpoint directory `path` (its ``config.json``)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"path={str(path)!r} is not a directory")
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"path={str(path)!r} has no config.json")
    return read_hf_config(read_json_file(file))


def read_json_file(file: Path):
    """The JSON value of `file`; a file that is not JSON is a `ValueError` naming it."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{str(file)!r} is not valid JSON: {error}") from None


def read_hf_config(config: dict) -> dict:
    """The `ModelConfig` fields of a transformers config dict (``config.json`` or ``PretrainedConfig.to_dict()``)."""
    if not isinstance(config, dict):
        raise ValueError(f"config={config!r} must be a dict")
    if "model_type" not in config:
        raise ValueError("config.json has no 'model_type'")
    architecture = config["model_type"]
    if architecture in MULTIMODAL_WRAPPERS:
        return _read_wrapper(config, architecture)
    if "text_config" in config:
        raise NotImplementedError(
            f"model_type={architecture!r} is a multimodal wrapper (it has a text_config) that is not supported; "
            f"supported wrappers: {tuple(MULTIMODAL_WRAPPERS)}"
        )
    if architecture not in LANGUAGE_MODEL_TYPES:
        raise NotImplementedError(
            f"model_type={architecture!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
        )
    quantization = _quantization(config.get("quantization_config"), architecture)
    return {**_READERS[architecture](config), "quantization": quantization}


def _quantization(quantization_config, architecture: str) -> str | None:
    """The ``quant_method`` of a ``quantization_config`` that `load_model` can read (gpt-oss's MXFP4 experts)."""
    if not quantization_config:
        return None
    if not isinstance(quantization_config, dict):
        raise ValueError(f"quantization_config={quantization_config!r} must be a dict")
    quantization = quantization_config.get("quant_method")
    if (architecture, quantization) != ("gpt_oss", "mxfp4"):
        raise NotImplementedError(
            f"quantization_config (quant_method={quantization!r}) is not supported for "
            f"model_type={architecture!r} (only gpt_oss's mxfp4 experts, dequantized on load)"
        )
    return quantization


_SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _read_wrapper(config: dict, wrapper: str) -> dict:
    """A multimodal wrapper's fields: its language model's (``text_config``) and the wrapper's image token."""
    language = MULTIMODAL_WRAPPERS[wrapper]
    text = config.get("text_config")
    text = {} if text is None else text  # transformers: every default of the text config class
    if not isinstance(text, dict):
        raise ValueError(f"text_config={text!r} of model_type={wrapper!r} must be a dict")
    text_type = text.get("model_type", language)
    if text_type != language:
        raise NotImplementedError(
            f"text_config.model_type={text_type!r} in model_type={wrapper!r} is not supported (only {language!r})"
        )
    text = {**TEXT_CONFIG_SIZES[language], **text, "model_type": language}
    for key in _SPECIAL_TOKEN_KEYS:  # GenerationConfig.from_model_config: the wrapper's first, then the text's
        if config.get(key) is not None:
            text[key] = config[key]
    defaults = WRAPPER_DEFAULTS[wrapper]
    if wrapper == "gemma3":  # Gemma3ForConditionalGeneration ties its LM head by the wrapper's config alone
        text["tie_word_embeddings"] = config.get("tie_word_embeddings", defaults["tie_word_embeddings"])
    # (Llama4ForConditionalGeneration's LM head is its Llama4ForCausalLM's: tied by text_config's own key)
    quantization = _quantization(text.get("quantization_config") or config.get("quantization_config"), language)
    fields = _READERS[language](text)
    if wrapper == "gemma3":  # Gemma3ForConditionalGeneration never applies final_logit_softcapping (5.17)
        fields["final_logit_softcapping"] = None
    image_token_id = next(
        (config[k] for k in ("image_token_index", "image_token_id") if config.get(k) is not None),
        defaults["image_token_index"],
    )
    return {**fields, "wrapper": wrapper, "image_token_id": int(image_token_id), "quantization": quantization}


def _common(config: dict, architecture: str) -> dict:
    """The keys every family shares."""
    get = lambda key, **kw: _get(config, key, architecture, **kw)
    num_heads = get("num_attention_heads", required=True)
    hidden = get("hidden_size", required=True)
    num_kv_heads = config.get("num_key_value_heads")
    if num_kv_heads is None:
        num_kv_heads = CONFIG_DEFAULTS[architecture].get("num_key_value_heads", num_heads)
    head_dim = config.get("head_dim")
    if head_dim is None:
        head_dim = CONFIG_DEFAULTS[architecture].get("head_dim") or hidden // num_heads
    eos = config.get("eos_token_id", CONFIG_DEFAULTS[architecture]["eos_token_id"])
    return dict(
        architecture=architecture,
        vocab_size=get("vocab_size", required=True),
        hidden_size=hidden,
        intermediate_size=get("intermediate_size", required=True),
        num_layers=get("num_hidden_layers", required=True),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        bos_token_id=config.get("bos_token_id", CONFIG_DEFAULTS[architecture]["bos_token_id"]),
        eos_token_ids=_token_ids(eos),
        pad_token_id=config.get("pad_token_id", CONFIG_DEFAULTS[architecture]["pad_token_id"]),
    )


def _activation(config: dict, architecture: str) -> str:
    """Gemma's ``hidden_activation`` (older files: ``hidden_act``), the others' ``hidden_act``."""
    if architecture in ("gemma2", "gemma3_text"):
        return config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    return _get(config, "hidden_act", architecture)


def _global_rope(config: dict, architecture: str, default: dict | None = None) -> RopeParameters:
    """One RoPE for every layer, as `RotaryEmbeddingConfigMixin.convert_rope_params_to_dict` reads it:
    ``rope_scaling`` before ``rope_parameters``, then ``rope_theta`` and the family's default theta."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or default or {}
    params = dict(params)
    params.setdefault("rope_theta", config.get("rope_theta", CONFIG_DEFAULTS[architecture]["rope_theta"]))
    return RopeParameters.from_hf(
        params, max_position_embeddings=_get(config, "max_position_embeddings", architecture)
    )


def _alternating(num_layers: int, pattern: int) -> tuple[str, ...]:
    """transformers' default ``layer_types``: every `pattern`-th layer full, the others sliding."""
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def _layer_types(config: dict, num_layers: int, default: tuple[str, ...]) -> tuple[str, ...]:
    layer_types = config.get("layer_types")
    if layer_types is None:
        return default
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types={layer_types!r} must be a list of num_hidden_layers={num_layers} entries"
        )
    return tuple(layer_types)


def _read_mistral(config: dict) -> dict:
    common = _common(config, "mistral")
    sliding_window = _get(config, "sliding_window", "mistral")
    layer_type = "full_attention" if sliding_window is None else "sliding_attention"
    rope = _global_rope(config, "mistral")
    return dict(
        **common,
        hidden_act=_activation(config, "mistral"),
        layer_types=(layer_type,) * common["num_layers"],
        sliding_window=sliding_window,
        rope=(rope,) * common["num_layers"],
    )


def _read_gemma(config: dict, architecture: str) -> dict:
    common = _common(config, architecture)
    num_layers = common["num_layers"]
    if config.get("use_bidirectional_attention"):
        raise NotImplementedError("use_bidirectional_attention=True (an encoder) is not supported")
    get = lambda key: _get(config, key, architecture)
    max_pos = get("max_position_embeddings")
    if architecture == "gemma2":
        layer_types = _layer_types(config, num_layers, _alternating(num_layers, 2))
        rope = (_global_rope(config, architecture),) * num_layers
        attn_softcap = get("attn_logit_softcapping")
    else:
        pattern = config.get("sliding_window_pattern", 6)
        layer_types = _layer_types(config, num_layers, _alternating(num_layers, pattern))
        # Gemma3TextConfig.convert_rope_params_to_dict: one dict per layer type; rope_scaling goes to the
        # global layers, rope_theta (default 1e6) to the global ones, rope_local_base_freq (1e4) to the local.
        per_type = {k: dict(v) if v else None for k, v in (config.get("rope_parameters") or {}).items()}
        if not per_type or set(per_type).isdisjoint(LAYER_TYPES):
            per_type = {
                "sliding_attention": {"rope_type": "default"},
                "full_attention": {"rope_type": "default"},
            }
        if config.get("rope_scaling"):
            per_type.setdefault("full_attention", {"rope_type": "default"})
            per_type["full_attention"].update(config["rope_scaling"])
        if per_type.get("full_attention") is None:
            per_type["full_attention"] = {"rope_type": "default"}
        per_type["full_attention"].setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
        if per_type.get("sliding_attention") is None:
            per_type["sliding_attention"] = {"rope_type": "default"}
        per_type["sliding_attention"].setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
        ropes = {k: RopeParameters.from_hf(v, max_position_embeddings=max_pos) for k, v in per_type.items()}
        missing = sorted(set(layer_types) - set(ropes))
        if missing:
            raise ValueError(f"rope_parameters has no entry for layer types {missing}")
        rope = tuple(ropes[t] for t in layer_types)
        # Gemma3Attention never passes attn_logit_softcapping to its attention (transformers 5.17): not applied.
        attn_softcap = None
    if "chunked_attention" in layer_types:
        raise ValueError(f"layer_types={layer_types!r}: model_type={architecture!r} has no chunked layers")
    return dict(
        **common,
        hidden_act=_activation(config, architecture),
        layer_types=layer_types,
        sliding_window=get("sliding_window") if "sliding_attention" in layer_types else None,
        rope=rope,
        query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
        attn_logit_softcapping=attn_softcap,
        final_logit_softcapping=get("final_logit_softcapping"),
        attention_bias=bool(get("attention_bias")),
    )


def _read_gpt_oss(config: dict) -> dict:
    common = _common(config, "gpt_oss")
    num_layers = common["num_layers"]
    get = lambda key: _get(config, key, "gpt_oss")
    layer_types = _layer_types(config, num_layers, _alternating(num_layers, 2))
    default_rope = dict(
        rope_type="yarn",
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=4096,
    )
    rope = _global_rope(config, "gpt_oss", default_rope)
    num_experts = get("num_local_experts")
    return dict(
        **common,
        hidden_act=_activation(config, "gpt_oss"),
        layer_types=layer_types,
        sliding_window=get("sliding_window") if "sliding_attention" in layer_types else None,
        rope=(rope,) * num_layers,
        attention_bias=bool(get("attention_bias")),
        attention_sinks=True,
        num_experts=num_experts,
        num_experts_per_tok=get("num_experts_per_tok"),
        moe_layers=tuple(range(num_layers)),
    )


def _read_llama4(config: dict) -> dict:
    common = _common(config, "llama4_text")
    num_layers = common["num_layers"]
    get = lambda key: _get(config, key, "llama4_text")
    # Llama4TextConfig.__post_init__: no_rope_layers[i] == 1 means layer i USES RoPE; the default puts a
    # NoPE layer every no_rope_layer_interval layers; layer_types defaults to chunked for RoPE layers.
    interval = get("no_rope_layer_interval")
    no_rope_layers = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(no_rope_layers) != num_layers:
        raise ValueError(
            f"no_rope_layers={no_rope_layers!r} must have num_hidden_layers={num_layers} entries"
        )
    default_types = tuple(
        "chunked_attention" if use_rope else "full_attention" for use_rope in no_rope_layers
    )
    layer_types = _layer_types(config, num_layers, default_types)
    step = get("interleave_moe_layer_step")
    moe_layers = config.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, num_layers, step))
    rope = _global_rope(config, "llama4_text")
    chunk = get("attention_chunk_size")
    if "sliding_attention" in layer_types:
        raise ValueError(f"layer_types={layer_types!r}: model_type='llama4_text' has no sliding layers")
    return dict(
        **common,
        hidden_act=_activation(config, "llama4_text"),
        layer_types=layer_types,
        attention_chunk_size=chunk if "chunked_attention" in layer_types else None,
        rope=tuple(rope if use_rope else None for use_rope in no_rope_layers),
        rope_interleaved=True,
        attention_bias=bool(get("attention_bias")),
        num_experts=get("num_local_experts"),
        num_experts_per_tok=get("num_experts_per_tok"),
        moe_layers=tuple(sorted(int(i) for i in moe_layers)),
        intermediate_size_mlp=get("intermediate_size_mlp"),
        use_qk_norm=bool(get("use_qk_norm")),
        attn_temperature_tuning=bool(get("attn_temperature_tuning")),
        floor_scale=float(get("floor_scale")),
        attn_scale=float(get("attn_scale")),
    )


def _qwen3_window(config: dict, architecture: str) -> int | None:
    """Qwen3Config / Qwen3MoeConfig: ``sliding_window`` only when ``use_sliding_window``."""
    use = _get(config, "use_sliding_window", architecture)
    return _get(config, "sliding_window", architecture) if use else None


def _read_qwen3(config: dict, architecture: str) -> dict:
    common = _common(config, architecture)
    num_layers = common["num_layers"]
    get = lambda key: _get(config, key, architecture)
    window = _qwen3_window(config, architecture)
    if architecture == "qwen3":  # Qwen3Config.__post_init__: sliding from max_window_layers on, when windowed
        first_sliding = check_int("max_window_layers", get("max_window_layers"), minimum=0, maximum=None)
        default_types = tuple(
            "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
            for i in range(num_layers)
        )
        layer_types = _layer_types(config, num_layers, default_types)
    else:  # Qwen3MoeModel gives every layer the window (Qwen3MoeConfig has no layer_types)
        layer_types = ("full_attention" if window is None else "sliding_attention",) * num_layers
        given = config.get("layer_types")
        if given is not None and tuple(given) != layer_types:
            raise NotImplementedError(
                f"layer_types={given!r}: model_type='qwen3_moe' puts sliding_window={window!r} on every layer "
                "(transformers ignores layer_types there)"
            )
    if "chunked_attention" in layer_types:
        raise ValueError(f"layer_types={layer_types!r}: model_type={architecture!r} has no chunked layers")
    sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    if sliding and window is None:
        raise ValueError(
            f"layer_types has sliding layers {sliding} but no window: sliding_window="
            f"{config.get('sliding_window')!r} with use_sliding_window={get('use_sliding_window')!r}"
        )
    fields = dict(
        **common,
        hidden_act=_activation(config, architecture),
        layer_types=layer_types,
        sliding_window=window if sliding else None,
        rope=(_global_rope(config, architecture),) * num_layers,
        attention_bias=bool(get("attention_bias")),
    )
    if architecture == "qwen3_moe":
        num_experts = next(
            (config[k] for k in ("num_experts", "num_local_experts") if config.get(k) is not None),
            get("num_experts"),
        )
        step = check_int("decoder_sparse_step", get("decoder_sparse_step"))
        mlp_only = config.get("mlp_only_layers") or ()
        for layer in mlp_only:
            check_int("mlp_only_layers", layer, minimum=0, maximum=num_layers - 1)
        fields.update(
            num_experts=num_experts,
            num_experts_per_tok=get("num_experts_per_tok"),
            moe_layers=tuple(
                i for i in range(num_layers) if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
            ),
            moe_intermediate_size=get("moe_intermediate_size"),
            norm_topk_prob=bool(get("norm_topk_prob")),
        )
    return fields


_READERS = {
    "mistral": _read_mistral,
    "gemma2": lambda config: _read_gemma(config, "gemma2"),
    "gemma3_text": lambda config: _read_gemma(config, "gemma3_text"),
    "gpt_oss": _read_gpt_oss,
    "llama4_text": _read_llama4,
    "qwen3": lambda config: _read_qwen3(config, "qwen3"),
    "qwen3_moe": lambda config: _read_qwen3(config, "qwen3_moe"),
}
