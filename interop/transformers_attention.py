"""A HuggingFace transformers attention function backed by jax_hybrid_attn.

    from jax_hybrid_attn_torch.transformers_attention import register

    register()                                   # once: adds "jax_hybrid" to transformers' registries
    model = AutoModelForCausalLM.from_config(config, attn_implementation="jax_hybrid")
    # or: model.set_attn_implementation("jax_hybrid")
    with torch.no_grad():
        tokens = model.generate(input_ids, max_new_tokens=32)

Every attention layer then calls `attention_forward` with HF's query [B, N, L, H] and the dense keys and values
[B, K, S, H] that HF's KV cache returns after its update. The function lays the keys and values out as a paged
cache with a contiguous block table, builds `AttentionMetadata` (every batch row one request of L queries, the
last L of its S positions) and calls `jax_hybrid_attn.paged_attention` (the Mosaic GPU kernel on a GPU, the jnp
reference on a CPU) in one jitted JAX call. It returns ``(attn_output [B, L, N, H], None)``, as HF's sdpa does.

Per-layer parameters (`layer_params`), each from where the model's own eager attention reads it:
  * scale: the ``scaling`` argument (None: ``head_dim ** -0.5``, as HF's eager functions do).
  * sliding window: the ``sliding_window`` keyword (Gemma 2/3, Mistral, gpt-oss pass it per layer, None on
    global layers); without that keyword, ``module.sliding_window``.
  * chunked attention (Llama 4): ``config.layer_types[layer_idx] == "chunked_attention"`` with
    ``config.attention_chunk_size``; Llama4TextAttention has no attribute of its own for it (its
    ``use_rope`` layers are the chunked ones, which is how the config's default ``layer_types`` is built).
  * logits soft cap: the ``softcap`` keyword (Gemma 2; Gemma 3's attention does not pass it, so neither is it
    applied there, exactly as in its eager path).
  * sinks (gpt-oss): the ``s_aux`` keyword, else ``module.sinks``: one unscaled logit per query head in the
    softmax denominator, as gpt-oss's eager path concatenates it to the scaled logits.
  * causal: the ``is_causal`` keyword, else ``module.is_causal`` (default True).

Conventions. HF's masks (masking_utils 5.17) and this package agree:
  * sliding window: HF's ``sliding_window_overlay`` keeps ``kv_idx > q_idx - sliding_window``, i.e.
    ``q - k < W``: the W most recent positions, the query's own included, our `params.py` convention. HF's
    sliding-window cache keeps the last W - 1 keys, so a step sees ``S = W - 1 + L`` keys; windows depend only
    on ``q - k``, so relative positions suffice.
  * chunked: HF keeps ``(k - left_pad) // C == (q - left_pad) // C`` on absolute positions; without padding
    that is ours. HF's chunked cache also keeps only the last C - 1 keys, so absolute positions are needed:
    the key offset modulo C is read from the mask (the first key the last query may see starts its chunk), and
    the keys are placed at that offset in the paged cache.
  * GQA: query head n reads KV head ``n // (N // K)``, as HF's ``repeat_kv``.

Masks and safety. `register` also registers `attention_mask_function` as the mask builder for the same name
(without one, HF would pass no mask at all and padding would go unseen): HF's sdpa boolean mask, always
materialized [B, 1, L, S]. Before computing, the mask is compared with the pattern this layer's parameters give
(`jax_hybrid_attn.masks.attention_mask`, the same predicate the reference and kernels use); any difference
raises NotImplementedError, so a padded batch, packed sequences, a custom or additive-bias mask, a static
cache, or a window the model masks differently from what `layer_params` found can never give a silently wrong
result. The check runs once per mask tensor and layer pattern (masks are shared across a model's layers).

Recompilation. JAX compiles per input shape, and HF hands over exactly-S-long keys that grow by one every
generated token. So the keys and values are copied (on torch's side, one strided copy each) into a buffer whose
length is a power-of-two number of `BLOCK_SIZE` blocks, and queries are padded to a power-of-two length when
causal (padded queries sit after the real ones, which causal masking keeps from influencing them); the jitted
call then writes the keys and values into a paged cache by slot. One function is compiled per (batch,
query bucket, key bucket, dtype, layer parameters). Tensors that need no padding (decode queries, L = 1; keys
that exactly fill their bucket) enter JAX zero-copy; the output leaves through DLPack, sharing JAX's memory.

Limits (each raises NotImplementedError, never a wrong result): padded batches (left or right padding: use
batch size 1, or equal-length prompts), gradients (no backward: run under ``torch.no_grad()`` or
``torch.inference_mode()``), dropout > 0, ``position_bias``, queries longer than the keys, value head size
different from the query's. ``output_attentions`` returns None weights with a warning (as sdpa does). On a
GPU the kernels take bfloat16/float16 and head sizes that are multiples of 64 (`paged_attention` raises
otherwise); ``register(implementation="reference")`` forces the jnp reference anywhere.

Stream order on a GPU: the inputs enter JAX after the work queued on torch's current stream, and the output is
exported so that torch's current stream waits for the JAX computation, which also covers JAX's reads of the
inputs: torch may reuse their memory once this function has returned.
"""

