"""The vLLM plugin against the torch eager reference, on the CPU with vLLM's own classes.

vLLM's `Attention` layers (with the plugin as their backend), its KV-cache specs customized by the backend, its
cache allocation (`allocate_kv_cache` in the LBHNC layout), its `CommonAttentionMetadata` and its forward context;
random data, NaN in every cache slot no request owns (the null block 0, blocks vLLM dropped left of a window,
unused blocks), sequence lengths straddling block boundaries, and a mixed batch with cudagraph-style padding rows.
Runs in the vLLM virtualenv (`scripts/test-vllm`); not collected where vLLM is not installed (tests/conftest.py).
"""

import dataclasses
import importlib.metadata
import itertools
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

import jax.numpy as jnp
from vllm.config import CacheConfig, DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.platforms.interface import DeviceCapability
from vllm.plugins import load_plugins_by_group
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache, customize_attention_spec

from jax_hybrid_attn.testing import TOLERANCES
from jax_hybrid_attn_torch import PagedAttentionBackend
from jax_hybrid_attn_torch.vllm_backend import (
    BACKEND_CLASS_PATH,
    JaxHybridAttentionBackend,
    JaxHybridAttentionImpl,
    JaxHybridAttentionMetadata,
    register,
)

from ..torch_reference import paged_attention_torch, write_kv_torch

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 16
QUERY_LENS = (1, 19, 5, 1, 1, 0)  # decode, prefill across a block edge, extend, decodes, a padded request
SEQ_LENS = (33, 19, 40, 16, 17, 0)  # straddling the block boundaries (16, 32)
NUM_ACTUAL_TOKENS = sum(QUERY_LENS)
NUM_TOKENS = NUM_ACTUAL_TOKENS + 3  # q/k/v/output rows padded as for a CUDA graph; slot_mapping -1 there
SINKS = torch.linspace(-1.0, 2.0, NUM_HEADS)
NULL_BLOCK = 0


def tolerance(dtype: torch.dtype) -> dict:
    """`jax_hybrid_attn.testing.TOLERANCES`, keyed by the query dtype."""
    return TOLERANCES[jnp.dtype(str(dtype).removeprefix("torch."))]


# ------------------------------------------------------------------------------------------------ the model


@dataclasses.dataclass
class Model:
    """vLLM's side of a model: config, `Attention` layers, KV-cache groups with their specs, per-layer caches."""

    config: VllmConfig
    layers: dict[str, Attention]
    groups: list[KVCacheGroupSpec]
    caches: dict[str, torch.Tensor]  # vLLM's views, [B, 2, S, K*H]
    num_blocks: int
    block_size: int = BLOCK_SIZE
    kv_layout: str = "NHD"  # "HND_VT" for an fp8 cache in blocks of a multiple of 64

    def group_of(self, name: str) -> int:
        return next(g for g, group in enumerate(self.groups) if name in group.layer_names)

    @property
    def blocks_per_request(self) -> int:
        return max(math.ceil(s / self.block_size) for s in SEQ_LENS) + 1  # a spare column of null blocks

    def view(self, name: str) -> torch.Tensor:
        """The layer's cache as the backend holds it, zero-copy (float8 e4m3 for an fp8 cache): [B, 2, S, K, H]
        ("NHD"), or its bytes as [B, 2, K, S, H] ("HND_VT")."""
        cache = self.caches[name].unflatten(3, (NUM_KV_HEADS, HEAD_SIZE))
        cache = cache.view(torch.float8_e4m3fn) if cache.dtype == torch.uint8 else cache
        if self.kv_layout == "HND_VT":
            cache = cache.view(cache.shape[0], 2, NUM_KV_HEADS, self.block_size, HEAD_SIZE)
        return cache


