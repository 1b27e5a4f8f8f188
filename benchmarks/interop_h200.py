"""The torch backend on the H200: layer call against the direct JAX call, host overhead, stream race,
zero-copy, the cost of `plan`'s value check.

    PYTHONPATH=. python benchmarks/interop_h200.py [--trials 1000] [--small] [--sections layer,plan]

(`jax_hybrid_attn_torch` is the `interop/` folder: install the repository (``pip install -e .``) or, on a machine
without a registry, make it importable: ``mkdir -p /tmp/pkgs && ln -sfn $PWD/interop /tmp/pkgs/jax_hybrid_attn_torch``
then ``PYTHONPATH=.:/tmp/pkgs``.)

1. Decode shape: 64 requests with 8,192-token contexts, 32 query / 8 KV heads, head_dim 128, bf16, block 16, a
   torch-owned cache. The backend's `run` (import q/k/v/cache, write k/v, attend, export the output) against the
   same jitted JAX work called directly on JAX arrays. Both are timed over back-to-back calls (as layers run)
   with one sync at the end; the host overhead is the time `run` takes to return, the GPU being busy. Also with
   q, k and v as views of one projection output (vLLM's case: one import instead of three). ``--trace DIR``
   adds the host time per run by profiler event.
2. Stream race: torch zeroes q, sleeps on the GPU, then writes q on a side stream; `run` is called under that
   stream; torch compares JAX's output with the expected one on the same stream. Mismatches are counted on the
   device over all trials.
3. Zero-copy: the data pointers of q, k, v, the cache and the output on both sides of each conversion.
4. Whether a conversion waits on the host: with tens of milliseconds of torch work queued on the GPU, the host
   time of an ordered import, an unordered one and an export (a conversion that waits takes about as long as the
   queued work).
5. `plan`'s value check: a vLLM-like step (250 decodes over random contexts and 6 prefills of 1,024 tokens,
   block tables [256, 512], block 16, int64 slots as vLLM's) on the device, planned with the default check
   and with ``checked=False``. Parity first (one packed buffer), then the host time per plan, the GPU idle and
   with torch work queued (the check copies the metadata to the host, which waits for that work).

Prints a short table last.
"""

import argparse
import cProfile
import pstats
import time
from functools import partial

import jax
import jax.numpy as jnp
import jax_hybrid_attn_torch.backend as backend_module
import jax_hybrid_attn_torch.dlpack as dlpack_module
import numpy as np
import torch
from jax_hybrid_attn_torch import AttentionLayer, PagedAttentionBackend, to_jax

from jax_hybrid_attn import KVCache, make_attention_metadata, paged_attention
from jax_hybrid_attn.kv_cache import write_kv
from trace_summary import profiled


