"""The check both backends give a real argument (``lam``, ``radius``) once it is out of any
tensor: the same types accepted, the same errors, word for word."""

from __future__ import annotations

import math
import numbers

__all__ = ["finite_nonnegative"]


def finite_nonnegative(value: object, name: str) -> float:
    """``value`` as a Python float, checked to be finite and >= 0 (``name``: the argument's).

    Raises:
        TypeError: not a real number (str, None, bool, complex).
        ValueError: NaN, inf, negative, or an int beyond the float range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    try:
        result = float(value)
    except OverflowError:
        raise ValueError(
            f"{name} must be a finite number >= 0, got an int too large for a float"
        ) from None
    if math.isnan(result) or math.isinf(result) or result < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {result!r}")
    return result
