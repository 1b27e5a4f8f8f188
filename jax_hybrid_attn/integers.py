"""The scalar helpers every module needs: the checked-int and checked-bool argument tests, ceiling division,
rounding up to a power of two. (No jax at import: the CLI builds its parser without it.)"""

import numbers

import numpy as np

__all__ = ["INT32_MAX", "cdiv", "check_bool", "check_int", "check_int_scalar", "is_int", "next_power_of_two"]

INT32_MAX = 2**31 - 1
"""The largest value a static size may take: positions, windows and chunks are int32 on the device."""


def is_int(value) -> bool:
    """Whether `value` is an integer scalar: a Python int or a numpy integer, never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value, *, minimum: int = 1, maximum: int | None = INT32_MAX) -> int:
    """`value` as a Python int, or `ValueError` naming `name` unless it is an integer scalar (numpy ones
    included, bools not) in ``[minimum, maximum]`` (``maximum=None``: no upper bound)."""
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}={value!r} must be an int {bound}")
    return int(value)


def check_int_scalar(name: str, value, *, minimum: int = 1, maximum: int | None = INT32_MAX):
    """`check_int` for an argument that may also be an integer scalar array (numpy or JAX, traced or not):
    `value` itself, a Python int for an int. A concrete array's value is checked as `check_int` checks an int;
    a traced one is taken as it is (its value is unknown until the device runs: the caller says what a bad one
    does). `ValueError` naming `name` for anything else."""
    import jax  # here, not at import

    if not isinstance(value, (jax.Array, np.ndarray)):
        return check_int(name, value, minimum=minimum, maximum=maximum)
    if value.ndim != 0 or not np.issubdtype(value.dtype, np.integer):
        kind = f"a {value.dtype} array of shape {tuple(value.shape)}"
        raise ValueError(f"{name} ({kind}) must be an int or an integer scalar array")
    if not isinstance(value, jax.core.Tracer):
        check_int(name, value.item(), minimum=minimum, maximum=maximum)
    return value


def check_bool(name: str, value) -> bool:
    """`value` as a Python bool; `ValueError` naming `name` for anything but a bool or numpy bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={value!r} must be a bool")
    return bool(value)


def cdiv(a, b):
    """``ceil(a / b)`` for integers (Python ints or integer arrays, ``b > 0``)."""
    return -(-a // b)


def next_power_of_two(value: int, *, minimum: int = 1) -> int:
    """The smallest power of two >= `value` (1 for values <= 1), at least `minimum`: static sizes rounded so
    that varying ones compile few shapes."""
    return max(minimum, 1 << (max(int(value), 1) - 1).bit_length())