def make_model(
    options: dict[str, dict], *, dtype: torch.dtype, hybrid: bool, cache_dtype: str = "auto", scales=None,
    block_size: int = BLOCK_SIZE,
) -> Model:
    """`Attention` layers named by `options` (their keyword arguments), with the plugin as backend.

    hybrid: vLLM's hybrid allocator (one group per spec: full, each sliding window), else one
    `FullAttentionSpec` group holding every layer (the allocator disabled: windows are computed, not freed).
    A layer sharing another's cache joins the target's group and binds its cache, as vLLM does.
    """
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(cache_dtype=cache_dtype, block_size=block_size),
    )
    with set_current_vllm_config(config):
        layers = {
            name: Attention(
                NUM_HEADS,
                HEAD_SIZE,
                kwargs.pop("scale", HEAD_SIZE**-0.5),
                NUM_KV_HEADS,
                cache_config=config.cache_config,
                prefix=name,
                attn_backend=JaxHybridAttentionBackend,
                **kwargs,
            )
            for name, kwargs in ((name, dict(kwargs)) for name, kwargs in options.items())
        }
    for layer in layers.values():  # vLLM's k/v scales, as loaded with an fp8 checkpoint
        layer._k_scale_float, layer._v_scale_float = scales or (1.0, 1.0)
    specs: dict[str, object] = {}
    for name, layer in layers.items():
        if layer.kv_sharing_target_layer_name is not None:
            continue
        spec = layer.get_kv_cache_spec(config)
        if cache_dtype == "auto":
            spec = dataclasses.replace(spec, dtype=dtype)  # no model config here: "auto" would be float16
        if not hybrid:
            spec = FullAttentionSpec(
                block_size=spec.block_size,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                dtype=spec.dtype,
                kv_quant_mode=spec.kv_quant_mode,
            )
        specs[name] = customize_attention_spec(JaxHybridAttentionBackend, spec)
    groups: list[KVCacheGroupSpec] = []
    for name, spec in specs.items():
        group = next((g for g in groups if g.kv_cache_spec == spec), None)
        if group is None:
            groups.append(KVCacheGroupSpec([name], spec))
        else:
            group.layer_names.append(name)
    blocks_per_request = max(math.ceil(s / block_size) for s in SEQ_LENS) + 1
    num_blocks = 1 + len(groups) * len(SEQ_LENS) * blocks_per_request + 4  # the null block, 4 never used
    pages = {name: spec.page_size_bytes * num_blocks for name, spec in specs.items()}
    offsets = dict(zip(pages, itertools.accumulate(pages.values(), initial=0), strict=False))
    tensors = [
        KVCacheTensor(
            size=sum(pages.values()),
            layers=[name],
            layer_stride=pages[name],
            block_stride=specs[name].page_size_bytes,
            offset=offsets[name],
        )
        for name in specs
    ]
    caches = allocate_kv_cache(
        KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups),
        torch.device("cpu"),
        KVCacheLayout.LBHNC,
    )
    for name, layer in layers.items():
        if (target := layer.kv_sharing_target_layer_name) is not None:
            caches[name] = caches[target]
            next(g for g in groups if target in g.layer_names).layer_names.append(name)
    bind_kv_cache(caches, config.compilation_config.static_forward_context, [])  # each layer's `kv_cache`
    kv_layout = "HND_VT" if cache_dtype == "fp8" and block_size % 64 == 0 else "NHD"
    model = Model(config, layers, groups, caches, num_blocks, block_size, kv_layout)
    for name in specs:
        model.view(name).fill_(float("nan"))
    return model


# ------------------------------------------------------------------------------------------------- the step


@dataclasses.dataclass
class Step:
    common: list[CommonAttentionMetadata]  # per KV-cache group
    q: dict[str, torch.Tensor]  # [T', N, H] per layer
    k: dict[str, torch.Tensor]  # [T', K, H]
    v: dict[str, torch.Tensor]


