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

from jax_hybrid_attn import PAD_SLOT_ID, AttentionMetadata, check_metadata_values
from jax_hybrid_attn.cascade import split_violations
from jax_hybrid_attn.integers import INT32_MAX, cdiv, check_bool, check_int, next_power_of_two

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


def _check_int64_range(**tensors: torch.Tensor) -> None:
    """int64 tensors must fit int32 (they are converted): checked on their values, which waits for them."""
    info = torch.iinfo(torch.int32)
    for name, tensor in tensors.items():
        if tensor.dtype == torch.int64 and tensor.numel():
            low, high = int(tensor.min()), int(tensor.max())
            if low < info.min or high > info.max:
                raise ValueError(f"{name} holds values in [{low}, {high}], outside int32's [{info.min}, {info.max}]")


def _check_values(fields: list[torch.Tensor], layout: PlanLayout, *, block_size: int) -> tuple[int, ...]:
    """The checked mode: every group's metadata, copied to the host, through `check_metadata_values` (the pool
    size is not known yet), and its common prefix through `cascade.split_violations` (the parts that do not
    depend on a layer's window or chunk). Returns per group the number of cache blocks its ids and slots need."""
    query_start_loc, seq_lens, block_tables, slot_mapping = (
        field.cpu().numpy().astype(np.int32) for field in fields[:4]
    )
    common = fields[4].cpu().numpy().astype(np.int32) if layout.cascade else None
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
        check_metadata_values(metadata, num_blocks=None, block_size=block_size)
        if common is not None:
            broken = np.asarray(split_violations(metadata, int(common[group]), block_size=block_size))
            if broken.any():
                raise ValueError(
                    f"num_common_prefix_blocks={common.tolist()} does not split group {group}'s requests "
                    f"{np.flatnonzero(broken).tolist()}: their leading blocks differ from the first request's, or "
                    "their query starts inside the prefix"
                )
        highest_slot = int(slot_mapping[group].max(initial=PAD_SLOT_ID))
        needed.append(max(int(block_tables[group].max(initial=0)), highest_slot // block_size) + 1)
    return tuple(needed)


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
    num_common_prefix_blocks=None,
) -> tuple[torch.Tensor, PlanLayout, tuple[int, ...] | None]:
    """Check one step's metadata and pack it into one int32 tensor on its device (see `PagedAttentionBackend.plan`
    for the arguments; `padding` is a zero int32 tensor of at least one alignment's elements on that device).

    Returns (the packed tensor, its layout, and with ``checked=True`` the number of cache blocks each group's
    ids and slots need, else None). Bounds left None are read from the tensors, which waits for them. The layout's
    counts (requests, tokens, blocks per request) are the step's rounded up to powers of two; the packed fields
    are padded to them."""
    checked, causal = check_bool("checked", checked), check_bool("causal", causal)
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
    _check_int64_range(
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables, slot_mapping=slot_mapping
    )
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_reqs else 0
        if max_query_len < 0:
            raise ValueError(f"query_start_loc={query_start_loc.tolist()} must never decrease")
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if num_reqs else 0
        if max_seq_len < 0:
            raise ValueError(f"seq_lens={seq_lens.tolist()} must be >= 0")
    layout = PlanLayout(
        num_reqs=num_reqs,
        num_tokens=slot_mapping.shape[1],
        num_groups=num_groups,
        blocks_per_req=block_tables.shape[2],
        # rounded up, within int32 (the metadata's bound)
        max_query_len=min(next_power_of_two(check_int("max_query_len", max_query_len, minimum=0)), INT32_MAX),
        max_seq_len=min(next_power_of_two(check_int("max_seq_len", max_seq_len, minimum=0)), INT32_MAX),
        causal=causal,
        cascade=num_common_prefix_blocks is not None,
    )
    common = _common_prefix_blocks(num_common_prefix_blocks, num_groups=num_groups, blocks_per_req=layout.blocks_per_req,
                                   device=query_start_loc.device)  # fmt: skip
    fields = [query_start_loc, seq_lens, block_tables, slot_mapping] + ([common] if layout.cascade else [])
    needed_blocks = _check_values(fields, layout, block_size=block_size) if checked else None
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
