"""Decoder models in Flax NNX whose layers take their attention type from the checkpoint's config."""

from .attention_cache import AttentionCache, DenseAttention, dense_attention
from .checkpoint_plan import CheckpointPlan, ParamSource, plan_checkpoint
from .compare import ComparisonReport, compare_with_transformers
from .config import LANGUAGE_MODEL_TYPES, MULTIMODAL_WRAPPERS, SUPPORTED_ARCHITECTURES, ModelConfig
from .decoder import Decoder, DecoderIntermediates, KVCacheScale
from .embedded import EMBEDDED_HF_CONFIG, embedded_config, save_embedded_checkpoint
from .loading import checkpoint_tensor_names, load_model, random_model
from .rope import RopeParameters
from .summary import describe_model, model_line
from .tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    MissingTokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_files,
)

__all__ = [
    "AttentionCache",
    "DenseAttention",
    "dense_attention",
    "SUPPORTED_ARCHITECTURES",
    "LANGUAGE_MODEL_TYPES",
    "MULTIMODAL_WRAPPERS",
    "ModelConfig",
    "RopeParameters",
    "Decoder",
    "DecoderIntermediates",
    "KVCacheScale",
    "load_model",
    "random_model",
    "save_embedded_checkpoint",
    "checkpoint_tensor_names",
    "plan_checkpoint",
    "CheckpointPlan",
    "ParamSource",
    "compare_with_transformers",
    "ComparisonReport",
    "describe_model",
    "model_line",
    "EMBEDDED_HF_CONFIG",
    "embedded_config",
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "MissingTokenizer",
    "load_tokenizer",
    "tokenizer_files",
]
