"""Chained 64-bit block hashes computed in JAX from token ids, with 32-bit integer arithmetic only.

The hash of full block k of a request is ``H(parent, tokens of block k, adapter_id)``, where ``parent`` is the
hash of block k-1, or for block 0 the request's root ``H(ROOT, cache_salt)``; so a hash names the whole prefix,
as vLLM's ``hash_fn((parent_hash or NONE_HASH, block_token_ids, extra_keys))`` does. The adapter id (a LoRA)
enters every block and the cache salt the first one, as in vLLM. A hash is two uint32 words ``(hi, lo)``:
`jax_enable_x64` is not needed.

``H`` runs two different 32-bit mixers over the words (a MurmurHash3 body and an xxHash32-style round, with
different seeds) and joins the two lanes with a two-round Feistel network of MurmurHash3 finalizers, a bijection
that spreads every input bit over all 64 output bits. Constants are fixed, so a hash is the same in every run,
process, machine and backend (pinned by a test).

Collisions. Treating ``H`` as a random 64-bit function, n distinct cached blocks collide somewhere with
probability ``1 - exp(-n^2 / 2^65)``: 2.7 % for n = 10^9 blocks ever hashed, 2.7e-6 for n = 10^7. What a
collision costs is a lookup hitting a wrong block; a lookup against m cached blocks does so with probability
``m / 2^64`` (5.4e-14 for a million cached blocks). For certainty, `AllocatorConfig(verify_hits=True)` stores the
token ids of each cached block and compares them on every hit.

Deliberate differences from vLLM: vLLM hashes with sha256 (cryptographic; a random ``NONE_HASH`` per process
unless ``PYTHONHASHSEED`` is set); ours is a fast non-cryptographic hash with a fixed seed, so hashes are stable
across processes but an adversary who controls prompts could build collisions: isolate tenants with
``cache_salt``. Multimodal and prompt-embedding extra keys are not supported. A group whose block size is a
multiple ``r`` of the hash block size is keyed by the hash of its last hash block (which chains over all earlier
tokens) rather than by the concatenation of its ``r`` hashes.
"""

import hashlib

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, UInt32

__all__ = ["NO_ADAPTER", "cache_salt_words", "chain_block_hash", "hash_words", "root_hash"]

NO_ADAPTER = 0
"""`adapter_id` of a request served without an adapter."""

_MURMUR_C1, _MURMUR_C2, _MURMUR_N = 0xCC9E2D51, 0x1B873593, 0xE6546B64
_FMIX_M1, _FMIX_M2 = 0x85EBCA6B, 0xC2B2AE35
_XX_P1, _XX_P2, _XX_P3, _XX_P4, _XX_P5 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1
_SEED_A, _SEED_B = 0x5BD1E995, 0x2545F491
_FEISTEL_K1, _FEISTEL_K2 = 0x68E31DA4, 0xB5297A4D
_ROOT = (0x6A09E667, 0xBB67AE85)
_TAG_ROOT, _TAG_BLOCK = 0x524F4F54, 0x424C4B30


def _u32(x) -> UInt32[Array, "..."]:
    return jnp.asarray(x).astype(jnp.uint32)


def _rotl(x, r: int):
    return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def _fmix32(h):
    h = h ^ (h >> jnp.uint32(16))
    h = h * jnp.uint32(_FMIX_M1)
    h = h ^ (h >> jnp.uint32(13))
    h = h * jnp.uint32(_FMIX_M2)
    return h ^ (h >> jnp.uint32(16))


def hash_words(words: UInt32[Array, "... n"]) -> UInt32[Array, "... 2"]:
    """64-bit hash ``[..., (hi, lo)]`` of each row of uint32 words (n static)."""
    words = _u32(words)
    n = words.shape[-1]
    a = jnp.full(words.shape[:-1], _SEED_A, jnp.uint32)
    b = jnp.full(words.shape[:-1], _SEED_B + _XX_P5, jnp.uint32)
    for i in range(n):
        w = words[..., i]
        k = _rotl(w * jnp.uint32(_MURMUR_C1), 15) * jnp.uint32(_MURMUR_C2)
        a = _rotl(a ^ k, 13) * jnp.uint32(5) + jnp.uint32(_MURMUR_N)
        b = _rotl(b + w * jnp.uint32(_XX_P3), 17) * jnp.uint32(_XX_P4)
    a = _fmix32(a ^ jnp.uint32(n))
    b = _fmix32(b * jnp.uint32(_XX_P1) + jnp.uint32(n * _XX_P2 & 0xFFFFFFFF))
    a = a ^ _fmix32(b + jnp.uint32(_FEISTEL_K1))
    b = b ^ _fmix32(a + jnp.uint32(_FEISTEL_K2))
    return jnp.stack([a, b], axis=-1)


def root_hash(cache_salt: UInt32[Array, "... 2"]) -> UInt32[Array, "... 2"]:
    """Parent hash of a request's block 0: the fixed root mixed with the request's cache salt (0, 0 = none)."""
    cache_salt = _u32(cache_salt)
    root = jnp.broadcast_to(jnp.asarray(_ROOT, jnp.uint32), cache_salt.shape)
    tag = jnp.full(cache_salt.shape[:-1] + (1,), _TAG_ROOT, jnp.uint32)
    return hash_words(jnp.concatenate([root, cache_salt, tag], axis=-1))


def chain_block_hash(
    parent: UInt32[Array, "... 2"], tokens: Int[Array, "... S"], adapter_id: Int[Array, "..."]
) -> UInt32[Array, "... 2"]:
    """Hash of one full block: its parent's hash, its S token ids and the adapter id."""
    extra = jnp.stack([_u32(adapter_id), jnp.full(jnp.shape(adapter_id), _TAG_BLOCK, jnp.uint32)], axis=-1)
    return hash_words(jnp.concatenate([_u32(parent), _u32(tokens), extra], axis=-1))


def cache_salt_words(cache_salt: str | bytes | None) -> np.ndarray:
    """A cache salt (any string) as the two uint32 words `root_hash` takes; ``None`` gives (0, 0)."""
    if cache_salt is None:
        return np.zeros(2, np.uint32)
    if not isinstance(cache_salt, (str, bytes)):
        raise ValueError(f"cache_salt={cache_salt!r} must be a str, bytes or None")
    data = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt
    digest = hashlib.sha256(b"jax_hybrid_attn cache salt\0" + data).digest()
    words = np.frombuffer(digest[:8], dtype=">u4").astype(np.uint32)
    return words if words.any() else np.array([0, 1], np.uint32)
