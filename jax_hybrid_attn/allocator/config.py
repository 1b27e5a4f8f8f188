"""KV-cache configuration from per-layer specs: groups, shared tensors, `num_blocks`, startup check.

vLLM's general hybrid path (`vllm/v1/core/kv_cache_utils.py`), in plain Python:
  1. page sizes are unified by scaling each smaller-page layer's ``block_size`` by ``max_page // page``
     (`NotImplementedError` when that does not divide);
  2. layers are bucketed by identical spec; ``group_size`` is the smallest bucket, or the largest one when
     ``max < 1.5 * min``; a bucket of n layers becomes ``cdiv(n, group_size)`` groups, group i taking
     ``layers[i::num_groups]``;
  3. ``num_blocks = available_memory // page_size // group_size``; there are ``group_size`` tensors of
     ``page_size * num_blocks`` bytes, tensor i shared by the i-th layer of every group that has one. All groups
     share one block pool, so one block id names different memory in each layer of a tensor.

Deliberate differences from vLLM:
  * The startup check counts in blocks and keeps the null block out: a request of ``max_model_len`` tokens must
    fit in ``num_blocks - 1`` blocks (vLLM compares bytes with the whole pool, so its limit case cannot be
    allocated). `max_concurrency` divides ``num_blocks - 1`` for the same reason.
  * Layers of one attention type with different page sizes (e.g. full attention with two head sizes) go through
    the general path (separate groups with scaled block sizes) instead of vLLM's `UniformTypeKVCacheSpecs`.
  * No data/context parallelism, Mamba, cross-attention or MLA specs; no per-worker minimum.
"""

import dataclasses
import math
from collections.abc import Mapping, Sequence

from ..spec import AttentionSpec, ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

__all__ = [
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheTensor",
    "blocks_per_request",
    "check_enough_kv_cache_memory",
    "estimate_max_model_len",
    "get_kv_cache_config",
    "get_kv_cache_groups",
    "max_concurrency",
    "unify_page_sizes",
]

GROUP_SIZE_PAD_RATIO = 1.5
"""vLLM pads the smaller type's groups up to the larger size when ``max_layers < 1.5 * min_layers``."""

SUPPORTED_SPECS = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)


@dataclasses.dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share block tables: one spec, ``len(layer_names) <= group_size`` layers."""

    layer_names: tuple[str, ...]
    kv_cache_spec: AttentionSpec


@dataclasses.dataclass(frozen=True)
class KVCacheTensor:
    """One KV-cache buffer of ``size`` bytes, used by one layer of each group (``shared_by``)."""

    size: int
    shared_by: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    """What to allocate: ``num_blocks`` blocks in one id space, the tensors, and the groups."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    @property
    def specs(self) -> tuple[AttentionSpec, ...]:
        return tuple(group.kv_cache_spec for group in self.kv_cache_groups)

    @property
    def group_size(self) -> int:
        return max((len(group.layer_names) for group in self.kv_cache_groups), default=0)

    @property
    def page_size_bytes(self) -> int:
        return max((spec.page_size_bytes for spec in self.specs), default=0)


