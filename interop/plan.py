"""One step's metadata packed into one int32 buffer on the torch side, for `PagedAttentionBackend.plan`.

Per step, the metadata of every KV-cache group (vLLM's `CommonAttentionMetadata` fields) goes into ONE buffer,
imported into JAX once: each DLPack import costs host time comparable to a decode kernel. `PlanLayout` says where
each field lies; inside the jitted layer call, `PlanLayout.metadata` slices one group's `AttentionMetadata` out of
it, with no copy.

Shape letters: T tokens · R requests · P blocks per request · G KV-cache groups.
"""

import dataclasses

import jax
import numpy as np
import torch

from jax_hybrid_attn import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    AttentionMetadata,
    LayerAttentionParams,
    check_metadata_values,
)
from jax_hybrid_attn.cascade import split_violations
from jax_hybrid_attn.integers import INT32_MAX, cdiv, check_bool, check_int, next_power_of_two
from jax_hybrid_attn.params import CAUSAL

__all__ = ["PACKED_FIELD_ALIGNMENT", "PlanLayout", "pack_plan"]

PACKED_FIELD_ALIGNMENT = 256
"""Bytes: Mosaic GPU kernels refuse operands that are not 256-byte aligned ("Input buffer 3 is not 256-byte
aligned", seen on the H200). The cache must be; each field of the packed metadata starts at a multiple of it,
because XLA hands slices of a parameter to the kernels without a copy."""

_ALIGN_ELEMENTS = PACKED_FIELD_ALIGNMENT // 4  # int32


def _aligned(size: int) -> int:
    return cdiv(size, _ALIGN_ELEMENTS) * _ALIGN_ELEMENTS


@dataclasses.dataclass(frozen=True)
class PlanLayout:
    """Where each field lies in the packed int32 metadata buffer (static under jit).

    The buffer holds ``query_start_loc`` (R+1), ``seq_lens`` (R), then each group's block table (R*P) and each
    group's slot mapping (T), and with `cascade` each group's count of common prefix blocks (G), every field
    starting at a multiple of `PACKED_FIELD_ALIGNMENT` bytes.
    """

    num_reqs: int
    num_tokens: int
    num_groups: int
    blocks_per_req: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    cascade: bool = False

    @property
    def field_sizes(self) -> tuple[int, ...]:
        r, t, g, p = self.num_reqs, self.num_tokens, self.num_groups, self.blocks_per_req
        return (r + 1, r) + (r * p,) * g + (t,) * g + ((g,) if self.cascade else ())

    @property
    def field_offsets(self) -> tuple[int, ...]:
        offsets, start = [], 0
        for size in self.field_sizes:
            offsets.append(start)
            start += _aligned(size)
        return tuple(offsets)

    def metadata(self, packed: jax.Array, group: int) -> AttentionMetadata:
        """The `AttentionMetadata` of KV-cache group `group`, sliced from the packed buffer."""
        offsets, sizes = self.field_offsets, self.field_sizes

        def field(i):
            return packed[offsets[i] : offsets[i] + sizes[i]]

        query_start_loc = field(0)
        return AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=field(1),
            block_tables=field(2 + group).reshape(self.num_reqs, self.blocks_per_req),
            slot_mapping=field(2 + self.num_groups + group),
            num_actual_tokens=query_start_loc[-1],
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            causal=self.causal,
            num_common_prefix_blocks=field(2 + 2 * self.num_groups)[group] if self.cascade else None,
        )


def _pack(fields: list[torch.Tensor], padding: torch.Tensor) -> torch.Tensor:
    """One int32 buffer: each field flattened and padded to the alignment, in one `torch.cat`."""
    pieces = []
    for field in fields:
        flat = field.reshape(-1).to(torch.int32)
        pieces += [flat, padding[: _aligned(flat.numel()) - flat.numel()]]
    return torch.cat(pieces)