def make_step(model: Model, *, dtype: torch.dtype, seed: int = 0) -> Step:
    """Block tables over one shuffled pool (block ids are unique across groups, 0 is the null block), vLLM's
    nulling of blocks wholly left of a sliding window, each layer's context written into its cache (the rest
    stays NaN), and random q/k/v per layer."""
    generator = torch.Generator().manual_seed(seed)
    ids = 1 + torch.randperm(model.num_blocks - 1, generator=generator)
    query_start_loc = torch.tensor([0, *torch.tensor(QUERY_LENS).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    common = []
    for g, group in enumerate(model.groups):
        block_size, blocks_per_request = model.block_size, model.blocks_per_request
        table = torch.zeros(len(SEQ_LENS), blocks_per_request, dtype=torch.int32)
        slot_mapping = torch.full((NUM_TOKENS,), -1, dtype=torch.int64)
        window = getattr(group.kv_cache_spec, "sliding_window", None)
        for r, (q_len, s_len) in enumerate(zip(QUERY_LENS, SEQ_LENS, strict=True)):
            start = (g * len(SEQ_LENS) + r) * blocks_per_request
            table[r, : math.ceil(s_len / block_size)] = ids[start : start + math.ceil(s_len / block_size)]
            first_query = s_len - q_len
            if isinstance(group.kv_cache_spec, SlidingWindowSpec):
                dropped = max(first_query - (window - 1), 0) // block_size  # blocks wholly left of the window
                table[r, :dropped] = NULL_BLOCK
            positions = torch.arange(first_query, s_len)
            slot_mapping[int(query_start_loc[r]) : int(query_start_loc[r + 1])] = slots(table[r], positions,
                                                                                        block_size)  # fmt: skip
        common.append(
            CommonAttentionMetadata(
                query_start_loc=query_start_loc,
                query_start_loc_cpu=query_start_loc.clone(),
                seq_lens=seq_lens,
                num_reqs=len(SEQ_LENS),
                num_actual_tokens=NUM_ACTUAL_TOKENS,
                max_query_len=max(QUERY_LENS),
                max_seq_len=max(SEQ_LENS),
                block_table_tensor=table,
                slot_mapping=slot_mapping,
                causal=True,
                seq_lens_cpu_upper_bound=seq_lens.clone(),
            )
        )
    q, k, v = {}, {}, {}
    for name, layer in model.layers.items():
        group = common[model.group_of(name)]
        if layer.kv_sharing_target_layer_name is None:
            for r, (q_len, s_len) in enumerate(zip(QUERY_LENS, SEQ_LENS, strict=True)):
                positions = torch.arange(s_len - q_len)
                positions = positions[group.block_table_tensor[r, positions // model.block_size] != NULL_BLOCK]
                context = torch.randn(2, len(positions), NUM_KV_HEADS, HEAD_SIZE, generator=generator).to(
                    dtype
                )
                write_kv_torch(
                    model.view(name),
                    context[0],
                    context[1],
                    slots(group.block_table_tensor[r], positions, model.block_size),
                    kv_layout=model.kv_layout,
                    **fp8_scales(model, name),
                )
        q[name] = torch.randn(NUM_TOKENS, NUM_HEADS, HEAD_SIZE, generator=generator).to(dtype)
        k[name] = torch.randn(NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE, generator=generator).to(dtype)
        v[name] = torch.randn(NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE, generator=generator).to(dtype)
    return Step(common, q, k, v)


def slots(table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return table_row[positions // block_size].to(torch.int64) * block_size + positions % block_size


def fp8_scales(model: Model, name: str) -> dict:
    layer = model.layers[name]
    if layer.kv_cache_dtype not in ("fp8", "fp8_e4m3"):
        return {}
    return {"k_scale": layer._k_scale_float, "v_scale": layer._v_scale_float}


def expected(model: Model, step: Step) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The torch reference, layer after layer: outputs [T, N, H] and each cache after the step."""
    caches = {
        name: model.view(name).clone()
        for name in model.layers
        if model.layers[name].kv_sharing_target_layer_name is None
    }
    outputs = {}
    for name, layer in model.layers.items():
        group = step.common[model.group_of(name)]
        target = layer.kv_sharing_target_layer_name or name
        cache = caches[target]
        if layer.kv_sharing_target_layer_name is None:
            write_kv_torch(
                cache,
                step.k[name][:NUM_ACTUAL_TOKENS],
                step.v[name][:NUM_ACTUAL_TOKENS],
                group.slot_mapping[:NUM_ACTUAL_TOKENS],
                kv_layout=model.kv_layout,
                **fp8_scales(model, name),
            )
        impl = layer.impl
        outputs[name] = paged_attention_torch(
            step.q[name][:NUM_ACTUAL_TOKENS],
            cache,
            group.query_start_loc,
            group.seq_lens,
            group.block_table_tensor,
            sm_scale=impl.scale,
            sliding_window=impl.sliding_window,
            logits_soft_cap=impl.logits_soft_cap,
            sinks=impl.sinks,
            kv_layout=model.kv_layout,
            **fp8_scales(model, name),
        )
    return outputs, caches


def build(model: Model, step: Step) -> dict[str, JaxHybridAttentionMetadata]:
    """Per layer, its group's metadata from the plugin's builder (as vLLM's model runner hands it to forward)."""
    builders = [
        JaxHybridAttentionBackend.get_builder_cls()(
            group.kv_cache_spec, group.layer_names, model.config, "cpu"
        )
        for group in model.groups
    ]
    metadata = [builder.build(0, common) for builder, common in zip(builders, step.common, strict=True)]
    return {name: metadata[model.group_of(name)] for name in model.layers}


def check(model: Model, outputs: dict[str, torch.Tensor], wanted, wanted_caches) -> None:
    """Outputs within the dtype's tolerance; caches written in place, NaN kept everywhere else."""
    for name, out in outputs.items():
        torch.testing.assert_close(
            out[:NUM_ACTUAL_TOKENS].float(),
            wanted[name].float(),
            **tolerance(wanted[name].dtype),
            msg=lambda m, name=name: f"layer {name}: {m}",
        )
    for name, cache in wanted_caches.items():
        torch.testing.assert_close(model.view(name).float(), cache.float(), equal_nan=True, atol=0, rtol=0)


# -------------------------------------------------------------------------------------------------- tests


GEMMA3_LIKE = {f"layers.{i}.attn": ({} if i == 5 else {"per_layer_sliding_window": 8}) for i in range(6)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemma3_like_hybrid_groups_through_vllms_attention_forward(dtype):
    """5 sliding-window layers and 1 full layer in two KV-cache groups (vLLM's hybrid allocator), each layer run
    by `Attention.forward` under vLLM's forward context, which hands it its group's metadata."""
    model = make_model(GEMMA3_LIKE, dtype=dtype, hybrid=True)
    assert [type(g.kv_cache_spec) for g in model.groups] == [SlidingWindowSpec, FullAttentionSpec]
    assert [len(g.layer_names) for g in model.groups] == [5, 1]
    step = make_step(model, dtype=dtype)
    dropped = step.common[0].block_table_tensor[:, 0] == NULL_BLOCK  # left of the window (the last: idle)
    assert dropped.tolist() == [True, False, True, False, False, True]
    wanted, wanted_caches = expected(model, step)
    metadata = build(model, step)
    outputs = {}
    with set_forward_context(metadata, model.config, slot_mapping={}):
        for name, layer in model.layers.items():
            # as vLLM's models call it: q, k, v are column blocks of the QKV projection's output (views)
            qkv = torch.cat(
                [step.q[name].flatten(1), step.k[name].flatten(1), step.v[name].flatten(1)], dim=1
            )
            q, k, v = qkv.split(
                [NUM_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE], dim=-1
            )
            outputs[name] = layer(q, k, v).unflatten(1, (NUM_HEADS, HEAD_SIZE))
    check(model, outputs, wanted, wanted_caches)


ONE_GROUP = {
    "layers.0.attn": {},
    "layers.1.attn": {"per_layer_sliding_window": 5},
    "layers.2.attn": {"per_layer_sliding_window": 17},
    "layers.3.attn": {"logits_soft_cap": 5.0, "scale": 0.3},
    "layers.4.attn": {"per_layer_sliding_window": 9, "sinks": SINKS},  # gpt-oss style
    "layers.5.attn": {"kv_sharing_target_layer_name": "layers.0.attn"},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layers_of_one_group_keep_their_own_window_soft_cap_scale_and_sinks(dtype):
    """One FullAttentionSpec group (hybrid allocator off) whose layers differ in window, soft cap, scale and sinks,
    and a layer reading another's cache; `forward` called directly, padding rows of `output` left alone."""
    model = make_model(ONE_GROUP, dtype=dtype, hybrid=False)
    assert len(model.groups) == 1 and model.groups[0].kv_cache_spec.sliding_window is None
    step = make_step(model, dtype=dtype, seed=1)
    wanted, wanted_caches = expected(model, step)
    metadata = build(model, step)
    outputs = {}
    for name, layer in model.layers.items():
        output = torch.full((NUM_TOKENS, NUM_HEADS, HEAD_SIZE), 7.0, dtype=dtype)
        result = layer.impl.forward(
            layer, step.q[name], step.k[name], step.v[name], model.caches[name], metadata[name], output
        )
        assert result is output and (output[NUM_ACTUAL_TOKENS:] == 7.0).all()
        outputs[name] = output
    check(model, outputs, wanted, wanted_caches)


@pytest.mark.parametrize("block_size", [BLOCK_SIZE, 64])
def test_float8_cache_with_the_layers_scales(block_size):
    """An fp8 cache with the layers' k/v scales; in blocks of 64 the plugin keeps it in "HND_VT" (V transposed per
    block: the kernels' float8 PV product), vLLM's [B, 2, S, K*H] bytes viewed as [B, 2, K, S, H]."""
    model = make_model(
        {"layers.0.attn": {"per_layer_sliding_window": 9}, "layers.1.attn": {}},
        dtype=torch.bfloat16,
        hybrid=True,
        cache_dtype="fp8",
        scales=(0.5, 2.0),
        block_size=block_size,
    )
    assert all(cache.dtype == torch.uint8 for cache in model.caches.values())
    assert model.kv_layout == ("HND_VT" if block_size == 64 else "NHD")
    step = make_step(model, dtype=torch.bfloat16, seed=2)
    wanted, wanted_caches = expected(model, step)
    metadata = build(model, step)
    assert {m.plans.backend.kv_layout for m in metadata.values()} == {model.kv_layout}
    outputs = {}
    for name, layer in model.layers.items():
        outputs[name] = torch.empty(NUM_TOKENS, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
        layer.impl.forward(
            layer, step.q[name], step.k[name], step.v[name], model.caches[name], metadata[name], outputs[name]
        )
    check(model, outputs, wanted, wanted_caches)


def test_a_step_plans_once_per_group_and_a_metadata_built_in_between_is_planned_again(monkeypatch):
    model = make_model(
        {"layers.0.attn": {}, "layers.1.attn": {"per_layer_sliding_window": 5}},
        dtype=torch.float32,
        hybrid=False,
    )
    step = make_step(model, dtype=torch.float32, seed=3)
    wanted, _ = expected(model, step)
    plans = []
    original = PagedAttentionBackend.plan
    monkeypatch.setattr(
        PagedAttentionBackend, "plan", lambda self, *a, **kw: plans.append(a) or original(self, *a, **kw)
    )
    builder = JaxHybridAttentionBackend.get_builder_cls()(
        model.groups[0].kv_cache_spec, model.groups[0].layer_names, model.config, "cpu"
    )
    metadata = builder.build(0, step.common[0])
    other = builder.build(
        0, step.common[0].unpadded(num_actual_tokens=QUERY_LENS[0], num_actual_reqs=1)
    )  # a draft
    outputs = {}
    for name, layer in model.layers.items():
        outputs[name] = torch.empty(NUM_TOKENS, NUM_HEADS, HEAD_SIZE)
        layer.impl.forward(
            layer, step.q[name], step.k[name], step.v[name], model.caches[name], metadata, outputs[name]
        )
    assert len(plans) == 1  # planned lazily, by the first layer, with `metadata` (not `other`)
    draft = torch.empty(NUM_TOKENS, NUM_HEADS, HEAD_SIZE)
    layer = model.layers["layers.0.attn"]
    layer.impl.forward(
        layer, step.q["layers.0.attn"], None, None, model.caches["layers.0.attn"], other, draft
    )
    assert len(plans) == 2 and plans[-1][3].shape == (QUERY_LENS[0],)
    torch.testing.assert_close(draft[:1], wanted["layers.0.attn"][:1], **tolerance(torch.float32))
    for name, out in outputs.items():
        torch.testing.assert_close(out[:NUM_ACTUAL_TOKENS], wanted[name], **tolerance(torch.float32))


def test_vllm_lays_the_cache_out_as_the_backends_nhd_cache():
    """vLLM resolves the LBHNC layout from the backend; its per-layer view is [B, 2, S, K*H], the backend's
    [B, 2, S, K, H] without a copy."""
    assert get_supported_kv_cache_layouts([JaxHybridAttentionBackend]) == [KVCacheLayout.LBHNC]
    model = make_model({"layers.0.attn": {}}, dtype=torch.bfloat16, hybrid=True)
    cache = model.caches["layers.0.attn"]
    shape = PagedAttentionBackend.get_kv_cache_shape(model.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    assert tuple(cache.shape) == (*shape[:3], NUM_KV_HEADS * HEAD_SIZE) and cache.is_contiguous()
    nhd = model.layers["layers.0.attn"].impl.backend_cache(cache)
    assert tuple(nhd.shape) == shape and nhd.data_ptr() == cache.data_ptr()


def test_vllms_selection_accepts_the_backend_where_the_kernels_run():
    options = {
        "dtype": torch.bfloat16,
        "kv_cache_dtype": "auto",
        "block_size": 16,
        "use_mla": False,
        "has_sink": True,
        "use_sparse": False,
        "use_mm_prefix": False,
        "use_per_head_quant_scales": False,
        "attn_type": AttentionType.DECODER,
        "has_sliding_window": True,
    }
    hopper = DeviceCapability(9, 0)
    assert (
        JaxHybridAttentionBackend.validate_configuration(head_size=128, device_capability=hopper, **options)
        == []
    )
    assert JaxHybridAttentionBackend.validate_configuration(
        head_size=80, device_capability=hopper, **options
    ) == ["head_size=80: the kernels take multiples of 64"]
    invalid = JaxHybridAttentionBackend.validate_configuration(
        head_size=128, device_capability=hopper, **{**options, "attn_type": AttentionType.ENCODER_ONLY}
    )
    assert invalid == [f"attention type {AttentionType.ENCODER_ONLY} not supported"]


def test_the_entry_point_registers_the_custom_backend():
    entry_points = {ep.name: ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert "jax_hybrid_attn" in entry_points, "installed metadata without the entry point: pip install -e ."
    entry_point = entry_points["jax_hybrid_attn"]
    assert entry_point.value == "jax_hybrid_attn_torch.vllm_backend:register"
    assert load_plugins_by_group("vllm.general_plugins")["jax_hybrid_attn"] is register  # vLLM's own loader
    AttentionBackendEnum.CUSTOM.clear_override()
    try:
        with pytest.raises(ValueError, match="must be registered before use"):
            AttentionBackendEnum.CUSTOM.get_class()
        entry_point.load()()
        entry_point.load()()  # vLLM may load plugins more than once
        assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND_CLASS_PATH
        assert AttentionBackendEnum.CUSTOM.get_class() is JaxHybridAttentionBackend
        assert AttentionBackendEnum[JaxHybridAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()


def test_the_profiling_run_without_metadata_zeroes_the_output():
    model = make_model({"layers.0.attn": {}}, dtype=torch.float32, hybrid=True)
    layer = model.layers["layers.0.attn"]
    output = torch.full((4, NUM_HEADS, HEAD_SIZE), 3.0)
    q = torch.randn(4, NUM_HEADS, HEAD_SIZE)
    k = torch.randn(4, NUM_KV_HEADS, HEAD_SIZE)
    assert layer.impl.forward(layer, q, k, k, model.caches["layers.0.attn"], None, output) is output
    assert (output == 0).all()


def test_unsupported_options_raise_not_implemented_error_naming_them():
    def impl(**kwargs):
        args = dict(num_heads=NUM_HEADS, head_size=HEAD_SIZE, scale=0.25, num_kv_heads=NUM_KV_HEADS, **kwargs)
        return JaxHybridAttentionImpl(**args)

    with pytest.raises(NotImplementedError, match=r"alibi_slopes=\[0\.5"):
        impl(alibi_slopes=[0.5] * NUM_HEADS)
    for attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY, AttentionType.ENCODER_DECODER):
        with pytest.raises(NotImplementedError, match=f"attn_type=.*{attn_type.value}"):
            impl(attn_type=attn_type)
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8_e5m2'"):
        impl(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(NotImplementedError, match="use_alibi_sqrt"):
        impl(use_alibi_sqrt=True)
    with pytest.raises(ValueError, match="sliding_window"):
        impl(sliding_window=0)
    with pytest.raises(NotImplementedError, match="head_size_v=8"):
        JaxHybridAttentionBackend.customize_spec(
            FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, head_size_v=8, dtype=torch.float16)
        )

    model = make_model({"layers.0.attn": {}}, dtype=torch.float32, hybrid=True)
    step = make_step(model, dtype=torch.float32)
    group = model.groups[0]
    builder = JaxHybridAttentionBackend.get_builder_cls()(
        group.kv_cache_spec, group.layer_names, model.config, "cpu"
    )
    with pytest.raises(NotImplementedError, match="causal=False"):
        builder.build(0, dataclasses.replace(step.common[0], causal=False))
    with pytest.raises(NotImplementedError, match="causal=a per-request tensor"):
        builder.build(
            0, dataclasses.replace(step.common[0], causal=torch.ones(len(SEQ_LENS), dtype=torch.int32))
        )
    metadata = builder.build(0, step.common[0])
    layer, name = model.layers["layers.0.attn"], "layers.0.attn"
    args = (layer, step.q[name], step.k[name], step.v[name])
    output = torch.empty(NUM_TOKENS, NUM_HEADS, HEAD_SIZE)
    with pytest.raises(NotImplementedError, match="output_scale"):
        layer.impl.forward(*args, model.caches[name], metadata, output, output_scale=torch.ones(1))
    with pytest.raises(ValueError, match=r"kv_cache\.shape=\(\d+, 2, 16, 16\) must be"):
        layer.impl.forward(*args, model.caches[name][..., :16], metadata, output)
    other = make_model({"layers.9.attn": {}}, dtype=torch.float32, hybrid=True)
    with pytest.raises(
        ValueError, match="layer 'layers.0.attn' of this KV-cache group .* found no such layer"
    ):
        JaxHybridAttentionBackend.get_builder_cls()(
            group.kv_cache_spec, group.layer_names, other.config, "cpu"
        ).build(0, step.common[0])
