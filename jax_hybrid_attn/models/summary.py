"""What a served model is, in one line and as JSON: `describe_model` and `model_line`.

The checkpoint's ``model_type`` (and its language model's when it is a multimodal wrapper), the layers of each
attention type with their window or chunk, and, for a checkpoint, how many stored tensors were read and skipped
(its `CheckpointPlan`), e.g.::

    model gemma3 (its language model, gemma3_text), 6 layers: full 1: 5; sliding (window 8) 5: 0-4; tensors read 50, skipped 20
"""

from .checkpoint_plan import CheckpointPlan
from .config import LAYER_TYPES, ModelConfig

__all__ = ["describe_model", "model_line"]

_SHORT_NAMES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}
_SIZE_KEYS = {"sliding_attention": "window", "chunked_attention": "chunk"}


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 4, 6, 7]`` as ``"0-2, 4, 6-7"``."""
    pieces, start = [], None
    for i, layer in enumerate(layers):
        start = layer if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            pieces.append(str(layer) if layer == start else f"{start}-{layer}")
            start = None
    return ", ".join(pieces)


def describe_model(config: ModelConfig, *, plan: CheckpointPlan | None = None) -> dict:
    """The served model as a JSON-ready dict: ``model_type``, ``language_model_type`` (a wrapper's language
    model, else None), ``num_layers``, ``attention`` (per attention type present: its layers and window or chunk)
    and ``tensors`` (``{"read": n, "skipped": m}`` from `plan`; None for random weights)."""
    attention = {}
    for layer_type in LAYER_TYPES:
        layers = [i for i, t in enumerate(config.layer_types) if t == layer_type]
        if layers:
            entry = {"layers": layers}
            if layer_type in _SIZE_KEYS:
                params = config.layer_params(layers[0])
                entry[_SIZE_KEYS[layer_type]] = params.sliding_window or params.attention_chunk_size
            attention[layer_type] = entry
    return {
        "model_type": config.model_type,
        "language_model_type": config.architecture if config.wrapper else None,
        "num_layers": config.num_layers,
        "attention": attention,
        "tensors": None if plan is None else {"read": len(plan.reads), "skipped": len(plan.skipped)},
    }


def model_line(description: dict) -> str:
    """`describe_model`'s dict as one line."""
    head = f"model {description['model_type']}"
    if description["language_model_type"]:
        head += f" (its language model, {description['language_model_type']})"
    parts = []
    for layer_type, entry in description["attention"].items():
        name = _SHORT_NAMES[layer_type]
        size = _SIZE_KEYS.get(layer_type)
        if size:
            name += f" ({size} {entry[size]})"
        parts.append(f"{name} {len(entry['layers'])}: {_ranges(entry['layers'])}")
    tensors = description["tensors"]
    weights = "random weights"
    if tensors is not None:
        weights = f"tensors read {tensors['read']}, skipped {tensors['skipped']}"
    return f"{head}, {description['num_layers']} layers: {'; '.join(parts)}; {weights}"
