"""Shared rules of pathnorm_tf: argument checks, dtypes, finiteness, "are we tracing for XLA".

Every other private module imports this one (and :mod:`pathnorm_tf._xla`) only; none imports
the public facade :mod:`pathnorm_tf.functional`.

Errors follow one rule on both backends: a strength that is not a real number (``str``,
``None``, ``bool``, ``complex``, a non-numeric tensor) raises ``TypeError``; a real that is
NaN, inf or negative, and a shape or dtype that does not fit, raise ``ValueError``; weights
holding NaN/inf raise :class:`NonFiniteWeightsError` (a ``ValueError``, and in TensorFlow also
an ``InvalidArgumentError``, the type the graph runtime raises for a failed check).
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf

from shared_spec.scalars import finite_nonnegative, not_scalar_message

try:  # TensorFlow's own test for "being traced for XLA" (private, hence the fallback)
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
except ImportError:  # pragma: no cover

    def GraphOrParentsInXlaContext(graph: Any) -> bool:
        return True  # every graph: the XLA-friendly formulations (same values)


Scalar = Any  # a Python number or a 0-d tensor (tf.Tensor, tf.Variable)


class NonFiniteWeightsError(tf.errors.InvalidArgumentError, ValueError):
    """A weight given to the prox holds NaN or inf (the prox is undefined there).

    A ``ValueError`` with the message of torch's ``pathnorm_lightning.NonFiniteWeightsError``,
    and also a ``tf.errors.InvalidArgumentError``: in a graph (``tf.function`` without XLA) the
    check is an assertion, which the runtime raises as that type with this message (Python
    cannot run there, and ``fit`` re-raises it), so ``except tf.errors.InvalidArgumentError``
    catches every case: eager, graph and the deferred XLA one (see
    :mod:`pathnorm_tf.optimizers`)."""

    def __init__(self, message: str) -> None:
        super().__init__(None, None, message)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.message,)


def non_finite_message(name: str) -> str:
    """The message for NaN/inf in ``name`` (the torch side's ``non_finite``)."""
    return (
        f"{name} contains NaN or inf; the prox of non-finite weights is undefined "
        "(check the learning rate and the loss for divergence)"
    )


def tracing_for_xla() -> bool:
    """True while a function is traced for XLA (``tf.function(jit_compile=True)``, Keras
    ``jit_compile=True``); False eagerly and in plain graphs. Only the choice between
    equivalent formulations depends on it, never the values beyond rounding."""
    if tf.executing_eagerly():
        return False
    return bool(GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def is_symbolic(t: Any) -> bool:
    return isinstance(t, tf.Tensor) and not hasattr(t, "numpy")


def warn_if_xla(what: str, stacklevel: int = 3) -> None:
    """XLA compiles TensorFlow's assertions away: say so when a graph check is added there."""
    if tracing_for_xla():
        warnings.warn(
            f"pathnorm_tf: {what} is not checked under XLA (jit_compile=True), which drops "
            "TensorFlow assertions; compile without XLA to get the error, or check the values "
            "outside the compiled function.",
            UserWarning,
            stacklevel=stacklevel,
        )


def check_scalar(value: Scalar, name: str) -> float | tf.Tensor:
    """``value`` (a Python or NumPy real, or a 0-d real array or tensor) as a Python float,
    checked now, or, for a symbolic tensor, as a 0-d tensor with run-time assertions. The rule,
    and its messages, are the torch package's (:mod:`shared_spec.scalars`).

    Raises:
        TypeError: ``value`` is not a real number (a bool of any kind included).
        ValueError: it is NaN, inf or negative, or an array or tensor that is not 0-d.
    """
    if tf.is_tensor(value) or isinstance(value, tf.Variable):
        t = tf.convert_to_tensor(value)
        if is_symbolic(t):  # only the graph knows the value: checked when it runs
            if t.shape.rank not in (None, 0):
                raise ValueError(not_scalar_message(name, type(value).__name__, t.shape.as_list()))
            if not (t.dtype.is_floating or t.dtype.is_integer) or t.dtype == tf.bool:
                raise TypeError(f"{name} must be a real number, got a {t.dtype.name} tensor")
            t = tf.ensure_shape(t, [])
            warn_if_xla(f"a tensor {name} (finite, >= 0)")
            message = f"{name} must be a finite number >= 0"
            tf.debugging.assert_all_finite(tf.cast(t, tf.float64), message)
            tf.debugging.assert_non_negative(t, message=message)
            return t
    return finite_nonnegative(value, name)


def as_matrix(w: Any, name: str, check_finite: bool) -> tf.Tensor:
    """``w`` as a 2-D floating tensor, checked (see :func:`check_finite_tensor`)."""
    try:
        t = tf.convert_to_tensor(w)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} must be a tf.Tensor, tf.Variable or keras.Variable, got {type(w).__name__}"
        ) from None
    if t.shape.rank != 2:
        raise ValueError(f"{name} must be a 2-D kernel, got shape {tuple(t.shape)}")
    if not t.dtype.is_floating:
        raise ValueError(f"{name} must have a floating dtype, got {t.dtype.name}")
    return check_finite_tensor(t, name) if check_finite else t


def check_finite_tensor(t: tf.Tensor, name: str) -> tf.Tensor:
    """``t``, checked for NaN/inf: eagerly :class:`NonFiniteWeightsError` now; in a graph a
    run-time assertion (``tf.errors.InvalidArgumentError``; dropped under XLA, with a warning)."""
    message = non_finite_message(name)
    if is_symbolic(t):
        warn_if_xla(f"that {name} is finite (check_finite=True)", stacklevel=6)
        return tf.debugging.assert_all_finite(t, message)
    if not bool(tf.reduce_all(tf.math.is_finite(t))):
        raise NonFiniteWeightsError(message)
    return t


def static_dims(t: tf.Tensor, name: str) -> tuple[int, int]:
    a, b = t.shape
    if a is None or b is None:
        raise ValueError(
            f"{name} needs a static shape (the bisection length depends on it), got {t.shape}"
        )
    return int(a), int(b)


def check_pair(kernel_in: Any, kernel_out: Any, check_finite: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """Two kernels that pair up: 2-D, one floating dtype, ``kernel_in.shape[1] ==
    kernel_out.shape[0]``."""
    k_in = as_matrix(kernel_in, "kernel_in", check_finite)
    k_out = as_matrix(kernel_out, "kernel_out", check_finite)
    if k_in.dtype != k_out.dtype:
        raise ValueError(
            f"kernel_in ({k_in.dtype.name}) and kernel_out ({k_out.dtype.name}) must have the "
            "same dtype; cast one of them (the prox would otherwise run at the lower precision)"
        )
    n_in, n_out = k_in.shape[1], k_out.shape[0]
    if n_in is not None and n_out is not None and n_in != n_out:
        raise ValueError(
            f"kernel_in (m, n) = {tuple(k_in.shape)} and kernel_out (n, p) = "
            f"{tuple(k_out.shape)} do not pair: kernel_in.shape[1] must equal "
            "kernel_out.shape[0] (the hidden width n)"
        )
    return k_in, k_out


def scalar(value: float | tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """``value`` in ``dtype``; a Python float is converted directly (tf.cast would round it to
    float32 first)."""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return tf.cast(value, dtype)
    return tf.constant(value, dtype)


def compute_dtype(dtype: tf.DType) -> tf.DType:
    """float64 stays float64; every other float (half, bfloat16, float32) works in float32."""
    return tf.float64 if dtype == tf.float64 else tf.float32