def decode_inputs(num_reqs, context, num_heads, num_kv_heads, head_dim, block_size, device):
    blocks_per_req = context // block_size
    num_blocks = num_reqs * blocks_per_req + 1
    generator = torch.Generator(device="cpu").manual_seed(0)
    shape = PagedAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=generator).to(device=device, dtype=torch.bfloat16)
    tables = 1 + torch.randperm(num_reqs * blocks_per_req, generator=generator).reshape(
        num_reqs, blocks_per_req
    )
    seq_lens = torch.full((num_reqs,), context, dtype=torch.int32)
    last = context - 1
    slots = tables[:, last // block_size] * block_size + last % block_size
    metadata = {
        "query_start_loc": torch.arange(num_reqs + 1, dtype=torch.int32).to(device),
        "seq_lens": seq_lens.to(device),
        "block_tables": tables.to(torch.int32).to(device),
        "slot_mapping": slots.to(torch.int32).to(device),
    }
    q = torch.randn(num_reqs, num_heads, head_dim, generator=generator).to(
        device=device, dtype=torch.bfloat16
    )
    k = torch.randn(num_reqs, num_kv_heads, head_dim, generator=generator).to(
        device=device, dtype=torch.bfloat16
    )
    v = torch.randn(num_reqs, num_kv_heads, head_dim, generator=generator).to(
        device=device, dtype=torch.bfloat16
    )
    return cache, metadata, q, k, v


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layer_calls(device, args, rows):
    shape = (32, 8, 128, 16) if not args.small else (4, 2, 64, 16)
    num_heads, num_kv_heads, head_dim, block_size = shape
    num_reqs, context = (64, 8192) if not args.small else (4, 256)
    cache, metadata, q, k, v = decode_inputs(
        num_reqs, context, num_heads, num_kv_heads, head_dim, block_size, device
    )
    layer = AttentionLayer(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_dim)
    backend = PagedAttentionBackend({"layer": layer}, block_size=block_size)
    backend.plan(**metadata, max_query_len=1, max_seq_len=context)

    @partial(jax.jit, donate_argnums=3)
    def direct(q, k, v, kv_cache, metadata):  # the same work, called on JAX arrays
        kv_cache = write_kv(kv_cache, k, v, metadata.slot_mapping)
        return paged_attention(q, kv_cache, metadata), kv_cache

    jax_metadata = make_attention_metadata(
        np.ones(num_reqs, np.int32),
        metadata["seq_lens"].cpu().numpy(),
        metadata["block_tables"].cpu().numpy(),
        block_size=block_size,
        max_query_len=1,
        max_seq_len=context,
    )
    q_j, k_j, v_j = (jnp.asarray(np.asarray(t.float().cpu()), jnp.bfloat16) for t in (q, k, v))
    cache_j = jnp.asarray(np.asarray(cache.float().cpu()), jnp.bfloat16)

    reps = args.reps
    out_j, cache_j = direct(q_j, k_j, v_j, cache_j, jax_metadata)  # compile
    jax.block_until_ready(out_j)
    out_t = backend.run("layer", q, k, v, cache)  # compile
    sync(device)
    error = float((out_t.float().cpu() - torch.from_numpy(np.array(out_j.astype(jnp.float32)))).abs().max())

    def direct_call():
        nonlocal cache_j
        out, cache_j = direct(q_j, k_j, v_j, cache_j, jax_metadata)
        return out

    def time_direct():
        nonlocal cache_j
        start = time.perf_counter()
        for _ in range(reps):
            out, cache_j = direct(q_j, k_j, v_j, cache_j, jax_metadata)
        jax.block_until_ready((out, cache_j))
        return (time.perf_counter() - start) / reps

    # vLLM's way: q, k and v are column blocks of one projection output (the backend imports it once)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_view, k_view, v_view = qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1)
    backend.run("layer", q_view, k_view, v_view, cache)  # compile
    sync(device)

    def time_backend(q, k, v, *, keep_output=True):
        host, out = 0.0, None
        start = time.perf_counter()
        for _ in range(reps):
            call = time.perf_counter()
            if keep_output:  # the previous output lives until the next one replaces it
                out = backend.run("layer", q, k, v, cache)
            else:
                backend.run("layer", q, k, v, cache)
            host += time.perf_counter() - call
        sync(device)
        del out
        return (time.perf_counter() - start) / reps, host / reps

    direct_s, backend_s, fused_s, dropped_s = [], [], [], []
    for _ in range(args.rounds):  # interleaved, medians
        direct_s.append(time_direct())
        backend_s.append(time_backend(q, k, v))
        fused_s.append(time_backend(q_view, k_view, v_view))
        dropped_s.append(time_backend(q, k, v, keep_output=False))
    direct_t = float(np.median(direct_s)) * 1e6
    backend_t = float(np.median([b for b, _ in backend_s])) * 1e6
    host_t = float(np.median([h for _, h in backend_s])) * 1e6
    fused_t = float(np.median([b for b, _ in fused_s])) * 1e6
    fused_host_t = float(np.median([h for _, h in fused_s])) * 1e6
    label = f"B={num_reqs} ctx={context} {num_heads}/{num_kv_heads} D={head_dim} bf16"
    rows.append((f"layer call, direct JAX ({label})", f"{direct_t:.1f} us/call"))
    rows.append(
        ("layer call, torch backend run", f"{backend_t:.1f} us/call = {backend_t / direct_t:.3f}x direct")
    )
    rows.append(("host time of run (GPU busy)", f"{host_t:.1f} us/call"))
    rows.append(("run, q/k/v views of one qkv tensor", f"{fused_t:.1f} us/call = {fused_t / direct_t:.3f}x direct, "
                 f"host {fused_host_t:.1f} us/call"))  # fmt: skip
    dropped_t = float(np.median([b for b, _ in dropped_s])) * 1e6
    rows.append(
        ("run, each output dropped at once", f"{dropped_t:.1f} us/call = {dropped_t / direct_t:.3f}x direct")
    )
    rows.append(("backend vs direct output", f"max |diff| {error:.3g}"))
    return backend, cache, q, k, v, direct_call


def host_parts(backend, cache, q, k, v, direct_call, reps, rows):
    """Host time of each part of `run` and of its peers, timed one part at a time over `reps` calls, the GPU kept
    busy by the calls themselves: DLPack imports with and without an event, an export, the backend's jitted call on
    JAX-owned and on imported arrays, the direct call, and a trivial jitted call. "Ordered" imports make JAX wait
    for torch's stream (an event on each side); "already ordered" ones carry no event."""
    spec = backend.layers["layer"]
    device, stream = dlpack_module._DLPACK_TARGETS[q.__dlpack_device__()]
    dl_type = int(q.__dlpack_device__()[0])
    owned = [to_jax(t).copy() for t in (q, k, v)]  # JAX-owned copies
    owned_cache = [to_jax(cache).copy()]
    trivial = jax.jit(lambda x: x + 1)
    small = jnp.ones((16,), jnp.float32)

    def layer_step(q_in, k_in, v_in, cache_in):
        return backend_module._layer_step(
            backend._packed, q_in, k_in, v_in, cache_in, KVCache(None, backend.kv_layout), None, None,
            layout=backend._layout, group=0, params=spec.params, implementation=None, interpret=False,
        )  # fmt: skip

    exported = layer_step(*owned, to_jax(cache).copy())[0]
    # what XLA returns for a donated import: the cache `run` holds between calls
    held = [layer_step(*owned, to_jax(cache.clone()))[1]]

    def on_owned_cache(q_in, k_in, v_in):
        _, owned_cache[0] = layer_step(q_in, k_in, v_in, owned_cache[0])

    def on_held_cache(q_in, k_in, v_in):
        _, held[0] = layer_step(q_in, k_in, v_in, held[0])

    def ordered():
        return to_jax(q), *(to_jax(t, already_ordered=True) for t in (k, v))

    def capsule_to_buffer():  # the capsules are made outside the timed loop
        capsules = [q.__dlpack__(stream=stream) for _ in range(reps)]
        start = time.perf_counter()
        for capsule in capsules:
            dlpack_module._managed_tensor_to_buffer(capsule, device, stream, None, dl_type)
        return time.perf_counter() - start

    parts = {
        "torch capsule (q.__dlpack__, event on torch's stream)": lambda: q.__dlpack__(stream=stream),
        "JAX buffer from that capsule (definition event)": capsule_to_buffer,
        "import, ordered (to_jax)": lambda: to_jax(q),
        "import, already ordered (no event)": lambda: to_jax(q, already_ordered=True),
        "export (to_torch)": lambda: backend_module.to_torch(exported),
        "trivial jitted call (x + 1)": lambda: trivial(small),
        "direct call (write_kv + paged_attention, JAX arrays)": direct_call,
        "jitted layer call, JAX-owned arrays": lambda: on_owned_cache(*owned),
        "jitted layer call, JAX-owned q/k/v, held cache": lambda: on_held_cache(*owned),
        "ordered import of q + jitted call": lambda: on_owned_cache(to_jax(q), *owned[1:]),
        "already-ordered import of q + jitted call": lambda: on_owned_cache(
            to_jax(q, already_ordered=True), *owned[1:]
        ),
        "ordered q, already-ordered k/v + call, held cache": lambda: on_held_cache(*ordered()),
        "already-ordered q/k/v + call, held cache (no wait)": lambda: on_held_cache(
            *(to_jax(t, already_ordered=True) for t in (q, k, v))
        ),
        "4 imports (q ordered) + call, cache imported": lambda: layer_step(
            *ordered(), to_jax(cache, already_ordered=True)
        ),
        "backend run": lambda: backend.run("layer", q, k, v, cache),
    }
    for name, part in parts.items():
        if part is capsule_to_buffer:
            seconds = part()
        else:
            part()
            sync(cache.device)
            start = time.perf_counter()
            for _ in range(reps):
                part()
            seconds = time.perf_counter() - start
        sync(cache.device)
        rows.append((f"host: {name}", f"{seconds / reps * 1e6:.1f} us"))


def zero_copy(backend, cache, q, k, v, rows):
    """Wrap the backend's conversions and compare data pointers on both sides."""
    seen = []
    original_to_jax, original_to_torch = backend_module.to_jax, backend_module.to_torch

    def recording_to_jax(tensor, **kwargs):
        array = original_to_jax(tensor, **kwargs)
        seen.append((kwargs.get("name", "?"), tensor.data_ptr() == array.unsafe_buffer_pointer()))
        return array

    def recording_to_torch(array, **kwargs):
        tensor = original_to_torch(array, **kwargs)
        seen.append(
            ("exported " + kwargs.get("name", "array"), tensor.data_ptr() == array.unsafe_buffer_pointer())
        )
        return tensor

    backend_module.to_jax, backend_module.to_torch = recording_to_jax, recording_to_torch
    try:
        cache_pointer = cache.data_ptr()
        out = backend.run("layer", q, k, v, cache)
        sync(cache.device)
    finally:
        backend_module.to_jax, backend_module.to_torch = original_to_jax, original_to_torch
    shared = {name: same for name, same in seen}
    copied_back = any(name == "exported updated kv cache" for name, _ in seen)
    rows.append(("zero-copy q / k / v", f"{shared.get('q')} / {shared.get('k')} / {shared.get('v')}"))
    rows.append(
        (
            "zero-copy kv_cache in, updated in place",
            f"{shared.get('kv_cache')}, {not copied_back and cache.data_ptr() == cache_pointer}",
        )
    )
    rows.append(("zero-copy output", f"{shared.get('exported output')} (tensor {tuple(out.shape)})"))


def stream_race(backend, cache, q, k, v, device, trials, rows):
    if device.type != "cuda":
        rows.append(("stream race", "skipped: needs a CUDA device"))
        return
    expected = backend.run("layer", q, k, v, cache).clone()
    side = torch.cuda.Stream(device)
    q_buffer = torch.empty_like(q)
    mismatches = torch.zeros((), dtype=torch.int64, device=device)
    sync(device)
    with torch.cuda.stream(side):
        for _ in range(trials):
            q_buffer.zero_()
            torch.cuda._sleep(200_000)  # ~0.1 ms: JAX would read zeros if it did not wait for torch
            q_buffer.copy_(q)
            out = backend.run("layer", q_buffer, k, v, cache)
            mismatches += (out != expected).any()  # torch reads JAX's output on the same stream
    sync(device)
    rows.append((f"stream race, {trials} trials", f"{int(mismatches)} mismatches"))


def conversion_waits(device, rows, *, queued_matmuls: int = 20):
    """Host time of one conversion while torch work is queued, against the time that work takes."""
    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    x = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    exported = jnp.ones((1024, 1024), jnp.bfloat16)

    def queue_work():
        for _ in range(queued_matmuls):
            a @ a

    conversions = {
        "ordered import (to_jax)": lambda: to_jax(x),
        "unordered import (already_ordered=True)": lambda: to_jax(x, already_ordered=True),
        "export (to_torch)": lambda: backend_module.to_torch(exported),
    }
    sync(device)
    started = time.perf_counter()
    queue_work()
    sync(device)
    work = time.perf_counter() - started
    for name, convert in conversions.items():
        convert()  # warm
        sync(device)
        queue_work()
        started = time.perf_counter()
        convert()
        seconds = time.perf_counter() - started
        sync(device)
        rows.append(
            (f"host time of an {name}, {work * 1e3:.0f} ms of work queued", f"{seconds * 1e6:.0f} us")
        )


def vllm_like_step(device, *, num_decodes, num_prefills, prefill_len, block_size, blocks_per_req):
    """`plan`'s arguments for a step of decodes over random contexts and a few prefills: each request's blocks
    shuffled over the pool, its slots those of its positions (vLLM's metadata, int64 slots as vLLM's)."""
    generator = torch.Generator().manual_seed(0)
    query_lens = torch.tensor([1] * num_decodes + [prefill_len] * num_prefills)
    capacity = blocks_per_req * block_size
    contexts = torch.randint(0, capacity - prefill_len, (len(query_lens),), generator=generator)
    seq_lens = query_lens + contexts
    used = (seq_lens + block_size - 1) // block_size
    tables = torch.zeros(len(query_lens), blocks_per_req, dtype=torch.int32)
    ids = 1 + torch.randperm(int(used.sum()), generator=generator).int()
    tables[torch.arange(blocks_per_req) < used[:, None]] = ids
    requests = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens.tolist(), seq_lens.tolist())])
    slots = tables[requests, positions // block_size].long() * block_size + positions % block_size
    metadata = {
        "query_start_loc": torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).int()]),
        "seq_lens": seq_lens.int(),
        "block_tables": tables,
        "slot_mapping": slots,
    }
    bounds = {"max_query_len": int(query_lens.max()), "max_seq_len": int(seq_lens.max())}
    return {name: tensor.to(device) for name, tensor in metadata.items()}, bounds


