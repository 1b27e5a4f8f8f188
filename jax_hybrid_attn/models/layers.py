"""The building blocks every family's layers share, in Flax NNX, as transformers 5.17 computes them: a Linear
with transformers' ``[out, in]`` weight, the RMSNorm styles, the activations and the gated MLP.

Shape letters: T tokens · D hidden size · I MLP width.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig

__all__ = ["INIT_STD", "PRECISION", "GatedMLP", "Linear", "RMSNorm", "activation", "matmul", "normal_param"]

PRECISION = jax.lax.Precision.HIGHEST
"""float32 products at full precision on every backend (a GPU would use TF32 otherwise); bf16 is unaffected."""

INIT_STD = 0.02
"""transformers' `initializer_range` default: the random weights' standard deviation."""


def normal_param(rngs: nnx.Rngs, shape, param_dtype) -> nnx.Param:
    return nnx.Param(
        jax.random.normal(rngs.params(), shape, param_dtype) * jnp.asarray(INIT_STD, param_dtype)
    )


def matmul(x, w_t):
    """``x @ w_t`` at full float32 precision."""
    return jnp.matmul(x, w_t, precision=PRECISION)


def activation(name: str):
    if name == "silu":
        return jax.nn.silu
    return functools.partial(jax.nn.gelu, approximate=True)  # gelu_pytorch_tanh


class Linear(nnx.Module):
    """``x @ weight.T + bias`` with transformers' ``[out, in]`` weight."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, rngs, dtype, param_dtype):
        self.weight = normal_param(rngs, (out_features, in_features), param_dtype)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if bias else None
        self.dtype = dtype

    def __call__(self, x):
        y = matmul(x, self.weight[...].astype(self.dtype).T)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, with each family's weight form and dtype casts.

    style "llama" (Mistral, Llama 4): ``w * normed(x_f32).astype(dtype)``;
    style "gemma": ``(normed(x_f32) * (1 + w_f32)).astype(dtype)`` (weights initialised at 0);
    style "f32": gpt-oss, ``(w * normed(x_f32)).astype(dtype)``, the weight stored in float32 whatever
    `param_dtype` (transformers keeps these norms in float32)."""

    def __init__(self, dim: int, *, eps: float, style: str, param_dtype):
        init = jnp.zeros if style == "gemma" else jnp.ones
        if style == "f32":  # gpt-oss keeps its norms in float32 (transformers' _keep_in_fp32_modules)
            param_dtype = jnp.float32
        self.weight = nnx.Param(init((dim,), param_dtype))
        self.eps = eps
        self.style = style

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...]
        if self.style == "gemma":
            return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        if self.style == "f32":
            return (w * normed).astype(x.dtype)
        return w.astype(x.dtype) * normed.astype(x.dtype)


class GatedMLP(nnx.Module):
    """``down(act(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, intermediate_size: int, *, rngs, dtype, param_dtype):
        d = config.hidden_size
        common = dict(bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Linear(d, intermediate_size, **common)
        self.up_proj = Linear(d, intermediate_size, **common)
        self.down_proj = Linear(intermediate_size, d, **common)
        self.act = config.hidden_act

    def __call__(self, x):
        return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))
