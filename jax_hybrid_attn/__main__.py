"""``python -m jax_hybrid_attn generate ...``: see `jax_hybrid_attn.cli`."""

import sys

from .cli import main

sys.exit(main())
