"""Tokenizers behind one small interface: ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``eos_token_ids``, ``bos_token_id``, ``vocab_size``, and ``source`` (what was read, for reports).

  * `HFTokenizer`: a ``tokenizers.Tokenizer``, read from a checkpoint's ``tokenizer.json``, or converted by
    transformers (the ``tokenizers`` extra) from the files a checkpoint ships instead: SentencePiece's
    ``tokenizer.model``, BPE's ``vocab.json`` + ``merges.txt``, a ``tokenizer_config.json`` naming a class.
    Its end-of-sequence ids come from ``generation_config.json``'s ``eos_token_id`` (an int or a list), else
    ``config.json``'s, else ``tokenizer_config.json``'s ``eos_token``;
  * `ByteTokenizer`: UTF-8 bytes as ids 0-255 and three specials (pad 256, bos 257, eos 258), no files: the
    embedded default model's tokenizer, and a checkpoint's that ships no tokenizer file at all (random-weight
    benchmark checkpoints).
  * `MissingTokenizer`: a checkpoint's tokenizer that cannot be read here (the extra is not installed):
    token-id prompts still run, text raises the error that says what to install.
"""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from ..extras import MissingExtraError, require_extra
from .hf_config import read_json_file

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "MissingTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "tokenizer_files",
]

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_FILE_NAMES = (
    "tokenizer.model",  # SentencePiece: Llama 2, Mistral, Gemma
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",  # byte-level BPE, with merges.txt: GPT-2, Qwen
    "merges.txt",
    "vocab.txt",  # WordPiece
    "tokenizer.tiktoken",
)
"""Files that hold a tokenizer other than ``tokenizer.json`` (transformers converts them)."""
SENTENCEPIECE_SUFFIX = ".model"
VOCABULARY_PROBE = "hello"
"""Text that any real vocabulary encodes to at least one token."""


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    source: str

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

    def __init__(self, *, eos_token_ids: tuple[int, ...] = (EOS,), source: str = "UTF-8 bytes"):
        """`eos_token_ids`: the ids that end a generation (a checkpoint's own, where the bytes stand in for
        its missing tokenizer: its vocabulary gives 258 another meaning); `source`: what reports call it."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.source = source

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


class MissingTokenizer:
    """A checkpoint's tokenizer that cannot be read here: its special ids are known (the configs), its text
    is not. Token-id prompts run; `encode` and `decode` raise `error`, which says what to install."""

    vocab_size = None
    bos_token_id = None

    def __init__(self, error: Exception, *, eos_token_ids: tuple[int, ...], source: str):
        self.error, self.eos_token_ids, self.source = error, tuple(eos_token_ids), source

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise self.error

    def decode(self, ids: Sequence[int]) -> str:
        raise self.error


def _read_json(path: Path) -> dict:
    """The JSON object of the file `path` ({} when there is none); anything else: `ValueError` naming it."""
    if not path.is_file():
        return {}
    value = read_json_file(path)
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, not {type(value).__name__}")
    return value


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


def _checkpoint_eos_ids(directory: Path) -> tuple[int, ...]:
    """The checkpoint's EOS ids: ``generation_config.json``'s, else ``config.json``'s (a wrapper's
    ``text_config`` last); none: ()."""
    for name in ("generation_config.json", "config.json"):
        value = _config_value(_read_json(directory / name), "eos_token_id")
        if value is not None:
            return _ids(value)
    return ()


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the checkpoint's special ids: the directory's ``tokenizer.json``, or
    `backend` (one transformers converted from the directory's other files) described by `source`."""

    def __init__(self, path: str | os.PathLike, *, backend=None, source: str = TOKENIZER_JSON):
        path = Path(path)
        if backend is None:
            from tokenizers import Tokenizer as _Tokenizer

            try:
                backend = _Tokenizer.from_file(str(path / TOKENIZER_JSON))
            except Exception as error:  # noqa: BLE001 - the Rust parser's own exception type
                raise ValueError(f"{str(path / TOKENIZER_JSON)!r} cannot be read: {error}") from None
        self._tokenizer = backend
        self.source = source
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


