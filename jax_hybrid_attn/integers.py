"""The two integer helpers every module needs: the checked-int argument test and ceiling division."""

__all__ = ["cdiv", "check_int"]


def check_int(name: str, value, *, minimum: int = 1) -> None:
    """Raise `ValueError` naming `name` unless `value` is an int (not a bool) ``>= minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def cdiv(a, b):
    """``ceil(a / b)`` for integers (Python ints or integer arrays, ``b > 0``)."""
    return -(-a // b)
