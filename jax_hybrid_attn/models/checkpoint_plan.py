"""What a checkpoint's tensors make, said before any tensor is read: `plan_checkpoint`.

A checkpoint directory holds ``config.json`` and safetensors weights: one ``model.safetensors``, or shards listed
by ``model.safetensors.index.json``. The plan comes from the config, the index (or the one file's header) and the
`Decoder`'s parameter names alone. Each parameter of the `Decoder` (transformers' names and layouts:
``model.layers.3.self_attn.q_proj.weight``) gets its `ParamSource`, the stored tensors it is made of:

  * ``copy``: one tensor of the same name, as stored. A multimodal wrapper's language model is stored under
    ``language_model.model.*`` and ``language_model.lm_head.*`` (the layout transformers writes, 4 and 5.17
    alike) or ``model.language_model.*`` and ``lm_head.*`` (Gemma 3's layout in memory in transformers 5);
  * ``mxfp4``: gpt-oss's experts as ``*_blocks`` and ``*_scales``, dequantized on load;
  * ``experts``: Qwen 3 MoE's fused experts made of one Linear per expert as published checkpoints (and
    transformers 5.17's `save_pretrained`) store them: ``mlp.experts.{e}.gate_proj.weight`` and ``up_proj``
    concatenated on their first axis, ``down_proj`` alone, stacked over the experts.

Every other stored tensor is skipped with its reason (a wrapper's vision tower and multimodal projector, a tied LM
head, saved RoPE buffers) or is an error: a parameter none of the tensors makes, a tensor nothing uses, a
parameter two tensors would make.
"""

import contextlib
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from flax import nnx

from .config import ModelConfig
from .decoder import Decoder
from .hf_config import read_json_file

__all__ = [
    "CheckpointPlan",
    "ParamSource",
    "checkpoint_tensor_names",
    "open_weights",
    "plan_checkpoint",
    "SOURCE_KINDS",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

SOURCE_KINDS = ("copy", "mxfp4", "experts", "kv_scale", "default_kv_scale")
"""How a parameter is made of stored tensors (`ParamSource.how`)."""

KV_SCALE_NAMES = ("self_attn.k_scale", "self_attn.v_scale")
"""A layer's float8 KV-cache scales (`decoder.KVCacheScale`), as vLLM names them in a checkpoint: optional, 1.0
where absent."""

_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)
"""A multimodal wrapper's stored prefixes of its language model, and the `Decoder`'s names for them."""

_MULTIMODAL_PREFIXES = {
    "vision_tower.": "vision tower",
    "vision_model.": "vision tower",
    "multi_modal_projector.": "multimodal projector",
    "model.vision_tower.": "vision tower",
    "model.vision_model.": "vision tower",
    "model.multi_modal_projector.": "multimodal projector",
}
"""A multimodal wrapper's stored prefixes that are never read, and what they hold."""

_PER_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""Qwen 3 MoE's fused expert parameters and the per-expert Linears each is made of, in order."""

_MXFP4_SUFFIXES = ("_blocks", "_scales")


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """The stored tensors one parameter is made of.

    Attributes:
      how: one of `SOURCE_KINDS`.
      names: the stored tensors in the order `how` takes them: for "mxfp4" the blocks and the scales, for
        "experts" each expert's parts in turn (``gate_0, up_0, gate_1, up_1, ...`` or ``down_0, down_1, ...``),
        for "kv_scale" the one stored scale (shape [] or [1]); none for "default_kv_scale" (a checkpoint without
        the layer's KV scale: 1.0).
      parts_per_expert: for "experts", the tensors concatenated into each expert's slice (2 for gate and up).
    """

    how: str
    names: tuple[str, ...]
    parts_per_expert: int = 1


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """Which stored tensors make which parameter, and which are skipped (`plan_checkpoint`).

    Attributes:
      path: the checkpoint directory.
      config: its `ModelConfig`.
      files: every stored tensor's name and the file holding it.
      shapes: every `Decoder` parameter's name and shape.
      sources: every parameter's name and its `ParamSource`.
      skipped: the stored tensors that are not read, each with the reason.
    """

    path: Path
    config: ModelConfig
    files: Mapping[str, Path]
    shapes: Mapping[str, tuple[int, ...]]
    sources: Mapping[str, ParamSource]
    skipped: Mapping[str, str]

    @property
    def reads(self) -> tuple[str, ...]:
        """The stored tensors that loading reads, sorted (each once)."""
        return tuple(sorted({name for source in self.sources.values() for name in source.names}))

    def reads_by_file(self) -> dict[Path, list[str]]:
        """`reads` grouped by the file holding them."""
        grouped: dict[Path, list[str]] = {}
        for name in self.reads:
            grouped.setdefault(self.files[name], []).append(name)
        return grouped


def _check_dir(path) -> Path:
    checked = Path(path)
    if not checked.is_dir():
        raise ValueError(f"path={str(path)!r} is not a directory")
    return checked


