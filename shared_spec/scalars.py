"""The check both backends give a real argument (``lam``, ``radius``): the same types accepted,
the same errors, word for word.

A backend handles only what needs its own framework (a symbolic TensorFlow tensor) and passes
everything else here, its own eager tensors included: a Python real, a NumPy scalar, or a 0-d
array or tensor of any framework (NumPy, torch, TensorFlow) is accepted; an array or tensor
that is not 0-d is refused (even with one element), as are bools of every kind.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import numpy as np

__all__ = ["finite_nonnegative", "not_scalar_message", "unwrap_scalar"]


def not_scalar_message(name: str, kind: str, shape: Iterable[int | None]) -> str:
    """The message for an array or tensor (type name ``kind``) of ``shape`` that is not 0-d."""
    dims = tuple(None if d is None else int(d) for d in shape)
    message = (
        f"{name} must be a scalar (a number, or a 0-d array or tensor), got an array of "
        f"shape {dims} ({kind})"
    )
    if dims and all(d == 1 for d in dims):
        message += ": pass its one element as a number"
    return message


def unwrap_scalar(value: object, name: str) -> object:
    """``value`` out of any array: a NumPy scalar, or a 0-d array or tensor (anything with a
    ``shape`` or ``__array__``), as the Python scalar it holds; anything else unchanged.

    Raises:
        ValueError: an array or tensor that is not 0-d.
    """
    if type(value) in (float, int, bool):
        return value
    shape = getattr(value, "shape", None)
    if shape is None:
        if not hasattr(value, "__array__"):
            return value  # str, None, complex, Fraction ...: judged by finite_nonnegative
        shape = np.shape(value)
    if tuple(shape) != ():
        raise ValueError(not_scalar_message(name, type(value).__name__, shape))
    item = getattr(value, "item", None)  # NumPy, torch (also on a GPU or requiring grad)
    return item() if callable(item) else np.asarray(value).item()


def finite_nonnegative(value: object, name: str) -> float:
    """``value`` as a Python float, checked to be finite and >= 0 (``name``: the argument's);
    arrays and tensors are unwrapped first (:func:`unwrap_scalar`).

    Raises:
        TypeError: not a real number (str, None, complex, a bool of any kind).
        ValueError: an array or tensor that is not 0-d; NaN, inf, negative, or an int beyond
            the float range.
    """
    value = unwrap_scalar(value, name)
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
