"""The DLPack bridge on the CPU: zero-copy both ways, and a clear error for what DLPack would get wrong."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jax_hybrid_attn_torch.dlpack import ALIGNMENT, is_compact, same_memory, to_jax, to_torch

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.int32,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_to_jax_shares_memory_and_values(dtype):
    source = torch.randn(8, 16).mul(10).to(dtype)
    array = to_jax(source)
    assert same_memory(source, array)
    assert array.shape == (8, 16)
    np.testing.assert_array_equal(np.asarray(array.astype(jnp.float32)), source.to(torch.float32).numpy())


def test_torch_writes_after_import_are_visible_through_the_shared_memory():
    source = torch.zeros(32)
    array = to_jax(source)
    source[5] = 3.0
    assert float(array[5]) == 3.0


def test_to_torch_shares_memory_and_values():
    array = jnp.arange(48, dtype=jnp.bfloat16).reshape(6, 8)
    tensor = to_torch(array)
    assert same_memory(tensor, array)
    np.testing.assert_array_equal(tensor.to(torch.float32).numpy(), np.asarray(array, np.float32))


def test_a_transposed_tensor_is_compact_and_shared():
    source = torch.randn(16, 8)
    transposed = source.T
    assert is_compact(transposed)
    array = to_jax(transposed)
    assert same_memory(transposed, array)
    np.testing.assert_array_equal(np.asarray(array), transposed.numpy())


def test_a_slice_is_refused_unless_a_copy_is_asked_for():
    source = torch.randn(16, 8)
    sliced = source[:, :4]
    assert not is_compact(sliced)
    with pytest.raises(ValueError, match=r"not compact.*copy=True"):
        to_jax(sliced, name="q")
    array = to_jax(sliced, copy=True)
    assert not same_memory(sliced, array)
    np.testing.assert_array_equal(np.asarray(array), sliced.numpy())


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64], ids=str)
def test_64_bit_dtypes_are_refused_not_silently_narrowed(dtype):
    with pytest.raises(ValueError, match=r"slot_mapping\.dtype=torch\.(int64|float64).*silently"):
        to_jax(torch.zeros(4, dtype=dtype), name="slot_mapping")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torch.ones(4, requires_grad=True), "requires grad: pass tensor.detach"),
        (lambda: torch._neg_view(torch.arange(4.0)), "negated view.*resolve_neg"),
        (lambda: torch.ones(4, dtype=torch.complex64).conj(), "conjugated view.*resolve_conj"),
        (lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8), r"quantized \(torch.quint8\)"),
        (lambda: torch.ones(4).to_sparse(), "layout torch.sparse_coo"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor"),
        (lambda: torch.empty(4, device="meta"), "meta device"),
    ],
    ids=["requires-grad", "neg-view", "conj-view", "quantized", "sparse", "nested", "meta"],
)
def test_tensors_whose_memory_is_not_their_values_are_refused(make, match):
    """A negated view would come out unnegated (its memory holds the values without the sign): every such kind
    is refused naming the tensor and what to pass instead."""
    with pytest.raises(ValueError, match=rf"^q .*{match}"):
        to_jax(make(), name="q")


def test_export_options_and_arrays_dlpack_cannot_describe_are_named():
    with pytest.raises(ValueError, match="alignment='16' must be an int"):
        to_jax(torch.ones(4), alignment="16")
    with pytest.raises(ValueError, match=r"keys holds PRNG keys .* jax.random.key_data\(keys\)"):
        to_torch(jax.random.key(0), name="keys")
    with pytest.raises(ValueError, match=r"packed.dtype=int4 packs values below a byte"):
        to_torch(jnp.ones(4, jnp.int4), name="packed")


def test_a_misaligned_pointer_is_refused_before_any_computation():
    storage = torch.randn(1 + 64).to(torch.bfloat16)
    misaligned = storage[1:]
    assert misaligned.data_ptr() % ALIGNMENT
    with pytest.raises(ValueError, match=r"k\.data_ptr\(\)=0x[0-9a-f]+ is not 16-byte aligned"):
        to_jax(misaligned, name="k")
    to_jax(misaligned.clone(), name="k")  # a fresh allocation is aligned


def test_wrong_types_and_deleted_arrays_are_named():
    with pytest.raises(ValueError, match="q must be a torch.Tensor"):
        to_jax(np.zeros(3), name="q")
    with pytest.raises(ValueError, match="out must be a jax.Array"):
        to_torch(torch.zeros(3), name="out")
    array = jnp.zeros(4)
    donated = jax.jit(lambda x: x + 1, donate_argnums=0)
    donated(array)
    if array.is_deleted():  # the CPU client honours donation of a JAX-owned buffer
        with pytest.raises(ValueError, match="deleted"):
            to_torch(array)


def test_empty_tensors_pass_both_ways():
    empty = torch.zeros(0, 4)
    assert to_jax(empty).shape == (0, 4)
    assert to_torch(jnp.zeros((0, 4))).shape == (0, 4)
