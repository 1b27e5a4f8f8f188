"""The environment of a test subprocess that sees several CPU devices (XLA reads the count when JAX starts)."""

import os


def forced_cpu_devices_env(count: int) -> dict[str, str]:
    """This process's environment with `count` forced host devices added to its `XLA_FLAGS` (so the test command's
    other XLA options, e.g. the unoptimized CPU backend, still apply) and JAX on the CPU."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
