"""transformers' continuous batching on jax_hybrid_attn: the attention function ``paged|jax_hybrid``.

    from jax_hybrid_attn_torch.transformers_cb import register

    register()                                   # once: adds "paged|jax_hybrid" to AttentionInterface
    model.set_attn_implementation("paged|jax_hybrid")
    outputs = model.generate_batch(prompts, generation_config=..., continuous_batching_config=...)
    # or model.init_continuous_batching(...) for a ContinuousBatchingManager: streaming, cancel

transformers' continuous batching (`PagedAttentionCache`) keeps one K and one V tensor per layer slot,
[(B + 2) * S, K, H] each: B blocks of S tokens, then a read-trash and a write-trash block. Each step it hands
every attention layer the step's packed queries and new keys and values, ``cu_seq_lens_q``, per layer type
``cu_seq_lens_k``, and per layer group the slots to write (``write_index``) and to read (``read_index``).
Every call here is one jitted JAX call that writes and attends through this package, over those tensors:

  * Full-attention groups: the K and V tensors are the (k_cache, v_cache) pair layout, [B + 2, S, K, H]
    views, with no copy. The new keys and values are written at ``write_index`` (the slot mapping); the block
    table is read off ``read_index`` (a request's slots in position order, so every S-th slot names its next
    block), or off ``write_index`` in a step that reads nothing (every request starts at position 0); then
    paged attention.
  * Sliding-window groups: transformers keeps a ring of W slots per request (position p in slot ``p % W``)
    and writes only the last W new tokens of a chunk, so a chunk's early queries need keys its own write
    replaces. As transformers' own functions do, the window is read before the write: the layer gathers each
    request's cached keys (``read_index``, at most W - 1) and its new ones into a step buffer of whole pages
    (a copy of the window only, inside the same jitted call), attends over it, then writes the new keys into
    the ring.

Per layer the parameters come from the layer: ``scaling``, its window (the cache's window of its group), the
``softcap`` keyword (Gemma 2: applied, as its eager attention does; transformers' own ``paged|eager`` drops
it), the ``s_aux`` keyword or ``module.sinks`` (gpt-oss). Chunked attention (Llama 4) is refused by
transformers' cache itself ("Invalid group type"); a layer of that type raises NotImplementedError here too.

Static shapes: the step's tokens, requests and key counts are rounded up to powers of two, so that few shapes
compile; queries, keys and values are copied into a buffer of that length on torch's side (the one copy per
layer outside JAX). The output leaves through DLPack and is sliced back to the step's tokens.

On a GPU the forward runs on the continuous-batching manager's own CUDA stream: inputs enter JAX after the
work queued on torch's current stream, and the output is exported so that the stream waits for JAX
(`dlpack.to_jax` / `to_torch`). The caches are donated to the jitted call, so XLA writes them in place; XLA's
CPU client does not alias imported buffers, and there the written cache is copied back.

Shape letters: T tokens · R requests · N query heads · K kv heads · H head size · B blocks · S block size ·
P blocks per request.
"""

import dataclasses
import functools
import weakref
from functools import partial

import jax
import jax.numpy as jnp
import torch
from transformers import AttentionInterface

from jax_hybrid_attn import PAD_SLOT_ID, AttentionMetadata, LayerAttentionParams, paged_attention, write_kv
from jax_hybrid_attn.integers import cdiv, next_power_of_two

from .dlpack import same_memory, to_jax, to_torch

__all__ = ["NAME", "continuous_batching_attention", "register"]

NAME = "paged|jax_hybrid"
WINDOW_PAGE_SIZE = 16
"""Tokens per page of a sliding-window group's step buffer."""
MIN_BUCKET = 16
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def register(*, implementation: str | None = None, interpret: bool = False) -> str:
    """Add ``paged|jax_hybrid`` to transformers' `AttentionInterface`; returns the name. `implementation` and
    `interpret` go to `jax_hybrid_attn.paged_attention` (default: the kernels on a GPU, the reference on a CPU)."""
    function = partial(continuous_batching_attention, implementation=implementation, interpret=interpret)
    AttentionInterface.register(NAME, functools.update_wrapper(function, continuous_batching_attention))
    return NAME


def _bucket(value: int) -> int:
    return next_power_of_two(value, minimum=MIN_BUCKET)


