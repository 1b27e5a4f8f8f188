"""A runner's step functions lowered in worker processes, and kept across processes (`jax.export`).

Lowering a step function holds Python's lock, and most of it is the Mosaic GPU kernels' lowering, so threads do not
speed it up. Worker processes do: each rebuilds the runner abstractly from a picklable `RunnerSpec` (nothing
allocated, JAX on its CPU), lowers its share of the executables for the GPU and sends them back as serialized
`jax.export` modules of flat arguments. The engine's process compiles those (XLA's compiles in threads).

The same modules are kept in a directory (``EngineConfig(compilation_cache=DIR)``), keyed by everything that shapes
them: this package's source, JAX's version, the device kind, the spec and the executable. A later process loads
them instead of lowering, and with JAX's persistent cache in the same directory (`use_compilation_cache`) XLA's
compiles become cache loads too.

`StepLowering` gathers both: it starts the workers when it is made, which can be before the weights exist
(`engine.lower_ahead`), so that they lower while the weights load.
"""

import dataclasses
import hashlib
import os
import pickle
import queue
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import export

from ..kernels.mixed_batch import lowering_for_sms, num_sms
from ..models.config import ModelConfig
from ..models.decoder import Decoder
from .config import EngineConfig

__all__ = ["RunnerSpec", "StepCache", "StepLowering", "export_step", "export_in_workers", "use_compilation_cache"]

FORMAT_VERSION = 1
"""Bumped when what a cache entry holds changes."""
MOSAIC_GPU_CALL = "mosaic_gpu_v2"
"""The custom call of the Mosaic GPU kernels: not one of `jax.export`'s stable targets, kept as lowered (the cache
key pins the versions)."""
_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def use_compilation_cache(directory: str | os.PathLike) -> None:
    """JAX's persistent compilation cache in `directory`, keeping every entry (however fast it compiled or small it
    is) and XLA's GPU autotuning results. Call it before anything compiles."""
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_persistent_cache_enable_xla_caches", "xla_gpu_per_fusion_autotune_cache_dir")


@dataclasses.dataclass(frozen=True)
class RunnerSpec:
    """What a worker needs to rebuild a `ModelRunner` abstractly: the model's config and dtypes, the resolved
    engine config, ``max_model_len`` and the SM count of the GPU its kernels launch on (`mixed_batch.num_sms`:
    a worker lowers on its CPU)."""

    model_config: ModelConfig
    engine_config: EngineConfig
    max_model_len: int
    dtype: str
    param_dtype: str
    num_sms: int

    @classmethod
    def of(cls, model: Decoder, model_config: ModelConfig, config: EngineConfig, max_model_len: int):
        """The spec of a runner of `model`, or None when a worker could not rebuild it: a model other than
        ``Decoder(model_config, dtype=..., param_dtype=...)`` with its dtypes, or a runner over several devices."""
        if config.tensor_parallel != 1 or not isinstance(model, Decoder) or model.config != model_config:
            return None
        param_dtype = model.model.embed_tokens.weight.dtype
        spec = cls.of_config(model_config, config, max_model_len, dtype=model.dtype, param_dtype=param_dtype)
        rebuilt = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(spec.abstract_model()))
        actual = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(model))
        return spec if rebuilt == actual else None

    @classmethod
    def of_config(cls, model_config: ModelConfig, config: EngineConfig, max_model_len: int, *, dtype, param_dtype):
        """The spec of a runner of ``Decoder(model_config, dtype=dtype, param_dtype=param_dtype)`` (`config`
        resolved, one device)."""
        # where and how it is compiled, not what: equal steps share entries
        config = dataclasses.replace(config, compilation_cache=None, compile_workers=0, max_model_len=max_model_len)
        return cls(model_config, config, max_model_len, jnp.dtype(dtype).name, jnp.dtype(param_dtype).name,
                   num_sms())  # fmt: skip

    def abstract_model(self) -> Decoder:
        return nnx.eval_shape(lambda: Decoder(self.model_config, rngs=nnx.Rngs(0), dtype=self.dtype,
                                              param_dtype=self.param_dtype))  # fmt: skip

    def abstract_runner(self):
        from .model_runner import ModelRunner

        return ModelRunner(self.abstract_model(), self.model_config, self.engine_config,
                           max_model_len=self.max_model_len)  # fmt: skip

    def executable_keys(self) -> list[tuple]:
        """`ModelRunner.executable_keys` of the runner of this spec."""
        from .model_runner import executable_keys
        from .step_shapes import step_shapes

        config = self.engine_config
        shapes = step_shapes(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                             cascade=config.cascade_step)  # fmt: skip
        return executable_keys(shapes, num_decode_steps=config.decode_steps)

    def fingerprint(self, key: tuple, *, platform: str, device_kind: str) -> str:
        """The cache key of executable `key` of this spec on a device of `device_kind`."""
        digest = hashlib.sha256()
        for path in sorted(_PACKAGE_DIR.rglob("*.py")):
            digest.update(path.relative_to(_PACKAGE_DIR).as_posix().encode())
            digest.update(path.read_bytes())
        digest.update(repr((FORMAT_VERSION, jax.__version__, platform, device_kind, self, key)).encode())
        return digest.hexdigest()[:32]


def export_step(runner, key: tuple, *, platform: str) -> bytes:
    """Executable `key` of `runner` lowered for `platform`, as a serialized `jax.export` module of flat arguments
    (the leaves of its dynamic arguments, in `jax.tree.flatten` order), with the structure of its outputs."""
    fn, args, _ = runner.call(key)
    leaves, in_tree = jax.tree.flatten(args)
    out_tree = []

    def flat(*leaves):
        outputs, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, leaves)))
        out_tree.append(tree)
        return tuple(outputs)

    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    exported = export.export(jax.jit(flat), platforms=[platform],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(MOSAIC_GPU_CALL)])(*abstract)  # fmt: skip
    return pickle.dumps({"exported": exported.serialize(), "out_tree": out_tree[0]})


