"""Execute notebooks on the CPU and store them with their outputs (`scripts/store_notebooks` runs this).

Each notebook runs in a fresh kernel from its own folder, in the environment of `scripts/test`; its outputs are
written back into the file, stderr streams left out (warnings that differ between machines), and its metadata
records the sha256 of its code cells' sources at execution time (`code_sha256`). `tests/test_notebooks.py`
recomputes that hash, so a code cell edited without storing the notebook again fails the tests.

Usage: python scripts/store_notebooks.py [NOTEBOOK ...]   (default: every notebooks/*.ipynb)
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
METADATA_KEY = "jax_hybrid_attn"  # notebook metadata: {"code_sha256": ...}
CELL_TIMEOUT_S = 900  # as scripts/test's --nbmake-timeout
ENVIRONMENT = {  # scripts/test's, where the caller has not set them
    "JAX_PLATFORMS": "cpu",
    "PJRT_NPROC": "8",
    "XLA_FLAGS": "--xla_backend_optimization_level=0",
}
STORE_COMMAND = "scripts/store_notebooks"


def code_sha256(notebook: dict) -> str:
    """sha256 of the notebook's code cells' sources, in order (a source stored as a list of lines is joined)."""
    sources = []
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            source = cell["source"]
            sources.append(source if isinstance(source, str) else "".join(source))
    return hashlib.sha256(json.dumps(sources).encode()).hexdigest()


def stored_sha256(notebook: dict) -> str | None:
    """The hash recorded when the notebook's outputs were stored, None if it never was."""
    return notebook.get("metadata", {}).get(METADATA_KEY, {}).get("code_sha256")


def _private_paths() -> list[str]:
    """Paths of this machine that a stored output must not show."""
    return [str(path) for path in {ROOT, Path.home(), Path(sys.prefix)} if len(str(path)) > 1]


def store(path: Path) -> float:
    """Execute `path` and write it back with its outputs and code hash; returns the seconds it ran."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:  # what an earlier run left
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
    started = time.perf_counter()
    NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()  # fmt: skip
    seconds = time.perf_counter() - started
    private = _private_paths()
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs = [out for out in cell.outputs if not (out.output_type == "stream" and out.name == "stderr")]
        text = json.dumps(cell.outputs)
        leaked = [p for p in private if p in text]
        if leaked:
            raise SystemExit(f"{path.name}: an output shows the local path {leaked[0]}; print relative paths")
    notebook.metadata[METADATA_KEY] = {"code_sha256": code_sha256(notebook)}
    nbformat.write(notebook, path)
    return seconds


def main(argv: list[str]) -> None:
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    paths = [Path(arg).resolve() for arg in argv] or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        seconds = store(path)
        print(f"{path.relative_to(ROOT)}: executed in {seconds:.1f} s, stored ({path.stat().st_size / 1024:.0f} KiB)",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