def _check_tensors(**tensors: torch.Tensor) -> torch.device:
    """Every tensor is an int32/int64 torch tensor on one device; returns that device."""
    device = None
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}.dtype={tensor.dtype} must be torch.int32 (or int64, converted)")
        device = tensor.device if device is None else device
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, query_start_loc on {device}")
    return device


def _per_group(block_tables, slot_mapping, *, num_groups: int, num_reqs: int):
    """[R, P] / [T] (shared by every group) or [G, R, P] / [G, T], as [G, R, P] and [G, T] views."""
    if block_tables.dim() == 2:
        block_tables = block_tables.unsqueeze(0).expand(num_groups, -1, -1)
    if slot_mapping.dim() == 1:
        slot_mapping = slot_mapping.unsqueeze(0).expand(num_groups, -1)
    if block_tables.dim() != 3 or block_tables.shape[:2] != (num_groups, num_reqs):
        raise ValueError(
            f"block_tables.shape={tuple(block_tables.shape)} must be [R={num_reqs}, P] or "
            f"[G={num_groups}, R={num_reqs}, P]"
        )
    if slot_mapping.dim() != 2 or slot_mapping.shape[0] != num_groups:
        raise ValueError(f"slot_mapping.shape={tuple(slot_mapping.shape)} must be [T] or [G={num_groups}, T]")
    return block_tables, slot_mapping


FIELD_NAMES = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "num_common_prefix_blocks")


def _host_values(fields: list[torch.Tensor]) -> list[np.ndarray]:
    """The fields' values on the host: CPU tensors where they are (no copy), others `_copied_to_host`."""
    if fields[0].device.type == "cpu":
        return [field.resolve_neg().numpy() for field in fields]
    return _copied_to_host(fields)


def _copied_to_host(fields: list[torch.Tensor]) -> list[np.ndarray]:
    """The fields' values as int64 host arrays, in one copy (which waits for them)."""
    flat = torch.cat([field.reshape(-1).to(torch.int64) for field in fields]).cpu().numpy()
    sizes = np.cumsum([field.numel() for field in fields])[:-1]
    return [part.reshape(field.shape) for part, field in zip(np.split(flat, sizes), fields, strict=True)]


def _check_int32_range(names, values: list[np.ndarray]) -> None:
    """The int64 values fit int32 (they are converted)."""
    info = np.iinfo(np.int32)
    for name, value in zip(names, values):
        if value.dtype == np.int64 and value.size:
            low, high = int(value.min()), int(value.max())
            if low < info.min or high > info.max:
                raise ValueError(
                    f"{name} holds values in [{low}, {high}], outside int32's [{info.min}, {info.max}]"
                )


