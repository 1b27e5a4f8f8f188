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
from .layer_inputs import tensor_key

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
    """The static sizes of one step (powers of two): tokens, requests, blocks per request of the full groups,
    cached window slots per request of the sliding groups, pages per request and in all of their step buffers."""

    num_tokens: int
    num_reqs: int
    full_blocks: int
    window_slots: int
    window_pages: int
    buffer_pages: int


@dataclasses.dataclass
class _Step:
    """One step's indices in JAX (planned and imported once, at the step's first layer)."""

    shape: _StepShape
    num_tokens: jax.Array  # [] the step's tokens (before padding)
    query_start_loc: jax.Array  # [R + 1]
    cu_seq_lens_k: dict  # layer type -> [R + 1]
    write_index: list  # per group [T] (PAD_SLOT_ID past the step's tokens)
    reads: list  # per group: a full group's block tables [R, P], a sliding group's cached slots [R, window_slots]


def _cu_seq_lens_k(kwargs) -> dict:
    cu = kwargs["cu_seq_lens_k"]
    return dict(cu) if isinstance(cu, dict) else {FULL_ATTENTION: cu, SLIDING_ATTENTION: cu}


def _max_seqlen_k(kwargs, layer_type: str) -> int:
    lengths = kwargs.get("max_seqlen_k", 0)
    return int(lengths.get(layer_type, 0)) if isinstance(lengths, dict) else int(lengths)


def _group_windows(cache) -> list[int]:
    """Each group's sliding window (1: full attention), as transformers' cache keeps it per layer."""
    windows = {}
    for layer, (group, _) in cache.layer_index_to_group_indices.items():
        windows[group] = cache.sliding_windows[layer]
    return [windows[group] for group in range(len(windows))]


def _padded_rows(rows: torch.Tensor, num_rows: int) -> jax.Array:
    """[R, C] int32 rows, zero rows appended up to `num_rows`, in JAX."""
    out = rows.new_zeros((num_rows, rows.shape[1]))
    out[: rows.shape[0]] = rows
    return to_jax(out, name="step index")


def _kept_writes(cache, write_index: torch.Tensor) -> torch.Tensor:
    """[T] slots with transformers' trash slot as `PAD_SLOT_ID`: it sends every token it does not keep (padding,
    a sliding group's tokens already out of the window) to that one slot; thousands of writes to one slot would
    serialize the cache write, and a dropped write costs nothing."""
    trash = getattr(cache, "write_trash_index", None)
    return write_index if trash is None else torch.where(write_index == trash, PAD_SLOT_ID, write_index)


