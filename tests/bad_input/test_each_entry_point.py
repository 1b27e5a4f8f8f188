"""Every public entry point rejects malformed arguments with an error that names the offending argument.

Each case mutates one field of a small valid call; `test_valid_calls_succeed` shows the unmutated calls pass.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_hybrid_attn
from jax_hybrid_attn import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCache,
    LayerAttentionParams,
    SlidingWindowSpec,
    check_metadata_values,
    expand_block_tables,
    get_kv_cache_shape,
    local_window_size,
    make_attention_metadata,
    make_local_attention_virtual_batches,
    masks,
    metadata_from_lengths,
    metadata_group_key,
    reorder_decodes_first,
    split_decodes_and_prefills,
    window_left,
    write_kv,
)
from jax_hybrid_attn.cascade import cascade_pays, split_violations
from jax_hybrid_attn.masks import allowed_key_range, attention_mask
from jax_hybrid_attn.params import resolve_sm_scale
from jax_hybrid_attn.reference import paged_attention
from jax_hybrid_attn.testing import random_paged_inputs

QUERY_LENS, SEQ_LENS, BLOCK_SIZE = [3, 1, 4], [5, 6, 9], 4
VALID = random_paged_inputs(
    0, query_lens=QUERY_LENS, seq_lens=SEQ_LENS, num_q_heads=4, num_kv_heads=2, head_dim=8,
    block_size=BLOCK_SIZE, dtype=jnp.float32,
)  # fmt: skip
Q, KV, MD = VALID.q, VALID.kv_cache.data, VALID.metadata  # an "NHD" cache's array alone
T, N, H = Q.shape
NUM_BLOCKS, NUM_COLS = KV.shape[0], MD.block_tables.shape[1]
TABLE = np.asarray(MD.block_tables)
NEW_KV = jnp.asarray(np.random.default_rng(1).standard_normal((T, 2, H)), jnp.float32)
FP8 = jnp.float8_e4m3fn
SPEC = dict(block_size=4, num_kv_heads=2, head_size=8, dtype=jnp.bfloat16)


POSITIONS = jnp.arange(4)
PARAMS_W = LayerAttentionParams(sliding_window=2)


def mask(**options):
    return attention_mask(POSITIONS, POSITIONS[:, None], 4, **options)


def key_range(**options):
    return allowed_key_range(POSITIONS, 4, **options)


def split(**changes):
    return split_decodes_and_prefills(MD.replace(**changes))


def reorder(**changes):
    return reorder_decodes_first(MD.replace(**changes))


def virtual(**changes):
    return make_local_attention_virtual_batches(8, MD.replace(**changes), 4)


def attention(q=Q, kv_cache=KV, metadata=MD, **kwargs):
    return paged_attention(q, kv_cache, metadata, **kwargs)


def with_params(**options):
    """paged_attention on the valid inputs for a layer of these options (checked when the params are built)."""
    return attention(params=LayerAttentionParams(**options))


def checked(**changes):
    """paged_attention(checked=True) on the valid inputs with some metadata fields replaced."""
    return attention(metadata=MD.replace(**changes), checked=True)


def edited(field, index, value):
    """A copy of the valid metadata's `field` (int32) with one entry set."""
    array = np.array(getattr(MD, field))
    array[index] = value
    return jnp.asarray(array)


def write(kv_cache=None, k=NEW_KV, v=NEW_KV, slot_mapping=MD.slot_mapping, **kwargs):
    kv_cache = jnp.array(KV) if kv_cache is None else kv_cache  # a fresh copy: write_kv donates it
    return write_kv(kv_cache, k, v, slot_mapping, **kwargs)


def build(query_lens=QUERY_LENS, seq_lens=SEQ_LENS, block_tables=TABLE, block_size=BLOCK_SIZE, **kwargs):
    return make_attention_metadata(query_lens, seq_lens, block_tables, block_size=block_size, **kwargs)


LENGTHS = dict(
    query_lens=jnp.asarray(QUERY_LENS, jnp.int32),
    seq_lens=jnp.asarray(SEQ_LENS, jnp.int32),
    block_tables=jnp.asarray(TABLE),
    block_size=BLOCK_SIZE,
    num_tokens=T,
    max_query_len=4,
    max_seq_len=9,
)
BAD_SIZES = {"0": 0, "negative": -1, "float": 2.5, "str": "4", "huge": 2**40, "none": None, "bool": True}


