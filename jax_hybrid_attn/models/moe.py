"""The mixture-of-experts MLPs of gpt-oss, Llama 4 and Qwen 3 MoE, in Flax NNX, as transformers 5.17 computes
them: each routes every token to its top k experts, and the experts run as one `jax.lax.ragged_dot` over the
token-expert pairs sorted by expert (no kernel of our own).

Shape letters: T tokens · D hidden size · I an expert's MLP width · E experts · k experts per token.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from .config import ModelConfig
from .layers import PRECISION, GatedMLP, activation, matmul, normal_param

__all__ = ["GptOssMLP", "Llama4MoE", "Qwen3MoeMLP"]


def _grouped(expert_ids, num_experts: int):
    """The token-expert pairs sorted by expert: the order, each pair's token row, and the group sizes."""
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, flat[order], group_sizes


def _ragged(lhs, rhs, group_sizes):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=PRECISION)


class GptOssRouter(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs, param_dtype):
        self.weight = normal_param(rngs, (config.num_experts, config.hidden_size), param_dtype)
        self.bias = normal_param(rngs, (config.num_experts,), param_dtype)


class GptOssExperts(nnx.Module):
    """Experts with interleaved ``gate_up_proj [E, D, 2I]`` (gate at even columns), biases, clamped SwiGLU."""

    def __init__(self, config: ModelConfig, *, rngs, param_dtype):
        e, d, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = normal_param(rngs, (e, d, 2 * i), param_dtype)
        self.gate_up_proj_bias = nnx.Param(jnp.zeros((e, 2 * i), param_dtype))
        self.down_proj = normal_param(rngs, (e, i, d), param_dtype)
        self.down_proj_bias = nnx.Param(jnp.zeros((e, d), param_dtype))


class GptOssMLP(nnx.Module):
    """gpt-oss's MoE: router logits ``x @ W.T + b``, top-k, softmax over the k, weighted sum of the experts."""

    alpha = 1.702
    limit = 7.0

    def __init__(self, config: ModelConfig, *, rngs, dtype, param_dtype):
        self.router = GptOssRouter(config, rngs=rngs, param_dtype=param_dtype)
        self.experts = GptOssExperts(config, rngs=rngs, param_dtype=param_dtype)
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.dtype = dtype

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        dt = self.dtype
        logits = matmul(x, self.router.weight[...].astype(dt).T) + self.router.bias[...].astype(dt)
        top_values, top_ids = jax.lax.top_k(logits, self.top_k)  # [T, k]
        scores = jax.nn.softmax(top_values, axis=-1).astype(dt)
        order, experts, group_sizes = _grouped(top_ids, self.num_experts)
        rows = order // self.top_k
        e = self.experts
        gate_up = _ragged(x[rows], e.gate_up_proj[...].astype(dt), group_sizes)
        gate_up = gate_up + e.gate_up_proj_bias[...].astype(dt)[experts]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        glu = gate * jax.nn.sigmoid(gate * self.alpha)
        out = _ragged((up + 1) * glu, e.down_proj[...].astype(dt), group_sizes)
        out = out + e.down_proj_bias[...].astype(dt)[experts]
        out = out * scores.reshape(-1)[order][:, None]
        return jnp.zeros_like(x).at[rows].add(out.astype(x.dtype))


class Llama4Router(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs, param_dtype):
        self.weight = normal_param(rngs, (config.num_experts, config.hidden_size), param_dtype)


class Llama4Experts(nnx.Module):
    """Experts with ``gate_up_proj [E, D, 2I]`` (gate the first half) and ``down_proj [E, I, D]``, no biases."""

    def __init__(self, config: ModelConfig, *, rngs, param_dtype):
        e, d, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = normal_param(rngs, (e, d, 2 * i), param_dtype)
        self.down_proj = normal_param(rngs, (e, i, d), param_dtype)


