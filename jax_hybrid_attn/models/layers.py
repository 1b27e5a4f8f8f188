"""The building blocks every family's layers share, in Flax NNX, as transformers 5.17 computes them: a Linear
with transformers' ``[out, in]`` weight, the RMSNorm styles, the activations and the gated MLP.

Shape letters: T tokens · D hidden size · I MLP width.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig

__all__ = [
    "INIT_STD",
    "PRECISION",
    "GatedMLP",
    "Linear",
    "RMSNorm",
    "activation",
    "concatenate_weights",
    "matmul",
    "normal_param",
]

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


def concatenate_weights(parts):
    """`parts` (arrays of equal trailing shapes and one dtype) concatenated along their first axis; where they are
    `jax.ShapeDtypeStruct`s (the weights of a model made by `nnx.eval_shape`), the `jax.ShapeDtypeStruct` of that
    concatenation."""
    if all(isinstance(part, jax.ShapeDtypeStruct) for part in parts):
        first = parts[0]
        if any(part.shape[1:] != first.shape[1:] or part.dtype != first.dtype for part in parts):
            raise ValueError(f"cannot concatenate {[(part.shape, part.dtype) for part in parts]} along axis 0")
        return jax.ShapeDtypeStruct((sum(part.shape[0] for part in parts), *first.shape[1:]), first.dtype)
    return jnp.concatenate(parts, axis=0)


def per_head(weight, heads: int):
    """A vector `weight` [H] repeated for `heads` heads ([heads, H]; a `jax.ShapeDtypeStruct` likewise)."""
    if isinstance(weight, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((heads, *weight.shape), weight.dtype)
    return jnp.broadcast_to(weight, (heads, *weight.shape))


def activation(name: str):
    if name == "silu":
        return jax.nn.silu
    return functools.partial(jax.nn.gelu, approximate=True)  # gelu_pytorch_tanh


class Linear(nnx.Module):
    """``x @ weight.T + bias`` with transformers' ``[out, in]`` weight: random as built (normal weight, zero bias),
    or holding given ones (`of_weight`)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, rngs, dtype, param_dtype):
        self.weight = normal_param(rngs, (out_features, in_features), param_dtype)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if bias else None
        self.dtype = dtype

    @classmethod
    def of_weight(cls, weight, bias, *, dtype) -> "Linear":
        """A Linear holding `weight` ``[out, in]`` and `bias` ``[out]`` (None: no bias) as they are, arrays or
        `jax.ShapeDtypeStruct`s, computing in `dtype`. Nothing random is drawn: the Linear is built abstractly
        (`nnx.eval_shape`), then given the weights."""
        out_features, in_features = weight.shape
        linear = nnx.eval_shape(lambda: cls(in_features, out_features, bias=bias is not None, rngs=nnx.Rngs(0),
                                            dtype=dtype, param_dtype=weight.dtype))  # fmt: skip
        linear.weight = nnx.Param(weight)
        if bias is not None:
            linear.bias = nnx.Param(bias)
        return linear

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

    @classmethod
    def of_weight(cls, weight, *, eps: float, style: str) -> "RMSNorm":
        """An RMSNorm holding `weight` as it is (an array or a `jax.ShapeDtypeStruct`, of any shape that
        broadcasts against the inputs' trailing axes, e.g. one row per head)."""
        norm = nnx.eval_shape(lambda: cls(1, eps=eps, style=style, param_dtype=weight.dtype))
        norm.weight = nnx.Param(weight)
        return norm

    def __call__(self, x):
        return rms_norm(x, self.weight[...], eps=self.eps, style=self.style)


def rms_norm(x, weight, *, eps: float, style: str):
    """`RMSNorm`'s computation over the last axis of `x`, with a `weight` that broadcasts against `x` (one per
    position of the last axis, or one row per head: `Attention` norms q's and k's heads in one array)."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if style == "gemma":
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    if style == "f32":
        return (weight * normed).astype(x.dtype)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


class GatedMLP(nnx.Module):
    """``down(act(gate(x)) * up(x))``.

    `fuse_projections` turns ``gate`` and ``up`` into one ``gate_up_proj`` (one matmul for both, the same products).
    That form is for serving (`layer_scan.ScannedDecoder`): its parameter names are no longer transformers', so a
    checkpoint loads into the unfused form."""

    def __init__(self, config: ModelConfig, intermediate_size: int, *, rngs, dtype, param_dtype):
        d = config.hidden_size
        common = dict(bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Linear(d, intermediate_size, **common)
        self.up_proj = Linear(d, intermediate_size, **common)
        self.gate_up_proj = nnx.data(None)  # `fuse_projections`: gate's and up's weights ``[2I, D]``
        self.down_proj = Linear(intermediate_size, d, **common)
        self.act = config.hidden_act

    def fuse_projections(self) -> None:
        """Replace `gate_proj` and `up_proj` by one `gate_up_proj` whose weight is theirs concatenated
        (``[2I, D]``, gate first). This module's new Linear holds the concatenation: the old ones are left as
        they are, so a copy of a module (`nnx.merge` of its split) fuses without touching the original."""
        gate, up = self.gate_proj, self.up_proj
        weight = concatenate_weights([gate.weight.get_value(), up.weight.get_value()])
        self.gate_up_proj = Linear.of_weight(weight, None, dtype=gate.dtype)
        self.gate_proj = self.up_proj = None

    def __call__(self, x):
        if self.gate_up_proj is not None:
            # The barrier keeps XLA from running the activation as a cuBLASLt epilogue of the product: that call
            # cannot read a scanned layer's weights in place in their stack (`EngineConfig.cublas_matmuls`).
            gate, up = jnp.split(jax.lax.optimization_barrier(self.gate_up_proj(x)), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(activation(self.act)(gate) * up)