def _check_int(name: str, value, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def _check_specs(specs: Mapping[str, AttentionSpec]) -> None:
    if not isinstance(specs, Mapping):
        raise ValueError(f"specs must be a mapping from layer name to spec, got {type(specs).__name__}")
    for name, spec in specs.items():
        if not isinstance(spec, SUPPORTED_SPECS):
            raise NotImplementedError(
                f"layer {name!r} has spec {type(spec).__name__}; supported: "
                + ", ".join(cls.__name__ for cls in SUPPORTED_SPECS)
            )


def unify_page_sizes(specs: Mapping[str, AttentionSpec]) -> dict[str, AttentionSpec]:
    """Scale each smaller-page layer's block size so every layer's page has the largest page's bytes."""
    _check_specs(specs)
    if not specs:
        return {}
    max_page = max(spec.page_size_bytes for spec in specs.values())
    unified = {}
    for name, spec in specs.items():
        page = spec.page_size_bytes
        if max_page % page:
            raise NotImplementedError(
                f"layer {name!r}: page size {page} bytes does not divide the largest page size {max_page}; "
                "page sizes are unified by scaling block_size, not by padding"
            )
        try:
            unified[name] = dataclasses.replace(spec, block_size=spec.block_size * (max_page // page))
        except ValueError as error:
            raise NotImplementedError(
                f"layer {name!r}: unifying its page size gives an invalid spec: {error}"
            ) from error
    return unified


def get_kv_cache_groups(specs: Mapping[str, AttentionSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """Group layers: identical specs (after page-size unification) in equal-size groups, strided.

    Example: 10 full and 52 sliding-window layers give group_size 10: one full group and six window groups of
    9 or 8 layers (``layers[i::6]``).
    """
    specs = unify_page_sizes(specs)
    buckets: dict[AttentionSpec, list[str]] = {}
    for name, spec in specs.items():
        buckets.setdefault(spec, []).append(name)
    if not buckets:
        return ()
    sizes = [len(names) for names in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < GROUP_SIZE_PAD_RATIO * min(sizes):
        group_size = max(sizes)
    groups = []
    for spec, names in buckets.items():
        num_groups = math.ceil(len(names) / group_size)
        groups.extend(KVCacheGroupSpec(tuple(names[i::num_groups]), spec) for i in range(num_groups))
    return tuple(groups)


def blocks_per_request(
    specs: Sequence[AttentionSpec], *, max_model_len: int, max_num_batched_tokens: int
) -> int:
    """Blocks one request can hold at once over all groups (vLLM's recycling-aware startup bound)."""
    return sum(
        spec.max_num_blocks_per_request(
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens
        )
        for spec in specs
    )


def estimate_max_model_len(
    specs: Sequence[AttentionSpec], *, num_blocks: int, max_num_batched_tokens: int, upper: int
) -> int:
    """Largest ``max_model_len <= upper`` whose request fits in ``num_blocks - 1`` blocks; 0 if none does."""

    def fits(length: int) -> bool:
        need = blocks_per_request(specs, max_model_len=length, max_num_batched_tokens=max_num_batched_tokens)
        return need <= num_blocks - 1

    low, high = 0, upper  # fits(low) holds (or low == 0); binary search on a monotone predicate
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def check_enough_kv_cache_memory(
    kv_config: KVCacheConfig, *, max_model_len: int, max_num_batched_tokens: int
):
    """Raise `ValueError` naming the largest ``max_model_len`` that fits when one request does not fit."""
    specs = kv_config.specs
    if not specs:
        return
    need = blocks_per_request(
        specs, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens
    )
    usable = kv_config.num_blocks - 1
    if need <= usable:
        return
    bytes_per_block = kv_config.page_size_bytes * kv_config.group_size
    largest = estimate_max_model_len(
        specs,
        num_blocks=kv_config.num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        upper=max_model_len,
    )
    fix = (
        f"the largest max_model_len that fits is {largest}"
        if largest
        else "no max_model_len fits: give the KV cache more memory"
    )
    raise ValueError(
        f"{max_model_len=} needs {need} KV-cache blocks ({need * bytes_per_block / 2**30:.2f} GiB) for one request, "
        f"but only {usable} blocks ({usable * bytes_per_block / 2**30:.2f} GiB; block 0 is the null block) are "
        f"available; {fix}. Increase the memory budget or decrease max_model_len."
    )


def get_kv_cache_config(
    specs: Mapping[str, AttentionSpec],
    *,
    available_memory: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    num_blocks_override: int | None = None,
) -> KVCacheConfig:
    """Groups, tensors and ``num_blocks`` for a memory budget of ``available_memory`` bytes, checked.

    Raises:
      ValueError: a request of ``max_model_len`` tokens does not fit; the message names the largest that does.
    """
    _check_int("available_memory", available_memory, minimum=0)
    _check_int("max_model_len", max_model_len, minimum=1)
    _check_int("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
    groups = get_kv_cache_groups(specs)
    if not groups:  # attention-free model: the pool still holds the null block
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=(), kv_cache_groups=())
    page_size = groups[0].kv_cache_spec.page_size_bytes
    group_size = max(len(group.layer_names) for group in groups)
    num_blocks = available_memory // page_size // group_size
    if num_blocks_override is not None:
        _check_int("num_blocks_override", num_blocks_override, minimum=1)
        num_blocks = num_blocks_override
    tensors = tuple(
        KVCacheTensor(
            size=page_size * num_blocks,
            shared_by=tuple(group.layer_names[i] for group in groups if i < len(group.layer_names)),
        )
        for i in range(group_size)
    )
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
    check_enough_kv_cache_memory(
        kv_config, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens
    )
    return kv_config


def max_concurrency(kv_config: KVCacheConfig, *, max_model_len: int, max_num_batched_tokens: int) -> float:
    """How many requests of ``max_model_len`` tokens fit at once (``KV cache size in tokens / max_model_len``)."""
    need = blocks_per_request(
        kv_config.specs, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens
    )
    return (kv_config.num_blocks - 1) / need if need else math.inf
