"""Pure TensorFlow functions: the exact 1-path-norm prox, its bounds and the paper's baselines.

Layout (Keras ``Dense(n) -> act -> Dense(p)`` on inputs of width m): hidden unit ``i`` owns the
column ``kernel_in[:, i]`` (incoming) of ``kernel_in`` (m, n) and the row ``kernel_out[i, :]``
(outgoing) of ``kernel_out`` (n, p); the 1-path-norm is ``sum_i ||kernel_out[i, :]||_1 *
||kernel_in[:, i]||_1`` (biases are not part of it). The algorithms work in ``shared_spec``'s
neutral layout: ``X = kernel_out`` (n, p), ``Y = transpose(kernel_in)`` (n, m).

The prox solves, separately for every hidden unit (x = outgoing, y = incoming weights)::

    min_{v, w}  1/2 ||v - x||^2 + 1/2 ||w - y||^2 + lam * ||v||_1 * ||w||_1

exactly, with the same candidates and tie rule by ``"sort"`` (:mod:`pathnorm_tf._sort`, the
shortest exact algorithm: read it first) or ``"band"`` (:mod:`pathnorm_tf._band`, the default:
it sorts only the band of the long side that can change support). The prox is
scale-equivariant, so each unit is scaled by a power of two (exact) that brings its largest
entry near 1: the result is exact at every finite magnitude (TensorFlow's CPU kernels treat a
subnormal weight as 0, docs/keras.md). Static-shape tf ops: eager, ``tf.function`` and XLA
(``jit_compile=True``), CPU and GPU; float16/bfloat16 are computed in float32. The paper's layer-wise baselines live in :mod:`pathnorm_tf._baselines`
and are public here.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from pathnorm_tf._band import Band, band_setup, prox_band
from pathnorm_tf._baselines import project_linf_operator_norm, project_rows_l1_ball, prox_l1
from pathnorm_tf._common import (
    NonFiniteWeightsError,
    Scalar,
    check_pair,
    check_scalar,
    compute_dtype,
    static_dims,
)
from pathnorm_tf._sort import prox_rows
from pathnorm_tf._xla import BITS, materialized, reduce_units

__all__ = [
    "METHODS",
    "NonFiniteWeightsError",
    "path_norm",
    "product_bound",
    "project_linf_operator_norm",
    "project_rows_l1_ball",
    "prox_l1",
    "prox_path_norm",
]

METHODS = ("auto", "band", "sort")
# For lam >= 1 no support pair is feasible (k l lam^2 >= 1): only the two trivial points remain
# and the prox no longer depends on lam. Capping keeps lam^2 finite (as torch does).
_LAM_CAP = 2.0


@tf.autograph.experimental.do_not_convert
def prox_path_norm(
    kernel_in: Any,
    kernel_out: Any,
    lam: Scalar,
    *,
    check_finite: bool = True,
    method: str = "auto",
) -> tuple[tf.Tensor, tf.Tensor]:
    """Exact prox of ``lam * path_norm``: ``argmin 1/2||A - K_in||^2 + 1/2||B - K_out||^2 + lam P(A, B)``.

    Args:
        kernel_in: first Dense kernel, shape (m, n) (static shape).
        kernel_out: second Dense kernel, shape (n, p), of the same dtype.
        lam: prox step, finite and >= 0 (inside proximal SGD: ``lr * lambda``); a Python number
            (checked now) or a 0-d tensor (checked when the graph runs).
        check_finite: check the weights for NaN/inf (eagerly: :class:`NonFiniteWeightsError`;
            inside a graph: ``tf.debugging.assert_all_finite``). Disable on hot paths.
        method: ``"sort"`` sorts whole rows of the longer side; ``"band"`` sorts only the band
            of entries that can change support; ``"auto"`` = ``"band"``. Both are exact and
            return the same minimiser (as the torch methods).

    Returns:
        ``(kernel_in_new, kernel_out_new)``, new tensors of the input dtype. Half precision
        inputs are computed in float32 and cast back.

    Raises:
        TypeError: ``lam`` is not a real number.
        ValueError: ``lam`` is NaN, inf or negative; the kernels do not pair (rank, width,
            dtype); ``method`` is unknown. :class:`NonFiniteWeightsError` (a ``ValueError``)
            for NaN/inf weights.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    lam = check_scalar(lam, "lam")
    k_in, k_out = check_pair(kernel_in, kernel_out, check_finite)
    m, n = static_dims(k_in, "kernel_in")
    _, p = static_dims(k_out, "kernel_out")
    if (isinstance(lam, float) and lam == 0.0) or m * n == 0 or n * p == 0:
        return tf.identity(k_in), tf.identity(k_out)
    new_in, new_out = _prox_kernels(k_in, k_out, lam, method)
    return new_in, new_out


