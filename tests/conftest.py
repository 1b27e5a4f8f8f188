"""Test session setup: enough CPU client threads for Mosaic GPU interpret mode; no compilation cache of the CLI's,
but one JAX cache for the session; the vLLM tests only with vLLM; a worker's memory mappings kept below the kernel's
limit.

XLA's compiles are most of the suite's time, and many tests compile the same executables again: engines of the same
model and sizes (an engine compiles its steps ahead of time, which JAX's in-memory caches do not keep), the embedded
model in every CLI and server subprocess and notebook. The workers, their subprocesses and the notebooks share JAX's
persistent compilation cache in one temporary directory (through the environment), made by the first process and
removed when it ends. Its key is the module and the compile options: a test that compiles one module in two ways
(`compile_single_task`) compiles two modules.

The variable is read when the CPU backend starts, so it is set here, before any test runs a computation
(`jax_hybrid_attn._compat.check_interpret_threads` explains why).

Every XLA CPU executable that JAX's caches keep holds a few memory mappings (about 3). A test worker that
compiles through most of the suite reaches the kernel's `vm.max_map_count` (65,530 by default), and the next
compile then fails inside LLVM ("Cannot allocate memory") and the worker dies with a segmentation fault. So the
worker clears JAX's caches when a test module leaves more than half of the limit in use (or any test more than
`_MAPPINGS_HIGH_WATER` of it), which gives the mappings back.
"""

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import jax

from jax_hybrid_attn._compat import INTERPRET_CPU_THREADS
from jax_hybrid_attn.engine_options import COMPILATION_CACHE_VARIABLE

os.environ.setdefault("PJRT_NPROC", str(INTERPRET_CPU_THREADS))
# The CLI keeps compiled steps in the user's cache directory by default; the tests (and the servers and CLIs they
# start as subprocesses) compile theirs, and those that test the cache point it at a directory of their own.
os.environ[COMPILATION_CACHE_VARIABLE] = "off"

_SESSION_CACHE_VARIABLE = "JHA_TESTS_JAX_CACHE"
_JAX_CACHE_SETTINGS = {  # every executable, however fast it compiled or small it is
    "jax_compilation_cache_dir": None,
    "jax_persistent_cache_min_compile_time_secs": 0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}
_owns_session_cache = _SESSION_CACHE_VARIABLE not in os.environ  # the first process: pytest, or its controller
if _owns_session_cache:
    os.environ[_SESSION_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="jha-tests-jax-cache-")
for _name, _value in {**_JAX_CACHE_SETTINGS, "jax_compilation_cache_dir": os.environ[_SESSION_CACHE_VARIABLE]}.items():
    os.environ[_name.upper()] = str(_value)  # subprocesses and notebook kernels read it when JAX starts
for _name, _value in {**_JAX_CACHE_SETTINGS, "jax_compilation_cache_dir": os.environ[_SESSION_CACHE_VARIABLE]}.items():
    jax.config.update(_name, _value)  # this process too (JAX started before the variables were set)


def pytest_unconfigure(config):
    if _owns_session_cache:
        shutil.rmtree(os.environ[_SESSION_CACHE_VARIABLE], ignore_errors=True)

# The vLLM plugin's tests need vLLM, which pins its own torch: they run in their own environment
# (scripts/test-vllm) and are not collected where vLLM is not installed.
if importlib.util.find_spec("vllm") is None:
    collect_ignore = ["vllm"]

_MAX_MAP_COUNT_FILE = Path("/proc/sys/vm/max_map_count")
_OWN_MAPPINGS_FILE = Path("/proc/self/maps")
_MAPPINGS_AFTER_A_MODULE = 0.5  # share of the limit in use after a module that clears JAX's caches
_MAPPINGS_HIGH_WATER = 0.75  # share of the limit in use after any test that clears them


def _mappings_share() -> float:
    """The share of `vm.max_map_count` this process uses (0.0 where /proc does not tell)."""
    try:
        limit = int(_MAX_MAP_COUNT_FILE.read_text())
        with _OWN_MAPPINGS_FILE.open("rb") as maps:
            in_use = sum(1 for _ in maps)
    except (OSError, ValueError):
        return 0.0
    return in_use / limit


def pytest_runtest_teardown(item, nextitem):
    last_of_its_module = nextitem is None or nextitem.path != item.path
    threshold = _MAPPINGS_AFTER_A_MODULE if last_of_its_module else _MAPPINGS_HIGH_WATER
    if _mappings_share() > threshold:
        jax.clear_caches()