def _first_keys(first_query: np.ndarray, params: LayerAttentionParams) -> np.ndarray:
    """The first key position that query position `first_query` attends under `params`: the first key of
    `masks.allowed_key_range`, in numpy (the jnp one costs as much host time as all other checks together)."""
    first = np.zeros_like(first_query)
    window, chunk = params.sliding_window, params.attention_chunk_size
    if window is not None:
        first = np.where(first_query >= window, first_query - window + 1, first)
    if chunk is not None:
        first = np.maximum(first, first_query // chunk * chunk)
    return first


def _check_slots_follow_tables(query_start_loc, seq_lens, block_tables, slot_mapping, *, block_size, group):
    """Each token of a request writes the slot of its position p in the request's block table (vLLM's slot
    mapping: ``block_tables[r, p // S] * S + p % S``), each padding token (from ``query_start_loc[-1]`` on)
    `PAD_SLOT_ID`: another slot would leave a position the queries read unwritten, or write another's.
    Returns the index of each (not padding) token's block in the flattened tables."""
    query_lens = np.diff(query_start_loc)
    request = np.repeat(np.arange(seq_lens.size), query_lens)
    position = seq_lens[request] - query_start_loc[request + 1] + np.arange(request.size)
    entry = request * block_tables.shape[1] + position // block_size  # in the flattened tables
    expected = np.full(slot_mapping.shape, PAD_SLOT_ID, np.int64)
    expected[: request.size] = block_tables.ravel().take(entry) * np.int64(block_size) + position % block_size
    wrong = np.flatnonzero(slot_mapping != expected)
    if wrong.size:
        token = int(wrong[0])
        where = f"slot_mapping[{token}]" if group is None else f"slot_mapping[{group}, {token}]"
        got = f"{where}={slot_mapping[token]}"
        if token >= request.size:
            raise ValueError(
                f"{got} must be PAD_SLOT_ID={PAD_SLOT_ID}: token {token} is padding (from "
                f"query_start_loc[-1]={request.size} on), which writes nowhere"
            )
        r, p = int(request[token]), int(position[token])
        table = "block_tables" if group is None else f"block_tables[{group}]"
        raise ValueError(
            f"{got} must be {expected[token]}: token {token} is request {r}'s position {p}, whose slot is "
            f"{table}[{r}, {p // block_size}] * {block_size} + {p % block_size}"
        )
    return entry


def _check_reads(seq_lens, query_lens, block_tables, written, *, block_size, params, group) -> None:
    """What the group's layers (`params`, each distinct one) read and write: from the first key any of them
    attends for a request's first query to its last position, no block is `NULL_BLOCK_ID` (no request owns
    its contents), nor one this step writes, but at the request's own written entries (`written`: each
    token's, in the flattened tables); no block is written for two requests. As
    `validation.check_block_reads`, for all of a group's layers at once, on whole arrays."""
    first_key = np.min([_first_keys(seq_lens - query_lens, p) for p in params], axis=0)
    first = first_key // block_size
    num_reqs, width = block_tables.shape
    starts = np.arange(num_reqs) * width + first
    ends = starts - first + (seq_lens - 1) // block_size + 1
    ends = np.where(query_lens > 0, ends, starts)  # an idle request reads nothing
    bounds = np.stack([starts, ends], axis=1).ravel()
    flat = block_tables.ravel()

    def first_read(marks):  # (request, column) of the first marked entry that a request reads, or None
        marked = np.logical_or.reduceat(np.append(marks, False), bounds)[::2]
        requests = np.flatnonzero(marked & (ends > starts))
        if not requests.size:
            return None
        r = int(requests[0])
        return r, int(np.flatnonzero(marks[starts[r] : ends[r]])[0] + first[r])

    table = "block_tables" if group is None else f"block_tables[{group}]"
    null = first_read(flat == NULL_BLOCK_ID)
    if null is not None:
        r, column = null
        raise ValueError(
            f"{table}[{r}, {column}] is the null block {NULL_BLOCK_ID}, which request {r} reads (its layers "
            f"attend key positions {first_key[r]}..{seq_lens[r] - 1}): no request owns its contents"
        )
    if int(flat.max(initial=0)) >= 1 << 24:  # ids that large: renumbered, for a lookup table of their count
        flat = np.unique(flat, return_inverse=True)[1].reshape(-1)
    writer = np.zeros(int(flat.max(initial=0)) + 1, np.int32)  # by block id: 1 + the request writing into it
    blocks, rows = flat[written], written // width + 1
    writer[blocks] = rows
    twice = np.flatnonzero(writer[blocks] != rows)
    if twice.size:
        entry = int(written[twice[0]])
        r, column, other = entry // width, entry % width, writer[blocks[twice[0]]] - 1
        raise ValueError(
            f"{table}[{r}, {column}]={block_tables[r, column]} is written in this step for requests {r} and "
            f"{other}: a block has one writer"
        )
    marks = writer.take(flat.astype(np.intp)) > 0  # (take is faster with intp indices)
    marks[written] = False
    foreign = first_read(marks)
    if foreign is not None:
        r, column = foreign
        other = writer[flat[r * width + column]] - 1
        raise ValueError(
            f"{table}[{r}, {column}]={block_tables[r, column]} is a block request {r} reads, which this step "
            f"writes for request {other}" + (" at another column" if other == r else "")
        )


def _check_values(values: list[np.ndarray], layout: PlanLayout, *, block_size: int, group_params) -> tuple:
    """The checked mode, on the fields' host values (int64 ones already within int32): every group's metadata
    through `check_metadata_values` (the pool size is not known yet), its common prefix through
    `cascade.split_violations`, its slots against its block table (`_check_slots_follow_tables`) and its
    layers' reads (`_check_reads`). Returns per group the number of cache blocks its ids and slots need."""
    query_start_loc, seq_lens, block_tables, slot_mapping = (
        value.astype(np.int32, copy=False) for value in values[:4]
    )
    common = values[4] if layout.cascade else None
    needed = []
    for group in range(layout.num_groups):
        metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables[group],
            slot_mapping=slot_mapping[group],
            num_actual_tokens=np.asarray(query_start_loc[-1], np.int32),
            max_query_len=layout.max_query_len,
            max_seq_len=layout.max_seq_len,
            causal=layout.causal,
        )
        try:
            check_metadata_values(metadata, num_blocks=None, block_size=block_size)
        except ValueError as error:
            if layout.num_groups == 1:
                raise
            raise ValueError(f"KV-cache group {group}'s {error}") from None
        params = group_params[group]
        if common is not None:
            splits = [
                split_violations(metadata, int(common[group]), block_size=block_size, params=p)
                for p in params or (CAUSAL,)
            ]
            broken = np.any(splits, axis=0)
            if broken.any():
                raise ValueError(
                    f"num_common_prefix_blocks={common.tolist()} does not split group {group}'s requests "
                    f"{np.flatnonzero(broken).tolist()}: their leading blocks differ from the first "
                    "request's, their query starts inside the prefix, or a layer's window or chunk ends "
                    "inside it"
                )
        name = group if layout.num_groups > 1 else None
        reached = max(1, -(-int(seq_lens.max(initial=0)) // block_size))  # the columns any request reaches
        tables = np.ascontiguousarray(block_tables[group, :, :reached])
        written = _check_slots_follow_tables(
            query_start_loc, seq_lens, tables, slot_mapping[group], block_size=block_size, group=name
        )
        if params:
            query_lens = np.diff(query_start_loc)
            options = {"block_size": block_size, "params": params, "group": name}
            _check_reads(seq_lens, query_lens, tables, written, **options)
        highest_slot = int(slot_mapping[group].max(initial=PAD_SLOT_ID))
        needed.append(max(int(block_tables[group].max(initial=0)), highest_slot // block_size) + 1)
    return tuple(needed)


def _bounds(query_start_loc, seq_lens, max_query_len, max_seq_len) -> tuple[int, int]:
    """`plan`'s bounds, checked; one left None is read from the values (host arrays, or tensors: a wait)."""
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if len(seq_lens) else 0
        if max_query_len < 0:
            raise ValueError(f"query_start_loc={query_start_loc.tolist()} must never decrease")
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if len(seq_lens) else 0
        if max_seq_len < 0:
            raise ValueError(f"seq_lens={seq_lens.tolist()} must be >= 0")
    max_query_len = check_int("max_query_len", max_query_len, minimum=0)
    return max_query_len, check_int("max_seq_len", max_seq_len, minimum=0)


def pack_plan(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_groups: int,
    block_size: int,
    max_query_len: int | None,
    max_seq_len: int | None,
    causal: bool,
    checked: bool,
    padding: torch.Tensor,
    group_params: tuple[tuple[LayerAttentionParams, ...], ...],
    num_common_prefix_blocks=None,
) -> tuple[torch.Tensor, PlanLayout, tuple[int, ...] | None]:
    """Check one step's metadata and pack it into one int32 tensor on its device (see `PagedAttentionBackend.plan`
    for the arguments; `padding` is a zero int32 tensor of at least one alignment's elements on that device;
    `group_params` holds per KV-cache group the distinct parameters of its layers, which a checked plan checks
    the reads against).

    Returns (the packed tensor, its layout, and with ``checked=True`` the number of cache blocks each group's
    ids and slots need, else None). Bounds left None are read from the values (unchecked: from the tensors,
    which waits for them). The layout's counts (requests, tokens, blocks per request) are the step's, rounded
    up to powers of two; the packed fields are padded to them."""
    checked, causal = check_bool("checked", checked), check_bool("causal", causal)
    if not isinstance(group_params, tuple) or len(group_params) != num_groups:
        raise ValueError(f"group_params={group_params!r} must be a tuple of {num_groups} tuples, one a group")
    _check_tensors(
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables, slot_mapping=slot_mapping
    )
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(
            f"query_start_loc.shape={tuple(query_start_loc.shape)} and seq_lens.shape={tuple(seq_lens.shape)} "
            "must be [R+1] and [R]"
        )
    block_tables, slot_mapping = _per_group(block_tables, slot_mapping, num_groups=num_groups, num_reqs=num_reqs)
    common = _common_prefix_blocks(
        num_common_prefix_blocks,
        num_groups=num_groups,
        blocks_per_req=block_tables.shape[2],
        device=query_start_loc.device,
    )
    fields = [query_start_loc, seq_lens, block_tables, slot_mapping] + ([] if common is None else [common])
    values = _host_values(fields) if checked else None
    if checked:
        _check_int32_range(FIELD_NAMES, values)
    max_query_len, max_seq_len = _bounds(*(values or fields)[:2], max_query_len, max_seq_len)
    layout = PlanLayout(
        num_reqs=num_reqs,
        num_tokens=slot_mapping.shape[1],
        num_groups=num_groups,
        blocks_per_req=block_tables.shape[2],
        # rounded up, within int32 (the metadata's bound)
        max_query_len=min(next_power_of_two(max_query_len), INT32_MAX),
        max_seq_len=min(next_power_of_two(max_seq_len), INT32_MAX),
        causal=causal,
        cascade=common is not None,
    )
    needed_blocks = None
    if checked:
        needed_blocks = _check_values(values, layout, block_size=block_size, group_params=group_params)
    # Counts rounded up to powers of two, so that a serving loop's varying batches compile a few shapes only:
    # padding requests are empty (their query and sequence lengths 0), padding tokens write nowhere
    layout = dataclasses.replace(
        layout, num_reqs=next_power_of_two(num_reqs), num_tokens=next_power_of_two(layout.num_tokens),
        blocks_per_req=next_power_of_two(layout.blocks_per_req),
    )  # fmt: skip
    extra_reqs = layout.num_reqs - num_reqs
    query_start_loc = torch.cat([query_start_loc, query_start_loc[-1:].expand(extra_reqs)])
    seq_lens = torch.nn.functional.pad(seq_lens, (0, extra_reqs))
    block_tables = torch.nn.functional.pad(block_tables, (0, layout.blocks_per_req - block_tables.shape[2], 0, extra_reqs))
    slot_mapping = torch.nn.functional.pad(
        slot_mapping, (0, layout.num_tokens - slot_mapping.shape[1]), value=PAD_SLOT_ID
    )
    cascade = [common] if layout.cascade else []
    return _pack([query_start_loc, seq_lens, *block_tables, *slot_mapping, *cascade], padding), layout, needed_blocks


def _common_prefix_blocks(counts, *, num_groups: int, blocks_per_req: int, device) -> torch.Tensor | None:
    """`plan`'s ``num_common_prefix_blocks`` (None, or G ints in [0, P]) as an int32 tensor [G] on `device`."""
    if counts is None:
        return None
    values = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    if (
        not isinstance(values, (list, tuple)) or len(values) != num_groups
        or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= blocks_per_req for v in values)
    ):  # fmt: skip
        raise ValueError(
            f"num_common_prefix_blocks={counts!r} must be {num_groups} ints (one per KV-cache group) in "
            f"[0, {blocks_per_req}] (the block tables' width)"
        )
    return torch.tensor(values, dtype=torch.int32, device=device)
