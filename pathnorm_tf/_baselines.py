"""The paper's layer-wise baselines: soft-thresholding (the l1 prox) and the l1-ball projections
of rows or of a Dense kernel's columns (a bound on each layer's l_inf operator norm). Public
through :mod:`pathnorm_tf.functional`; the torch ones are in ``pathnorm_lightning/_baselines.py``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from pathnorm_tf._common import (
    Scalar,
    as_matrix,
    check_finite_tensor,
    check_scalar,
    compute_dtype,
    scalar,
)

__all__ = ["project_linf_operator_norm", "project_rows_l1_ball", "prox_l1", "soft_threshold"]


def soft_threshold(t: tf.Tensor, lam: float | tf.Tensor) -> tf.Tensor:
    """``sign(t) max(|t| - lam, 0)``, in ``t``'s dtype (no checks)."""
    lam_t = scalar(lam, t.dtype)
    return tf.sign(t) * tf.maximum(tf.abs(t) - lam_t, tf.zeros([], t.dtype))


@tf.autograph.experimental.do_not_convert
def prox_l1(w: Any, lam: Scalar, check_finite: bool = True) -> tf.Tensor:
    """Soft-thresholding ``sign(w) max(|w| - lam, 0)``, the prox of ``lam ||w||_1``, for a
    floating tensor ``w`` of any shape and ``lam`` finite and >= 0: a new tensor of ``w``'s shape
    and dtype (``check_finite``: NaN/inf weights raise, as in ``prox_path_norm``)."""
    lam = check_scalar(lam, "lam")
    try:
        t = tf.convert_to_tensor(w)
    except (TypeError, ValueError):
        raise ValueError(f"w must be a floating-point tensor, got {type(w).__name__}") from None
    if not t.dtype.is_floating:
        raise ValueError(f"w must be a floating-point tensor, got dtype {t.dtype.name}")
    return soft_threshold(check_finite_tensor(t, "w") if check_finite else t, lam)


@tf.autograph.experimental.do_not_convert
def project_rows_l1_ball(w: Any, radius: Scalar, check_finite: bool = True) -> tf.Tensor:
    """Project each row of ``w`` (shape (r, c)) onto ``{z : ||z||_1 <= radius}``.

    Exact (sort-based) to the rounding of a row's largest entry (a row whose largest entry
    exceeds ~2^23 times ``radius`` in float32, 2^52 in float64, may land outside the ball by
    that), vectorised over rows: the generic row-wise projection. For the l_inf operator-norm
    bound of a Dense kernel (whose rows are *inputs*) use :func:`project_linf_operator_norm`.

    Args:
        w: a 2-D floating tensor.
        radius: the l1 radius, finite and >= 0.
        check_finite: NaN/inf weights raise, as in ``prox_path_norm``.

    Returns:
        A new tensor of ``w``'s shape and dtype.

    References:
        Duchi, Shalev-Shwartz, Singer, Chandra, *Efficient Projections onto the l1-Ball for
        Learning in High Dimensions*, ICML 2008.
    """
    radius = check_scalar(radius, "radius")
    t = as_matrix(w, "w", check_finite)
    cd = compute_dtype(t.dtype)
    u = tf.cast(tf.stop_gradient(t), cd)
    if t.shape[1] == 0 or t.shape[0] == 0:
        return tf.identity(t)
    r = scalar(radius, cd)
    au = tf.abs(u)
    s = tf.sort(au, axis=1, direction="DESCENDING")
    cs = tf.cumsum(s, axis=1)
    j = tf.cast(tf.range(1, tf.shape(u)[1] + 1), cd)
    rho = tf.reduce_sum(tf.cast(s - (cs - r) / j > 0, tf.int32), 1, keepdims=True)
    rho = tf.maximum(rho, 1)
    theta = tf.maximum((tf.gather(cs, rho - 1, axis=1, batch_dims=1) - r) / tf.cast(rho, cd), 0.0)
    inside = tf.reduce_sum(au, 1, keepdims=True) <= r
    out = tf.where(inside, u, tf.sign(u) * tf.maximum(au - theta, 0.0))
    out = tf.where(r > 0, out, tf.zeros_like(out))
    return tf.cast(out, t.dtype)


@tf.autograph.experimental.do_not_convert
def project_linf_operator_norm(kernel: Any, radius: Scalar, check_finite: bool = True) -> tf.Tensor:
    """Project a Dense kernel (in, out) onto ``{K : ||K||_{inf -> inf} <= radius}`` (``radius``
    finite and >= 0; ``check_finite`` as in :func:`project_rows_l1_ball`): a new tensor of its
    shape and dtype.

    The l_inf operator norm of ``u -> u @ K`` is the largest l1 norm of a column of ``K`` (the
    incoming weights of one output unit), so each *column* is projected onto the l1 ball: the
    paper's layer-wise baseline, equal to ``project_rows_l1_ball`` on the torch weight ``K.T``.
    """
    t = as_matrix(kernel, "kernel", check_finite)
    return tf.transpose(project_rows_l1_ball(tf.transpose(t), radius, check_finite=False))
