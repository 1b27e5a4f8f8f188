"""jax_hybrid_attn_torch: the PyTorch side of jax_hybrid_attn (DLPack bridge, attention backend, transformers).

Installed from the repository's `interop/` folder under this project-specific name. This is the only
package that imports torch; `jax_hybrid_attn` itself never does.

* `to_jax` / `to_torch` (`dlpack`): zero-copy tensors both ways, with the checks DLPack does not make.
* `PagedAttentionBackend` (`backend`): `plan` once per step, `run` once per layer, from torch tensors.
* `transformers_attention.register()`: ``attn_implementation="jax_hybrid"`` for HuggingFace models (imported on
  demand: it imports transformers).
* `transformers_cb.register()`: ``"paged|jax_hybrid"`` for transformers' continuous batching (on demand too).
"""

from .backend import AttentionLayer, PagedAttentionBackend
from .dlpack import same_memory, to_jax, to_torch

__all__ = ["AttentionLayer", "PagedAttentionBackend", "same_memory", "to_jax", "to_torch"]
