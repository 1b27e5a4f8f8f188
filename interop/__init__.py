"""jax_hybrid_attn_torch: the PyTorch side of jax_hybrid_attn (DLPack bridge, attention backend).

Installed from the repository's `interop/` folder under this project-specific name. This is the only
package that imports torch; `jax_hybrid_attn` itself never does.
"""