import functools
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import logging

from jax_hybrid_attn import LayerAttentionParams, metadata_from_lengths, paged_attention, write_kv
from jax_hybrid_attn.constants import NULL_BLOCK_ID
from jax_hybrid_attn.integers import next_power_of_two
from jax_hybrid_attn.masks import attention_mask as allowed_keys

from .dlpack import ALIGNMENT, is_compact, to_jax, to_torch

__all__ = ["BLOCK_SIZE", "NAME", "attention_forward", "attention_mask_function", "layer_params", "register"]

logger = logging.get_logger(__name__)

NAME = "jax_hybrid"
"""The default `attn_implementation` name."""

BLOCK_SIZE = 16
"""Tokens per block of the paged layout; divides the kernels' 64- and 128-key steps."""

assert NULL_BLOCK_ID == 0, "the layout below puts the null block first"

UNSUPPORTED = "jax_hybrid attention (jax_hybrid_attn_torch.transformers_attention)"


def register(name: str = NAME, *, implementation: str | None = None) -> str:
    """Register the attention function and its mask builder under `name`; returns `name`.

    Then ``from_pretrained(..., attn_implementation=name)``, ``from_config(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` run every attention layer through `attention_forward`.

    Args:
      implementation: passed to `jax_hybrid_attn.paged_attention`: "kernel", "reference", or None (the kernel
        for GPU tensors, the reference for CPU tensors).
    """
    function = attention_forward
    if implementation is not None:
        function = functools.partial(attention_forward, implementation=implementation)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, attention_mask_function)
    return name


