"""The torch-only reference (`tests/torch_reference.py`) against the JAX reference and torch's own SDPA.

Shape letters: T tokens · R requests · N query heads · K kv heads · H head_dim · B blocks · S block size.
"""

import ast
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from jax_hybrid_attn import LayerAttentionParams, reference
from jax_hybrid_attn.kv_cache import write_kv
from jax_hybrid_attn.testing import TOLERANCES, random_paged_inputs

from .torch_reference import paged_attention_torch, write_kv_torch

TORCH_DTYPES = {
    jnp.dtype(jnp.float32): torch.float32,
    jnp.dtype(jnp.float16): torch.float16,
    jnp.dtype(jnp.bfloat16): torch.bfloat16,
    jnp.dtype(jnp.float8_e4m3fn): torch.float8_e4m3fn,
}
HEAD_DIM = 16


def to_torch(x) -> torch.Tensor:
    """A jax or numpy array as a torch tensor of its dtype (bf16 and fp8 travel exactly through float32)."""
    a = np.array(x)  # a writable copy
    if a.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn)):
        return torch.from_numpy(a.astype(np.float32)).to(TORCH_DTYPES[a.dtype])
    return torch.from_numpy(a)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype in (torch.bfloat16, torch.float8_e4m3fn) else t).numpy()


def case(name, **options):
    defaults = dict(
        heads=(4, 2), kv_layout="NHD", mask={}, logits_soft_cap=None, with_sinks=False, causal=True,
        dtype=jnp.float32, kv_dtype=None, block_size=8, sm_scale=None, padding=0,
        # Straddling block (8) and chunk (8, 16) boundaries: decodes, a whole prefill, suffix prefills.
        seq_lens=[1, 8, 9, 23, 40], query_lens=[1, 8, 3, 1, 17],
    )  # fmt: skip
    return pytest.param(dict(defaults, **options), id=name)


CASES = [
    case("full-mha", heads=(4, 4)),
    case("full-gqa-hnd-bf16", heads=(4, 1), kv_layout="HND", dtype=jnp.bfloat16, padding=3),
    case("window1", mask=dict(sliding_window=1)),
    case("window5-hnd", mask=dict(sliding_window=5), kv_layout="HND", heads=(6, 2)),
    case("window37-bf16", mask=dict(sliding_window=37), dtype=jnp.bfloat16),
    case("chunk8", mask=dict(attention_chunk_size=8), heads=(4, 4), padding=2),
    case("chunk16-hnd-block4", mask=dict(attention_chunk_size=16), kv_layout="HND", block_size=4),
    case("window5-chunk16", mask=dict(sliding_window=5, attention_chunk_size=16), heads=(4, 1)),
    case("softcap", logits_soft_cap=1.5, sm_scale=0.4),
    case("sinks", with_sinks=True, heads=(6, 2)),
    case(
        "sinks-window5-softcap-bf16",
        with_sinks=True,
        mask=dict(sliding_window=5),
        logits_soft_cap=2.0,
        dtype=jnp.bfloat16,
    ),
    case("noncausal-full", causal=False, heads=(4, 4)),
    case("noncausal-window5", causal=False, mask=dict(sliding_window=5)),
    case("noncausal-chunk8-hnd", causal=False, mask=dict(attention_chunk_size=8), kv_layout="HND", padding=3),
    case("noncausal-sinks-softcap", causal=False, with_sinks=True, logits_soft_cap=1.5),
    case("fp8-bf16-window5", kv_dtype=jnp.float8_e4m3fn, dtype=jnp.bfloat16, mask=dict(sliding_window=5)),
    case(
        "fp8-f32-hnd-chunk16", kv_dtype=jnp.float8_e4m3fn, kv_layout="HND", mask=dict(attention_chunk_size=16)
    ),
    case("fp8-noncausal-sinks", kv_dtype=jnp.float8_e4m3fn, causal=False, with_sinks=True, heads=(4, 1)),
]


def padded(inputs, padding):
    """q and slot mapping with `padding` extra tokens past ``query_start_loc[-1]``."""
    if not padding:
        return inputs.q, inputs.metadata
    q = jnp.concatenate([inputs.q, jnp.ones((padding, *inputs.q.shape[1:]), inputs.q.dtype)])
    slots = jnp.concatenate([inputs.metadata.slot_mapping, jnp.full(padding, -1, jnp.int32)])
    return q, inputs.metadata.replace(slot_mapping=slots)