def _scales(big: tf.Tensor, zero_to_one: bool) -> tf.Tensor:
    """Per unit a power of two ``s`` (``big``'s shape and dtype) that brings ``big`` (the
    unit's largest magnitude) into [1, 2), clipped to the normal numbers (into [2^-23, 4) or
    [2^-52, 4) at the ends of the range): multiplying by it is exact. ``zero_to_one``: ``s = 1``
    where ``big`` is 0 (or subnormal, which TensorFlow treats as 0)."""
    dt = big.dtype
    mant, bias = (23, 127) if dt == tf.float32 else (52, 1023)
    int_t = BITS[dt]
    exponent = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(tf.bitcast(big, int_t), tf.constant(mant, int_t)),
        tf.constant(2 * bias + 1, int_t),
    )  # the biased exponent field: 0 for zero and subnormals, 2 bias + 1 for inf and NaN
    power = tf.clip_by_value(2 * bias - exponent, 1, 2 * bias - 1)  # biased exponent of 2^-e
    if zero_to_one:
        power = tf.where(tf.equal(exponent, 0), tf.constant(bias, int_t), power)
    (s,) = materialized(tf.bitcast(tf.bitwise.left_shift(power, tf.constant(mant, int_t)), dt))
    return s


@tf.autograph.experimental.do_not_convert
def _prox_kernels(
    k_in: tf.Tensor,
    k_out: tf.Tensor,
    lam: float | tf.Tensor,
    method: str = "auto",
    *,
    verdict: bool = False,
) -> tuple[tf.Tensor, ...]:
    """:func:`prox_path_norm` without input checks (Dense layout, static shapes); with
    ``verdict``, also whether every entry of both kernels is finite (0-d bool, see
    :func:`_all_finite`): the new kernels are undefined where it is False.

    The per-unit work (the short side, the candidates) runs in float64 and
    :func:`_soft_threshold_exact` applies the thresholds to the kernels: the result is the exact
    prox rounded once to the weights' dtype. The sort scales every unit by a power of two from
    its largest entry; the band, by one from its short side's largest entry (applied inside its
    passes over the long side), after which long-side squares that underflow are below the
    objective's resolution. A unit whose short side is 0 keeps its long side (exact, whatever
    its sums). Units whose long-side sums still leave the range (a long side beyond ~2^60 times
    its short side in float32, ~2^500 in float64) take the sort's thresholds, in a branch that
    runs only when there is such a unit.
    """
    ld = compute_dtype(k_in.dtype)  # the long side's storage
    # lam capped (see _LAM_CAP); lam2 squared in float64 and rounded once, as torch squares a float
    if isinstance(lam, float):
        lam = min(lam, _LAM_CAP)
    else:
        lam = tf.minimum(tf.cast(lam, tf.float64), _LAM_CAP)
    lam2 = lam * lam
    k_in_c = tf.cast(tf.stop_gradient(k_in), ld)  # (m, n): hidden unit i is column i
    k_out_c = tf.cast(tf.stop_gradient(k_out), ld)  # (n, p): hidden unit i is row i
    m, n = int(k_in_c.shape[0]), int(k_in_c.shape[1])
    p = int(k_out_c.shape[1])
    finite = None
    if method == "sort":
        t_out, t_in = _sort_thresholds(k_in_c, k_out_c, lam, lam2)
        if verdict:
            finite = _all_finite(k_in_c, k_out_c, None)
    else:
        short = tf.reduce_max(tf.abs(k_in_c), 0)[:, None] if p > m else k_out_c
        big = tf.reduce_max(tf.abs(short), 1, keepdims=True)
        s = _scales(big, True)
        s64 = tf.cast(s, tf.float64)
        # The shorter side is enumerated (the problem is symmetric); the longer one stays in its
        # Dense layout (no transpose), scaled inside the band's passes (no pass of its own).
        if p > m:
            x = tf.cast(tf.transpose(k_in_c), tf.float64) * s64
            problem = band_setup(x, k_out_c, 0, lam, lam2, True, y_scale=s)
        else:
            x = tf.cast(k_out_c, tf.float64) * s64
            problem = band_setup(x, k_in_c, 1, lam, lam2, y_scale=s)
        t_x, t_y = prox_band(problem)
        t_out, t_in = (t_y, t_x) if problem.swapped else (t_x, t_y)
        if verdict:
            finite = _all_finite(k_in_c, k_out_c, problem)
        # a zero short side: the long side stays (the minimiser is (x, 0) or (0, y))
        t_out, t_in = (tf.where(big > 0, t / s64, tf.zeros_like(t)) for t in (t_out, t_in))
        valid = problem.in_range | tf.equal(big, 0)

        def band_then_sort() -> tuple[tf.Tensor, tf.Tensor]:
            # the rare units whose long-side sums left the range: the sort method's thresholds
            sorted_out, sorted_in = _sort_thresholds(k_in_c, k_out_c, lam, lam2)
            return tf.where(valid, t_out, sorted_out), tf.where(valid, t_in, sorted_in)

        t_out, t_in = tf.cond(tf.reduce_all(valid), lambda: (t_out, t_in), band_then_sort)
    new_in = _soft_threshold_exact(k_in_c, tf.reshape(t_in, [1, n]))
    new_out = _soft_threshold_exact(k_out_c, t_out)
    new = tf.cast(new_in, k_in.dtype), tf.cast(new_out, k_out.dtype)
    return new if finite is None else (*new, finite)


