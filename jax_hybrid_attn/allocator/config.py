"""Configuration: KV-cache groups, shared tensors and `num_blocks` from per-layer specs (vLLM's sizing, with its
startup check), and `AllocatorConfig`, the allocator's static sizes and options.

vLLM's general hybrid path (its `get_kv_cache_config`), in plain Python:
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
import functools
import math
from collections.abc import Mapping, Sequence

from ..integers import cdiv, check_bool, check_int, next_power_of_two
from ..spec import AttentionSpec, ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

__all__ = [
    "CHUNKED_LOCAL",
    "FULL",
    "SLIDING_WINDOW",
    "AllocatorConfig",
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


def _check_spec(name: str, spec) -> None:
    """`NotImplementedError` naming `name` for a `spec` that the allocator has no manager for."""
    if not isinstance(spec, SUPPORTED_SPECS):
        raise NotImplementedError(
            f"{name} is a {type(spec).__name__}; the allocator has managers for "
            + ", ".join(cls.__name__ for cls in SUPPORTED_SPECS)
        )


def _check_specs(specs: Mapping[str, AttentionSpec]) -> None:
    if not isinstance(specs, Mapping):
        raise ValueError(f"specs must be a mapping from layer name to spec, got {type(specs).__name__}")
    for name, spec in specs.items():
        _check_spec(f"specs[{name!r}]", spec)


def _check_spec_sequence(specs: Sequence[AttentionSpec]) -> tuple[AttentionSpec, ...]:
    if not isinstance(specs, (tuple, list)):
        got = f"{specs!r:.60}"
        raise ValueError(f"specs must be a sequence of AttentionSpecs, one per KV-cache group, got {got}")
    for i, spec in enumerate(specs):
        _check_spec(f"specs[{i}]", spec)
    return tuple(specs)


def _check_kv_config(kv_config) -> "KVCacheConfig":
    if not isinstance(kv_config, KVCacheConfig):
        raise ValueError(f"kv_config must be a KVCacheConfig, got {type(kv_config).__name__}")
    return kv_config


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
        num_groups = cdiv(len(names), group_size)
        groups.extend(KVCacheGroupSpec(tuple(names[i::num_groups]), spec) for i in range(num_groups))
    return tuple(groups)


def blocks_per_request(
    specs: Sequence[AttentionSpec], *, max_model_len: int, max_num_batched_tokens: int
) -> int:
    """Blocks one request can hold at once over all groups (vLLM's recycling-aware startup bound)."""
    specs = _check_spec_sequence(specs)
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
    specs = _check_spec_sequence(specs)
    num_blocks = check_int("num_blocks", num_blocks, minimum=0, maximum=None)
    check_int("max_num_batched_tokens", max_num_batched_tokens)
    upper = check_int("upper", upper, minimum=0)

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
    specs = _check_kv_config(kv_config).specs
    if not specs:
        return
    need = blocks_per_request(
        specs, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens
    )
    usable = max(kv_config.num_blocks - 1, 0)  # block 0 is the null block
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
        f"the largest max_model_len that fits is {largest}; decrease max_model_len or give the KV cache more memory"
        if largest
        else "no max_model_len fits: give the KV cache more memory"
    )
    raise ValueError(
        f"{max_model_len=} needs {need} KV-cache blocks ({_bytes(need * bytes_per_block)}) for one request, but "
        f"only {usable} are available ({_bytes(usable * bytes_per_block)}; block 0 is the null block): {fix}."
    )


