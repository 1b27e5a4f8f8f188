"""The tokenizers (bytes; a tokenizer.json with the checkpoint's special ids) and the embedded model."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_hybrid_attn.models import (
    ByteTokenizer,
    Decoder,
    DenseAttention,
    HFTokenizer,
    embedded_config,
    load_tokenizer,
    random_model,
)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo, wörld")
    assert ids[0] == tok.BOS and max(ids[1:]) < 256
    assert tok.decode(ids + [tok.EOS, tok.PAD]) == "héllo, wörld"
    assert tok.encode("a", add_special_tokens=False) == [97]
    assert tok.eos_token_ids == (258,) and tok.vocab_size == 259
    with pytest.raises(ValueError, match="text=3"):
        tok.encode(3)


def _write_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "hello": 4, "world": 5, "<end>": 6}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<pad>", "<eos>", "<bos>", "<end>"])
    tokenizer.save(str(path / "tokenizer.json"))


def test_hf_tokenizer_and_eos_ids(tmp_path):
    _write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 2}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world there") == [4, 5, 3]
    assert tok.decode([2, 4, 5, 1]) == "hello world"
    assert tok.eos_token_ids == (1,) and tok.bos_token_id == 2 and tok.vocab_size == 7
    # generation_config.json wins over config.json, and may list several
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 6]}))
    assert load_tokenizer(tmp_path).eos_token_ids == (1, 6)


def test_hf_tokenizer_eos_from_tokenizer_config(tmp_path):
    _write_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<end>"}))
    assert load_tokenizer(tmp_path).eos_token_ids == (6,)


def test_load_tokenizer_fallbacks(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    with pytest.raises(ValueError, match="missing.*not a directory"):
        load_tokenizer(tmp_path / "missing")


def test_embedded_model_runs():
    config = embedded_config()
    assert config.architecture == "gemma3_text" and config.vocab_size == ByteTokenizer.vocab_size
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert config.layer_params(0).sliding_window == 32 and config.layer_params(5).sliding_window is None
    model = random_model(config, seed=0)
    tokens = jnp.asarray(ByteTokenizer().encode("hello there"), jnp.int32)
    logits, _ = nnx.jit(lambda m, t: m(t, DenseAttention(t.shape[0]), logits_indices=jnp.array([0, 5])))(
        model, tokens
    )
    assert logits.shape == (2, config.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    again = Decoder(config, rngs=nnx.Rngs(0))
    assert np.array_equal(again.model.embed_tokens.weight[...], model.model.embed_tokens.weight[...])


def test_bytes_stand_in_for_a_missing_tokenizer_with_the_checkpoints_own_eos(tmp_path):
    """Byte 258 means something else in the checkpoint's vocabulary: generation stops on its own EOS ids."""
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_tokenizer(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert load_tokenizer(tmp_path).eos_token_ids == (1, 106)
    (tmp_path / "bare").mkdir()
    assert load_tokenizer(tmp_path / "bare").eos_token_ids == ()  # neither file: no EOS


CORPUS = ["The capital of France is Paris.", "Sliding-window attention keeps only the recent keys.",
          "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"]  # fmt: skip
TEXTS = ["The capital of Spain is", "ünïcode and  spaces\tand\nlines", "def f(x): return x"]


@pytest.fixture(scope="module")
def sentencepiece_checkpoint(tmp_path_factory):
    """A directory with a SentencePiece ``tokenizer.model`` (Llama 2's form: no tokenizer.json) and its configs."""
    spm = pytest.importorskip("sentencepiece")
    directory = tmp_path_factory.mktemp("sentencepiece")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 30))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(directory / "tokenizer"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                   num_threads=1, minloglevel=2)  # fmt: skip
    for leftover in (corpus, directory / "tokenizer.vocab"):
        leftover.unlink()
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return directory


def test_a_sentencepiece_checkpoint_gives_transformers_token_ids(sentencepiece_checkpoint):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(sentencepiece_checkpoint))
    tok = load_tokenizer(sentencepiece_checkpoint)
    assert isinstance(tok, HFTokenizer)
    assert tok.source == "tokenizer.model, tokenizer_config.json through transformers"
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text) and ids[0] == 1
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    native = pytest.importorskip("sentencepiece").SentencePieceProcessor(
        model_file=str(sentencepiece_checkpoint / "tokenizer.model"))
    assert tok.encode(CORPUS[0]) == [1, *native.encode(CORPUS[0])]  # SentencePiece's own pieces, not bytes
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1


def test_a_byte_level_bpe_checkpoint_gives_transformers_token_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.model.save(str(tmp_path))  # vocab.json and merges.txt, as GPT-2 and Qwen ship them
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    assert tok.source == "merges.txt, tokenizer_config.json, vocab.json through transformers"
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text)
        assert tok.decode(tok.encode(text)) == reference.decode(reference.encode(text), skip_special_tokens=True)
    assert tok.eos_token_ids == (reference.convert_tokens_to_ids("<|endoftext|>"),)


def test_without_the_tokenizers_extra_text_is_refused_with_what_to_install(sentencepiece_checkpoint, monkeypatch):
    import importlib.util

    from jax_hybrid_attn.extras import MissingExtraError
    from jax_hybrid_attn.models import MissingTokenizer

    find_spec = importlib.util.find_spec
    hidden = lambda name, *args: None if name == "sentencepiece" else find_spec(name, *args)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    tok = load_tokenizer(sentencepiece_checkpoint)
    assert isinstance(tok, MissingTokenizer) and tok.eos_token_ids == (2,)  # token-id prompts still stop on EOS
    with pytest.raises(MissingExtraError, match=r"the tokenizer of .*\(tokenizer.model, tokenizer_config.json; no tokenizer.json\) needs the tokenizers extra \(sentencepiece not "
                       r"installed\): pip install 'jax-hybrid-attn\[tokenizers\]'"):  # fmt: skip
        tok.encode("hello")


def test_a_checkpoint_that_names_a_tokenizer_never_falls_back_to_bytes(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(ValueError, match=r"transformers read no vocabulary from the tokenizer of .*\(tokenizer_config"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json' is not valid JSON"):
        load_tokenizer(tmp_path)


def test_bytes_stand_in_only_where_the_checkpoint_ships_no_tokenizer_file_and_say_so(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer) and tok.source == "UTF-8 bytes (the checkpoint ships no tokenizer file)"
    assert load_tokenizer(None).source == "UTF-8 bytes"
