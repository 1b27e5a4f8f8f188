"""Tokenizers behind one small interface: ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``eos_token_ids``, ``bos_token_id``, ``vocab_size``.

  * `HFTokenizer`: a checkpoint's ``tokenizer.json`` through the ``tokenizers`` package; its end-of-sequence
    ids come from ``generation_config.json``'s ``eos_token_id`` (an int or a list), else ``config.json``'s,
    else ``tokenizer_config.json``'s ``eos_token``;
  * `ByteTokenizer`: UTF-8 bytes as ids 0-255 and three specials (pad 256, bos 257, eos 258), no files: the
    embedded default model's tokenizer.
"""

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, then pad, bos and eos; `encode` starts with bos."""

    PAD = 256
    BOS = 257
    EOS = 258
    vocab_size = 259
    pad_token_id = PAD
    bos_token_id = BOS

    def __init__(self, *, eos_token_ids: tuple[int, ...] = (EOS,)):
        """`eos_token_ids`: the ids that end a generation (a checkpoint's own, where the bytes stand in for its
        missing tokenizer: its vocabulary gives 258 another meaning)."""
        self.eos_token_ids = tuple(eos_token_ids)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text={text!r} must be a str")
        return ([self.BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """The bytes of `ids` as UTF-8 (invalid sequences replaced); special ids are dropped."""
        try:  # every id a byte, the common case, without a Python loop (an array would give its raw buffer)
            data = bytes(ids) if isinstance(ids, list | tuple) else None
        except (ValueError, TypeError):
            data = None
        if data is None:
            data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def _config_value(config: dict, key: str):
    """`config[key]`, else (a multimodal wrapper's ``config.json``) its ``text_config``'s, else None."""
    if config.get(key) is not None:
        return config[key]
    text_config = config.get("text_config")
    return text_config.get(key) if isinstance(text_config, dict) else None


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


class HFTokenizer:
    """A ``tokenizer.json`` (the ``tokenizers`` package), with the checkpoint's special ids."""

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        self._tokenizer = _Tokenizer.from_file(str(path / "tokenizer.json"))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        generation = _read_json(path / "generation_config.json")
        config = _read_json(path / "config.json")
        tokenizer_config = _read_json(path / "tokenizer_config.json")

        def special(key: str) -> tuple[int, ...]:
            for value in (generation.get(key), _config_value(config, key)):
                if value is not None:
                    return _ids(value)
            token = tokenizer_config.get(key.replace("_id", ""))
            if isinstance(token, dict):
                token = token.get("content")
            token_id = None if token is None else self._tokenizer.token_to_id(token)
            return () if token_id is None else (token_id,)

        self.eos_token_ids = special("eos_token_id")
        bos = special("bos_token_id")
        self.bos_token_id = bos[0] if bos else None
        pad = special("pad_token_id")
        self.pad_token_id = pad[0] if pad else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text={text!r} must be a str")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens skipped."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(path: str | os.PathLike | None = None) -> "HFTokenizer | ByteTokenizer":
    """The tokenizer of the checkpoint directory `path`: its ``tokenizer.json`` when present, else (and for
    ``path=None``, the embedded model) a `ByteTokenizer`, which for a checkpoint stops on the checkpoint's own EOS
    ids (``generation_config.json``, else ``config.json``, a wrapper's ``text_config`` last; none: never). A
    directory that does not exist is a `ValueError`."""
    if path is None:
        return ByteTokenizer()
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"path={str(path)!r} is not a directory")
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer(directory)
    for name in ("generation_config.json", "config.json"):
        value = _config_value(_read_json(directory / name), "eos_token_id")
        if value is not None:
            return ByteTokenizer(eos_token_ids=_ids(value))
    return ByteTokenizer(eos_token_ids=())
