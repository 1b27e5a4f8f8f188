"""Test session setup: enough CPU client threads for Mosaic GPU interpret mode; the vLLM tests only with vLLM.

The variable is read when the CPU backend starts, so it is set here, before any test runs a computation
(`jax_hybrid_attn._compat.check_interpret_threads` explains why).
"""

import importlib.util
import os

from jax_hybrid_attn._compat import INTERPRET_CPU_THREADS

os.environ.setdefault("PJRT_NPROC", str(INTERPRET_CPU_THREADS))

# The vLLM plugin's tests need vLLM, which pins its own torch: they run in their own environment
# (scripts/test-vllm) and are not collected where vLLM is not installed.
if importlib.util.find_spec("vllm") is None:
    collect_ignore = ["vllm"]
