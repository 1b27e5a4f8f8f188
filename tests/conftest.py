"""Test session setup: enough CPU client threads for Mosaic GPU interpret mode.

The variable is read when the CPU backend starts, so it is set here, before any test runs a computation
(`jax_hybrid_attn._compat.check_interpret_threads` explains why).
"""

import os

from jax_hybrid_attn._compat import INTERPRET_CPU_THREADS

os.environ.setdefault("PJRT_NPROC", str(INTERPRET_CPU_THREADS))
