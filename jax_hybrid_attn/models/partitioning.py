"""Tensor parallelism for a `Decoder`: its weights split Megatron-style over one mesh axis.

Column-parallel (split by output features, whole heads in order): the q, k and v projections, the MLP's gate and
up projections, and the sinks with their heads. Row-parallel (split by input features): the output and down
projections, so that XLA adds one all-reduce after each attention block and one after each MLP. Replicated:
embeddings, norms (the q/k norms act on the head dimension), and the routers and experts of MoE MLPs.

With fewer KV heads than devices, each KV head of the k and v projections is repeated ``devices / K`` times, so
that every device holds the whole KV head its query heads read (`sharding.replicate_kv_heads`); the model's
config then says ``num_kv_heads = devices``, and so does its KV cache.

Shape letters: N query heads · K kv heads · H head size · D hidden size.
"""

import dataclasses

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..integers import check_int
from ..sharding import kv_heads_per_device, replicate_kv_heads
from .config import ModelConfig
from .decoder import Decoder

__all__ = ["shard_model", "shard_weights", "tensor_parallel_config", "weight_spec"]

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
KV_PROJECTIONS = ("k_proj", "v_proj")


def tensor_parallel_config(config: ModelConfig, num_devices: int) -> ModelConfig:
    """`config` as the model runs on `num_devices` devices: its KV heads repeated up to the device count when
    fewer. Raises `ValueError` when the heads or the MLP do not split evenly."""
    check_int("num_devices", num_devices, minimum=1)
    if config.num_heads % num_devices:
        raise ValueError(f"num_heads={config.num_heads} does not split over {num_devices} devices")
    kv_heads_per_device(config.num_kv_heads, num_devices)
    for name in ("intermediate_size", "intermediate_size_mlp"):
        size = getattr(config, name)
        if size and size % num_devices:
            raise ValueError(f"{name}={size} does not split over {num_devices} devices")
    return dataclasses.replace(config, num_kv_heads=max(config.num_kv_heads, num_devices))


def weight_spec(path: str, ndim: int, axis: str) -> P:
    """The partition of the weight at `path` (``"model.layers.0.self_attn.q_proj.weight"``, transformers'
    ``[out, in]`` layout) over the mesh axis `axis`."""
    parts = path.split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) > 1 else ("", parts[-1])
    if module in COLUMN_PARALLEL and leaf in ("weight", "bias"):
        return P(axis, *[None] * (ndim - 1))
    if module in ROW_PARALLEL and leaf == "weight":
        return P(None, axis)
    if module == "self_attn" and leaf == "sinks":
        return P(axis)
    return P()


def shard_weights(state: nnx.State, config: ModelConfig, mesh: Mesh, axis: str) -> nnx.State:
    """The model's weights (`nnx.split`'s state, made for `config`) placed on `mesh`, split over `axis` (see the
    module docstring); KV heads repeated as `tensor_parallel_config` says."""
    num_devices = mesh.shape[axis]
    tensor_parallel_config(config, num_devices)  # the heads and the MLP split evenly

    def place(path, x):
        name = jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
        parts = name.split(".")
        if len(parts) > 1 and parts[-2] in KV_PROJECTIONS:  # [K * H, ...], heads repeated when K < devices
            heads = x.reshape(config.num_kv_heads, config.head_dim, *x.shape[1:])
            x = replicate_kv_heads(heads, num_devices=num_devices, axis=0).reshape(-1, *x.shape[1:])
        return jax.device_put(x, NamedSharding(mesh, weight_spec(name, x.ndim, axis)))

    return jax.tree_util.tree_map_with_path(place, state)


def shard_model(model, mesh: Mesh, axis: str) -> tuple[nnx.GraphDef, nnx.State, ModelConfig]:
    """A `Decoder` split over `axis` of `mesh`: (its graph for the sharded config, its weights on the mesh, that
    config (`tensor_parallel_config`))."""
    config = tensor_parallel_config(model.config, mesh.shape[axis])
    # the graph of the same model with the sharded config's KV heads
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0), dtype=model.dtype))
    graphdef, _ = nnx.split(abstract)
    _, state = nnx.split(model)
    return graphdef, shard_weights(state, model.config, mesh, axis), config