def export_in_workers(spec: RunnerSpec, shares: list[list[tuple]], *, platform: str):
    """`export_step` of the executables of each share in a new process of its own (``python -m`` this module, JAX
    on its CPU: it lowers for `platform` and touches no GPU). Yields (key, serialized step) as each process ends."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(_PACKAGE_DIR.parent), os.environ.get("PYTHONPATH", "")])}  # fmt: skip

    def run(share):
        done = subprocess.run([sys.executable, "-m", __name__], input=pickle.dumps((spec, share, platform)),
                              capture_output=True, env=env)  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"a process lowering the step functions failed ({done.returncode}):\n"
                               f"{done.stderr.decode(errors='replace')[-4000:]}")  # fmt: skip
        return list(zip(share, pickle.loads(done.stdout), strict=True))

    with ThreadPoolExecutor(max_workers=len(shares)) as pool:
        for future in as_completed([pool.submit(run, share) for share in shares]):
            yield from future.result()


def _worker_main() -> None:
    """(In a worker process.) Read (spec, keys, platform) from stdin, write their `export_step`s to stdout."""
    spec, keys, platform = pickle.loads(sys.stdin.buffer.read())
    runner = spec.abstract_runner()
    with lowering_for_sms(spec.num_sms):
        steps = [export_step(runner, key, platform=platform) for key in keys]
    sys.stdout.buffer.write(pickle.dumps(steps))


class StepLowering:
    """The serialized step functions (`export_step`) of every executable of `spec`'s runner, as each is ready: from
    `cache` where it has them, else lowered by `workers` new processes (each forward shape in one of its own, the
    rest together; started here, so they run while the caller goes on) or, with no workers, by the runner that
    asks (`results`), and put in `cache`."""

    def __init__(self, spec: RunnerSpec, *, cache: "StepCache | None" = None, workers: int = 0):
        self.spec, self.cache = spec, cache
        platform = export.default_export_platform()  # "cuda", not "gpu"
        device_kind = jax.devices()[0].device_kind
        self._ready: queue.Queue = queue.Queue()  # (key, blob) or (None, exception)
        self._fingerprints, cached, missing = {}, 0, []
        for key in spec.executable_keys():
            fingerprint = spec.fingerprint(key, platform=platform, device_kind=device_kind)
            blob = None if cache is None else cache.get(fingerprint)
            if blob is None:
                missing.append(key)
                self._fingerprints[key] = fingerprint
            else:
                self._ready.put((key, blob))
                cached += 1
        self._expected = cached + (len(missing) if workers > 0 else 0)
        self._here = [] if workers > 0 else missing  # lowered by `results`' runner
        if workers > 0 and missing:
            whole_model = ("forward", "decode_steps")  # a lowering each; the small calls share one
            forwards = [key for key in missing if key[0] in whole_model]
            rest = [key for key in missing if key[0] not in whole_model]
            shares = [[key] for key in forwards] + ([rest] if rest else [])
            merged = [sum(shares[i::workers], []) for i in range(min(workers, len(shares)))]
            threading.Thread(target=self._from_workers, args=(merged, platform), daemon=True,
                             name="jha-lowering").start()  # fmt: skip
        self._platform = platform

    def _from_workers(self, shares, platform):
        try:
            for key, blob in export_in_workers(self.spec, shares, platform=platform):
                self._keep(key, blob)
                self._ready.put((key, blob))
        except Exception as error:  # raised again by `results`, on the caller's thread
            self._ready.put((None, error))

    def _keep(self, key, blob):
        if self.cache is not None:
            self.cache.put(self._fingerprints[key], blob)

    def results(self, runner):
        """(key, serialized step function) of every executable, as each is ready; those no worker lowers are
        lowered by `runner` (a runner of this spec) on this thread, after the ready ones."""
        for _ in range(self._expected):
            key, blob = self._ready.get()
            if key is None:
                raise blob
            yield key, blob
        for key in self._here:
            blob = export_step(runner, key, platform=self._platform)
            self._keep(key, blob)
            yield key, blob


class StepCache:
    """Serialized step functions in `directory` (created if missing), one file per fingerprint."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def get(self, fingerprint: str) -> bytes | None:
        path = self.directory / f"{fingerprint}.step"
        return path.read_bytes() if path.is_file() else None

    def put(self, fingerprint: str, blob: bytes) -> None:
        path = self.directory / f"{fingerprint}.step"
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_bytes(blob)
        partial.replace(path)  # atomic: a reader sees the whole entry or none


def load_step(blob: bytes, abstract_args: list, *, donate: tuple[int, ...]):
    """(the `jax.stages.Lowered` of a serialized step function on these flat abstract arguments, the structure of
    its outputs)."""
    entry = pickle.loads(blob)
    exported = export.deserialize(entry["exported"])
    lowered = jax.jit(exported.call, donate_argnums=donate).lower(*abstract_args)
    return lowered, entry["out_tree"]


def flat_positions(tree, donated_args: tuple[int, ...]) -> tuple[int, ...]:
    """The flat leaf positions of the positional arguments `donated_args` of the argument tuple `tree`."""
    counts = [len(jax.tree.leaves(arg)) for arg in tree]
    starts = np.cumsum([0, *counts])
    return tuple(int(i) for a in donated_args for i in range(starts[a], starts[a + 1]))


if __name__ == "__main__":
    _worker_main()
