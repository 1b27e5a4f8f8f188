"""Loading a transformers checkpoint directory into a `Decoder`, and random weights.

`load_model` follows the checkpoint's `CheckpointPlan` (`plan_checkpoint`: which stored tensors make which
parameter, which are skipped): it checks every tensor's shape in the files' headers, then reads exactly the
tensors the plan uses, with ``safetensors``' flax reader (bf16 included), one ``get_tensor`` each, cast to
`dtype`. A multimodal wrapper's vision tower and projector are never read. gpt-oss's MXFP4 experts (``*_blocks``,
``*_scales``) are dequantized as transformers does; Qwen 3 MoE's per-expert Linears are stacked into the fused
expert tensors. A float8 KV cache's per-layer scales (vLLM's ``self_attn.k_scale`` / ``self_attn.v_scale``) are
read in float32 where the checkpoint has them, and are 1.0 where it has not.
"""

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..integers import check_int
from .checkpoint_plan import (
    CheckpointPlan,
    ParamSource,
    checkpoint_tensor_names,
    open_weights,
    plan_checkpoint,
)
from .config import ModelConfig
from .decoder import Decoder

__all__ = ["load_model", "random_model", "checkpoint_tensor_names", "dequantize_mxfp4"]


def _abstract(config: ModelConfig, dtype) -> Decoder:
    return nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype))


def _stored_shapes(source: ParamSource, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape each stored tensor of `source` must have for a parameter of `shape` (None: known only once
    combined, as MXFP4 blocks)."""
    if source.how == "copy":
        return shape
    if source.how == "experts":  # [E, parts * O, ...]: each part [O, ...]
        return (shape[1] // source.parts_per_expert, *shape[2:])
    return None  # known only once combined (MXFP4 blocks), or a KV scale: [] or [1]


def _combine(source: ParamSource, raw: dict[str, np.ndarray]) -> np.ndarray:
    """The parameter `source` makes of the tensors read (`raw`, by stored name; the ones used leave it)."""
    tensors = [raw.pop(name) for name in source.names]
    if source.how == "copy":
        return tensors[0]
    if source.how == "default_kv_scale":
        return np.float32(1.0)
    if source.how == "kv_scale":
        scale = np.asarray(tensors[0], np.float32)
        if scale.size != 1 or not (np.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"tensor {source.names[0]!r} = {scale.tolist()} must be one finite number > 0 (a float8 "
                             "KV cache's scale)")  # fmt: skip
        return scale.reshape(())
    if source.how == "mxfp4":
        return dequantize_mxfp4(np.asarray(tensors[0]), np.asarray(tensors[1]))
    per = source.parts_per_expert
    experts = range(0, len(tensors), per)
    return np.stack([np.concatenate([np.asarray(t) for t in tensors[e : e + per]], axis=0) for e in experts])


def load_model(
    path: str | os.PathLike, *, dtype=jnp.float32, plan: CheckpointPlan | None = None
) -> tuple[ModelConfig, Decoder]:
    """The config and the `Decoder` of the checkpoint directory `path`, weights and activations in `dtype`.

    `plan`: the checkpoint's `plan_checkpoint(path)` when the caller has it already. `ValueError` names what is
    wrong: a path that is not a directory, no ``config.json``, no weights, a parameter missing from the files, a
    tensor of the files that is no parameter, a shape that differs."""
    if plan is None:
        plan = plan_checkpoint(path)
    elif not isinstance(plan, CheckpointPlan):
        raise ValueError(f"plan must be a CheckpointPlan, got {type(plan).__name__}")
    graphdef, abstract_state = nnx.split(_abstract(plan.config, dtype))
    wanted = {".".join(str(part) for part in p): (p, v) for p, v in nnx.to_flat_state(abstract_state)}
    expected = {}  # stored name -> its shape, where the plan fixes it
    for name, source in plan.sources.items():
        shape = _stored_shapes(source, plan.shapes[name])
        expected.update({stored: shape for stored in source.names if shape is not None})
    by_file = plan.reads_by_file()
    for file, names in by_file.items():  # every shape from the headers, before any tensor is read
        with open_weights(file) as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if name in expected and shape != expected[name]:
                    raise ValueError(f"tensor {name!r} has shape {shape}, the model expects {expected[name]}")
    raw = {}
    for file, names in by_file.items():
        with open_weights(file) as f:
            for name in names:
                raw[name] = f.get_tensor(name)
    values = {}
    for name, (_, variable) in wanted.items():
        value = _combine(plan.sources[name], raw)
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(
                f"tensor {name!r} is made of {list(plan.sources[name].names)[:4]} with shape {tuple(value.shape)}, "
                f"the model expects {tuple(variable.shape)}"
            )
        values[name] = jnp.asarray(value, dtype=variable.dtype)
    state = nnx.from_flat_state([(p, v.replace(values[name])) for name, (p, v) in wanted.items()])
    return plan.config, nnx.merge(graphdef, state)


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