def _padded_int32(tensor: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    out = torch.full((length,), fill, dtype=torch.int32, device=tensor.device)
    out[: tensor.numel()] = tensor.reshape(-1).to(torch.int32)
    return out


@dataclasses.dataclass(frozen=True)
class _StepShape:
    """The static sizes of one step (powers of two): tokens, requests, read slots per group, blocks per request
    of the full groups, pages per request of the sliding groups' buffers, pages of those buffers."""

    num_tokens: int
    num_reqs: int
    num_reads: int
    full_blocks: int
    window_pages: int
    buffer_pages: int


@dataclasses.dataclass
class _Step:
    """One step's indices in JAX (imported once, at the step's first layer)."""

    shape: _StepShape
    num_tokens: jax.Array  # [] the step's tokens (before padding)
    query_start_loc: jax.Array  # [R + 1]
    cu_seq_lens_k: dict  # layer type -> [R + 1]
    write_index: list  # per group [T] (PAD_SLOT_ID past the step's tokens)
    read_index: list | None  # per group [num_reads], or None in a step that reads nothing


def _cu_seq_lens_k(kwargs) -> dict:
    cu = kwargs["cu_seq_lens_k"]
    return dict(cu) if isinstance(cu, dict) else {FULL_ATTENTION: cu, SLIDING_ATTENTION: cu}


def _max_seqlen_k(kwargs) -> int:
    lengths = kwargs.get("max_seqlen_k", 0)
    return max(lengths.values()) if isinstance(lengths, dict) else int(lengths)


def _plan_step(cache, kwargs, num_tokens: int) -> _Step:
    cu_q = kwargs["cu_seq_lens_q"]
    num_reqs = cu_q.numel() - 1
    reads = kwargs.get("read_index") or []
    reads_anything = any(index.numel() for index in reads)
    max_keys = max(_max_seqlen_k(kwargs), num_tokens)
    total_keys = max([index.numel() for index in reads] + [num_tokens])  # a sliding group's keys of all requests
    shape = _StepShape(
        num_tokens=_bucket(num_tokens),
        num_reqs=_bucket(num_reqs),
        num_reads=_bucket(max((index.numel() for index in reads), default=1)),
        full_blocks=_bucket(cdiv(max_keys, cache.block_size)),
        window_pages=_bucket(cdiv(max_keys, WINDOW_PAGE_SIZE)),
        buffer_pages=_bucket(cdiv(total_keys, WINDOW_PAGE_SIZE) + num_reqs),
    )

    def starts(cu):  # [R + 1] int32, the padding requests empty
        out = torch.empty(shape.num_reqs + 1, dtype=torch.int32, device=cu.device)
        out[: cu.numel()] = cu.reshape(-1).to(torch.int32)
        out[cu.numel() :] = out[cu.numel() - 1]
        return to_jax(out, name="cu_seq_lens")

    read_trash = cache.read_trash_index
    return _Step(
        shape=shape,
        num_tokens=jnp.asarray(num_tokens, jnp.int32),
        query_start_loc=starts(cu_q),
        cu_seq_lens_k={name: starts(cu) for name, cu in _cu_seq_lens_k(kwargs).items()},
        write_index=[
            to_jax(_padded_int32(index[:num_tokens], shape.num_tokens, PAD_SLOT_ID), name="write_index")
            for index in kwargs["write_index"]
        ],
        read_index=[to_jax(_padded_int32(index, shape.num_reads, read_trash), name="read_index") for index in reads]
        if reads_anything
        else None,
    )


_steps: "weakref.WeakKeyDictionary[object, _Step]" = weakref.WeakKeyDictionary()
_aliases: dict = {}


def _step_of(cache, module, kwargs, num_tokens: int) -> _Step:
    """The step's indices, planned again at the first layer of every forward."""
    first_layer = min(cache.layer_index_to_group_indices)
    if module.layer_idx == first_layer or cache not in _steps:
        _steps[cache] = _plan_step(cache, kwargs, num_tokens)
    return _steps[cache]


def _layer_sinks(module: torch.nn.Module, sinks: torch.Tensor | None) -> jax.Array | None:
    """The layer's sinks as a float32 JAX copy, made again only when the tensor changes."""
    if sinks is None:
        return None
    cached = module.__dict__.get("_jax_hybrid_sinks")
    if cached is None or cached[0] is not sinks or cached[1] != sinks._version:
        cached = (sinks, sinks._version, to_jax(sinks.detach().to(torch.float32).clone(), name="sinks"))
        module.__dict__["_jax_hybrid_sinks"] = cached
    return cached[2]


def continuous_batching_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask=None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    implementation: str | None = None,
    interpret: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``paged|jax_hybrid``: one layer of a continuous-batching step (see the module docstring).

    Args:
      query: [1, N, T, H]; key, value: [1, K, T, H] (transformers' layout).
      kwargs: what continuous batching passes: ``cache``, ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_seqlen_k``,
        ``write_index``, ``read_index``.
    Returns:
      ([1, T, N, H] attention output, None).
    """
    cache = kwargs.get("cache")
    if cache is None or not hasattr(cache, "layer_index_to_group_indices"):
        raise ValueError(f"{NAME} runs inside continuous batching only: it needs transformers' PagedAttentionCache")
    if dropout:
        raise NotImplementedError(f"{NAME} with {dropout=}: inference only")
    layer = module.layer_idx
    layer_types = getattr(getattr(module, "config", None), "layer_types", None)
    if layer_types is not None and layer_types[layer] not in (FULL_ATTENTION, SLIDING_ATTENTION):
        raise NotImplementedError(f"{NAME} with layer type {layer_types[layer]!r} (layer {layer})")
    group, tensor_index = cache.layer_index_to_group_indices[layer]
    window = cache.sliding_windows[layer]
    sliding = window != 1
    _, num_heads, num_tokens, head_size = query.shape
    step = _step_of(cache, module, kwargs, num_tokens)
    shape = step.shape

    def padded(x, heads):  # [1, heads, T, H] -> [T_bucket, heads, H] (a torch copy)
        out = x.new_zeros((shape.num_tokens, heads, head_size))
        out[:num_tokens] = x[0].transpose(0, 1)
        return out

    # Every input is ready on torch's stream (the copies queued) before the query's import orders JAX's stream
    # after it; the other imports then skip that wait
    q, k, v = padded(query, num_heads), padded(key, key.shape[1]), padded(value, key.shape[1])
    q = to_jax(q, name="query")
    k, v = (to_jax(x, name=name, already_ordered=True) for x, name in ((k, "key"), (v, "value")))

    num_kv_heads = key.shape[1]
    k_tensor, v_tensor = cache.key_cache[tensor_index], cache.value_cache[tensor_index]
    pages = k_tensor.shape[0] // cache.block_size
    k_cache = to_jax(k_tensor.view(pages, cache.block_size, num_kv_heads, head_size), name="key_cache",
                     already_ordered=True)  # fmt: skip
    v_cache = to_jax(v_tensor.view(pages, cache.block_size, num_kv_heads, head_size), name="value_cache",
                     already_ordered=True)  # fmt: skip
    sinks = _layer_sinks(module, s_aux if s_aux is not None else getattr(module, "sinks", None))
    params = LayerAttentionParams(
        sm_scale=scaling, sliding_window=window if sliding else None, logits_soft_cap=softcap, causal=True
    )
    layer_type = SLIDING_ATTENTION if sliding else FULL_ATTENTION
    out, new_k, new_v = _layer_call(
        q, k, v, k_cache, v_cache, sinks,
        step.query_start_loc, step.cu_seq_lens_k[layer_type], step.write_index[group],
        None if step.read_index is None else step.read_index[group], step.num_tokens,
        shape=shape, block_size=cache.block_size, params=params, sliding=sliding,
        implementation=implementation, interpret=interpret,
    )  # fmt: skip
    for tensor, array in ((k_tensor, new_k), (v_tensor, new_v)):
        alias_key = (tensor.device.type, tuple(tensor.shape), tensor.dtype)
        if alias_key not in _aliases:  # on a GPU XLA wrote in place; XLA's CPU client does not alias
            _aliases[alias_key] = same_memory(tensor, array)
        if not _aliases[alias_key]:
            tensor.copy_(to_torch(array, name="written cache").reshape(tensor.shape))
    return to_torch(out, name="attention output")[:num_tokens].unsqueeze(0), None


@partial(
    jax.jit,
    static_argnames=("shape", "block_size", "params", "sliding", "implementation", "interpret"),
    donate_argnames=("k_cache", "v_cache"),
)
def _layer_call(
    q, k, v, k_cache, v_cache, sinks, query_start_loc, cu_seq_lens_k, write_index, read_index, num_actual_tokens,
    *, shape, block_size, params, sliding, implementation, interpret,
):  # fmt: skip
    """One layer: a sliding group reads its window into a step buffer, then writes; a full group writes, then
    attends over its cache."""
    seq_lens = jnp.diff(cu_seq_lens_k)
    options = dict(params=params, sinks=sinks, implementation=implementation, interpret=interpret)
    if sliding:
        (k_buffer, v_buffer), block_tables = _window_buffer(
            k, v, k_cache, v_cache, query_start_loc, cu_seq_lens_k, read_index, shape=shape
        )
        metadata = _metadata(query_start_loc, seq_lens, block_tables, num_actual_tokens, shape=shape,
                             page_size=WINDOW_PAGE_SIZE)  # fmt: skip
        out = paged_attention(q, (k_buffer, v_buffer), metadata, **options)
        k_cache, v_cache = write_kv((k_cache, v_cache), k, v, write_index)
        return out, k_cache, v_cache
    k_cache, v_cache = write_kv((k_cache, v_cache), k, v, write_index)
    source, starts = (write_index, query_start_loc) if read_index is None else (read_index, cu_seq_lens_k)
    blocks = jnp.arange(shape.full_blocks)
    first_slots = jnp.clip(starts[:-1, None] + blocks[None, :] * block_size, 0, source.shape[0] - 1)
    in_sequence = blocks[None, :] < (seq_lens[:, None] + block_size - 1) // block_size
    block_tables = jnp.where(in_sequence, jnp.maximum(source[first_slots], 0) // block_size, 0)
    metadata = _metadata(query_start_loc, seq_lens, block_tables, num_actual_tokens, shape=shape,
                         page_size=block_size)  # fmt: skip
    return paged_attention(q, (k_cache, v_cache), metadata, **options), k_cache, v_cache


def _metadata(query_start_loc, seq_lens, block_tables, num_actual_tokens, *, shape, page_size) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables.astype(jnp.int32),
        slot_mapping=jnp.full(shape.num_tokens, PAD_SLOT_ID, jnp.int32),
        num_actual_tokens=num_actual_tokens,
        max_query_len=shape.num_tokens,
        max_seq_len=block_tables.shape[1] * page_size,
        causal=True,
    )


def _window_buffer(k, v, k_cache, v_cache, query_start_loc, cu_seq_lens_k, read_index, *, shape):
    """Each request's keys and values of a sliding-window step, in position order (its cached window from
    ``read_index``, then its new tokens), in whole pages of `WINDOW_PAGE_SIZE`: ([pages, page, K, H] pair, its
    block tables [R, P])."""
    page = WINDOW_PAGE_SIZE
    seq_lens = jnp.diff(cu_seq_lens_k)
    query_lens = jnp.diff(query_start_loc)
    cached_lens = seq_lens - query_lens
    pages_of = (seq_lens + page - 1) // page
    first_page = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(pages_of)[:-1].astype(jnp.int32)])
    position = jnp.arange(shape.buffer_pages * page)
    buffer_page = position // page
    request = jnp.clip(jnp.searchsorted(first_page, buffer_page, side="right") - 1, 0, shape.num_reqs - 1)
    offset = (buffer_page - first_page[request]) * page + position % page
    valid = (offset < seq_lens[request]) & (buffer_page < first_page[request] + pages_of[request])
    from_cache = offset < cached_lens[request]
    new_token = jnp.clip(query_start_loc[request] + offset - cached_lens[request], 0, k.shape[0] - 1)
    if read_index is None:
        cached_slot = jnp.zeros_like(position)
    else:
        cached_slot = read_index[jnp.clip(cu_seq_lens_k[request] + offset, 0, read_index.shape[0] - 1)]
    num_pages, block_size = k_cache.shape[:2]
    cached_slot = jnp.clip(cached_slot, 0, num_pages * block_size - 1)

    def gather(new, cache):
        cached = cache.reshape(num_pages * block_size, *cache.shape[2:])[cached_slot]
        rows = jnp.where(from_cache[:, None, None], cached, new[new_token])
        rows = jnp.where(valid[:, None, None], rows, jnp.zeros_like(rows))
        return rows.reshape(shape.buffer_pages, page, *rows.shape[1:])

    table = first_page[:, None] + jnp.arange(shape.window_pages)[None, :]
    block_tables = jnp.where(jnp.arange(shape.window_pages)[None, :] < pages_of[:, None], table, 0)
    return (gather(k, k_cache), gather(v, v_cache)), jnp.clip(block_tables, 0, shape.buffer_pages - 1)
