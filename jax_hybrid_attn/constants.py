"""Named sentinels shared by the allocator, the metadata and the kernels (vLLM's values).

Shape letters used in every docstring of this package:
  T query tokens in the batch (flattened) · R requests · N query heads · K kv heads · H head_dim ·
  B blocks in the pool · S block_size · P max blocks per request.
A "block" is what JAX and FlashInfer call a page: S consecutive token positions of one request.
"""

NULL_BLOCK_ID = 0
"""Block id standing in for blocks outside a window or chunk, and for unused block-table entries.
The allocator never hands it out; its contents are never read by a correct kernel."""

PAD_SLOT_ID = -1
"""`slot_mapping` entry of a padding token: its K/V is not written anywhere."""
