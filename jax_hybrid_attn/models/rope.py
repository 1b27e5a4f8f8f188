"""Rotary position embeddings as transformers computes them: the inverse frequencies of each RoPE type, and
their application in the two layouts (rotate-half, and Llama 4's interleaved complex pairs).

The frequencies are computed once in numpy float32, op by op as `transformers.modeling_rope_utils` does
(``default``, ``linear``, ``llama3``, ``yarn``); the angles ``position * inv_freq`` are float32, their cos and
sin are scaled by the type's attention factor and cast to the activations' dtype.

Shape letters: T tokens · N heads · H head size.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = ["ROPE_TYPES", "RopeParameters", "apply_rope"]

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""The RoPE types this package computes (transformers' `rope_type` names)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeParameters:
    """One layer type's RoPE, read from a transformers `rope_parameters` dict (after its defaults).

    Attributes:
      rope_type: one of `ROPE_TYPES`.
      rope_theta: the base wavelength.
      factor: the scaling factor (linear, llama3, yarn).
      original_max_position_embeddings: the pretraining length (llama3, yarn).
      low_freq_factor, high_freq_factor: llama3's band edges.
      beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate: yarn's options.
      max_position_embeddings: the model's length (yarn's factor when `factor` is None).
    """

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    max_position_embeddings: int | None = None

    @classmethod
    def from_hf(cls, params: dict, *, max_position_embeddings: int) -> "RopeParameters":
        """From one transformers rope dict (``rope_type`` or the legacy ``type``; unknown keys refused)."""
        params = dict(params)
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        if rope_type not in ROPE_TYPES:
            raise NotImplementedError(f"rope_type={rope_type!r} is not supported (supported: {ROPE_TYPES})")
        partial = params.pop("partial_rotary_factor", None)
        if partial not in (None, 1, 1.0):
            raise NotImplementedError(f"partial_rotary_factor={partial!r} is not supported (only 1.0)")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - fields)
        if unknown:
            raise ValueError(f"rope_parameters has keys {unknown} that rope_type={rope_type!r} does not take")
        if rope_type in ("llama3", "yarn"):
            params.setdefault("original_max_position_embeddings", max_position_embeddings)
        for key in ("factor",) if rope_type in ("linear", "llama3") else ():
            if params.get(key) is None:
                raise ValueError(f"rope_parameters has no {key!r}, which rope_type={rope_type!r} needs")
        if rope_type == "llama3":
            for key in ("low_freq_factor", "high_freq_factor"):
                if params.get(key) is None:
                    raise ValueError(f"rope_parameters has no {key!r}, which rope_type={rope_type!r} needs")
        return cls(rope_type=rope_type, max_position_embeddings=max_position_embeddings, **params)

    def inv_freq(self, head_dim: int) -> tuple[np.ndarray, float]:
        """The float32 inverse frequencies ``[H // 2]`` and the cos/sin scale (transformers' rope init functions)."""
        dim = head_dim
        base = self.rope_theta
        exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        default = (np.float32(1.0) / (np.float32(base) ** exponents)).astype(np.float32)
        if self.rope_type == "default":
            return default, 1.0
        if self.rope_type == "linear":
            return (default / np.float32(self.factor)).astype(np.float32), 1.0
        if self.rope_type == "llama3":
            return self._llama3(default), 1.0
        return self._yarn(dim)

    def _llama3(self, inv_freq: np.ndarray) -> np.ndarray:
        factor = self.factor
        low, high = self.low_freq_factor, self.high_freq_factor
        old_context_len = self.original_max_position_embeddings
        low_freq_wavelen = old_context_len / low
        high_freq_wavelen = old_context_len / high
        wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq).astype(
            np.float32
        )
        with np.errstate(divide="ignore", invalid="ignore"):  # high == low (Llama 4 Scout): no medium band
            smooth = (np.float32(old_context_len) / wavelen - np.float32(low)) / np.float32(high - low)
            smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def _yarn(self, dim: int) -> tuple[np.ndarray, float]:
        base = self.rope_theta
        original = self.original_max_position_embeddings
        factor = self.factor
        if factor is None:
            factor = self.max_position_embeddings / original

        def get_mscale(scale, mscale=1):
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention_factor = self.attention_factor
        if attention_factor is None:
            if self.mscale and self.mscale_all_dim:
                attention_factor = float(
                    get_mscale(factor, self.mscale) / get_mscale(factor, self.mscale_all_dim)
                )
            else:
                attention_factor = get_mscale(factor)
        beta_fast = self.beta_fast or 32
        beta_slow = self.beta_slow or 1

        def correction_dim(num_rotations):
            return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        pos_freqs = (np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(
            np.float32
        )
        extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
        interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
        ramp = np.clip(
            (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1
        )
        extrapolation_factor = (1 - ramp).astype(np.float32)
        inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
        return inv_freq.astype(np.float32), float(attention_factor)


def apply_rope(
    x: Float[Array, "T N H"],
    positions: Int[Array, "T"],
    inv_freq: np.ndarray,
    attention_scaling: float,
    *,
    interleaved: bool = False,
) -> Float[Array, "T N H"]:
    """`x` rotated by the angles ``positions * inv_freq``, in `x`'s dtype.

    ``interleaved=False``: transformers' rotate-half (pairs ``i`` and ``i + H/2``; cos and sin cast to x's dtype
    first). ``interleaved=True``: Llama 4's complex multiply of pairs ``(2i, 2i+1)`` in float32."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]  # [T, H/2]
    cos = jnp.cos(freqs) * jnp.float32(attention_scaling)
    sin = jnp.sin(freqs) * jnp.float32(attention_scaling)
    if interleaved:
        xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
        real, imag = xf[..., 0], xf[..., 1]
        c, s = cos[:, None, :], sin[:, None, :]
        out = jnp.stack([real * c - imag * s, real * s + imag * c], axis=-1)
        return out.reshape(x.shape).astype(x.dtype)
    cos = jnp.concatenate([cos, cos], axis=-1).astype(x.dtype)[:, None, :]
    sin = jnp.concatenate([sin, sin], axis=-1).astype(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