@pytest.mark.parametrize("c", CASES)
def test_matches_jax_reference(c):
    num_q_heads, num_kv_heads = c["heads"]
    inputs = random_paged_inputs(
        0, query_lens=c["query_lens"], seq_lens=c["seq_lens"], num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, block_size=c["block_size"], dtype=c["dtype"],
        kv_dtype=c["kv_dtype"],
        kv_layout=c["kv_layout"], with_sinks=c["with_sinks"], causal=c["causal"],
        # Blocks no query can see (left of the window or chunk) become the NaN-filled null block.
        null_unreachable_for=c["mask"] or None,
    )  # fmt: skip
    q, metadata = padded(inputs, c["padding"])
    options = dict(
        c["mask"], sm_scale=c["sm_scale"], logits_soft_cap=c["logits_soft_cap"], causal=c["causal"],
        kv_layout=c["kv_layout"], k_scale=inputs.kv_cache.k_scale, v_scale=inputs.kv_cache.v_scale,
    )  # fmt: skip
    params = LayerAttentionParams(
        **c["mask"], sm_scale=c["sm_scale"], logits_soft_cap=c["logits_soft_cap"], causal=c["causal"]
    )
    expected = reference.paged_attention(
        q, inputs.kv_cache, metadata, params=params, sinks=inputs.sinks, checked=True
    )

    out = paged_attention_torch(
        to_torch(q), to_torch(inputs.kv_cache.data), to_torch(metadata.query_start_loc),
        to_torch(metadata.seq_lens), to_torch(metadata.block_tables),
        sinks=None if inputs.sinks is None else to_torch(inputs.sinks), **options,
    )  # fmt: skip

    assert out.dtype == TORCH_DTYPES[jnp.dtype(c["dtype"])] and out.shape == q.shape
    out = to_numpy(out)
    assert np.isfinite(out).all(), "NaN from unused or null blocks leaked"
    num_actual = int(metadata.query_start_loc[-1])
    assert not out[num_actual:].any(), "padding tokens must give zeros"
    np.testing.assert_allclose(
        out, np.asarray(expected.astype(jnp.float32)), **TOLERANCES[jnp.dtype(c["dtype"])]
    )


@pytest.mark.parametrize(
    "kv_layout, kv_dtype", [("NHD", jnp.bfloat16), ("HND", jnp.float32), ("NHD", jnp.float8_e4m3fn),
                            ("HND", jnp.float8_e4m3fn)],
)  # fmt: skip
def test_write_kv_matches_jax(kv_layout, kv_dtype):
    dtype = jnp.bfloat16 if kv_dtype == jnp.float8_e4m3fn else kv_dtype
    inputs = random_paged_inputs(1, query_lens=[3, 5], seq_lens=[10, 20], num_q_heads=4, num_kv_heads=2,
                                 head_dim=HEAD_DIM, block_size=8, dtype=dtype, kv_dtype=kv_dtype,
                                 kv_layout=kv_layout)  # fmt: skip
    rng = np.random.default_rng(2)
    num_blocks, block_size = inputs.kv_cache.dims[0], 8
    k_scale, v_scale = inputs.kv_cache.k_scale, inputs.kv_cache.v_scale
    slots = rng.choice(num_blocks * block_size, 12, replace=False).astype(np.int32)
    slots[[2, 7]] = -1  # padding tokens
    scale = 1.0 if k_scale is None else 8 * k_scale
    kv = rng.standard_normal((2, 12, 2, HEAD_DIM)) * scale
    kv[:, 0, 0, :3] = [1e5, -1e5, 0.5]  # beyond ±448 scales: saturates in fp8
    k, v = jnp.asarray(kv[0], dtype), jnp.asarray(kv[1], dtype)

    torch_cache = to_torch(inputs.kv_cache.data)
    write_kv_torch(torch_cache, to_torch(k), to_torch(v), torch.from_numpy(slots), kv_layout=kv_layout,
                   k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    cache = inputs.kv_cache.replace(data=jnp.array(inputs.kv_cache.data))
    expected = write_kv(cache, k, v, jnp.asarray(slots)).data
    # Bit-exact, NaN of untouched slots included.
    np.testing.assert_array_equal(to_numpy(torch_cache), np.asarray(expected.astype(jnp.float32)))


@pytest.mark.parametrize("query_len, sliding_window", [(37, None), (5, None), (5, 9)])
def test_matches_torch_sdpa_on_a_dense_request(query_len, sliding_window):
    """One request in blocks 0, 1, 2, ... in order, filled by `write_kv_torch`; the tail slots stay NaN."""
    seq_len, num_q_heads, num_kv_heads, block_size = 37, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(query_len, num_q_heads, HEAD_DIM, generator=gen)
    k, v = torch.randn(2, seq_len, num_kv_heads, HEAD_DIM, generator=gen)
    num_blocks = -(-seq_len // block_size)
    cache = torch.full((num_blocks, 2, block_size, num_kv_heads, HEAD_DIM), float("nan"))
    write_kv_torch(cache, k, v, torch.arange(seq_len, dtype=torch.int32))

    out = paged_attention_torch(q, cache, torch.tensor([0, query_len]), torch.tensor([seq_len]),
                                torch.arange(num_blocks)[None], sliding_window=sliding_window)  # fmt: skip

    heads_first = dict(enable_gqa=True)
    if query_len == seq_len and sliding_window is None:
        heads_first["is_causal"] = True  # top-left aligned, which is right for a whole prefill
    else:  # the queries are the last query_len positions: bottom-right aligned mask
        q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= q_pos - k_pos < sliding_window
        heads_first["attn_mask"] = mask
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), **heads_first
    )
    np.testing.assert_allclose(
        out.numpy(), expected.transpose(0, 1).numpy(), **TOLERANCES[jnp.dtype(jnp.float32)]
    )


def test_reference_imports_no_jax():
    """The torch reference is the independent check of the JAX library: it must not import it."""
    tree = ast.parse((pathlib.Path(__file__).parent / "torch_reference.py").read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert imported and not [m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "jax_hybrid_attn")]
