"""The distribution: import names, no torch in the core, public API present."""

import importlib.metadata
import pathlib
import subprocess
import sys
import tomllib


def test_core_import_does_not_import_torch():
    code = "import sys, jax_hybrid_attn; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_interop_ships_under_a_project_specific_name():
    import jax_hybrid_attn_torch

    assert jax_hybrid_attn_torch.__name__ == "jax_hybrid_attn_torch"
    assert "interop" in jax_hybrid_attn_torch.__file__


def test_pins_match_the_gpu_image_and_no_dlpack_package():
    requirements = importlib.metadata.requires("jax-hybrid-attn")
    assert "jax==0.11.2" in requirements and "jaxlib==0.11.2" in requirements
    assert not any(r.split()[0].startswith("dlpack") for r in requirements)
    assert importlib.metadata.version("jax") == "0.11.2"


def test_every_subpackage_ships():
    """A non-editable wheel carries exactly the packages pyproject lists: none may be forgotten."""
    root = pathlib.Path(__file__).parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(root).parts) for init in (root / "jax_hybrid_attn").rglob("__init__.py")}
    assert found <= listed


def test_the_extras_named_in_errors_install_the_modules_they_are_checked_for():
    """`extras.require_extra` names an extra of pyproject.toml for each module it finds missing."""
    import re

    from jax_hybrid_attn.extras import EXTRA_MODULES

    root = pathlib.Path(__file__).parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    distributions = importlib.metadata.packages_distributions()
    for extra, modules in EXTRA_MODULES.items():
        normal = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731 - PEP 503's normal form
        listed = {normal(re.split(r"[\[<>=~!; ]", requirement)[0]) for requirement in extras[extra]}
        for module in modules:
            assert {normal(d) for d in distributions[module]} & listed, (extra, module)


def test_the_subpackages_are_attributes_of_the_package_once_used():
    code = ("import sys, jax_hybrid_attn; print('jax_hybrid_attn.models' in sys.modules, "
            "callable(jax_hybrid_attn.models.compare_with_transformers), 'jax_hybrid_attn.serve.server' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "False"]
