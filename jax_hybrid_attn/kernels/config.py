"""The paged-attention kernel's options: tiling, pipeline depth, splits and consumers.

`KernelConfig` is a static argument of the kernel (`launch.launch_attention`); `default_config` picks
the measured best that fits in a CTA's shared memory.
"""

import dataclasses

ROWS = 64  # wgmma M: query rows per consumer warpgroup
SMEM_BUDGET_BYTES = 227 * 1024 - 4096  # H100/H200 per-block maximum, less room for barriers and alignment
REGISTER_FILE = 64 * 1024  # 32-bit registers per SM
WARPGROUP_THREADS = 128
PROFILE_RANGES = 512  # named phases per warpgroup that the on-device profiler records (`KernelConfig.profile_dir`)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """How the kernel tiles, pipelines and launches (a static argument: each value compiles its own kernel).

    Attributes:
      block_kv: keys per step (whole cache blocks, or part of one).
      num_stages: K/V ring slots the producer fills ahead of the consumers.
      num_splits: CTAs sharing one tile and KV head, each over a part of its keys (flash-decoding).
      num_consumers: warpgroups of 64 query rows sharing each K/V step (1 or 2).
      ping_pong: two consumers take turns on the tensor cores.
      consumer_registers, producer_registers: the registers per thread of each role with two consumers
        (``setmaxnreg``: multiples of 8 in [24, 256], together at most what the CTA launched with, since
        `setmaxnreg` only moves registers between warpgroups: an increase beyond that waits forever).
      q_parts: with a float8 cache, the float8 parts q is split into for the QK product: 2 (hi + lo, about
        bfloat16's precision) or 1 (float8's: half the product).
      p_parts: with V transposed ("HND_VT"), the float8 parts P is split into for the PV product: 2 (hi + lo,
        about bfloat16's precision) or 1 (float8's, as FlashAttention-3 does: half the product and its operand).
      direct_io: read q and write the output in [T, N, H] in the kernel where the launch allows it (one split, G
        in 1, 2, 4, 8; `mixed_batch`), rather than packing q into tiles and gathering the output per token.
      narrow_decode: decode launches over a float8 "HND_VT" cache run on the narrow decode kernel (keys on the
        wgmma's 64-row side, the query heads on its narrow side: `narrow_decode`) rather than on query tiles.
      profile_dir: the debug switch: when set, Mosaic GPU's on-device profiler records up to `PROFILE_RANGES`
        named phases per warpgroup and writes a Perfetto trace there (`benchmarks/kernel_timeline.py`; it slows
        the kernel).
    """

    block_kv: int = 128
    num_stages: int = 2
    num_splits: int = 1
    num_consumers: int = 1
    ping_pong: bool = True
    consumer_registers: int = 232
    producer_registers: int = 40
    q_parts: int = 2
    p_parts: int = 2
    direct_io: bool = True
    narrow_decode: bool = True
    profile_dir: str = ""

    def __post_init__(self):
        if self.block_kv % 64 or self.block_kv <= 0:
            raise ValueError(f"block_kv={self.block_kv} must be a positive multiple of 64")
        if self.num_stages < 1 or self.num_splits < 1:
            raise ValueError(f"num_stages={self.num_stages}, num_splits={self.num_splits} must be >= 1")
        if self.num_consumers not in (1, 2):
            raise ValueError(f"num_consumers={self.num_consumers} must be 1 or 2")
        for name in ("q_parts", "p_parts"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"{name}={getattr(self, name)} must be 1 or 2")
        for name in ("consumer_registers", "producer_registers"):
            count = getattr(self, name)
            if count % 8 or not 24 <= count <= 256:
                raise ValueError(f"{name}={count} must be a multiple of 8 in [24, 256]")
        used = self.num_consumers * self.consumer_registers + self.producer_registers
        if self.num_consumers > 1 and used > (self.num_consumers + 1) * self.launch_registers:
            raise ValueError(
                f"consumer_registers={self.consumer_registers}, producer_registers={self.producer_registers}: "
                f"more than the {self.num_consumers + 1} x {self.launch_registers} registers per thread launched"
            )

    @property
    def launch_registers(self) -> int:
        """Registers per thread the CTA launches with: the register file over its threads, rounded down to 8."""
        return REGISTER_FILE // (WARPGROUP_THREADS * (self.num_consumers + 1)) // 8 * 8

    @property
    def rows(self) -> int:
        """Query rows per tile."""
        return ROWS * self.num_consumers

    def smem_bytes(self, head_dim: int, q_itemsize: int, kv_itemsize: int, *, direct: bool = False,
                   v_transposed: bool = False) -> int:  # fmt: skip
        """Shared memory on the GPU: q/output tiles (with `direct`, and their untiled copies for q and the output
        in [T, N, H]), the K and V ring, and for a float8 cache q's two float8 parts and V's float16 staging
        buffer, or with V transposed ("HND_VT": the PV product reads it from the ring) P's two float8 parts
        (barriers aside)."""
        query_tiles = 2 if direct else 1  # with `direct`, the untiled staging copy too
        q_tiles = self.num_consumers * (query_tiles * ROWS * head_dim * q_itemsize + ROWS * 4)
        ring = 2 * self.num_stages * self.block_kv * head_dim * kv_itemsize
        if kv_itemsize == q_itemsize:
            return q_tiles + ring
        q_parts = self.num_consumers * 2 * ROWS * head_dim * kv_itemsize
        if v_transposed:
            staging = self.num_consumers * self.p_parts * ROWS * self.block_kv * kv_itemsize
        else:
            staging = self.num_consumers * self.block_kv * head_dim * q_itemsize
        return q_tiles + ring + q_parts + staging


def default_config(head_dim: int, q_itemsize: int, kv_itemsize: int, *, num_splits: int, num_consumers: int,
                   max_block_kv: int | None = None, v_transposed: bool = False):  # fmt: skip
    """The measured best on the H200 (benchmarks/RESULTS.md) of at most `max_block_kv` keys per step, shrunk until
    it fits in shared memory (`KernelConfig.smem_bytes` with `v_transposed`)."""
    for block_kv, num_stages in ((128, 2), (64, 3), (64, 2), (64, 1)):
        if max_block_kv is not None and block_kv > max_block_kv:
            continue
        config = KernelConfig(
            block_kv=block_kv, num_stages=num_stages, num_splits=num_splits, num_consumers=num_consumers
        )
        if config.smem_bytes(head_dim, q_itemsize, kv_itemsize, v_transposed=v_transposed) <= SMEM_BUDGET_BYTES:
            return config
    raise NotImplementedError(f"{head_dim=} does not fit the kernel's shared memory")