def from_lengths(**changes):
    return metadata_from_lengths(**{**LENGTHS, **changes})


def check_values(**changes):
    return check_metadata_values(MD, **{"num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, **changes})


def blocks_per_request(**changes):
    spec = SlidingWindowSpec(sliding_window=5, **SPEC)
    return spec.max_num_blocks_per_request(**{"max_model_len": 64, "max_num_batched_tokens": 8, **changes})


def expand(block_tables, *, allocator_block_size=8, kernel_block_size=4):
    return expand_block_tables(
        block_tables, allocator_block_size=allocator_block_size, kernel_block_size=kernel_block_size
    )


def int64_metadata(field):
    return lambda: attention(metadata=MD.replace(**{field: np.asarray(getattr(MD, field), np.int64)}))


def top(**options):
    return jax_hybrid_attn.paged_attention(Q, KV, MD, **options)


def cascade(num_common_prefix_blocks, **options):
    return jax_hybrid_attn.cascade_attention(
        Q, KV, MD, num_common_prefix_blocks=num_common_prefix_blocks, implementation="reference", **options
    )


PAYS = dict(num_reqs=4, num_query_tokens=4, prefix_len=1024, num_q_heads=8, num_kv_heads=2, head_dim=128)
PAYS["kv_itemsize"] = 2


def traced_checked_call():
    return jax.jit(lambda q, metadata: paged_attention(q, KV, metadata, checked=True))(Q, MD)


VALID_CALLS = {
    "paged_attention": lambda: attention(),
    "paged_attention-checked": lambda: attention(checked=True),
    "paged_attention-params": lambda: with_params(sliding_window=4, logits_soft_cap=30.0, sm_scale=0.5),
    "paged_attention-fp8": lambda: attention(kv_cache=KVCache(KV.astype(FP8), k_scale=0.5, v_scale=2.0)),
    "paged_attention-hnd": lambda: attention(kv_cache=KVCache(jnp.swapaxes(KV, 2, 3), "HND")),
    "paged_attention-kv-pair": lambda: attention(kv_cache=(KV[:, 0], KV[:, 1])),
    "paged_attention-traced-sinks": lambda: jax.jit(lambda s: attention(sinks=s))(jnp.zeros(N, jnp.float32)),
    "cascade_attention": lambda: (cascade(0), cascade(np.int64(0)), jax.jit(cascade)(jnp.int32(0))),
    "cascade_pays": lambda: cascade_pays(**{**PAYS, "num_reqs": np.int64(4)}) in (True, False),
    "write_kv-kv-pair": lambda: write(kv_cache=(jnp.array(KV[:, 0]), jnp.array(KV[:, 1]))),
    "write_kv": lambda: write(checked=True),
    "make_attention_metadata": lambda: build(num_tokens=T + 2),
    "metadata_from_lengths": lambda: from_lengths(block_size=np.int64(BLOCK_SIZE), causal=np.bool_(True)),
    "check_metadata_values": lambda: check_values(num_blocks=np.int64(NUM_BLOCKS), params=PARAMS_W),
    "numpy-scalar-num-actual-tokens": lambda: checked(num_actual_tokens=np.int32(T)),
    "specs": lambda: (FullAttentionSpec(**SPEC), SlidingWindowSpec(sliding_window=5, **SPEC),
                      ChunkedLocalAttentionSpec(attention_chunk_size=8, **SPEC)),  # fmt: skip
    "params": lambda: metadata_group_key(LayerAttentionParams(sliding_window=4, logits_soft_cap=30.0)),
    "helpers": lambda: (make_local_attention_virtual_batches(8, MD, 4), split_decodes_and_prefills(MD),
                        expand_block_tables(MD.block_tables, allocator_block_size=4, kernel_block_size=2)),  # fmt: skip
}


@pytest.mark.parametrize("call", VALID_CALLS.values(), ids=VALID_CALLS.keys())
def test_valid_calls_succeed(call):
    jax.block_until_ready(call())


def test_valid_attention_output_is_finite():
    out = attention(checked=True)
    assert out.shape == Q.shape and np.all(np.isfinite(out))


E, NI = ValueError, NotImplementedError
CASES = [
    # paged_attention: q
    ("q-rank", lambda: attention(q=Q[..., None]), E, r"q\.shape"),
    ("q-int32", lambda: attention(q=Q.astype(jnp.int32)), E, r"q\.dtype"),
    ("q-float64", lambda: attention(q=np.asarray(Q, np.float64)), E, r"q\.dtype"),
    ("q-head-dim", lambda: attention(q=Q[..., : H // 2]), E, "head_dim"),
    ("q-heads-not-multiple-of-kv-heads", lambda: attention(q=Q[:, :3]), E, "num_q_heads"),
    # paged_attention: kv_cache
    ("kv-rank", lambda: attention(kv_cache=KV[0]), E, r"kv_cache\.shape"),
    ("kv-axis1-3", lambda: attention(kv_cache=jnp.concatenate([KV, KV[:, :1]], axis=1)), E, r"kv_cache\.shape"),
    ("kv-int8", lambda: attention(kv_cache=KV.astype(jnp.int8)), E, r"kv_cache\.dtype"),
    ("kv-dtype-differs-from-q", lambda: attention(kv_cache=KV.astype(jnp.bfloat16)), E, r"kv_cache\.dtype"),
    ("kv-pair-of-three", lambda: attention(kv_cache=(KV[:, 0], KV[:, 1], KV[:, 1])), E, r"\(k_cache, v_cache\)"),
    ("kv-pair-shapes-differ", lambda: attention(kv_cache=(KV[:, 0], KV[:-1, 1])), E, "one shape and dtype"),
    ("kv-pair-dtypes-differ", lambda: attention(kv_cache=(KV[:, 0], KV[:, 1].astype(jnp.bfloat16))), E, "one shape and dtype"),
    ("kv-pair-rank", lambda: attention(kv_cache=(KV, KV)), E, r"kv_cache\[0\]\.shape"),
    ("kv-pair-int8", lambda: attention(kv_cache=(KV[:, 0].astype(jnp.int8), KV[:, 1].astype(jnp.int8))), E, r"kv_cache\.dtype"),
    ("kv-layout-lowercase", lambda: attention(kv_cache=KVCache(KV, "nhd")), E, r"kv_cache\.layout='nhd'"),
    # paged_attention: options
    ("sliding-window-0", lambda: with_params(sliding_window=0), E, "sliding_window"),
    ("sliding-window-negative", lambda: with_params(sliding_window=-1), E, "sliding_window"),
    ("sliding-window-float", lambda: with_params(sliding_window=2.5), E, "sliding_window"),
    ("sliding-window-bool", lambda: with_params(sliding_window=True), E, "sliding_window"),
    ("chunk-0", lambda: with_params(attention_chunk_size=0), E, "attention_chunk_size"),
    ("soft-cap-0", lambda: with_params(logits_soft_cap=0.0), E, "logits_soft_cap"),
    ("soft-cap-negative", lambda: with_params(logits_soft_cap=-1.0), E, "logits_soft_cap"),
    ("soft-cap-inf", lambda: with_params(logits_soft_cap=float("inf")), E, "logits_soft_cap"),
    ("sm-scale-0", lambda: with_params(sm_scale=0.0), E, "sm_scale"),
    ("sm-scale-nan", lambda: with_params(sm_scale=float("nan")), E, "sm_scale"),
    ("causal-int", lambda: with_params(causal=1), E, "causal"),
    ("causal-disagrees-with-metadata", lambda: with_params(causal=False), E, r"params\.causal.*metadata\.causal"),
    ("noncausal-metadata-with-default-params", lambda: attention(metadata=MD.replace(causal=False)),
     E, r"params\.causal=True disagrees with metadata\.causal=False"),  # fmt: skip
    ("params-not-params", lambda: attention(params="x"), E, "params="),
    ("params-dict", lambda: attention(params=dict(sliding_window=4)), E, "params="),
    ("top-level-params-not-params", lambda: jax_hybrid_attn.paged_attention(Q, KV, MD, params="x"), E, "params="),
    ("top-level-kernel-params-not-params",
     lambda: jax_hybrid_attn.paged_attention(Q, KV, MD, params="x", implementation="kernel"), E, "params="),  # fmt: skip
    ("sinks-shape", lambda: attention(sinks=jnp.ones(N + 1, jnp.float32)), E, "sinks"),
    ("sinks-rank", lambda: attention(sinks=jnp.ones((N, 1), jnp.float32)), E, "sinks"),
    ("sinks-int", lambda: attention(sinks=jnp.ones(N, jnp.int32)), E, "sinks"),
    *[(f"sinks-{label}-unchecked", lambda x=x: attention(sinks=jnp.full(N, x)), E, r"\] must be finite")
      for label, x in (("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf))],
    ("interpret-with-reference", lambda: top(implementation="reference", interpret=True), E, "True runs"),
    ("interpret-str", lambda: top(implementation="reference", interpret="x"), E, "interpret='x'"),
    ("metadata-kernel-plan-str", lambda: attention(metadata=MD.replace(kernel_plan="x")), E, "kernel_plan"),
    ("k-scale-for-float-cache", lambda: attention(kv_cache=KVCache(KV, k_scale=0.5)), E, r"kv_cache\.k_scale"),
    ("v-scale-for-float-cache", lambda: attention(kv_cache=KVCache(KV, v_scale=0.5)), E, r"kv_cache\.v_scale"),
    ("fp8-k-scale-0", lambda: attention(kv_cache=KVCache(KV.astype(FP8), k_scale=0.0)), E, r"kv_cache\.k_scale"),
    ("fp8-v-scale-negative", lambda: attention(kv_cache=KVCache(KV.astype(FP8), v_scale=-1.0)), E, "v_scale"),
    ("fp8-k-scale-vector", lambda: attention(kv_cache=KVCache(KV.astype(FP8), k_scale=jnp.ones(2))), E, "k_scale"),
    ("kv-cache-data-not-an-array", lambda: attention(kv_cache=KVCache("x")), TypeError, r"kv_cache\.data"),
    # paged_attention: metadata structure
    ("metadata-not-metadata", lambda: attention(metadata=dict(vars(MD))), E, "metadata must be"),
    *[(f"metadata-int64-{f}", int64_metadata(f), E, rf"metadata\.{f}\.dtype")
      for f in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")],  # fmt: skip
    ("query-start-loc-length", lambda: attention(metadata=MD.replace(query_start_loc=MD.query_start_loc[:-1])),
     E, r"metadata\.query_start_loc\.shape"),  # fmt: skip
    ("block-tables-rank", lambda: attention(metadata=MD.replace(block_tables=MD.block_tables[0])),
     E, r"metadata\.block_tables\.shape"),  # fmt: skip
    ("block-tables-rows", lambda: attention(metadata=MD.replace(block_tables=MD.block_tables[:-1])),
     E, r"metadata\.block_tables\.shape"),  # fmt: skip
    ("slot-mapping-length", lambda: attention(metadata=MD.replace(slot_mapping=MD.slot_mapping[:-1])),
     E, r"metadata\.slot_mapping\.shape"),  # fmt: skip
    ("max-query-len-negative", lambda: attention(metadata=MD.replace(max_query_len=-1)), E, r"metadata\.max_query_len"),
    ("metadata-causal-int", lambda: attention(metadata=MD.replace(causal=1)), E, r"metadata\.causal"),
    ("metadata-block-ids-in-range-str", lambda: attention(metadata=MD.replace(block_ids_in_range="yes")),
     E, r"metadata\.block_ids_in_range='yes' must be a bool"),  # fmt: skip
    # paged_attention: checked mode
    ("checked-block-id-too-large", lambda: checked(block_tables=edited("block_tables", (1, 0), NUM_BLOCKS)),
     E, r"metadata\.block_tables"),  # fmt: skip
    ("checked-block-id-negative", lambda: checked(block_tables=edited("block_tables", (2, 1), -1)),
     E, r"metadata\.block_tables"),  # fmt: skip
    ("checked-seq-len-beyond-table", lambda: checked(seq_lens=edited("seq_lens", 1, NUM_COLS * BLOCK_SIZE + 1)),
     E, r"metadata\.seq_lens.*capacity"),  # fmt: skip
    ("checked-query-start-loc-decreasing", lambda: checked(query_start_loc=edited("query_start_loc", 1, 5)),
     E, r"metadata\.query_start_loc"),  # fmt: skip
    ("checked-query-start-loc-not-at-0", lambda: checked(query_start_loc=edited("query_start_loc", 0, 1)),
     E, r"metadata\.query_start_loc"),  # fmt: skip
    ("checked-query-len-above-seq-len", lambda: checked(seq_lens=edited("seq_lens", 0, 2)),
     E, r"metadata\.seq_lens"),  # fmt: skip
    ("checked-num-actual-tokens", lambda: checked(num_actual_tokens=jnp.int32(T - 1)),
     E, r"metadata\.num_actual_tokens"),  # fmt: skip
    ("checked-slot-outside-cache", lambda: checked(slot_mapping=edited("slot_mapping", 0, NUM_BLOCKS * BLOCK_SIZE)),
     E, r"metadata\.slot_mapping"),  # fmt: skip
    ("checked-slot-negative", lambda: checked(slot_mapping=edited("slot_mapping", 2, -2)), E, r"metadata\.slot_mapping"),
    ("checked-max-query-len-too-small", lambda: checked(max_query_len=max(QUERY_LENS) - 1),
     E, r"metadata\.max_query_len"),  # fmt: skip
    ("checked-max-seq-len-too-small", lambda: checked(max_seq_len=max(SEQ_LENS) - 1), E, "max_seq_len"),
    ("checked-under-jit", traced_checked_call, E, r"checked=True.*traced"),
    # write_kv
    ("write-k-shape", lambda: write(k=NEW_KV[:, :1]), E, r"k\.shape"),
    ("write-v-length", lambda: write(v=NEW_KV[:-1]), E, r"v\.shape"),
    ("write-slot-mapping-int64", lambda: write(slot_mapping=np.asarray(MD.slot_mapping, np.int64)),
     E, r"slot_mapping\.dtype"),  # fmt: skip
    ("write-slot-mapping-length", lambda: write(slot_mapping=MD.slot_mapping[1:]), E, r"slot_mapping\.shape"),
    ("write-checked-slot-outside-cache",
     lambda: write(slot_mapping=edited("slot_mapping", 1, NUM_BLOCKS * BLOCK_SIZE), checked=True),
     E, "slot_mapping"),  # fmt: skip
    ("write-kv-layout", lambda: write(kv_cache=KVCache(jnp.array(KV), "NDH")), E, r"kv_cache\.layout"),
    ("write-k-scale-for-float-cache", lambda: write(kv_cache=KVCache(jnp.array(KV), k_scale=2.0)), E, "k_scale"),
    ("write-cache-rank", lambda: write(kv_cache=KV[0]), E, r"kv_cache\.shape"),
    # cascade attention
    *[(f"cascade-prefix-blocks-{label}", lambda bad=bad: cascade(bad), E, "num_common_prefix_blocks")
      for label, bad in (("float", 1.0), ("bool", True), ("str", "1"), ("none", None), ("list", [1]),
                         ("negative", -1), ("past-table", NUM_COLS + 1), ("jax-negative", jnp.int32(-1)),
                         ("jax-float", jnp.float32(1)), ("vector", jnp.ones(2, jnp.int32)))],
    *[(f"cascade-pays-{name}-{label}", lambda n=name, x=bad: cascade_pays(**{**PAYS, n: x}), E, f"{name}=")
      for name in PAYS for label, bad in (("negative", -1), ("float", 2.5), ("str", "2"), ("none", None))],
    ("split-violations-block-size-0", lambda: split_violations(MD, 1, block_size=0), E, "block_size=0"),
    ("split-violations-prefix-float", lambda: split_violations(MD, 1.5, block_size=4), E, "blocks=1.5"),
    ("split-violations-params-str", lambda: split_violations(MD, 1, block_size=4, params="x"), E, "params="),
    ("split-violations-not-metadata", lambda: split_violations({}, 1, block_size=4), E, "metadata must be"),
    # get_kv_cache_shape
    ("kv-shape-0-blocks", lambda: get_kv_cache_shape(0, 16, 2, 8), E, "num_blocks"),
    ("kv-shape-bool-heads", lambda: get_kv_cache_shape(4, 16, True, 8), E, "num_kv_heads"),
    ("kv-shape-layout", lambda: get_kv_cache_shape(4, 16, 2, 8, kv_layout="NCHW"), E, "kv_layout"),
    # metadata_from_lengths: static options and the arrays' kinds, dtypes and shapes
    *[(f"from-lengths-{name}-{label}", lambda name=name, bad=bad: from_lengths(**{name: bad}), E, rf"{name}=")
      for name in ("block_size", "num_tokens", "max_query_len", "max_seq_len")
      for label, bad in BAD_SIZES.items() if label != "0" or name == "block_size"],
    ("from-lengths-causal-str", lambda: from_lengths(causal="yes"), E, "causal='yes'"),
    *[(f"from-lengths-{name}-{label}", lambda n=name, bad=bad: from_lengths(**{n: bad}), E, rf"^{name} ")
      for name in ("query_lens", "seq_lens", "block_tables")
      for label, bad in (("list", [1, 2, 3]), ("float", LENGTHS[name].astype(jnp.float32)),
                         ("int64", np.asarray(LENGTHS[name], np.int64)), ("rank+1", LENGTHS[name][None]))],
    ("from-lengths-shapes", lambda: from_lengths(seq_lens=LENGTHS["seq_lens"][:-1]), E, r"seq_lens\.shape"),
    # check_metadata_values
    *[(f"check-values-{name}-{label}", lambda name=name, bad=bad: check_values(**{name: bad}), E, rf"{name}=")
      for name in ("num_blocks", "block_size")
      for label, bad in {**BAD_SIZES, "list": [4]}.items() if (label, name) != ("none", "num_blocks")],
    ("check-values-params-str", lambda: check_values(params="x"), E, "params="),
    ("resolve-sm-scale-head-dim-0", lambda: resolve_sm_scale(None, 0), E, "head_dim=0"),
    ("resolve-sm-scale-str", lambda: resolve_sm_scale("0.5", 8), E, "sm_scale='0.5'"),
    # make_attention_metadata
    ("build-seq-lens-below-query-lens", lambda: build(seq_lens=[2, 6, 9]), E, "query_lens"),
    ("build-negative-query-len", lambda: build(query_lens=[3, -1, 4]), E, "query_lens"),
    ("build-table-too-short", lambda: build(block_tables=TABLE[:, :-1]), E, "capacity"),
    ("build-table-rows", lambda: build(block_tables=TABLE[:-1]), E, "block_tables"),
    ("build-float-query-lens", lambda: build(query_lens=[3.0, 1.0, 4.0]), E, "query_lens"),
    ("build-seq-lens-beyond-int32", lambda: build(seq_lens=[5, 6, 2**31]), E, "seq_lens"),
    ("build-block-ids-beyond-int32", lambda: build(block_tables=TABLE.astype(np.int64) + 2**31), E, "block_tables"),
    ("build-block-size-0", lambda: build(block_size=0), E, "block_size"),
    ("build-num-tokens-too-small", lambda: build(num_tokens=T - 1), E, "num_tokens"),
    ("build-max-query-len-too-small", lambda: build(max_query_len=1), E, "max_query_len"),
    # specs
    ("full-spec-block-size-0", lambda: FullAttentionSpec(**{**SPEC, "block_size": 0}), E, "block_size"),
    ("full-spec-heads-bool", lambda: FullAttentionSpec(**{**SPEC, "num_kv_heads": True}), E, "num_kv_heads"),
    ("sliding-spec-window-0", lambda: SlidingWindowSpec(sliding_window=0, **SPEC), E, "sliding_window"),
    ("chunked-spec-not-multiple", lambda: ChunkedLocalAttentionSpec(attention_chunk_size=6, **SPEC),
     E, "attention_chunk_size"),  # fmt: skip
    ("spec-dtype-not-a-dtype", lambda: FullAttentionSpec(**{**SPEC, "dtype": "not-a-dtype"}), E, "dtype"),
    *[(f"spec-dtype-{label}", lambda bad=bad: FullAttentionSpec(**{**SPEC, "dtype": bad}), E, "floating")
      for label, bad in (("none", None), ("object", object), ("bool", bool), ("str", "U4"),
                         ("int8", jnp.int8), ("complex", np.complex64))],
    *[(f"spec-blocks-per-request-{name}-{label}", lambda n=name, bad=bad: blocks_per_request(**{n: bad}),
       E, rf"{name}=")
      for name in ("max_model_len", "max_num_batched_tokens") for label, bad in BAD_SIZES.items()],
    ("spec-max-model-len-0",
     lambda: FullAttentionSpec(**SPEC).max_memory_usage_bytes(max_model_len=0, max_num_batched_tokens=8),
     E, "max_model_len"),  # fmt: skip
    ("base-spec-block-count",
     lambda: AttentionSpec(**SPEC).max_memory_usage_bytes(max_model_len=64, max_num_batched_tokens=8),
     NI, "AttentionSpec"),  # fmt: skip
    # params and masks
    ("params-sliding-window-0", lambda: LayerAttentionParams(sliding_window=0), E, "sliding_window"),
    ("params-chunk-bool", lambda: LayerAttentionParams(attention_chunk_size=True), E, "attention_chunk_size"),
    ("params-causal-none", lambda: LayerAttentionParams(causal=None), E, "causal"),
    ("group-key-not-params", lambda: metadata_group_key("x"), E, "params"),
    ("window-left-0", lambda: window_left(0), E, "sliding_window"),
    ("local-window-size-negative", lambda: local_window_size(-3), E, "sliding_window"),
    ("mask-chunk-0",
     lambda: attention_mask(jnp.arange(4), jnp.arange(4), 4, params=LayerAttentionParams(attention_chunk_size=0)),
     E, "attention_chunk_size"),  # fmt: skip
    ("mask-params-not-params", lambda: attention_mask(jnp.arange(4), jnp.arange(4), 4, params="x"), E, "params="),
    *[(f"{name}-window-{label}", lambda call=call, w=w: call(sliding_window=w), E, f"window={shown} must")
      for name, call in (("mask", mask), ("key-range", key_range))
      for label, w, shown in (("0", 0, "0"), ("negative", -1, "-1"), ("float", 2.5, "2.5"),
                              ("bool", True, "True"), ("inf", float("inf"), "inf"), ("str", "4", "'4'"),
                              ("huge", 2**40, str(2**40)), ("numpy-0", np.int64(0), r"np\.int64\(0\)"),
                              ("jax-0", jnp.int32(0), "0"))],
    ("mask-window-vector", lambda: mask(sliding_window=jnp.ones(4, jnp.int32)), E, r"shape \(4,\)\) must"),
    ("mask-window-float-array", lambda: mask(sliding_window=jnp.float32(2)), E, r"float32 array of shape"),
    ("mask-window-and-params-window", lambda: mask(sliding_window=2, params=PARAMS_W), E, "the window once"),
    ("mask-float-positions", lambda: attention_mask(POSITIONS + 0.5, POSITIONS, 4), E, r"q_pos=.*float"),
    ("mask-list-positions", lambda: attention_mask(POSITIONS, [0, 1], 4), E, r"k_pos=\[0, 1\]"),
    ("mask-str-seq-len", lambda: attention_mask(POSITIONS, POSITIONS, "4"), E, r"seq_len='4'"),
    ("key-range-float-positions", lambda: allowed_key_range(POSITIONS * 1.0, 4), E, r"q_pos=.*float"),
    ("chunked-mask-0", lambda: masks.chunked_local_mask(POSITIONS, POSITIONS, 0), E, "chunk_size=0"),
    ("window-mask-bool", lambda: masks.sliding_window_mask(POSITIONS, POSITIONS, True), E, "window=True"),
    # metadata helpers
    ("virtual-chunk-not-multiple", lambda: make_local_attention_virtual_batches(6, MD, 4), E, "attention_chunk_size"),
    ("virtual-chunk-0", lambda: make_local_attention_virtual_batches(0, MD, 4), E, "attention_chunk_size"),
    ("virtual-block-size-0", lambda: make_local_attention_virtual_batches(8, MD, 0), E, "block_size"),
    ("virtual-table-without-columns", lambda: virtual(block_tables=MD.block_tables[:, :0]),
     E, r"metadata\.block_tables\.shape"),
    ("virtual-seq-len-past-table", lambda: virtual(seq_lens=edited("seq_lens", 1, NUM_COLS * BLOCK_SIZE + 9)),
     E, "capacity"),
    *[(f"{name}-query-start-loc-{label}", lambda helper=helper, qsl=qsl: helper(query_start_loc=qsl),
       E, r"metadata\.query_start_loc=\[.*must start at 0, never decrease")
      for name, helper in (("split", split), ("reorder", reorder), ("virtual", virtual))
      for label, qsl in (("decreasing", edited("query_start_loc", 1, 5)),
                         ("not-at-0", edited("query_start_loc", 0, 1)),
                         ("past-T", edited("query_start_loc", -1, T + 1)))],
    ("split-num-actual-tokens", lambda: split(num_actual_tokens=jnp.int32(T - 1)), E, "num_actual_tokens="),
    ("split-not-metadata", lambda: split_decodes_and_prefills(dict(vars(MD))), E, "metadata must be"),
    ("split-threshold-0", lambda: split_decodes_and_prefills(MD, decode_threshold=0), E, "decode_threshold"),
    ("split-require-uniform-str", lambda: split_decodes_and_prefills(MD, require_uniform="no"),
     E, "require_uniform='no'"),
    ("reorder-seq-len-below-query", lambda: reorder(seq_lens=edited("seq_lens", 0, 2)), E, "seq_lens="),
    ("reorder-is-prefilling-ints", lambda: reorder_decodes_first(MD, is_prefilling=[1, 0, 2]), E, "filling="),
    ("reorder-is-prefilling-str", lambda: reorder_decodes_first(MD, is_prefilling="yes"), E, "prefilling="),
    ("reorder-threshold-0", lambda: reorder_decodes_first(MD, decode_threshold=0), E, "decode_threshold"),
    ("reorder-is-prefilling-shape", lambda: reorder_decodes_first(MD, is_prefilling=[True, False]),
     E, "is_prefilling"),  # fmt: skip
    ("expand-not-dividing", lambda: expand_block_tables(MD.block_tables, allocator_block_size=16, kernel_block_size=6),
     E, "allocator_block_size"),  # fmt: skip
    ("expand-kernel-larger",
     lambda: expand_block_tables(MD.block_tables, allocator_block_size=8, kernel_block_size=16),
     E, "allocator_block_size"),  # fmt: skip
    ("expand-kernel-0", lambda: expand_block_tables(MD.block_tables, allocator_block_size=16, kernel_block_size=0),
     E, "kernel_block_size"),  # fmt: skip
    ("expand-allocator-0", lambda: expand_block_tables(MD.block_tables, allocator_block_size=0, kernel_block_size=8),
     E, "allocator_block_size"),  # fmt: skip
    ("expand-id-negative", lambda: expand(np.asarray([[1, -1]])), E, r"block_tables holds ids in \[-1, 1\]"),
    ("expand-id-past-int32", lambda: expand(np.asarray([[1, 2**30]], np.int64)), E, r"1073741824\].*int32"),
    ("expand-allocator-negative",
     lambda: expand_block_tables(MD.block_tables, allocator_block_size=-16, kernel_block_size=8),
     E, "allocator_block_size"),  # fmt: skip
]


def test_case_ids_are_unique():
    ids = [case[0] for case in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 30


@pytest.mark.parametrize("call, error, match", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_malformed_call_raises(call, error, match):
    with pytest.raises(error, match=match):
        jax.block_until_ready(call())


def test_valid_sizes_are_stored_as_python_ints():
    """numpy ints in a spec or a cache shape come back as Python ints: equal values, hashes and reprs."""
    spec = SlidingWindowSpec(sliding_window=np.int64(5), **{**SPEC, "block_size": np.int32(4)})
    assert spec == SlidingWindowSpec(sliding_window=5, **SPEC)
    assert type(spec.block_size) is type(spec.sliding_window) is int
    assert all(type(d) is int for d in get_kv_cache_shape(np.int64(4), 16, np.int32(2), 8))


def test_expand_block_tables_of_no_request_and_of_wide_ids():
    """A table of no request expands to no request (not a reshape error); int64 ids that fit expand exactly"""
    assert expand(np.zeros((0, 3), np.int32)).shape == (0, 6)
    wide = expand(np.asarray([[2**29 - 1]], np.int64), kernel_block_size=2)
    assert wide.dtype == jnp.int32 and np.asarray(wide).tolist() == [list(range(2**31 - 4, 2**31))]