def tokenizer_files(path: str | os.PathLike) -> list[str]:
    """The files of the checkpoint directory `path` that hold a tokenizer (``tokenizer.json``, the files of
    `TOKENIZER_FILE_NAMES`, a ``tokenizer_config.json`` naming a tokenizer class), sorted."""
    directory = Path(path)
    names = [name for name in (TOKENIZER_JSON, *TOKENIZER_FILE_NAMES) if (directory / name).is_file()]
    names += [p.name for p in directory.glob("*.tiktoken") if p.name not in names]
    if _read_json(directory / "tokenizer_config.json").get("tokenizer_class"):
        names.append("tokenizer_config.json")
    return sorted(names)


def _converted(directory: Path, files: list[str]):
    """The ``tokenizers.Tokenizer`` transformers makes of the checkpoint's tokenizer `files` (no
    ``tokenizer.json``). `MissingExtraError` (saying what to install) without transformers, or without
    SentencePiece for a ``.model`` file; `ValueError` when transformers cannot read them."""
    sentencepiece = any(name.endswith(SENTENCEPIECE_SUFFIX) for name in files)
    purpose = f"the tokenizer of {str(directory)!r} ({', '.join(files)}; no {TOKENIZER_JSON})"
    modules = ("transformers", "sentencepiece") if sentencepiece else ("transformers",)
    require_extra("tokenizers", modules=modules, needed_for=purpose)
    from transformers import AutoTokenizer

    try:
        converted = AutoTokenizer.from_pretrained(str(directory))
    except Exception as error:
        raise ValueError(
            f"transformers cannot read the tokenizer of {str(directory)!r} ({', '.join(files)}): "
            f"{type(error).__name__}: {error}"
        ) from error
    backend = getattr(converted, "backend_tokenizer", None)
    if backend is None:
        raise NotImplementedError(
            f"transformers reads the tokenizer of {str(directory)!r} as {type(converted).__name__}, which "
            f"has no {TOKENIZER_JSON} form: save one with its save_pretrained() and load the checkpoint again"
        )
    if not backend.encode(VOCABULARY_PROBE, add_special_tokens=False).ids:  # transformers' empty stand-in
        raise ValueError(
            f"transformers read no vocabulary from the tokenizer of {str(directory)!r} ({', '.join(files)}): "
            "its vocabulary file is missing"
        )
    return backend


def load_tokenizer(path: str | os.PathLike | None = None) -> "HFTokenizer | ByteTokenizer | MissingTokenizer":
    """The tokenizer of the checkpoint directory `path`.

    - ``path=None`` (the embedded model): a `ByteTokenizer`;
    - a ``tokenizer.json``: an `HFTokenizer` of it;
    - other tokenizer files (`tokenizer_files`: SentencePiece, BPE vocabularies, a ``tokenizer_config.json``
      naming a class): an `HFTokenizer` of what transformers converts them to, transformers' token ids; a
      `MissingTokenizer` when transformers or SentencePiece is not installed (its error names the extra),
      never bytes;
    - no tokenizer file at all (random-weight checkpoints): a `ByteTokenizer` that stops on the checkpoint's
      own EOS ids (``generation_config.json``, else ``config.json``, a wrapper's ``text_config`` last; none:
      never), its `source` saying so.

    A directory that does not exist, or a tokenizer file that cannot be read, is a `ValueError`."""
    if path is None:
        return ByteTokenizer()
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"path={str(path)!r} is not a directory")
    files = tokenizer_files(directory)
    if TOKENIZER_JSON in files:
        return HFTokenizer(directory)
    if files:
        source = f"{', '.join(files)} through transformers"
        try:
            return HFTokenizer(directory, backend=_converted(directory, files), source=source)
        except MissingExtraError as error:
            return MissingTokenizer(error, eos_token_ids=_checkpoint_eos_ids(directory), source=source)
    source = "UTF-8 bytes (the checkpoint ships no tokenizer file)"
    return ByteTokenizer(eos_token_ids=_checkpoint_eos_ids(directory), source=source)
