"""A checkpoint's chat template: found (`load_chat_template`) and rendered (`ChatTemplate`) as transformers'
``apply_chat_template`` renders it.

transformers renders the Jinja template in a sandbox with ``trim_blocks`` and ``lstrip_blocks``, loop controls,
a ``tojson`` filter that keeps non-ASCII text, ``raise_exception(message)`` and ``strftime_now(format)``; its
variables are ``messages``, ``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...), plus any extra keyword the caller passes. The rendered text is then tokenized without
adding special tokens: the template writes them.
"""

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ChatTemplate", "ChatTemplateError", "load_chat_template"]

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
"""Where newer transformers versions save the template, beside ``tokenizer_config.json``."""
DEFAULT_TEMPLATE_NAME = "default"
"""The template used when ``chat_template`` is a list of named templates."""
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render it."""


class ChatTemplate:
    """A Jinja chat template with the tokenizer's special tokens.

    Args:
      source: the template's text.
      special_tokens: ``bos_token``, ``eos_token``, ... as strings (the template's variables of those names).
    """

    def __init__(self, source: str, *, special_tokens: dict[str, str] | None = None):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"chat template={source!r} must be a non-empty string")
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template does not parse: {error}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = True, variables: Mapping[str, Any] | None = None
    ) -> str:
        """The conversation as the prompt's text; `ChatTemplateError` when the template refuses it or fails on it.

        `variables`: more of the template's variables (they override the special tokens); ``messages`` and
        ``add_generation_prompt`` are the arguments of those names."""
        variables = variables or {}
        taken = sorted(set(variables) & {"messages", "add_generation_prompt"})
        if taken:
            raise ValueError(f"variables={taken} are arguments of render, not variables")
        own = {"messages": list(messages), "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render({**self.special_tokens, **variables, **own})
        except ChatTemplateError:
            raise
        except Exception as error:  # noqa: BLE001 - the template failed on the request's data, whatever the error
            message = f"{type(error).__name__}: {error}"
            raise ChatTemplateError(f"the chat template failed on these messages: {message}") from None


def load_chat_template(model_dir: str | os.PathLike | None, *, override: str | None = None) -> ChatTemplate | None:
    """The chat template of checkpoint `model_dir` (``tokenizer_config.json``'s ``chat_template``, else
    ``chat_template.jinja``), or `override`: a file holding a template, or the template's text. None when there
    is neither."""
    config = _read_json(Path(model_dir) / TOKENIZER_CONFIG) if model_dir is not None else {}
    special = {key: _token_text(config.get(key)) for key in SPECIAL_TOKEN_KEYS if config.get(key) is not None}
    if override is not None:
        return ChatTemplate(_template_text(override), special_tokens=special)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
        source = named.get(DEFAULT_TEMPLATE_NAME)
    if source is None and model_dir is not None and (Path(model_dir) / TEMPLATE_FILE).is_file():
        source = (Path(model_dir) / TEMPLATE_FILE).read_text(encoding="utf-8")
    return None if source is None else ChatTemplate(source, special_tokens=special)


def _template_text(override: str) -> str:
    path = Path(override)
    if "{" not in override and "\n" not in override:
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template={override!r} is neither a file nor a Jinja template")
        return path.read_text(encoding="utf-8")
    return override


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value) -> str:
    """A special token as saved: a string, or an added token's dict (its ``content``)."""
    return value.get("content", "") if isinstance(value, dict) else str(value)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused these messages: {message}")


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)
