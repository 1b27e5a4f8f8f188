"""Loading a transformers checkpoint directory into a `Decoder`, and random weights.

A checkpoint directory holds ``config.json`` and safetensors weights with transformers' parameter names: one
``model.safetensors``, or shards listed by ``model.safetensors.index.json``. The `Decoder`'s parameters carry
the same names and shapes, so loading is a name-for-name copy: every parameter must be in the files with its
shape, and every tensor in the files must be a parameter (tensors transformers ignores too are skipped: the
LM head of a tied model, RoPE buffers). gpt-oss's MXFP4 experts (``*_blocks``, ``*_scales``) are
dequantized as transformers does. Tensors are read with ``safetensors``' flax reader (bf16 included) and
cast to `dtype`.
"""

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..integers import check_int
from .config import ModelConfig
from .decoder import Decoder

__all__ = ["load_model", "random_model", "checkpoint_tensor_names", "dequantize_mxfp4"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _weight_files(path: Path) -> dict[str, Path]:
    """Each tensor name in the checkpoint and the file holding it."""
    from safetensors import safe_open

    index = path / _INDEX
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(index)!r} has no weight_map")
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise ValueError(
                    f"{str(index)!r} names the shard {file.name!r}, which is not in {str(path)!r}"
                )
        return files
    single = path / _SINGLE
    if not single.is_file():
        others = sorted(p.name for p in path.glob("*.safetensors"))
        if len(others) != 1:
            raise ValueError(
                f"path={str(path)!r} has no {_SINGLE} nor {_INDEX} (safetensors files: {others})"
            )
        single = path / others[0]
    with safe_open(single, framework="flax") as f:
        return {name: single for name in f.keys()}


def checkpoint_tensor_names(path: str | os.PathLike) -> list[str]:
    """The tensor names of the checkpoint directory `path`, sorted."""
    return sorted(_weight_files(_check_dir(path)))


def _check_dir(path) -> Path:
    checked = Path(path)
    if not checked.is_dir():
        raise ValueError(f"path={str(path)!r} is not a directory")
    return checked


def _ignored(name: str, config: ModelConfig) -> bool:
    """Tensors transformers skips on load: a tied LM head, saved RoPE buffers."""
    return (config.tie_word_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")


def _abstract(config: ModelConfig, dtype) -> Decoder:
    return nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype))


def load_model(path: str | os.PathLike, *, dtype=jnp.float32) -> tuple[ModelConfig, Decoder]:
    """The config and the `Decoder` of the checkpoint directory `path`, weights and activations in `dtype`.

    `ValueError` names what is wrong: a path that is not a directory, no ``config.json``, no weights, a
    parameter missing from the files, a tensor of the files that is no parameter, a shape that differs."""
    from safetensors import safe_open

    path = _check_dir(path)
    config = ModelConfig.from_dir(path)
    files = _weight_files(path)
    graphdef, abstract_state = nnx.split(_abstract(config, dtype))
    flat = list(nnx.to_flat_state(abstract_state))
    wanted = {".".join(str(part) for part in p): (p, v) for p, v in flat}
    packed = {}  # parameter name -> its (blocks, scales) tensor names, for MXFP4 checkpoints
    if config.quantization == "mxfp4":
        for name in wanted:
            blocks, scales = f"{name}_blocks", f"{name}_scales"
            if name not in files and blocks in files and scales in files:
                packed[name] = (blocks, scales)
    stored = (set(files) - {n for pair in packed.values() for n in pair}) | set(packed)
    missing = sorted(set(wanted) - stored)
    if missing:
        raise ValueError(
            f"the checkpoint in {str(path)!r} lacks the tensors {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} ({len(missing)} missing)"
        )
    unexpected = sorted(name for name in stored if name not in wanted and not _ignored(name, config))
    if unexpected:
        raise ValueError(
            f"the checkpoint in {str(path)!r} has tensors the model does not: {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} unexpected)"
        )
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        for stored_name in packed.get(name, (name,)):
            by_file.setdefault(files[stored_name], []).append(stored_name)
    raw = {}
    for file, names in by_file.items():
        with safe_open(file, framework="flax") as f:
            for name in names:
                if name in wanted:
                    shape = tuple(f.get_slice(name).get_shape())
                    expected = tuple(wanted[name][1].shape)
                    if shape != expected:
                        raise ValueError(f"tensor {name!r} has shape {shape}, the model expects {expected}")
                raw[name] = f.get_tensor(name)
    values = {}
    for name, (_, variable) in wanted.items():
        if name in packed:
            value = dequantize_mxfp4(
                np.asarray(raw.pop(packed[name][0])), np.asarray(raw.pop(packed[name][1]))
            )
            if value.shape != tuple(variable.shape):
                raise ValueError(
                    f"tensor {name!r} dequantizes to shape {value.shape}, the model expects "
                    f"{tuple(variable.shape)}"
                )
        else:
            value = raw.pop(name)
        values[name] = jnp.asarray(value, dtype=variable.dtype)
    state = nnx.from_flat_state([(p, v.replace(values[name])) for name, (p, v) in wanted.items()])
    return config, nnx.merge(graphdef, state)


FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
"""The 16 values of an FP4 (e2m1) code."""


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 experts as transformers' `convert_moe_packed_tensors` dequantizes them, in float32 (exact).

    `blocks` ``[E, R, G, 16]`` uint8 hold two FP4 codes a byte (low nibble first) for 32 values a group,
    `scales` ``[E, R, G]`` uint8 each group's power of two plus 127; the result is ``[E, G * 32, R]``
    (the ``[E, in, out]`` layout of `gate_up_proj` and `down_proj`)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {blocks.dtype}{blocks.shape} and scales {scales.dtype}{scales.shape} "
            "must be uint8 [E, R, G, B] and [E, R, G]"
        )
    *prefix, groups, width = blocks.shape
    values = np.empty((*prefix, groups, width * 2), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None])
    return values.reshape(*prefix, groups * width * 2).swapaxes(1, 2)


def random_model(config: ModelConfig, *, seed: int = 0, dtype=jnp.float32) -> Decoder:
    """A `Decoder` of `config` with random weights (normal, std 0.02) drawn from `seed`."""
    seed = check_int("seed", seed, minimum=0, maximum=None)
    return Decoder(config, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)