def attention_mask_function(*args, **kwargs) -> torch.Tensor:
    """HF's mask builder for this implementation: sdpa's boolean mask [B, 1, L, S] (True: attend), never None.

    `attention_forward` needs the mask to see padding and custom patterns, and to place chunked layers' keys.
    """
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _layer_type(module: torch.nn.Module) -> str | None:
    layer_type = getattr(module, "layer_type", None)
    if layer_type is not None:
        return layer_type
    layer_types = getattr(getattr(module, "config", None), "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    if layer_types is not None and layer_idx is not None and 0 <= layer_idx < len(layer_types):
        return layer_types[layer_idx]
    return None


def _optional_int(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, bool) or int(value) != value:
        raise ValueError(f"{name}={value!r} must be an int or None")
    return int(value)


def layer_params(module: torch.nn.Module, scaling: float | None = None, **kwargs) -> LayerAttentionParams:
    """What one HF attention layer computes, from its call's arguments and the module (see the module docstring).

    Args:
      module: the HF attention module (``self`` in its forward).
      scaling, kwargs: the arguments the module passes to its attention function.
    """
    if "sliding_window" in kwargs:
        sliding_window = kwargs["sliding_window"]
    else:
        sliding_window = getattr(module, "sliding_window", None)
    chunk = None
    if _layer_type(module) == "chunked_attention":
        chunk = getattr(module.config, "attention_chunk_size", None)
    softcap = kwargs.get("softcap")
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    return LayerAttentionParams(
        sm_scale=None if scaling is None else float(scaling),
        sliding_window=_optional_int("sliding_window", sliding_window),
        attention_chunk_size=_optional_int("attention_chunk_size", chunk),
        logits_soft_cap=None if softcap is None else float(softcap),
        causal=bool(causal),
    )


def _sinks(module: torch.nn.Module, kwargs: dict) -> torch.Tensor | None:
    sinks = kwargs.get("s_aux")
    return getattr(module, "sinks", None) if sinks is None else sinks


def _share(tensor: torch.Tensor, name: str) -> jax.Array:
    """The tensor in JAX, zero-copy where DLPack can share it, else through one torch copy."""
    if (tensor.numel() and not is_compact(tensor)) or tensor.data_ptr() % ALIGNMENT:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return to_jax(tensor, name=name)


def _padded(tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """[B, X, S, H] -> [B, X, length, H] holding `tensor` at ``start : start + S``, zeros elsewhere (or itself)."""
    if start == 0 and length == tensor.shape[2]:
        return tensor
    out = tensor.new_zeros((*tensor.shape[:2], length, tensor.shape[3]))
    out[:, :, start : start + tensor.shape[2]] = tensor
    return out


# Masks already checked: (id, version, pattern) -> (weak reference, key offset). HF builds one mask per layer type
# and forward, shared by all layers of that type, so each is checked once instead of once per layer.
_checked_masks: dict[tuple, tuple[weakref.ref, int]] = {}
_MAX_CHECKED_MASKS = 64


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor (torch.inference_mode) has no version counter
        return -1


def _unsupported_mask(reason: str) -> NotImplementedError:
    return NotImplementedError(f"{UNSUPPORTED}: {reason}")


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """A boolean or additive (0 / large negative) HF mask as booleans, True where a key is attended."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        raise _unsupported_mask(
            f"attention_mask of dtype {mask.dtype}: expected bool or an additive float mask"
        )
    allowed = mask == 0
    if not (allowed | (mask <= torch.finfo(mask.dtype).min / 2)).all():
        raise _unsupported_mask("an additive attention_mask with values other than 0 and -inf (a bias)")
    return allowed


def _key_offset(mask, params: LayerAttentionParams, q_len: int, kv_len: int) -> int:
    """Check HF's mask against the layer's pattern and return the key offset for chunked layers (else 0).

    The keys are the last `kv_len` positions, the queries the last `q_len` of them. With chunked attention, key
    index j sits at absolute position ``base + j``; only ``base mod C`` matters and the returned offset equals it.
    """
    chunk = params.attention_chunk_size
    if mask is None:
        if chunk is not None and q_len != kv_len:
            raise _unsupported_mask(
                "a chunked layer without attention_mask cannot place its chunks (register() installs the mask "
                "builder that provides it)"
            )
        return 0
    if not isinstance(mask, torch.Tensor):
        raise _unsupported_mask(f"attention_mask of type {type(mask).__name__}: expected a torch.Tensor")
    if mask.ndim != 4 or tuple(mask.shape[-2:]) != (q_len, kv_len):
        raise _unsupported_mask(
            f"attention_mask.shape={tuple(mask.shape)}: expected [B, 1, L={q_len}, S={kv_len}] for {kv_len} keys "
            "ending with the queries (a static cache or a mask of another length)"
        )
    key = (id(mask), _version(mask), q_len, kv_len, params)
    cached = _checked_masks.get(key)
    if cached is not None and cached[0]() is mask:
        return cached[1]

    allowed = _allowed(mask)
    offset = 0
    if chunk is not None:
        last_row = allowed[0, 0, -1]
        if not bool(last_row.any()):
            raise _unsupported_mask("the last query attends to no key (a padded batch?)")
        first_key = int(last_row.to(torch.int8).argmax())  # the start of the last query's chunk
        offset = -first_key % chunk
        if offset and offset + kv_len - q_len < chunk:
            raise _unsupported_mask(
                f"a chunk of the queries starts before the first of the {kv_len} keys (offset {offset}, chunk {chunk})"
            )
    device = mask.device
    q_pos = torch.arange(q_len, device=device) + (offset + kv_len - q_len)
    k_pos = torch.arange(kv_len, device=device) + offset
    expected = allowed_keys(q_pos[:, None], k_pos[None, :], offset + kv_len, params=params)
    mismatch = allowed != expected
    if bool(mismatch.any()):
        batch, _, row, column = (int(i) for i in mismatch.nonzero()[0])
        if bool((allowed & ~expected).any()):
            reason = (
                "it allows keys that the layer's parameters exclude (window, chunk or causality disagree)"
            )
        else:
            reason = "it masks keys that the layer's pattern allows (a padded batch, packed sequences, a static cache or a custom mask)"
        raise _unsupported_mask(
            f"attention_mask differs from the pattern of {params} at batch {batch}, query {row}, key {column}: "
            f"{reason}. Only unpadded batches are supported: use equal-length prompts or batch size 1"
        )
    if len(_checked_masks) >= _MAX_CHECKED_MASKS:
        _checked_masks.clear()
    _checked_masks[key] = (weakref.ref(mask), offset)
    return offset


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    implementation: str | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature: query [B, N, L, H], key/value [B, K, S, H] -> ([B, L, N, H], None).

    Args:
      module: the calling attention module (its layer parameters, see `layer_params`).
      attention_mask: the mask HF built for this layer type (see `attention_mask_function`).
      dropout: must be 0 (no dropout).
      scaling: logits scale; None means ``H ** -0.5``.
      implementation: see `register`.
      kwargs: the module's other arguments: ``sliding_window``, ``softcap``, ``s_aux``, ``is_causal``, ...
    Raises:
      NotImplementedError: what this function does not support (module docstring), never a wrong result.
    """
    if dropout:
        raise NotImplementedError(
            f"{UNSUPPORTED}: dropout={dropout} (training); use eager or sdpa for training"
        )
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(f"{UNSUPPORTED}: position_bias")
    if kwargs.get("output_attentions", False):
        logger.warning_once(
            f"{UNSUPPORTED} does not return attention weights; use eager for output_attentions"
        )
    sinks = _sinks(module, kwargs)
    inputs = [t for t in (query, key, value, sinks) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        raise NotImplementedError(
            f"{UNSUPPORTED} has no backward pass: run inference under torch.no_grad() or torch.inference_mode()"
        )
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            got = f"shape {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must be a 4-D torch.Tensor ([B, heads, length, H]), got {got}")
    batch, _, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    if value.shape != key.shape or key.shape[0] != batch or key.shape[3] != head_dim:
        raise NotImplementedError(
            f"{UNSUPPORTED}: query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
            "must be [B, N, L, H], [B, K, S, H], [B, K, S, H]"
        )
    if q_len > kv_len:
        raise NotImplementedError(f"{UNSUPPORTED}: {q_len} queries but only {kv_len} keys (cross-attention?)")

    params = layer_params(module, scaling, **kwargs)
    offset = _key_offset(attention_mask, params, q_len, kv_len)

    # Shapes JAX sees: queries padded to a power of two (causal only), keys to a power-of-two number of blocks.
    q_bucket = next_power_of_two(q_len) if params.causal else q_len
    seq_len = offset + kv_len + (q_bucket - q_len)
    capacity = BLOCK_SIZE * next_power_of_two(math.ceil(seq_len / BLOCK_SIZE))
    if implementation is None and query.device.type == "cpu":
        implementation = "reference"
    out = _dense_paged_attention(
        _share(_padded(query, 0, q_bucket), "query"),
        _share(_padded(key, offset, capacity), "key"),
        _share(_padded(value, offset, capacity), "value"),
        None if sinks is None else _share(sinks.detach().to(torch.float32), "sinks"),
        np.int32(seq_len),
        params=params,
        implementation=implementation,
    )
    return to_torch(out, name="attn_output")[:, :q_len], None


@functools.partial(jax.jit, static_argnames=("params", "implementation"))
def _dense_paged_attention(q, k, v, sinks, seq_len, *, params, implementation):
    """q [B, N, L, H], k/v [B, K, P*S, H] holding each row's positions 0..seq_len-1 -> [B, L, N, H].

    Row b is request b; its blocks are ``1 + b*P ... 1 + b*P + P - 1`` of a paged cache whose block 0 is the null
    block. Every key is written into the cache by slot (`write_kv`), then its L queries, its last L positions,
    attend (`paged_attention`), with metadata built as for any step (`metadata_from_lengths`).
    """
    batch, num_heads, q_len, head_dim = q.shape
    _, num_kv_heads, capacity, _ = k.shape
    blocks = capacity // BLOCK_SIZE
    kv_cache = jnp.zeros((1 + batch * blocks, 2, BLOCK_SIZE, num_kv_heads, head_dim), k.dtype)
    key_slots = BLOCK_SIZE + jnp.arange(batch * capacity, dtype=jnp.int32)  # block 1 + b*P + p//S, offset p%S

    def tokens(x):  # [B, X, L, H] -> [B*L, X, H]
        return jnp.swapaxes(x, 1, 2).reshape(-1, x.shape[1], head_dim)

    kv_cache = write_kv(kv_cache, tokens(k), tokens(v), key_slots)
    metadata = metadata_from_lengths(
        jnp.full((batch,), q_len, jnp.int32),
        jnp.full((batch,), seq_len, jnp.int32),
        (1 + jnp.arange(batch * blocks, dtype=jnp.int32)).reshape(batch, blocks),
        block_size=BLOCK_SIZE,
        num_tokens=batch * q_len,
        max_query_len=q_len,
        max_seq_len=capacity,
        causal=params.causal,
    )
    out = paged_attention(tokens(q), kv_cache, metadata, params=params, sinks=sinks, implementation=implementation)
    return out.reshape(batch, q_len, num_heads, head_dim)