def _bytes(size: int) -> str:
    """`size` bytes in the largest binary unit that keeps it at least 1 ("1.50 GiB", "512 B")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"


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
    available_memory = check_int("available_memory", available_memory, minimum=0, maximum=None)
    max_model_len = check_int("max_model_len", max_model_len, minimum=1)
    max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
    groups = get_kv_cache_groups(specs)
    if not groups:  # attention-free model: the pool still holds the null block
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=(), kv_cache_groups=())
    page_size = groups[0].kv_cache_spec.page_size_bytes
    group_size = max(len(group.layer_names) for group in groups)
    num_blocks = available_memory // page_size // group_size
    if num_blocks_override is not None:
        num_blocks = check_int("num_blocks_override", num_blocks_override, minimum=1)
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
    specs = _check_kv_config(kv_config).specs
    need = blocks_per_request(
        specs, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens
    )
    return (kv_config.num_blocks - 1) / need if need else math.inf


# ------------------------------------------------------------------------------------------ the allocator

FULL, SLIDING_WINDOW, CHUNKED_LOCAL = 0, 1, 2
"""Kinds of a KV-cache group (vLLM's single-type managers), in `AllocatorConfig.kinds`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """Static sizes and options of the allocator (hashable; a `jax.jit` static argument).

    Attributes:
      specs: one spec per KV-cache group, in group order (`KVCacheConfig.specs`).
      num_blocks: B, blocks in the pool, the null block (id 0) included.
      max_num_seqs: R, request slots.
      max_model_len: L, most tokens of one request.
      max_num_batched_tokens: most new tokens of one step (T of the step's outputs, and vLLM's admission cap).
      max_num_lookahead_tokens: most lookahead (speculative) tokens of one request in one step.
      enable_caching: prefix caching (hashing, hit search, lazy eviction).
      verify_hits: store each cached block's token ids and compare them on every prefix hit.
      sliding_window_in_window_only: chunks are clipped so that sliding-window groups allocate only blocks that a
        later step still reads (see the `step` module); off by default, as in vLLM.
    """

    specs: tuple[AttentionSpec, ...]
    num_blocks: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_lookahead_tokens: int = 0
    enable_caching: bool = True
    verify_hits: bool = False
    sliding_window_in_window_only: bool = False

    def __post_init__(self):
        """Check every field and store it as a Python value (numpy ints and bools are converted)."""
        object.__setattr__(self, "specs", _check_spec_sequence(self.specs))
        if not self.specs:
            raise ValueError("specs=() must name at least one KV-cache group")
        for name in ("num_blocks", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            object.__setattr__(self, name, check_int(name, getattr(self, name)))
        lookahead = check_int("max_num_lookahead_tokens", self.max_num_lookahead_tokens, minimum=0)
        object.__setattr__(self, "max_num_lookahead_tokens", lookahead)
        for name in ("enable_caching", "verify_hits", "sliding_window_in_window_only"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))
        if self.num_blocks >= 2**30:
            raise ValueError(f"num_blocks={self.num_blocks} must be < 2**30 (int32 ring indices)")
        for i, spec in enumerate(self.specs):
            if isinstance(spec, ChunkedLocalAttentionSpec) and spec.block_size != self.alignment:
                raise NotImplementedError(
                    f"specs[{i}] is chunked-local with block_size={spec.block_size}, but the groups' block sizes "
                    f"have lcm {self.alignment}: chunked-local attention needs one block size for all groups (as in vLLM)"
                )

    def __hash__(self):  # cached: jax.jit hashes its static arguments on every call
        if "_hash" not in self.__dict__:
            self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
        return self.__dict__["_hash"]

    @classmethod
    def from_kv_cache_config(cls, kv_config: KVCacheConfig, **options) -> "AllocatorConfig":
        """The allocator for a `KVCacheConfig`; ``options`` are the other fields (``max_num_seqs`` ...)."""
        kv_config = _check_kv_config(kv_config)
        return cls(specs=kv_config.specs, num_blocks=kv_config.num_blocks, **options)

    # ----------------------------------------------------------------------------------------- derived sizes

    @property
    def num_groups(self) -> int:
        return len(self.specs)

    @functools.cached_property
    def kinds(self) -> tuple[int, ...]:
        kind = {
            FullAttentionSpec: FULL,
            SlidingWindowSpec: SLIDING_WINDOW,
            ChunkedLocalAttentionSpec: CHUNKED_LOCAL,
        }
        return tuple(kind[type(spec)] for spec in self.specs)

    @functools.cached_property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(spec.block_size for spec in self.specs)

    @functools.cached_property
    def sliding_windows(self) -> tuple[int, ...]:
        """Window of each sliding-window group; 0 for the others."""
        return tuple(getattr(spec, "sliding_window", 0) for spec in self.specs)

    @functools.cached_property
    def chunk_sizes(self) -> tuple[int, ...]:
        """Chunk of each chunked-local group; 0 for the others."""
        return tuple(getattr(spec, "attention_chunk_size", 0) for spec in self.specs)

    @functools.cached_property
    def hash_block_size(self) -> int:
        """Tokens per hash block: the gcd of the groups' block sizes (vLLM's hash_block_size)."""
        return math.gcd(*self.block_sizes) if self.specs else 1

    @functools.cached_property
    def alignment(self) -> int:
        """Prefix hits and caching are aligned to the lcm of the block sizes (vLLM's hybrid coordinator)."""
        return math.lcm(*self.block_sizes) if self.specs else 1

    @functools.cached_property
    def blocks_per_row(self) -> tuple[int, ...]:
        """P of each group: block-table columns, ``cdiv(max_model_len, block_size)`` (vLLM's full-length rows)."""
        return tuple(cdiv(self.max_model_len, s) for s in self.block_sizes)

    @property
    def max_blocks_per_row(self) -> int:
        return max(self.blocks_per_row, default=1)

    @property
    def hash_blocks_per_row(self) -> int:
        """Hash columns of a request row (at least one, never filled when ``max_model_len`` is below a block: the
        allocator's gathers need a non-empty row)."""
        return max(1, self.max_model_len // self.hash_block_size)

    @functools.cached_property
    def attention_groups(self) -> tuple[tuple[int, ...], ...]:
        """Groups with identical specs, looked up together; full attention first (vLLM's hybrid coordinator)."""
        by_spec: dict[AttentionSpec, list[int]] = {}
        for g, spec in enumerate(self.specs):
            by_spec.setdefault(spec, []).append(g)
        ordered = sorted(by_spec.values(), key=lambda ids: self.kinds[ids[0]] != FULL)
        return tuple(tuple(ids) for ids in ordered)

    @functools.cached_property
    def admission_caps(self) -> tuple[int, ...]:
        """Most blocks one request of a group can hold at once (vLLM's ``max_admission_blocks_per_request``)."""
        caps = []
        for spec, kind, window in zip(self.specs, self.kinds, self.sliding_windows):
            cap = spec.max_num_blocks_per_request(
                max_model_len=self.max_model_len,
                max_num_batched_tokens=self.max_num_batched_tokens + self.max_num_lookahead_tokens,
            )
            if kind == SLIDING_WINDOW and self.sliding_window_in_window_only:
                # The window behind the chunk, the longest clipped chunk (`group_rules.in_window_chunk`), lookahead:
                # 2 * (cdiv(W - 1, S) + 1) without lookahead.
                size = spec.block_size
                longest_chunk = max(1, window - 2 + size)
                reach = window - 1 + longest_chunk + self.max_num_lookahead_tokens
                cap = min(cap, cdiv(reach, size) + 1)
            caps.append(cap)
        return tuple(caps)

    @functools.cached_property
    def max_row_step_blocks(self) -> int:
        """Most blocks one request frees, takes or caches in one step whose computed tokens advance by at most
        ``max_num_batched_tokens + max_num_lookahead_tokens``: per group ``cdiv(T + La, S) + 1``, plus the blocks
        of a whole chunk for chunked-local groups (freed together at a chunk boundary), capped at ``P``. A request
        that would exceed it (its computed tokens jumped further) fails (see `step.allocate_slots`)."""
        tokens = self.max_num_batched_tokens + self.max_num_lookahead_tokens
        per_group = (
            min(p, cdiv(tokens, s) + 1 + cdiv(chunk, s))
            for s, p, chunk in zip(self.block_sizes, self.blocks_per_row, self.chunk_sizes, strict=True)
        )
        return max(1, sum(per_group))

    @property
    def ring_capacity(self) -> int:
        return next_power_of_two(2 * self.num_blocks)

    @property
    def num_buckets(self) -> int:
        return next_power_of_two(max(self.num_blocks // 2, 1))

    @property
    def stored_block_tokens(self) -> int:
        """Token ids kept per block for `verify_hits` (0 when off)."""
        return max(self.block_sizes) if self.verify_hits and self.specs else 0


def check_config(config) -> AllocatorConfig:
    """`config` itself, or `ValueError` when it is not an `AllocatorConfig` (every allocator function's first
    argument)."""
    if not isinstance(config, AllocatorConfig):
        raise ValueError(f"config must be an AllocatorConfig, got {type(config).__name__}")
    return config
