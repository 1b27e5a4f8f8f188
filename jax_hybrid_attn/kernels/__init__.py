"""Pallas Mosaic GPU kernels. `paged_attention.py`: the kernel over query tiles; `tiles.py`: the tile
tables and the packing of query rows around it. The public entry point is `jax_hybrid_attn.paged_attention`."""