def plan_check(device, args, rows, *, queued_matmuls: int = 20):
    """`plan` with its default value check against ``checked=False``: parity, then host time per plan."""
    shape = {"num_decodes": 250, "num_prefills": 6, "prefill_len": 1024}
    shape.update(block_size=16, blocks_per_req=512)
    if args.small:
        shape.update(num_decodes=6, num_prefills=2, prefill_len=32, blocks_per_req=16)
    metadata, bounds = vllm_like_step(device, **shape)
    head = {"num_heads": 32, "num_kv_heads": 8, "head_size": 128}
    layers = {"full": AttentionLayer(**head), "window": AttentionLayer(**head, sliding_window=128)}
    backend = PagedAttentionBackend(layers, block_size=shape["block_size"])
    packed = {}
    for checked in (True, False):
        backend.plan(**metadata, **bounds, checked=checked)
        packed[checked] = np.asarray(backend._packed)
    same = np.array_equal(packed[True], packed[False])
    rows.append(("plan parity, checked vs checked=False", "same packed metadata" if same else "DIFFERENT"))
    times = {True: [], False: []}
    for _ in range(args.rounds):  # interleaved, medians
        for checked in (True, False):
            sync(device)
            for _ in range(args.reps):
                start = time.perf_counter()
                backend.plan(**metadata, **bounds, checked=checked)
                times[checked].append(time.perf_counter() - start)
    num_reqs, num_tokens = len(metadata["seq_lens"]), len(metadata["slot_mapping"])
    label = f"{num_reqs} requests, {num_tokens} tokens, tables {list(metadata['block_tables'].shape)}"
    checked_t, unchecked_t = (float(np.median(times[c])) * 1e6 for c in (True, False))
    rows.append((f"plan host time, checked (default) ({label})", f"{checked_t:.1f} us"))
    check_t = checked_t - unchecked_t
    rows.append(("plan host time, checked=False", f"{unchecked_t:.1f} us (check: {check_t:.1f} us)"))
    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for checked in (True, False):
        sync(device)
        started = time.perf_counter()
        for _ in range(queued_matmuls):
            a @ a
        start = time.perf_counter()
        backend.plan(**metadata, **bounds, checked=checked)
        seconds = time.perf_counter() - start
        sync(device)
        work = time.perf_counter() - started
        name = f"plan host time, {work * 1e3:.0f} ms of torch work queued, checked={checked}"
        rows.append((name, f"{seconds * 1e6:.0f} us"))