def _plan_step(cache, kwargs, num_tokens: int) -> _Step:
    """The step's static shape and indices, from what continuous batching passes the layers. On torch's side
    (small index ops, no host sync): each full group's block tables from its slots in position order, each
    sliding group's cached window slots; these are what the layer calls read, so their shapes depend on the
    requests and their lengths, not on the step's total of cached tokens."""
    cu_q = kwargs["cu_seq_lens_q"].reshape(-1).to(torch.int32)
    num_reqs = cu_q.numel() - 1
    reads = [index.reshape(-1) for index in kwargs.get("read_index") or []]
    reads_in = [group < len(reads) and reads[group].numel() > 0 for group in range(len(kwargs["write_index"]))]
    cu_k = {name: cu.reshape(-1).to(torch.int32) for name, cu in _cu_seq_lens_k(kwargs).items()}
    windows = _group_windows(cache)
    sliding_keys = [reads[g].numel() for g, w in enumerate(windows) if w != 1 and reads_in[g]]
    max_full_keys = max(_max_seqlen_k(kwargs, FULL_ATTENTION), num_tokens)
    max_window_keys = max(_max_seqlen_k(kwargs, SLIDING_ATTENTION), num_tokens)
    shape = _StepShape(
        num_tokens=_bucket(num_tokens),
        num_reqs=_bucket(num_reqs),
        full_blocks=_bucket(cdiv(max_full_keys, cache.block_size)),
        window_slots=_bucket(max(max(windows) - 1, 1)),
        window_pages=_bucket(cdiv(max_window_keys, WINDOW_PAGE_SIZE)),
        buffer_pages=_bucket(cdiv(max(sliding_keys + [num_tokens]), WINDOW_PAGE_SIZE) + num_reqs),
    )
    device = cu_q.device

    def starts(cu):  # [R + 1] int32, the padding requests empty
        out = torch.empty(shape.num_reqs + 1, dtype=torch.int32, device=device)
        out[: cu.numel()] = cu
        out[cu.numel() :] = cu[-1]
        return to_jax(out, name="cu_seq_lens")

    def block_tables(group):  # [R, P]: every S-th slot of a request, in position order, names its next block
        if reads_in[group]:  # the request's slots, cached and new
            source, first = reads[group], cu_k[FULL_ATTENTION]
        else:  # a step that reads nothing: every request starts at position 0, its slots are those it writes
            source, first = kwargs["write_index"][group].reshape(-1), cu_q
        block = torch.arange(shape.full_blocks, device=device)
        seq_lens = torch.diff(cu_k[FULL_ATTENTION])
        slots = source[(first[:-1, None] + block[None, :] * cache.block_size).clamp(0, source.numel() - 1)]
        in_sequence = block[None, :] < (seq_lens[:, None] + cache.block_size - 1) // cache.block_size
        return torch.where(in_sequence, slots.clamp(min=0) // cache.block_size, 0).to(torch.int32)

    def window_slots(group):  # [R, window_slots]: a request's cached window, in position order
        offset = torch.arange(shape.window_slots, device=device)
        if not reads_in[group]:
            return torch.zeros((num_reqs, shape.window_slots), dtype=torch.int32, device=device)
        source, first = reads[group], cu_k[SLIDING_ATTENTION]
        cached_lens = torch.diff(first) - torch.diff(cu_q)
        slots = source[(first[:-1, None] + offset[None, :]).clamp(0, source.numel() - 1)]
        return torch.where(offset[None, :] < cached_lens[:, None], slots, 0).to(torch.int32)

    return _Step(
        shape=shape,
        num_tokens=jnp.asarray(num_tokens, jnp.int32),
        query_start_loc=starts(cu_q),
        cu_seq_lens_k={name: starts(cu) for name, cu in cu_k.items()},
        write_index=[
            to_jax(_padded_int32(_kept_writes(cache, index[:num_tokens]), shape.num_tokens, PAD_SLOT_ID),
                   name="write_index")  # fmt: skip
            for index in kwargs["write_index"]
        ],
        reads=[_padded_rows(window_slots(g) if w != 1 else block_tables(g), shape.num_reqs)
               for g, w in enumerate(windows)],  # fmt: skip
    )


_steps: "weakref.WeakKeyDictionary[object, _Step]" = weakref.WeakKeyDictionary()
_aliases: dict = {}
_held: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()  # cache -> tensor key -> array


def _cache_in_jax(cache, tensor: torch.Tensor, shape: tuple, *, name: str) -> jax.Array:
    """A cache tensor as a `shape` JAX array: the array XLA wrote in place at the layer's last call (it is this
    tensor's memory), else an import."""
    held = _held.get(cache, {}).pop(tensor_key(tensor), None)
    if held is not None and not held.is_deleted():
        return held
    return to_jax(tensor.view(shape), name=name, already_ordered=True)


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

    num_kv_heads = key.shape[1]
    # q, k and v enter JAX as one [T_bucket, N + 2K, H] copy (one import; split inside the call). Its import
    # orders JAX's stream after the copies queued on torch's; the caches' imports then skip that wait
    qkv = query.new_zeros((shape.num_tokens, num_heads + 2 * num_kv_heads, head_size))
    for x, first in ((query, 0), (key, num_heads), (value, num_heads + num_kv_heads)):
        qkv[:num_tokens, first : first + x.shape[1]] = x[0].transpose(0, 1)
    qkv = to_jax(qkv, name="query, key and value")
    k_tensor, v_tensor = cache.key_cache[tensor_index], cache.value_cache[tensor_index]
    paged = (k_tensor.shape[0] // cache.block_size, cache.block_size, num_kv_heads, head_size)
    k_cache, v_cache = (_cache_in_jax(cache, tensor, paged, name=name)
                        for tensor, name in ((k_tensor, "key_cache"), (v_tensor, "value_cache")))  # fmt: skip
    sinks = _layer_sinks(module, s_aux if s_aux is not None else getattr(module, "sinks", None))
    params = LayerAttentionParams(
        sm_scale=scaling, sliding_window=window if sliding else None, logits_soft_cap=softcap, causal=True
    )
    layer_type = SLIDING_ATTENTION if sliding else FULL_ATTENTION
    out, new_k, new_v = _layer_call(
        qkv, k_cache, v_cache, sinks,
        step.query_start_loc, step.cu_seq_lens_k[layer_type], step.write_index[group], step.reads[group],
        step.num_tokens,
        shape=shape, num_kv_heads=num_kv_heads, block_size=cache.block_size, params=params, sliding=sliding,
        implementation=implementation, interpret=interpret,
    )  # fmt: skip
    for tensor, array in ((k_tensor, new_k), (v_tensor, new_v)):
        alias_key = (tensor.device.type, tuple(tensor.shape), tensor.dtype)
        if alias_key not in _aliases:  # on a GPU XLA wrote in place; XLA's CPU client does not alias
            _aliases[alias_key] = same_memory(tensor, array)
        if _aliases[alias_key]:  # the array is the tensor: the layer's next call imports nothing
            _held.setdefault(cache, {})[tensor_key(tensor)] = array
        else:
            tensor.copy_(to_torch(array, name="written cache").reshape(tensor.shape))
    return to_torch(out, name="attention output")[:num_tokens].unsqueeze(0), None


@partial(
    jax.jit,
    static_argnames=("shape", "num_kv_heads", "block_size", "params", "sliding", "implementation", "interpret"),
    donate_argnames=("k_cache", "v_cache"),
)
def _layer_call(
    qkv, k_cache, v_cache, sinks, query_start_loc, cu_seq_lens_k, write_index, reads, num_actual_tokens,
    *, shape, num_kv_heads, block_size, params, sliding, implementation, interpret,
):  # fmt: skip
    """One layer: a sliding group reads its window into a step buffer, then writes; a full group writes, then
    attends over its cache. `reads`: the group's block tables [R, P] (full) or cached window slots [R, W'] (sliding)."""
    num_heads = qkv.shape[1] - 2 * num_kv_heads
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    seq_lens = jnp.diff(cu_seq_lens_k)
    options = dict(params=params, sinks=sinks, implementation=implementation, interpret=interpret)
    if sliding:
        (k_buffer, v_buffer), block_tables = _window_buffer(
            k, v, k_cache, v_cache, query_start_loc, cu_seq_lens_k, reads, shape=shape
        )
        metadata = _metadata(query_start_loc, seq_lens, block_tables, num_actual_tokens, shape=shape,
                             page_size=WINDOW_PAGE_SIZE)  # fmt: skip
        out = paged_attention(q, (k_buffer, v_buffer), metadata, **options)
        k_cache, v_cache = write_kv((k_cache, v_cache), k, v, write_index)
        return out, k_cache, v_cache
    k_cache, v_cache = write_kv((k_cache, v_cache), k, v, write_index)
    metadata = _metadata(query_start_loc, seq_lens, reads, num_actual_tokens, shape=shape,
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


def _window_buffer(k, v, k_cache, v_cache, query_start_loc, cu_seq_lens_k, cached_slots, *, shape):
    """Each request's keys and values of a sliding-window step, in position order (its cached window from
    `cached_slots` [R, W'], then its new tokens), in whole pages of `WINDOW_PAGE_SIZE`: ([pages, page, K, H]
    pair, its block tables [R, P])."""
    page = WINDOW_PAGE_SIZE
    seq_lens = jnp.diff(cu_seq_lens_k)
    query_lens = jnp.diff(query_start_loc)
    cached_lens = seq_lens - query_lens
    pages_of = (seq_lens + page - 1) // page
    first_page = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(pages_of)[:-1].astype(jnp.int32)])
    position = jnp.arange(shape.buffer_pages * page)
    buffer_page = position // page
    found = jnp.searchsorted(first_page, buffer_page, side="right", method="compare_all")  # loop-free on a GPU
    request = jnp.clip(found - 1, 0, shape.num_reqs - 1)
    offset = (buffer_page - first_page[request]) * page + position % page
    valid = (offset < seq_lens[request]) & (buffer_page < first_page[request] + pages_of[request])
    from_cache = offset < cached_lens[request]
    new_token = jnp.clip(query_start_loc[request] + offset - cached_lens[request], 0, k.shape[0] - 1)
    cached_slot = cached_slots[request, jnp.clip(offset, 0, cached_slots.shape[1] - 1)]
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