@contextlib.contextmanager
def open_weights(file: Path):
    """safetensors' ``safe_open`` of `file` (flax arrays), which reads its header; a file it cannot read (truncated,
    empty, not safetensors) is a `ValueError` naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(file, framework="flax")
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{str(file)!r} is not a readable safetensors file: {error}") from None
    with handle as f:
        yield f


def weight_files(path: Path) -> dict[str, Path]:
    """Each tensor name in the checkpoint directory `path` and the file holding it (from the index, or the one
    safetensors file's header). Every file's header is read: a file that cannot be read, or a shard that lacks a
    tensor the index puts in it, is a `ValueError`."""
    index = path / INDEX_FILE
    if index.is_file():
        index_value = read_json_file(index)
        weight_map = index_value.get("weight_map") if isinstance(index_value, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(index)!r} has no weight_map")
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise ValueError(f"{str(index)!r} names the shard {file.name!r}, which is not in {str(path)!r}")
            with open_weights(file) as f:
                stored = set(f.keys())
            missing = sorted(name for name, holder in files.items() if holder == file and name not in stored)
            if missing:
                raise ValueError(f"{str(index)!r} puts {missing[:3]} in {file.name!r}, which does not hold them")
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        others = sorted(p.name for p in path.glob("*.safetensors"))
        if len(others) != 1:
            raise ValueError(
                f"path={str(path)!r} has no {SINGLE_FILE} nor {INDEX_FILE} (safetensors files: {others})"
            )
        single = path / others[0]
    with open_weights(single) as f:
        return {name: single for name in f.keys()}


def checkpoint_tensor_names(path: str | os.PathLike) -> list[str]:
    """The tensor names of the checkpoint directory `path`, sorted."""
    return sorted(weight_files(_check_dir(path)))


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of a `Decoder` of `config`: its dotted name and shape (nothing allocated)."""
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    return {
        ".".join(str(part) for part in path): tuple(variable.shape)
        for path, variable in nnx.to_flat_state(nnx.state(abstract))
    }


def _language_model_name(stored: str, config: ModelConfig) -> tuple[str | None, str | None]:
    """(the `Decoder`'s name for the stored tensor `stored`, None) or (None, why it is skipped) for a wrapper's
    other parts; unknown names come back as they are (and are then unexpected)."""
    if config.wrapper is None:
        return stored, None
    for prefix, reason in _MULTIMODAL_PREFIXES.items():
        if stored.startswith(prefix):
            return None, f"{reason} of model_type={config.wrapper!r} (text only)"
    for prefix, ours in _LANGUAGE_MODEL_PREFIXES:
        if stored.startswith(prefix):
            return ours + stored[len(prefix) :], None
    return stored, None


def _ignored(name: str, config: ModelConfig) -> str | None:
    """Why transformers skips the tensor `name` on load (a tied LM head, saved RoPE buffers), else None."""
    if config.tie_word_embeddings and name == "lm_head.weight":
        return "LM head tied to the embedding"
    if name.endswith("rotary_emb.inv_freq"):
        return "RoPE buffer (recomputed)"
    return None


def _per_expert(param: str, config: ModelConfig) -> tuple[tuple[str, ...], int] | None:
    """The per-expert Linears a fused expert parameter `param` is made of (in `ParamSource.names` order) and the
    parts per expert; None for any other parameter."""
    head, _, leaf = param.rpartition(".")
    if config.architecture != "qwen3_moe" or not head.endswith(".experts") or leaf not in _PER_EXPERT_PARTS:
        return None
    parts = _PER_EXPERT_PARTS[leaf]
    names = tuple(f"{head}.{e}.{part}.weight" for e in range(config.num_experts) for part in parts)
    return names, len(parts)


def _listing(names: list[str]) -> str:
    return f"{names[:8]}{' ...' if len(names) > 8 else ''} ({len(names)}"


def plan_checkpoint(path: str | os.PathLike) -> CheckpointPlan:
    """The plan of loading the checkpoint directory `path` (its config, the index or the file's header; no tensor
    is read): each parameter's stored tensors, and the stored tensors skipped with the reason.

    `ValueError` names what is wrong: a path that is not a directory, no ``config.json``, no weights, a parameter
    none of the tensors makes, a tensor that is no parameter, two tensors for one parameter."""
    path = _check_dir(path)
    config = ModelConfig.from_dir(path)
    files = weight_files(path)
    shapes = parameter_shapes(config)
    by_param: dict[str, str] = {}  # the Decoder's name -> the stored name
    skipped: dict[str, str] = {}
    for stored in sorted(files):
        name, reason = _language_model_name(stored, config)
        reason = reason or _ignored(name, config)
        if reason is not None:
            skipped[stored] = reason
        elif name in by_param:
            raise ValueError(
                f"the checkpoint in {str(path)!r} stores the parameter {name!r} twice: {by_param[name]!r} and "
                f"{stored!r}"
            )
        else:
            by_param[name] = stored
    sources: dict[str, ParamSource] = {}
    missing = []
    for param in shapes:
        packed = tuple(param + suffix for suffix in _MXFP4_SUFFIXES)
        experts = _per_expert(param, config)
        if param.endswith(KV_SCALE_NAMES):
            stored = by_param.pop(param, None)
            sources[param] = ParamSource("kv_scale", (stored,)) if stored else ParamSource("default_kv_scale", ())
        elif param in by_param:
            sources[param] = ParamSource("copy", (by_param.pop(param),))
        elif config.quantization == "mxfp4" and all(name in by_param for name in packed):
            sources[param] = ParamSource("mxfp4", tuple(by_param.pop(name) for name in packed))
        elif experts is not None and any(name in by_param for name in experts[0]):
            absent = [name for name in experts[0] if name not in by_param]
            missing += absent
            if not absent:
                sources[param] = ParamSource("experts", tuple(by_param.pop(n) for n in experts[0]), experts[1])
        else:
            missing.append(param)
    if missing:
        raise ValueError(f"the checkpoint in {str(path)!r} lacks the tensors {_listing(missing)} missing)")
    unexpected = sorted(by_param.values())
    if unexpected:
        raise ValueError(
            f"the checkpoint in {str(path)!r} has tensors the model does not: {_listing(unexpected)} unexpected)"
        )
    return CheckpointPlan(path, config, files, shapes, sources, skipped)