def layer_sections(device, args, rows) -> None:
    """Sections 1-4: the layer call against the direct JAX call, its host time, zero-copy, the stream race."""
    backend, cache, q, k, v, direct_call = time_layer_calls(device, args, rows)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [backend.run("layer", q, k, v, cache) for _ in range(args.reps)])
        sync(device)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    if args.trace:
        summary = profiled(
            args.trace, lambda: [backend.run("layer", q, k, v, cache) for _ in range(args.reps)]
        )
        rows.append(("GPU ops per run (trace)", f"{summary.gpu_ops / args.reps:.1f}"))
        rows += [("host per run (trace)", line) for line in summary.host_lines(per=args.reps, top=12)]
    host_parts(backend, cache, q, k, v, direct_call, args.reps, rows)
    zero_copy(backend, cache, q, k, v, rows)
    stream_race(backend, cache, q, k, v, device, args.trials, rows)
    conversion_waits(device, rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--profile", action="store_true", help="print where run() spends its host time")
    parser.add_argument(
        "--trace", metavar="DIR", help="profile --reps runs into DIR: host time per run by event"
    )
    sections_help = "layer: sections 1-4 (the layer call); plan: section 5 (plan's value check)"
    parser.add_argument("--sections", default="layer,plan", help=sections_help)
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if not sections <= {"layer", "plan"}:
        parser.error(f"--sections={args.sections!r}: a comma list of layer, plan")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    if "layer" in sections:
        layer_sections(device, args, rows)
    if "plan" in sections:
        plan_check(device, args, rows)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; torch {torch.__version__} on {device}")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
