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
