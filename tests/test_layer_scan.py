"""The scanned layout of a decoder's layers (`layer_scan`): a scan's body slices each period's vectors and scalars
as one array per dtype (`VectorPack`), and computes what it computed slicing them one by one. How many kernels
that saves on a GPU: `benchmarks/kernel_census.py`."""

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybrid_attn.models import DenseAttention, ModelConfig
from jax_hybrid_attn.models.layer_scan import PACKED_MAX_SIZE, ScannedDecoder, VectorPack

from .hf_families import FAMILIES  # skips the module without transformers and torch
from .test_engine import perturbed_decoder

NUM_TOKENS = 19


def _repeated_family_model(family: str, repeats: int = 2):
    """`family`'s tiny model of `hf_families` with its layers `repeats` times over (a scan of `repeats`), every
    parameter perturbed, float32."""
    hf = FAMILIES[family][0]()
    hf.num_hidden_layers *= repeats
    if getattr(hf, "layer_types", None):
        hf.layer_types = list(hf.layer_types) * repeats
    config = ModelConfig.from_hf(hf.to_dict())
    return config, perturbed_decoder(config, seed=0)


def test_a_vector_pack_gives_back_every_leaf_of_each_dtype():
    """Matrices stay apart; vectors, scalars and small matrices of two dtypes go into one [repeats, n] array each,
    in order, and one repeat's row unpacks to that repeat's leaves."""
    rng = np.random.default_rng(0)
    weights = ({"norm": jnp.asarray(rng.normal(size=(3, 5)), jnp.bfloat16),
                "proj": jnp.asarray(rng.normal(size=(3, 300, 256)), jnp.float32),
                "per_head": jnp.asarray(rng.normal(size=(3, 2, 4)), jnp.float32)},
               {"scale": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
                "bias": jnp.asarray(rng.normal(size=(3, 7)), jnp.float32),
                "sinks": jnp.asarray(rng.normal(size=(3, 2)), jnp.bfloat16)})  # fmt: skip
    pack = VectorPack.of(weights)
    matrices, vectors = pack.pack(weights)
    assert [m.shape for m in matrices] == [(3, 300, 256)]  # more than PACKED_MAX_SIZE elements a layer
    assert sorted((v.shape, v.dtype.name) for v in vectors) == [((3, 7), "bfloat16"), ((3, 16), "float32")]
    for repeat in range(3):
        got = pack.unpack([m[repeat] for m in matrices], [v[repeat] for v in vectors])
        want = jax.tree.map(lambda leaf: leaf[repeat], weights)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)


def test_packed_vectors_give_the_same_logits():
    """gpt-oss (biases, sinks, float8-cache scales, its norms) and Gemma 3 (q/k norms, four norms a layer), their
    layers a scan of two repeats: the same logits bit for bit with the vectors packed or sliced one by one."""
    for family in ("gpt_oss", "gemma3_text"):
        config, model = _repeated_family_model(family)
        scanned = ScannedDecoder.from_decoder(model, fuse_projections=True)
        assert [run.repeats for run in scanned.runs] == [2], scanned.runs
        assert sum(leaf[0].size <= PACKED_MAX_SIZE for leaf in jax.tree.leaves(scanned.layer_weights)) >= 8
        tokens = jnp.asarray(np.random.default_rng(1).integers(3, config.vocab_size, NUM_TOKENS), jnp.int32)
        forward = jax.jit(lambda s, t, pack: s(t, DenseAttention(NUM_TOKENS), pack_vectors=pack)[0],
                          static_argnums=2)  # fmt: skip
        packed, apart = (np.asarray(forward(scanned, tokens, pack)) for pack in (True, False))
        assert float(np.abs(apart).max()) > 0.1
        np.testing.assert_array_equal(packed, apart)
