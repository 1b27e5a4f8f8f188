"""The package's optional parts (``pyproject.toml``'s extras) and a check that names the one missing.

The core needs none of them; ``jha serve`` needs ``serve``, ``jha compare`` and ``interop/`` need ``torch``,
and a checkpoint that ships its tokenizer as SentencePiece or BPE files rather than ``tokenizer.json`` needs
``tokenizers``. A missing one is a `MissingExtraError` that says what to install, raised before any weight is
read.
"""

import importlib.util

__all__ = ["EXTRA_MODULES", "MissingExtraError", "install_command", "require_extra"]

EXTRA_MODULES = {
    "serve": ("fastapi", "uvicorn", "jinja2", "prometheus_client"),
    "torch": ("torch", "transformers"),
    "tokenizers": ("transformers", "sentencepiece"),
}
"""The modules each extra brings that the package imports (a test checks them against ``pyproject.toml``)."""


class MissingExtraError(ImportError):
    """An optional part of the package is not installed; the message says which extra installs it."""


def install_command(extra: str) -> str:
    """The command that installs `extra`, for a release and for a checkout."""
    return f"pip install 'jax-hybrid-attn[{extra}]' (in a checkout: pip install -e '.[{extra}]')"


def require_extra(extra: str, *, needed_for: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise `MissingExtraError` when any of `modules` (default: all of `extra`'s) is not importable; the
    message says that `needed_for` needs them and how to install `extra`. Nothing is imported."""
    if extra not in EXTRA_MODULES:
        raise ValueError(f"extra={extra!r} is not one of {tuple(EXTRA_MODULES)}")
    missing = [name for name in modules or EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]
    if missing:
        names = ", ".join(missing)
        raise MissingExtraError(
            f"{needed_for} needs the {extra} extra ({names} not installed): {install_command(extra)}"
        )
