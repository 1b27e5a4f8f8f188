"""The notebooks are stored with their outputs (a repository page shows their plots) and those outputs are the code's:
each notebook's metadata holds the sha256 of the code cells that produced them (`scripts/store_notebooks`), every
code cell ran, none failed, and each notebook shows at least one plot. CI also executes every notebook
(`pytest --nbmake`), so the code runs as stored."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
STORE_SCRIPT = ROOT / "scripts" / "store_notebooks.py"
PLOT_MIME = "image/png"


def _store_module():
    spec = importlib.util.spec_from_file_location("store_notebooks", STORE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


store = _store_module()


def _fix(path: Path) -> str:
    return f"run `{store.STORE_COMMAND} notebooks/{path.name}` to execute it and store its outputs"


def _code_cells(notebook: dict) -> list[dict]:
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def test_every_notebook_is_checked():
    assert {path.name for path in NOTEBOOKS} >= {
        "tour.ipynb", "serving.ipynb", "masks.ipynb", "allocator.ipynb", "performance.ipynb", "parity.ipynb",
    }  # fmt: skip


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_stored_outputs_are_those_of_the_code(path):
    notebook = json.loads(path.read_text())
    stored = store.stored_sha256(notebook)
    assert stored is not None, f"{path.name} was never stored with its outputs: {_fix(path)}"
    assert stored == store.code_sha256(notebook), (
        f"{path.name}: its code cells changed since its outputs were stored: {_fix(path)}"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_every_code_cell_ran_and_a_plot_shows(path):
    notebook = json.loads(path.read_text())
    cells = _code_cells(notebook)
    not_run = [i for i, cell in enumerate(cells) if cell.get("execution_count") is None]
    assert not not_run, f"{path.name}: code cells {not_run} have no stored run: {_fix(path)}"
    counts = [cell["execution_count"] for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), f"{path.name}: cells ran out of order ({counts}): {_fix(path)}"
    outputs = [output for cell in cells for output in cell.get("outputs", [])]
    errors = [output.get("ename") for output in outputs if output["output_type"] == "error"]
    assert not errors, f"{path.name}: a stored output is an error ({errors[0]}): fix it, then {_fix(path)}"
    assert any(PLOT_MIME in output.get("data", {}) for output in outputs), (
        f"{path.name} shows no plot ({PLOT_MIME} output): {_fix(path)}"
    )