class Llama4MoE(nnx.Module):
    """Llama 4's MoE: the top-k experts' inputs are scaled by ``sigmoid(router logit)`` (before the expert,
    not after), plus a shared expert. transformers runs every expert on every token with the others' inputs
    scaled to 0, which gives exactly 0 without biases; only the top k are computed here."""

    def __init__(self, config: ModelConfig, *, rngs, dtype, param_dtype):
        self.experts = Llama4Experts(config, rngs=rngs, param_dtype=param_dtype)
        self.router = Llama4Router(config, rngs=rngs, param_dtype=param_dtype)
        self.shared_expert = GatedMLP(
            config, config.intermediate_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.act = config.hidden_act
        self.dtype = dtype

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        dt = self.dtype
        logits = matmul(x, self.router.weight[...].astype(dt).T)
        top_values, top_ids = jax.lax.top_k(logits, self.top_k)
        scores = jax.nn.sigmoid(top_values.astype(jnp.float32)).astype(dt)  # [T, k]
        order, _, group_sizes = _grouped(top_ids, self.num_experts)
        rows = order // self.top_k
        routed_in = x[rows] * scores.reshape(-1)[order][:, None]
        gate_up = _ragged(routed_in, self.experts.gate_up_proj[...].astype(dt), group_sizes)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        out = _ragged(up * activation(self.act)(gate), self.experts.down_proj[...].astype(dt), group_sizes)
        routed = jnp.zeros_like(x).at[rows].add(out.astype(x.dtype))
        return self.shared_expert(x) + routed


class Qwen3MoeRouter(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs, param_dtype):
        self.weight = normal_param(rngs, (config.num_experts, config.hidden_size), param_dtype)


class Qwen3MoeExperts(nnx.Module):
    """Experts in transformers 5.17's fused layout: ``gate_up_proj [E, 2I, D]`` (gate the first half, each expert's
    ``[out, in]``) and ``down_proj [E, D, I]``, no biases (`load_model` stacks checkpoints' per-expert Linears)."""

    def __init__(self, config: ModelConfig, *, rngs, param_dtype):
        e, d, i = config.num_experts, config.hidden_size, config.expert_intermediate_size
        self.gate_up_proj = normal_param(rngs, (e, 2 * i, d), param_dtype)
        self.down_proj = normal_param(rngs, (e, d, i), param_dtype)


class Qwen3MoeMLP(nnx.Module):
    """Qwen 3's MoE: float32 softmax over every expert's router logit, the top k (renormalized to sum to 1 when
    `ModelConfig.norm_topk_prob`), then the weighted sum of those experts' gated MLPs."""

    def __init__(self, config: ModelConfig, *, rngs, dtype, param_dtype):
        self.gate = Qwen3MoeRouter(config, rngs=rngs, param_dtype=param_dtype)
        self.experts = Qwen3MoeExperts(config, rngs=rngs, param_dtype=param_dtype)
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.act = config.hidden_act
        self.dtype = dtype

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        dt = self.dtype
        logits = matmul(x, self.gate.weight[...].astype(dt).T)  # [T, E]
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        top_values, top_ids = jax.lax.top_k(probs, self.top_k)  # [T, k]
        if self.norm_topk_prob:
            top_values = top_values / jnp.sum(top_values, axis=-1, keepdims=True)
        scores = top_values.astype(dt)
        order, _, group_sizes = _grouped(top_ids, self.num_experts)
        rows = order // self.top_k
        e = self.experts
        gate_up = _ragged(x[rows], jnp.swapaxes(e.gate_up_proj[...].astype(dt), 1, 2), group_sizes)  # [T*k, 2I]
        gate, up = jnp.split(gate_up, 2, axis=-1)
        down = jnp.swapaxes(e.down_proj[...].astype(dt), 1, 2)  # [E, I, D]
        out = _ragged(activation(self.act)(gate) * up, down, group_sizes)
        out = out * scores.reshape(-1)[order][:, None]
        return jnp.zeros_like(x).at[rows].add(out.astype(x.dtype))