def _all_finite(k_in: tf.Tensor, k_out: tf.Tensor, problem: Band | None) -> tf.Tensor:
    """Whether every entry of ``k_in`` and ``k_out`` is finite (0-d bool), read off the band
    ``problem``'s own sums where it can (``None``: one pass over both kernels).

    The short side ``problem.x`` is checked entry by entry (its power-of-two scale keeps finite
    entries finite and the others not); the long side by its per-unit sums of squares ``ysq``,
    which the band computes anyway and which a NaN or inf entry makes non-finite. Only where a
    sum is not finite (finite entries can also overflow it) does a pass over both kernels
    decide, in a branch of its own."""

    def exact() -> tf.Tensor:
        return tf.reduce_all([tf.reduce_all(tf.math.is_finite(k)) for k in (k_in, k_out)])

    if problem is None:
        return exact()
    sums = tf.reduce_all(tf.math.is_finite(problem.ysq))
    fast = sums & tf.reduce_all(tf.math.is_finite(problem.x))
    return tf.cond(fast, lambda: tf.constant(True), exact)


def _sort_thresholds(
    k_in: tf.Tensor, k_out: tf.Tensor, lam: float | tf.Tensor, lam2: float | tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """``(t_out, t_in)`` (n, 1) by the sort method, each unit scaled by a power of two from its
    largest entry over both sides (a pass over both kernels; exact at every finite magnitude)."""
    big_in = reduce_units(tf.reduce_max, tf.abs(k_in), 1)
    s = _scales(tf.maximum(big_in, tf.reduce_max(tf.abs(k_out), 1, keepdims=True)), False)
    x, y = tf.cast(k_out * s, tf.float64), tf.cast(tf.transpose(k_in) * s, tf.float64)
    t_out, t_in = prox_rows(x, y, lam, lam2)
    s64 = tf.cast(s, tf.float64)
    return t_out / s64, t_in / s64


def _soft_threshold_exact(z: tf.Tensor, t: tf.Tensor) -> tf.Tensor:
    """``sign(z) max(|z| - t, 0)`` for ``z`` in float32 or float64 and a float64 threshold
    ``t`` broadcast against it (``inf``: 0), in ``z``'s dtype, without float64 work per entry.

    ``t = t_hi + t_lo`` with ``t_hi`` = ``t`` rounded to float32 and ``t_lo`` = the rest
    rounded: ``|z| - t_hi > t_lo`` is exactly ``|z| > t`` (``|z| - t_hi`` is exact where it
    matters, and ``|t_lo|`` is below half an ulp of ``t_hi``), so the zero pattern is the
    exact one, and a kept entry is ``(|z| - t_hi) - t_lo``, within an ulp of ``|z| - t``.
    """
    if z.dtype == tf.float64:
        return z - tf.minimum(tf.maximum(z, -t), t)
    t_hi = tf.cast(t, z.dtype)
    t_lo = tf.cast(t - tf.cast(t_hi, t.dtype), z.dtype)  # (NaN for t = inf: nothing is kept)
    if z.shape.num_elements() >= 32 * t.shape.num_elements():  # (the long side, not the short)
        t_hi, t_lo = materialized(t_hi, t_lo)
    excess = tf.abs(z) - t_hi
    keep = excess > t_lo
    return tf.where(keep, tf.sign(z) * (excess - t_lo), tf.zeros_like(z))


# ---------------------------------------------------------------------------------------------
# Bounds
# ---------------------------------------------------------------------------------------------


@tf.autograph.experimental.do_not_convert
def path_norm(kernel_in: Any, kernel_out: Any) -> tf.Tensor:
    """1-path-norm ``sum_i ||kernel_out[i, :]||_1 ||kernel_in[:, i]||_1`` of two Dense kernels
    (m, n) and (n, p) of one dtype: a 0-d tensor of that dtype, differentiable.

    It upper-bounds the (l_inf, l_1) Lipschitz constant of ``u -> act(u @ K_in) @ K_out`` for
    any activation with slope in [0, 1] (Theorem 1 of the paper).
    """
    k_in, k_out = check_pair(kernel_in, kernel_out, check_finite=False)
    return tf.reduce_sum(tf.reduce_sum(tf.abs(k_out), 1) * tf.reduce_sum(tf.abs(k_in), 0))


@tf.autograph.experimental.do_not_convert
def product_bound(kernel_in: Any, kernel_out: Any) -> tf.Tensor:
    """Layer-wise bound ``sum|K_out| * max_i ||K_in[:, i]||_1`` (l_inf operator norm of K_in) of
    two Dense kernels (m, n) and (n, p) of one dtype: a 0-d tensor of that dtype; 0 for an empty
    layer (n = 0)."""
    k_in, k_out = check_pair(kernel_in, kernel_out, check_finite=False)
    # (the max over no column is -inf; a layer with no unit maps everything to 0)
    col_norm = tf.reduce_max(
        tf.concat([tf.reduce_sum(tf.abs(k_in), 0), tf.zeros([1], k_in.dtype)], 0)
    )
    return tf.reduce_sum(tf.abs(k_out)) * col_norm
