"""Pure TensorFlow functions: the exact 1-path-norm prox, its bounds and the paper's baselines.

Layout (Keras, two ``Dense`` layers ``Dense(n) -> act -> Dense(p)`` on inputs of width m):
``kernel_in`` is the first layer's kernel, shape (m, n); ``kernel_out`` the second's, shape
(n, p). Hidden unit ``i`` owns the column ``kernel_in[:, i]`` (incoming) and the row
``kernel_out[i, :]`` (outgoing). The 1-path-norm is
``sum_i ||kernel_out[i, :]||_1 * ||kernel_in[:, i]||_1``; biases are not part of it.
Internally every function works in the backend-neutral layout of ``shared_spec``:
``X = kernel_out`` (n, p) outgoing and ``Y = transpose(kernel_in)`` (n, m) incoming weights.

The prox solves, separately for every hidden unit (x = outgoing, y = incoming weights)::

    min_{v, w}  1/2 ||v - x||^2 + 1/2 ||w - y||^2 + lam * ||v||_1 * ||w||_1

exactly, with the two methods of ``pathnorm_lightning.functional``, ported with the same
candidates, order and tie-breaking (results agree to rounding; zero patterns are identical):

* ``"sort"`` (:func:`_prox_rows`): every minimiser is a stationary point fixed by its support
  sizes ``(k, l)`` (top-k of |x|, top-l of |y|) or a trivial point; the minimiser lies among
  ``(k, L(k))`` with ``L(k)`` the largest feasible ``l`` (a bisection of ``ceil(log2(m + 2))``
  fixed steps over whole sorted rows), plus ``(x, 0)``.
* ``"band"`` (:func:`_prox_rows_band`, the default): bounds on ``||v||_1`` fix most of the
  long side's support, so only the band of entries in between is sorted (a ``top_k`` into a
  static block of :data:`BAND_BLOCK` columns; a wider band falls back to ``"sort"``).

Everything is tf ops over static shapes, so it runs eagerly, in ``tf.function`` and under XLA
(``jit_compile=True``), on CPU and GPU. float16/bfloat16 are computed in float32.

On a Dense kernel the l_inf operator norm of the layer map ``u -> u @ kernel`` is the largest
l1 norm of a *column* (one output unit's incoming weights): use
:func:`project_linf_operator_norm` for the layer-wise constraint, not
:func:`project_rows_l1_ball` (which is the generic row-wise projection).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

try:  # TensorFlow's own test for "being traced for XLA" (private, hence the fallback)
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
except ImportError:  # pragma: no cover

    def GraphOrParentsInXlaContext(graph: Any) -> bool:
        return True  # every graph: the XLA-friendly formulations (same values)


__all__ = [
    "path_norm",
    "product_bound",
    "project_linf_operator_norm",
    "project_rows_l1_ball",
    "prox_l1",
    "prox_path_norm",
]

Scalar = Any  # a Python number or a 0-d tensor (tf.Tensor, tf.Variable)


# ---------------------------------------------------------------------------------------------
# Input checks (eager: ValueError, like the torch side; inside a graph: runtime assertions)
# ---------------------------------------------------------------------------------------------


def _is_symbolic(t: Any) -> bool:
    return isinstance(t, tf.Tensor) and not hasattr(t, "numpy")


def _warn_if_xla(what: str) -> None:
    """XLA compiles TensorFlow's assertions away: say so when a graph check is added there."""
    if _tracing_for_xla():
        warnings.warn(
            f"pathnorm_tf: {what} is not checked under XLA (jit_compile=True), which drops "
            "TensorFlow assertions; compile without XLA to get the error, or check the values "
            "outside the compiled function.",
            UserWarning,
            stacklevel=3,
        )


def _check_scalar(value: Scalar, name: str) -> float | tf.Tensor:
    """A Python float (validated now) or a 0-d float tensor (validated now or at run time)."""
    if isinstance(value, (str, bytes, bool)) or value is None:
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if isinstance(value, (tf.Tensor, tf.Variable)) or hasattr(value, "dtype"):
        t = tf.convert_to_tensor(value)
        if t.shape.rank not in (None, 0) and t.shape.num_elements() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(t.shape)}")
        t = tf.reshape(t, [])
        if not (t.dtype.is_floating or t.dtype.is_integer):
            raise ValueError(f"{name} must be a real number, got dtype {t.dtype.name}")
        if _is_symbolic(t):
            _warn_if_xla(f"a tensor {name} (finite, >= 0)")
            tf.debugging.assert_all_finite(
                tf.cast(t, tf.float64), f"{name} must be a finite number >= 0"
            )
            tf.debugging.assert_non_negative(t, message=f"{name} must be a finite number >= 0")
            return t
        value = float(t.numpy())
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def _as_matrix(w: Any, name: str, check_finite: bool) -> tf.Tensor:
    if isinstance(w, (tf.Tensor, tf.Variable)):
        t = tf.convert_to_tensor(w)
    else:
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
    if check_finite:
        msg = (
            f"{name} contains NaN or inf; the prox of non-finite weights is undefined "
            "(check the learning rate and the loss for divergence)"
        )
        if _is_symbolic(t):
            _warn_if_xla(f"that {name} is finite (check_finite=True)")
            t = tf.debugging.assert_all_finite(t, msg)
        elif not bool(tf.reduce_all(tf.math.is_finite(t))):
            raise ValueError(msg)
    return t


def _static_dims(t: tf.Tensor, name: str) -> tuple[int, int]:
    a, b = t.shape
    if a is None or b is None:
        raise ValueError(
            f"{name} needs a static shape (the bisection length depends on it), got {t.shape}"
        )
    return int(a), int(b)


def _check_pair(kernel_in: Any, kernel_out: Any, check_finite: bool) -> tuple[tf.Tensor, tf.Tensor]:
    k_in = _as_matrix(kernel_in, "kernel_in", check_finite)
    k_out = _as_matrix(kernel_out, "kernel_out", check_finite)
    n_in, n_out = k_in.shape[1], k_out.shape[0]
    if n_in is not None and n_out is not None and n_in != n_out:
        raise ValueError(
            f"kernel_in (m, n) = {tuple(k_in.shape)} and kernel_out (n, p) = "
            f"{tuple(k_out.shape)} do not pair: kernel_in.shape[1] must equal "
            "kernel_out.shape[0] (the hidden width n)"
        )
    return k_in, k_out


def _scalar(value: float | tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """``value`` in ``dtype``; a Python float is converted directly (tf.cast would round it to
    float32 first)."""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return tf.cast(value, dtype)
    return tf.constant(value, dtype)


def _compute_dtype(dtype: tf.DType) -> tf.DType:
    return tf.float64 if dtype == tf.float64 else tf.float32


# ---------------------------------------------------------------------------------------------
# The exact prox, neutral layout
# ---------------------------------------------------------------------------------------------


def _prefix_sums(a: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """For |values| ``a`` (n, q): ``c[:, k]`` = sum of the k largest, ``c2`` of their squares,
    ``top[:, k]`` = the k-th largest (index 0 padded with 0); each (n, q + 1)."""
    s = _sort_rows_desc(a)
    zero = tf.zeros_like(s[:, :1])
    c = tf.concat([zero, tf.cumsum(s, axis=1)], 1)
    c2 = tf.concat([zero, tf.cumsum(s * s, axis=1)], 1)
    top = tf.concat([zero, s], 1)
    return c, c2, top


def _candidate_objective(
    big_x: tf.Tensor,
    ly2: tf.Tensor,
    cx2: tf.Tensor,
    ly: tf.Tensor,
    k: tf.Tensor,
    lf: tf.Tensor,
    t_v: tf.Tensor,
    t_w: tf.Tensor,
    lam: tf.Tensor,
) -> tf.Tensor:
    """Objective (up to 1/2 (||x||^2 + ||y||^2)) of the point that support sizes ``(k, l)``
    and thresholds ``t_v = lam b``, ``t_w = lam a`` produce, from that point's own l1 norms
    ``X_k - k t_v`` and ``Y_l - l t_w`` (as the torch side): near ``d = 1 - k l lam^2 = 0``,
    ``a`` and ``b`` carry rounding amplified by ``1 / d``, and the closed form in ``a, b``
    could misrank nearly equal candidates."""
    nv = tf.maximum(big_x - k * t_v, 0.0)
    nw = tf.maximum(ly - lf * t_w, 0.0)
    return 0.5 * (k * t_v * t_v + lf * t_w * t_w - cx2 - ly2) + lam * nv * nw


def _prox_rows(
    x: tf.Tensor, y: tf.Tensor, lam: float | tf.Tensor, lam2: float | tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """Exact prox per row pair: ``x`` (n, p) outgoing, ``y`` (n, m) incoming weights.

    Returns the per-row soft-threshold levels ``(t_v, t_w)``, each (n, 1) (``inf``: the row
    becomes 0): ``v = S(x, t_v)``, ``w = S(y, t_w)``.
    """
    p, m = int(x.shape[1]), int(y.shape[1])
    if p > m:  # enumerate the shorter side, bisect on the longer one (the problem is symmetric)
        t_w, t_v = _prox_rows(y, x, lam, lam2)
        return t_v, t_w
    dtype = x.dtype
    ax, ay = tf.abs(x), tf.abs(y)
    cx, cx2, xk = _prefix_sums(ax)  # xk[:, k] = k-th largest |x|
    cy, cy2, yl = _prefix_sums(ay)
    zero = tf.zeros_like(cx[:, :1])

    # --- Candidates (k, L(k)) for k = 0..p: k is the column index. ---
    k_int = tf.range(p + 1)[tf.newaxis, :]
    k = tf.cast(k_int, dtype)  # (1, p + 1), broadcast against (n, p + 1)
    kx = cx  # X_k for every k
    k_is_zero = k_int == 0

    def feasible(l_idx: tf.Tensor) -> tf.Tensor:
        # (k, l) is feasible iff k l lam^2 < 1 and the last kept entries of both candidate
        # vectors are >= 0; multiplied through by d = 1 - k l lam^2 > 0 to avoid dividing.
        lf = tf.cast(l_idx, dtype)
        d = 1.0 - k * lf * lam2
        ly = tf.gather(cy, l_idx, axis=1, batch_dims=1)
        y_last = tf.gather(yl, l_idx, axis=1, batch_dims=1)
        v_ok = k_is_zero | (d * xk + lam2 * lf * kx - lam * ly >= 0)
        w_ok = (l_idx == 0) | (d * y_last + lam2 * k * ly - lam * kx >= 0)
        return (d > 0) & v_ok & w_ok

    # L(k) = the largest feasible l in [0, m] by bisection: l = 0 is always feasible and the
    # feasible set is downward closed in l, so a fixed number of halvings is exact.
    lo = tf.zeros_like(cx, dtype=tf.int32)
    hi = tf.fill(tf.shape(lo), tf.constant(m + 1, tf.int32))
    for _ in range(max(1, math.ceil(math.log2(m + 2)))):  # length depends on log2(m) only
        mid = (lo + hi) // 2
        ok = feasible(tf.minimum(mid, m))
        lo = tf.where(ok, mid, lo)
        hi = tf.where(ok, hi, mid)
    big_l = lo

    lf = tf.cast(big_l, dtype)
    d = 1.0 - k * lf * lam2
    ly = tf.gather(cy, big_l, axis=1, batch_dims=1)
    a = tf.maximum((kx - k * lam * ly) / d, 0.0)  # ||v||_1 of the candidate
    b = tf.maximum((ly - lf * lam * kx) / d, 0.0)  # ||w||_1 of the candidate
    h = _candidate_objective(
        kx, tf.gather(cy2, big_l, axis=1, batch_dims=1), cx2, ly, k, lf, lam * b, lam * a, lam
    )

    # --- The trivial point (x, 0), appended last (same order as the torch side). ---
    h = tf.concat([h, -0.5 * cx2[:, p:]], 1)
    a = tf.concat([a, cx[:, p:]], 1)
    b = tf.concat([b, zero], 1)
    ks = tf.concat([k_int + tf.zeros_like(big_l), tf.fill(tf.shape(zero), p)], 1)
    ls = tf.concat([big_l, tf.zeros_like(big_l[:, :1])], 1)

    # --- Selection: the least objective, first index on ties (as torch.argmin). ---
    best = _argmin_rows(h)
    a_star = tf.gather(a, best, axis=1, batch_dims=1)
    b_star = tf.gather(b, best, axis=1, batch_dims=1)
    v_keep = tf.gather(ks, best, axis=1, batch_dims=1) > 0
    w_keep = tf.gather(ls, best, axis=1, batch_dims=1) > 0
    inf = tf.constant(float("inf"), dtype)
    return tf.where(v_keep, lam * b_star, inf), tf.where(w_keep, lam * a_star, inf)


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
        kernel_out: second Dense kernel, shape (n, p).
        lam: prox step, finite and >= 0 (inside proximal SGD: ``lr * lambda``); a Python number
            (checked now) or a 0-d tensor (checked when the graph runs).
        check_finite: check the weights for NaN/inf (eager: ``ValueError``; inside a graph:
            ``tf.debugging.assert_all_finite``). Disable on hot paths.
        method: ``"sort"`` sorts whole rows of the longer side; ``"band"`` sorts only the band
            of entries that can change support (a static block of :data:`BAND_BLOCK` columns;
            rows with a wider band are redone with ``"sort"``); ``"auto"`` = ``"band"``. Both
            are exact and return the same minimiser (as the torch methods of the same names).

    Returns:
        ``(kernel_in_new, kernel_out_new)``, new tensors of the input dtypes. Half precision
        inputs are computed in float32 and cast back.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    lam = _check_scalar(lam, "lam")
    k_in, k_out = _check_pair(kernel_in, kernel_out, check_finite)
    m, n = _static_dims(k_in, "kernel_in")
    _, p = _static_dims(k_out, "kernel_out")
    if (isinstance(lam, float) and lam == 0.0) or m * n == 0 or n * p == 0:
        return tf.identity(k_in), tf.identity(k_out)
    return _prox_kernels(k_in, k_out, lam, method)


_LAM_CAP = 2.0
METHODS = ("auto", "band", "sort")


@tf.autograph.experimental.do_not_convert
def _prox_kernels(
    k_in: tf.Tensor, k_out: tf.Tensor, lam: float | tf.Tensor, method: str = "auto"
) -> tuple[tf.Tensor, tf.Tensor]:
    """:func:`prox_path_norm` without input checks (Dense layout, static shapes).

    The per-unit work (the short side, the sums over the long side, the candidates) and the
    final soft-threshold are done in float64, as by torch's compiled kernel, so that the result
    is the exact prox rounded once to the weights' dtype; the long side is kept (and compared,
    sliced, max-reduced) in its own precision, where that is exact.
    """
    cd = tf.float64
    ld = _compute_dtype(k_in.dtype)  # the long side's storage
    # For lam >= 1 no support pair is feasible (k l lam^2 >= 1): only the two trivial points
    # remain and the prox no longer depends on lam. Capping keeps lam^2 finite (as torch does).
    if isinstance(lam, float):
        lam = min(lam, _LAM_CAP)
    else:
        lam = tf.minimum(tf.cast(lam, tf.float64), _LAM_CAP)
    if isinstance(lam, float):
        # lam^2 in double precision, then rounded once: as the torch side does with a Python lam.
        lam_c: float | tf.Tensor = lam
        lam2_c: float | tf.Tensor = lam * lam
    else:
        # Same for a tensor lam: square in float64, round once to the compute dtype.
        lam64 = tf.cast(lam, tf.float64)
        lam_c = tf.cast(lam64, cd)
        lam2_c = tf.cast(lam64 * lam64, cd)
    k_in_c = tf.cast(tf.stop_gradient(k_in), ld)  # (m, n): hidden unit i is column i
    k_out_c = tf.cast(tf.stop_gradient(k_out), ld)  # (n, p): hidden unit i is row i
    m, n = int(k_in_c.shape[0]), int(k_in_c.shape[1])
    p = int(k_out_c.shape[1])
    if method == "sort":
        t_out, t_in = _prox_rows(
            tf.cast(k_out_c, cd), tf.cast(tf.transpose(k_in_c), cd), lam_c, lam2_c
        )
    elif p > m:  # the band method sorts the short side: swap roles (the problem is symmetric)
        t_in, t_out = _prox_band(tf.cast(tf.transpose(k_in_c), cd), k_out_c, 0, lam_c, lam2_c)
    else:  # the long side stays in the Dense layout: no transpose of the big kernel
        t_out, t_in = _prox_band(tf.cast(k_out_c, cd), k_in_c, 1, lam_c, lam2_c)
    new_in = _soft_threshold_exact(k_in_c, tf.reshape(t_in, [1, n]))
    new_out = _soft_threshold_exact(k_out_c, t_out)
    return tf.cast(new_in, k_in.dtype), tf.cast(new_out, k_out.dtype)


def _soft_threshold_exact(z: tf.Tensor, t: tf.Tensor) -> tf.Tensor:
    """``sign(z) max(|z| - t, 0)`` for ``z`` in float32 or float64 and a float64 threshold
    ``t`` broadcast against it (``inf``: 0), in ``z``'s dtype, without float64 work per entry.

    ``t = t_hi + t_lo`` with ``t_hi`` = ``t`` rounded to float32 and ``t_lo`` = the rest
    rounded: ``|z| - t_hi > t_lo`` is exactly ``|z| > t`` (``|z| - t_hi`` is exact where it
    matters, and ``|t_lo|`` is below half an ulp of ``t_hi``), so the zero pattern is the
    exact one, and a kept entry is ``(|z| - t_hi) - t_lo``, within an ulp of ``|z| - t``.
    """
    if z.dtype == tf.float64:
        return _soft_threshold_rows(z, t)
    t_hi = tf.cast(t, z.dtype)
    t_lo = tf.cast(t - tf.cast(t_hi, t.dtype), z.dtype)  # (NaN for t = inf: nothing is kept)
    if z.shape.num_elements() >= 32 * t.shape.num_elements():  # (the long side, not the short)
        t_hi, t_lo = _materialized(t_hi, t_lo)
    excess = tf.abs(z) - t_hi
    keep = excess > t_lo
    return tf.where(keep, tf.sign(z) * (excess - t_lo), tf.zeros_like(z))


# ---------------------------------------------------------------------------------------------
# The band method (torch's CPU default): sort only the part of the long side that can change
# support. Same minimiser as the whole-row sort; static shapes (the band block has a fixed
# width, a wider band falls back to the whole-row sort), so it also runs under XLA.
# ---------------------------------------------------------------------------------------------

# Static width of the widest band block (a top_k); if a band is wider, the whole-row sort is
# used. (On Glorot-initialised 784-200-10 kernels the band holds <= 8 entries for lam <= 1e-4
# and <= 16 for lam = 1e-3; in training mostly 0 to 2 entries in a handful of rows.)
BAND_BLOCK = 32
# Narrow bands (at most this many entries in every unit) are extracted by repeated max
# reductions over the long side instead of a top_k (which XLA on CPU runs as a slow partial
# sort of every row); each extra entry costs two reductions. Tiers, tried in order (in
# training the widest band mostly holds 1 or 2 entries; lam = 1e-3 on Glorot kernels: ~15).
_FAST_TIERS = (0, 1, 2, 4, 8, 16)
# Largest (n * p * (band + 1)) evaluated in one shot before bisecting instead (as torch).
_BAND_FULL_LIMIT = 1 << 15
# Reductions over the long side first combine this many slices elementwise (see _reduce_units).
_SPLITS = 8
# Rows of the short side at most this long are sorted by ranking (pairwise comparisons).
_RANK_SORT_MAX = 16
_EPS = {tf.float32: 2.0**-23, tf.float64: 2.0**-52}
_BITS = {tf.float32: tf.int32, tf.float64: tf.int64}


def _soft_threshold_rows(z: tf.Tensor, t: tf.Tensor) -> tf.Tensor:
    """``sign(z) max(|z| - t, 0)`` with a threshold ``t`` broadcast against ``z`` (``inf``: 0)."""
    return z - tf.minimum(tf.maximum(z, -t), t)


def _gather_rows(t: tf.Tensor, idx: tf.Tensor) -> tf.Tensor:
    return tf.gather(t, idx, axis=1, batch_dims=1)


def _select_chain(columns: int, entries: int) -> bool:
    """Whether to index ``columns`` columns for ``entries`` entries by a chain of selects (see
    :data:`_UNROLL_PICK`) rather than a gather."""
    return _tracing_for_xla() and columns <= _UNROLL_PICK and entries * columns <= _PICK_LIMIT


def _pick_rows(t: tf.Tensor, idx: tf.Tensor) -> tf.Tensor:
    """``t[i, idx[i, j]]`` for ``t`` (n, q) and ``idx`` (n, r) in ``[0, q)``. Under XLA, for
    small blocks (see :data:`_UNROLL_PICK`), a chain of selects: elementwise, so fused into its
    consumers (XLA on CPU runs each gather, and the index array it builds for it, as thunks of
    their own); otherwise a gather."""
    q = int(t.shape[1])
    if not _select_chain(q, idx.shape.num_elements()):
        return _gather_rows(t, idx)
    out = tf.broadcast_to(t[:, :1], tf.shape(idx))
    for c in range(1, q):
        out = tf.where(tf.equal(idx, c), t[:, c : c + 1], out)
    return out


def _at_least(h: tf.Tensor, *ts: tf.Tensor) -> tuple[tf.Tensor, ...]:
    """Each of ``ts`` (n, q) at the first index of the least ``h`` (n, q) per row, as columns
    (n, 1): ``_gather_rows(t, _argmin_rows(h))``; a row whose least value is NaN gives the
    last index. Under XLA, for small blocks (see :data:`_UNROLL_PICK`), one reduction (the
    least value) and a fused chain of selects from the last index to the first."""
    q = int(h.shape[1])
    if not _select_chain(q, h.shape.num_elements()):
        best = _argmin_rows(h)
        return tuple(_gather_rows(t, best) for t in ts)
    (h,) = _materialized(h)
    least = tf.reduce_min(h, axis=1, keepdims=True)
    out = [t[:, q - 1 :] for t in ts]
    for c in range(q - 2, -1, -1):
        at = tf.equal(h[:, c : c + 1], least)
        out = [tf.where(at, t[:, c : c + 1], o) for t, o in zip(ts, out, strict=True)]
    return tuple(out)


def _argmin_rows(h: tf.Tensor) -> tf.Tensor:
    """Per row the first index of the least value, as a column (n, 1) of int32 (``tf.argmin``).

    Under XLA the same index from two plain reductions: the least value, then the least index
    holding it. XLA on CPU runs an argmin as a variadic reduction (value and index), several
    times slower; this saved about 0.007 ms per Keras train step of 784-200-10. A row whose
    least value is NaN gives the last index, as XLA's argmin does for a row of NaNs.
    """
    if not _tracing_for_xla():
        return tf.argmin(h, axis=1, output_type=tf.int32)[:, tf.newaxis]
    k = int(h.shape[1])
    least = tf.reduce_min(h, axis=1, keepdims=True)
    iota = tf.range(k, dtype=tf.int32)[tf.newaxis, :]
    return tf.reduce_min(tf.where(tf.equal(h, least), iota, k - 1), axis=1, keepdims=True)


def _tracing_for_xla() -> bool:
    """True while a function is traced for XLA (``tf.function(jit_compile=True)``, Keras
    ``jit_compile=True``); False eagerly and in plain graphs. Only the choice of equivalent
    formulations (sorts, reductions) depends on it, never the result's values beyond rounding."""
    if tf.executing_eagerly():
        return False
    return bool(GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def _cumsum_cols(a: tf.Tensor) -> tf.Tensor:
    """``tf.cumsum(a, axis=1)`` for the short rows of the band method (p, band widths). Under
    XLA up to :data:`_UNROLL_CUMSUM` columns are summed by one masked, fused reduction: XLA on
    CPU runs a cumsum as a reduce-window thunk of its own (about 1 us each; the band method has
    several), while a chain of adds becomes one small thunk per column. (A non-finite entry
    spoils its row's earlier sums too, through inf * 0; the prox of such a row is undefined.)"""
    cols = int(a.shape[1])
    if cols > _UNROLL_CUMSUM or cols == 0 or not _tracing_for_xla():
        return tf.cumsum(a, axis=1)
    # out[:, j] = sum_k a[:, k] [k <= j]: one fused reduction over a (rows, cols, cols) mask.
    upper = tf.constant(np.triu(np.ones((cols, cols))), a.dtype)  # upper[k, j] = [k <= j]
    return tf.reduce_sum(a[:, :, tf.newaxis] * upper, axis=1)


_UNROLL_CUMSUM = 32
# Under XLA, rows of at most this many columns are indexed by a chain of selects, not a gather,
# while the chain's work (entries picked times columns) stays below _PICK_LIMIT: XLA copies the
# chain into each consumer, which on large blocks (512-512-512) costs more than the gather.
_UNROLL_PICK = 16
_PICK_LIMIT = 1 << 15


def _sort_rows_desc(a: tf.Tensor) -> tf.Tensor:
    """Each row of ``a`` (>= 0, shape (n, p)) sorted descending (the same values by any
    method; under XLA, the one XLA on CPU runs fastest)."""
    p = int(a.shape[1])
    if p == 1:
        return a
    xla = _tracing_for_xla()
    if p <= _RANK_SORT_MAX and xla:
        # rank_j = #{i : a_i > a_j or (a_i == a_j and i < j)} is a permutation; column r of the
        # result is the one entry of rank r (a sum of it and zeros: exact). Sums of p
        # elementwise terms (XLA fuses them; its sort of short rows costs far more).
        idx = tf.range(p)[tf.newaxis, :]
        cols = [a[:, i : i + 1] for i in range(p)]
        rank = tf.add_n(
            [tf.cast((c > a) | ((c == a) & (idx > i)), tf.int32) for i, c in enumerate(cols)]
        )
        zero = tf.zeros_like(a)
        return tf.add_n([tf.where(rank[:, j : j + 1] == idx, c, zero) for j, c in enumerate(cols)])
    if not xla:  # (TensorFlow's own sort kernel is fast)
        # |values| >= +0 sort like their bit patterns read as integers (cheaper than floats).
        int_dtype = tf.int64 if a.dtype == tf.float64 else tf.int32
        s = tf.sort(tf.bitcast(a, int_dtype), axis=1, direction="DESCENDING")
        return tf.bitcast(s, a.dtype)
    return _bitonic_sort_desc(a)


def _bitonic_sort_desc(a: tf.Tensor) -> tf.Tensor:
    """Each row of ``a`` (>= 0, shape (n, q)) sorted descending by a bitonic network.

    XLA on CPU sorts through a comparator-driven TopK (about 90 ns per element on a
    512 x 512 block); the network is ``log2(q') (log2(q') + 1) / 2`` elementwise max/min
    stages (``q'``: q rounded up to a power of two, padded with -1), exact like any sort.
    """
    n, q = int(a.shape[0]), int(a.shape[1])
    size = 1 << (q - 1).bit_length()
    if size > q:
        a = tf.concat([a, tf.fill([n, size - q], tf.constant(-1.0, a.dtype))], 1)
    k = 2
    while k <= size:
        j = k // 2
        while j >= 1:
            # Pairs (i, i + j) in blocks of 2j; a block runs descending iff bit k of i is 0.
            blocks = size // (2 * j)
            desc = tf.constant([((b * 2 * j) & k) == 0 for b in range(blocks)])[:, tf.newaxis]
            pairs = tf.reshape(a, [n, blocks, 2, j])
            first, second = pairs[:, :, 0, :], pairs[:, :, 1, :]
            hi, lo = tf.maximum(first, second), tf.minimum(first, second)
            a = tf.stack([tf.where(desc, hi, lo), tf.where(desc, lo, hi)], 2)
            a = tf.reshape(a, [n, size])
            j //= 2
        k *= 2
    return a[:, :q]


def _materialized(*ts: tf.Tensor) -> tuple[tf.Tensor, ...]:
    """``ts`` unchanged (per-unit values), computed once. XLA would otherwise fuse their
    float64 expressions into every loop over the long side that broadcasts them, and recompute
    them there once per element (its optimization barrier is expanded away on CPU before
    fusion). A reduction is not fused into a consumer: the max of ``t``'s bit pattern, as an
    integer, and the lowest integer is that bit pattern (NaN, inf and -0 too; a float max
    would not keep NaN on XLA's CPU backend)."""
    if not _tracing_for_xla():
        return ts
    out = []
    for t in ts:
        bits = tf.bitcast(t, _BITS[t.dtype])
        lowest = tf.fill(tf.shape(bits), _BITS[t.dtype].min)
        out.append(tf.bitcast(tf.reduce_max(tf.stack([bits, lowest], -1), -1), t.dtype))
    return tuple(out)


def _unit(t: tf.Tensor, unit_axis: int) -> tf.Tensor:
    """A per-unit column (n, 1) laid out to broadcast against the long side."""
    return t if unit_axis == 0 else tf.reshape(t, [1, -1])


def _fold(t: tf.Tensor, unit_axis: int, combine: Any) -> list[tf.Tensor]:
    """Pieces of a long-side tensor whose reductions, combined, reduce ``t`` per unit.

    XLA on CPU does not fuse an elementwise producer into a reduction: it writes the whole
    producer out first (a pass over memory per reduced expression). An elementwise ``combine``
    of :data:`_SPLITS` slices is fused with the producer instead, so the long side is read once
    and only a block of 1 / _SPLITS of its size is written (then reduced, with the few
    remaining entries as a second piece).
    """
    axis = 1 - unit_axis
    size = int(t.shape[axis])
    step = size // _SPLITS
    if step == 0 or not _tracing_for_xla():  # (otherwise each slice would be a copy)
        return [t]

    def part(start: int, stop: int) -> tf.Tensor:
        return t[start:stop] if axis == 0 else t[:, start:stop]

    acc = part(0, step)
    for i in range(1, _SPLITS):
        acc = combine(acc, part(i * step, (i + 1) * step))
    return [acc] + ([part(_SPLITS * step, size)] if _SPLITS * step < size else [])


def _reduce_units(fn: Any, t: tf.Tensor, unit_axis: int) -> tf.Tensor:
    """``fn`` (``tf.reduce_sum`` or ``tf.reduce_max``) over each unit's entries of a long-side
    tensor, as a column (n, 1) (see :func:`_fold`)."""
    combine = tf.add if fn is tf.reduce_sum else tf.maximum
    pieces = [fn(piece, axis=1 - unit_axis) for piece in _fold(t, unit_axis, combine)]
    out = pieces[0] if len(pieces) == 1 else combine(pieces[0], pieces[1])
    return tf.reshape(out, [-1, 1])


def _unit_sums(a: tf.Tensor, b: tf.Tensor, unit_axis: int) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-unit sums (n, 1) of two long-side tensors: the real and imaginary parts of one
    folded complex tensor (each part adds exactly as a real sum would). XLA splits the fold
    into two fused loops again, but the pair costs less than two real folds."""
    axis = 1 - unit_axis
    pieces = _fold(tf.complex(a, b), unit_axis, tf.add)
    re, im = (
        tf.reshape(tf.add_n([tf.reduce_sum(part(c), axis=axis) for c in pieces]), [-1, 1])
        for part in (tf.math.real, tf.math.imag)
    )
    return re, im


def _norm_sq(sum_sq: tf.Tensor) -> tf.Tensor:
    # A squared l2 norm rounded as torch.linalg.vector_norm(t).square() rounds it.
    return tf.square(tf.sqrt(sum_sq))


class _Band(NamedTuple):
    """What every band tier needs; per-unit values are columns (n, 1) (``k`` runs along 1)."""

    x: tf.Tensor  # short side (n, p), neutral layout, float64
    y: tf.Tensor  # long side: (n, m) if unit_axis == 0, (m, n) (Dense kernel) if 1; any float
    unit_axis: int
    lam: float | tf.Tensor
    lam2: float | tf.Tensor
    xs: tf.Tensor  # |x| sorted descending, (n, p)
    cx: tf.Tensor  # cx[:, k - 1] = sum of the k largest |x|
    cx2: tf.Tensor
    kk: tf.Tensor  # k = 1..p, (1, p)
    ysq: tf.Tensor
    tau_hi: tf.Tensor
    tau_lo: tf.Tensor
    c_hi: tf.Tensor  # number, sum and sum of squares of the |y| above tau_hi
    s_hi: tf.Tensor
    q_hi: tf.Tensor
    count: tf.Tensor  # band entries per unit (float)
    width: tf.Tensor  # 0-d: the largest count

    def unit(self, t: tf.Tensor) -> tf.Tensor:
        return _unit(t, self.unit_axis)

    def reduce(self, fn: Any, t: tf.Tensor) -> tf.Tensor:
        return _reduce_units(fn, t, self.unit_axis)

    def band_values(self) -> tf.Tensor:
        """``|y|`` on the band ``tau_lo < |y| <= tau_hi``, 0 elsewhere (``y``-shaped, y's dtype;
        compared in the bounds' dtype)."""
        ay = tf.abs(self.y)
        lo, hi = (self.unit(tf.cast(t, ay.dtype)) for t in (self.tau_lo, self.tau_hi))
        in_band = (ay > lo) & (ay <= hi)  # (both bounds are ld values: exact)
        return tf.where(in_band, ay, tf.zeros_like(ay))


def _band_setup(
    x: tf.Tensor, y: tf.Tensor, unit_axis: int, lam: float | tf.Tensor, lam2: float | tf.Tensor
) -> _Band:
    """Bounds ``tau_hi``, ``tau_lo`` and the band statistics.

    XLA on CPU does not fuse an elementwise producer into a reduction, so the number of reduced
    expressions over the long side is kept small (four, folded; see :func:`_fold`).
    """
    p = int(x.shape[1])
    m = int(y.shape[1 - unit_axis])
    dt, ld = x.dtype, y.dtype  # per-unit work in dt (float64); the long side in its own ld
    eps = _EPS[ld]  # (the long side is summed and compared in ld: its rounding rules)
    margin = 64 * eps
    ax = tf.abs(x)
    xs = _sort_rows_desc(ax)
    cx = _cumsum_cols(xs)
    cx2 = _cumsum_cols(xs * xs)
    x1, xsq = cx[:, p - 1 :], cx2[:, p - 1 :]
    # The bounds are rounded to ld once (within their margins) and kept out of the loops over
    # the long side (see _materialized); every comparison with the long side uses them.
    (tau_hi_l,) = _materialized(tf.cast(lam * x1 * (1 + margin), ld))
    tau_hi = tf.cast(tau_hi_l, dt)
    ay = tf.abs(y)
    r_hi = tf.maximum(ay - _unit(tau_hi_l, unit_axis), 0.0)
    ysq, r_sq = (tf.cast(_norm_sq(t), dt) for t in _unit_sums(ay * ay, r_hi * r_hi, unit_axis))
    # Upper bound on the minimum, and from it a lower bound a_lo on ||v||_1 (see torch).
    # ysq - r_sq cancels when tau_hi is tiny against |y|: raised by the rounding of both sums
    # (each within (m + 1) eps of its value), so that the bound stays above the minimum.
    g_best = tf.minimum(0.5 * (ysq - r_sq) + (m + 2) * eps * ysq, 0.5 * xsq)
    kk = tf.cast(tf.range(1, p + 1), dt)[tf.newaxis, :]
    theta = tf.sqrt(tf.maximum(2 * g_best - (xsq - cx2), 0.0) / kk)
    below = tf.concat([xs[:, 1:], tf.zeros_like(xs[:, :1])], 1)
    on_piece = tf.cast((theta <= xs) & (theta >= below), dt)
    theta_g = tf.reduce_max(theta * on_piece, 1, keepdims=True)
    theta_g = tf.where(g_best >= 0.5 * xsq, xs[:, :1], theta_g)
    a_lo = tf.reduce_sum(tf.maximum(ax - theta_g, 0.0), 1, keepdims=True)
    tau_lo = lam * a_lo * (1 - margin)
    # A second lower bound, free once ||y||^2 is known (the compiled torch kernel's fixed-point
    # bound, with ||y||_1 <= sqrt(m) ||y||_2): the minimiser's w = S(y, .) has
    # ||w||_1 <= ||y||_1 <= B, so ||v||_1 = sum (|x| - lam ||w||_1)_+ >= sum (|x| - lam B)_+.
    # Both B and the sum are widened by more than their rounding (a sum of m squares is
    # within (m - 1) eps of the exact one). In training it is the tighter bound by far (within
    # 1% of tau_hi where a_lo is within 10%), which leaves the band empty or one entry wide.
    big_b = tf.sqrt(m * ysq * (1 + (m + 2) * eps)) * (1 + 2 * eps)
    a_cs = tf.reduce_sum(tf.maximum(ax - lam * big_b, 0.0), 1, keepdims=True)
    a_cs -= (p + 2) * eps * (x1 + p * lam * big_b)
    tau_lo = tf.maximum(tau_lo, lam * a_cs * (1 - margin))
    (tau_lo_l,) = _materialized(tf.minimum(tf.cast(tau_lo, ld), tau_hi_l))
    tau_lo = tf.cast(tau_lo_l, dt)
    # Counts above tau_hi (c_hi) and in the band (count; tau_lo <= tau_hi) from one reduction
    # of (|y| > tau_lo) + K (|y| > tau_hi), K a power of two > m: integers below 2^24 (2^53 in
    # float64) sum exactly in any order. (|y| > t as 0/1 is sign(max(|y| - t, 0)) of torch:
    # a - b > 0 iff a > b.)
    in_hi = tf.cast(ay > _unit(tau_hi_l, unit_axis), ld)
    above_lo = tf.cast(ay > _unit(tau_lo_l, unit_axis), ld)
    pack = 2.0 ** math.ceil(math.log2(m + 1))
    if pack * (m + 1) <= 2.0 ** (53 if ld == tf.float64 else 24):
        packed, r_sum = (
            tf.cast(t, dt) for t in _unit_sums(above_lo + pack * in_hi, r_hi, unit_axis)
        )
        c_hi = tf.floor(packed / pack)
        count = packed - pack * c_hi - c_hi
    else:
        c_hi, r_sum = (tf.cast(t, dt) for t in _unit_sums(in_hi, r_hi, unit_axis))
        count = tf.cast(_reduce_units(tf.reduce_sum, above_lo - in_hi, unit_axis), dt)
    s_hi = r_sum + c_hi * tau_hi  # sum and sum of squares of the |y| above tau_hi
    q_hi = r_sq + 2 * tau_hi * r_sum + c_hi * tau_hi * tau_hi
    return _Band(
        x, y, unit_axis, lam, lam2, xs, cx, cx2, kk, ysq, tau_hi, tau_lo, c_hi, s_hi, q_hi,
        count, tf.reduce_max(count),
    )  # fmt: skip


def _band_candidates(b: _Band, band: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Thresholds ``(t_x, t_y)`` (n, 1) from the sorted band ``band`` (n, kb), zero padded."""
    x, xs, cx, cx2, kk, lam, lam2 = b.x, b.xs, b.cx, b.cx2, b.kk, b.lam, b.lam2
    n, p = int(x.shape[0]), int(x.shape[1])
    kb = int(band.shape[1])
    dt = x.dtype
    inf = tf.constant(float("inf"), dt)
    count = b.count
    zero = tf.zeros_like(x[:, :1])
    ly_all = b.s_hi + tf.concat([zero, _cumsum_cols(band)], 1)  # sum of c_hi + j largest
    yl_all = tf.concat([b.tau_hi, band], 1)  # the (c_hi + j)-th largest; tau_hi stands in at j=0
    j = tf.cast(tf.range(kb + 1), dt)[tf.newaxis, :]
    l_all = b.c_hi + j  # (n, kb + 1)
    # Feasibility of (k, l), multiplied through by d = 1 - k l lam^2 > 0:
    #   v_k >= 0  <=>  x_k + lam^2 l (X_k - k x_k) >= lam Y_l
    #   w_l >= 0  <=>  y_l + lam^2 k (Y_l - l y_l) >= lam X_k
    ax_k = cx - kk * xs
    by_l = ly_all - l_all * yl_all
    lam_x, lam_y = lam * cx, lam * ly_all
    l_max = 1.0 / (kk * lam2)  # d > 0  <=>  l < 1 / (k lam^2)

    def every_pair(w: int) -> tuple[tf.Tensor, tf.Tensor]:
        # Every pair (k, c_hi + j) with j < w at once, (n, p, w); keep the largest feasible j.
        # Taken only when w > the band width (later j are infeasible by the j <= count mask).
        l_w, j_w = l_all[:, :w], j[:, :w]
        feas = xs[:, :, None] + (lam2 * l_w)[:, None, :] * ax_k[:, :, None] >= lam_y[:, None, :w]
        feas &= (
            yl_all[:, None, :w] + tf.reshape(lam2 * kk, [1, p, 1]) * by_l[:, None, :w]
            >= lam_x[:, :, None]
        )
        l_in = tf.where(j_w <= count, l_w, inf)
        feas &= l_in[:, None, :] < tf.reshape(l_max, [1, p, 1])
        j_star = tf.reduce_max(tf.cast(feas, dt) * (j_w + 1)[:, None, :], 2) - 1
        # (the clip only matters for NaN weights, which must not index out of range)
        return tf.clip_by_value(tf.cast(j_star, tf.int32), 0, kb), j_star >= 0

    def bisect() -> tuple[tf.Tensor, tf.Tensor]:
        def feasible(ji: tf.Tensor) -> tf.Tensor:
            lj, lyj = _gather_rows(l_all, ji), _gather_rows(lam_y, ji)
            ok = xs + lam2 * lj * ax_k >= lyj
            ok &= _gather_rows(yl_all, ji) + lam2 * kk * _gather_rows(by_l, ji) >= lam_x
            return ok & (lj < l_max)

        lo = tf.zeros([n, p], tf.int32)
        # count <= kb unless the band overflows (then the result is discarded); NaN -> 1
        hi = tf.broadcast_to(tf.clip_by_value(tf.cast(count, tf.int32), 0, kb) + 1, [n, p])
        for _ in range(max(1, math.ceil(math.log2(kb + 2)))):  # depends on the block width only
            mid = (lo + hi) // 2
            ok = feasible(tf.minimum(mid, kb))
            lo = tf.where(ok, mid, lo)
            hi = tf.where(ok, hi, mid)
        return lo, feasible(tf.zeros_like(lo))

    if n * p * (kb + 1) <= _BAND_FULL_LIMIT:
        jj, valid = every_pair(kb + 1)
    elif n * p <= _BAND_FULL_LIMIT:
        full = tf.cast(n * p, dt) * (b.width + 1) <= _BAND_FULL_LIMIT
        jj, valid = tf.cond(full, lambda: every_pair(_BAND_FULL_LIMIT // (n * p)), bisect)
    else:
        jj, valid = bisect()

    lf = _pick_rows(l_all, jj)
    ly = _pick_rows(ly_all, jj)
    ly2 = b.q_hi + _pick_rows(tf.concat([zero, _cumsum_cols(band * band)], 1), jj)
    d = 1.0 - kk * lf * lam2
    a = tf.maximum((cx - kk * lam * ly) / d, 0.0)  # ||v||_1 of the candidate
    bb = tf.maximum((ly - lf * lam * cx) / d, 0.0)  # ||w||_1 of the candidate
    h = _candidate_objective(cx, ly2, cx2, ly, kk, lf, lam * bb, lam * a, lam)
    h = tf.where(valid, h, inf)
    # Candidates: (0, y), the support pairs, (x, 0); thresholds lam * b for v, lam * a for w.
    h = tf.concat([-0.5 * b.ysq, h, -0.5 * cx2[:, p - 1 :]], 1)
    infs = tf.fill(tf.shape(zero), inf)
    t_v = tf.concat([infs, lam * bb, zero], 1)
    t_w = tf.concat([zero, tf.where(lf == 0, inf, lam * a), infs], 1)
    return _at_least(h, t_v, t_w)


def _narrow_band(b: _Band, kb: int) -> tf.Tensor:
    """The sorted band (n, kb), zero padded, when no unit has more than ``kb`` band entries.

    Repeated max reductions: ``top_1`` = the largest band entry, ``top_{t+1}`` = the largest
    below ``top_t``; ``e_t`` = how many band entries equal ``top_t`` (ties), so slot ``s`` holds
    ``top_t`` for ``e_1 + ... + e_{t-1} <= s < e_1 + ... + e_t``. Same values as a sort.
    """
    dt = b.x.dtype
    vals = b.band_values()
    tops, ends = [b.reduce(tf.reduce_max, vals)], []
    for _ in range(kb - 1):
        prev = b.unit(tops[-1])
        ends.append(b.reduce(tf.reduce_sum, tf.cast(tf.equal(vals, prev), dt)))
        tops.append(b.reduce(tf.reduce_max, tf.where(vals < prev, vals, tf.zeros_like(vals))))
    slot = tf.cast(tf.range(kb), dt)[tf.newaxis, :]
    if ends:
        end = _cumsum_cols(tf.concat(ends, 1))  # (n, kb - 1)
        which = tf.reduce_sum(tf.cast(end[:, tf.newaxis, :] <= slot[:, :, tf.newaxis], tf.int32), 2)
        band = _gather_rows(tf.concat(tops, 1), which)
    else:
        band = tops[0]
    band = tf.cast(band, dt)
    return tf.where(slot < b.count, band, tf.zeros_like(band))


def _wide_band(b: _Band) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The band tier with a top_k block of :data:`BAND_BLOCK` columns: ``(t_x, t_y, too_wide)``;
    ``too_wide`` (0-d bool) flags a band wider than the block, where the result is invalid."""
    vals = b.band_values()
    if b.unit_axis == 1:
        vals = tf.transpose(vals)
    kb = min(BAND_BLOCK, int(vals.shape[1]))
    band = tf.cast(tf.math.top_k(vals, k=kb, sorted=True).values, b.x.dtype)
    t_x, t_y = _band_candidates(b, band)
    return t_x, t_y, b.width > kb


def _prox_band(
    x: tf.Tensor, y: tf.Tensor, unit_axis: int, lam: float | tf.Tensor, lam2: float | tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """Exact prox thresholds ``(t_x, t_y)`` (n, 1) sorting only a band of the long side.

    A port of ``pathnorm_lightning.functional._prox_rows_band``: the minimiser is the trivial
    point ``(0, y)``, ``(x, 0)``, or a stationary point whose incoming support contains every
    ``|y_j| > tau_hi = lam ||x||_1`` and no ``|y_j| <= tau_lo`` (``tau_lo`` from a lower bound
    on ``||v||_1``); only the band ``tau_lo < |y| <= tau_hi`` is sorted, then the largest
    feasible band index ``j`` is found for every ``k`` and the least objective is taken.

    ``x`` (n, p) is the short side; ``y`` the long side, (n, m) with ``unit_axis = 0`` or a
    Dense kernel (m, n) with ``unit_axis = 1`` (worked on in place of a transpose). The band
    is extracted by the cheapest tier that holds it: :data:`_FAST_TIERS` (repeated max
    reductions), then a top_k block of :data:`BAND_BLOCK` columns, then the whole-row sort.
    """
    b = _band_setup(x, y, unit_axis, lam, lam2)

    def neutral_y() -> tf.Tensor:
        return tf.cast(y if unit_axis == 0 else tf.transpose(y), x.dtype)

    def wide() -> tuple[tf.Tensor, tf.Tensor]:
        t_x, t_y, too_wide = _wide_band(b)
        return tf.cond(too_wide, lambda: _prox_rows(x, neutral_y(), lam, lam2), lambda: (t_x, t_y))

    tiers = sorted({min(t, BAND_BLOCK, int(y.shape[1 - unit_axis])) for t in _FAST_TIERS})

    def narrow(kb: int) -> tuple[tf.Tensor, tf.Tensor]:
        if kb == 0:  # no band anywhere: only j = 0
            return _band_candidates(b, tf.zeros_like(b.count))
        return _band_candidates(b, _narrow_band(b, kb))

    def tier(i: int) -> tuple[tf.Tensor, tf.Tensor]:
        if i == len(tiers):
            return wide()
        kb = tiers[i]
        return tf.cond(b.width <= kb, lambda: narrow(kb), lambda: tier(i + 1))

    # (One tf.switch_case over the tiers ran about 0.02 ms faster per train step, but XLA took
    # minutes instead of seconds to compile it for a 512-512-512 pair: the chain stays.)
    return tier(0)


def _prox_rows_band(
    x: tf.Tensor, y: tf.Tensor, lam: float | tf.Tensor, lam2: float | tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The top_k band tier alone, neutral layout (``y`` (n, m), m >= p): ``(t_v, t_w,
    too_wide)``, thresholds (n, 1); ``too_wide`` flags a band wider than :data:`BAND_BLOCK`."""
    return _wide_band(_band_setup(x, y, 0, lam, lam2))


# ---------------------------------------------------------------------------------------------
# Bounds
# ---------------------------------------------------------------------------------------------


@tf.autograph.experimental.do_not_convert
def path_norm(kernel_in: Any, kernel_out: Any) -> tf.Tensor:
    """1-path-norm ``sum_i ||kernel_out[i, :]||_1 ||kernel_in[:, i]||_1`` (0-d, differentiable).

    It upper-bounds the (l_inf, l_1) Lipschitz constant of ``u -> act(u @ K_in) @ K_out`` for
    any activation with slope in [0, 1] (Theorem 1 of the paper).
    """
    k_in, k_out = _check_pair(kernel_in, kernel_out, check_finite=False)
    return tf.reduce_sum(tf.reduce_sum(tf.abs(k_out), 1) * tf.reduce_sum(tf.abs(k_in), 0))


@tf.autograph.experimental.do_not_convert
def product_bound(kernel_in: Any, kernel_out: Any) -> tf.Tensor:
    """Layer-wise bound ``sum|K_out| * max_i ||K_in[:, i]||_1`` (l_inf operator norm of K_in)."""
    k_in, k_out = _check_pair(kernel_in, kernel_out, check_finite=False)
    return tf.reduce_sum(tf.abs(k_out)) * tf.reduce_max(tf.reduce_sum(tf.abs(k_in), 0))


# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------


@tf.autograph.experimental.do_not_convert
def prox_l1(w: Any, lam: Scalar) -> tf.Tensor:
    """Soft-thresholding ``sign(w) max(|w| - lam, 0)``: the prox of ``lam ||w||_1``."""
    lam = _check_scalar(lam, "lam")
    try:
        t = tf.convert_to_tensor(w)
    except (TypeError, ValueError):
        raise ValueError(f"w must be a floating-point tensor, got {type(w).__name__}") from None
    if not t.dtype.is_floating:
        raise ValueError(f"w must be a floating-point tensor, got dtype {t.dtype.name}")
    return _soft_threshold(t, lam)


def _soft_threshold(t: tf.Tensor, lam: float | tf.Tensor) -> tf.Tensor:
    lam_t = _scalar(lam, t.dtype)
    return tf.sign(t) * tf.maximum(tf.abs(t) - lam_t, tf.zeros([], t.dtype))


@tf.autograph.experimental.do_not_convert
def project_rows_l1_ball(w: Any, radius: Scalar) -> tf.Tensor:
    """Project each row of ``w`` (shape (r, c)) onto ``{z : ||z||_1 <= radius}``.

    Exact (sort-based, Duchi et al. 2008), vectorised over rows. This is the generic row-wise
    projection; for the l_inf operator-norm constraint of a Dense kernel (whose rows are
    *inputs*) use :func:`project_linf_operator_norm`.
    """
    radius = _check_scalar(radius, "radius")
    t = _as_matrix(w, "w", check_finite=False)
    return _project_rows(t, radius)


def _project_rows(t: tf.Tensor, radius: float | tf.Tensor) -> tf.Tensor:
    """:func:`project_rows_l1_ball` without input checks."""
    cd = _compute_dtype(t.dtype)
    u = tf.cast(tf.stop_gradient(t), cd)
    c = t.shape[1]
    if c == 0 or (t.shape[0] == 0):
        return tf.identity(t)
    r = _scalar(radius, cd)
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
def project_linf_operator_norm(kernel: Any, radius: Scalar) -> tf.Tensor:
    """Project a Dense kernel (in, out) onto ``{K : ||K||_{inf -> inf} <= radius}``.

    The l_inf operator norm of ``u -> u @ K`` is the largest l1 norm of a column of ``K``
    (the incoming weights of one output unit), so each *column* is projected onto the l1
    ball: the layer-wise constraint of the paper's baseline, equal to
    ``project_rows_l1_ball`` on the torch weight ``K.T``.
    """
    t = _as_matrix(kernel, "kernel", check_finite=False)
    return tf.transpose(project_rows_l1_ball(tf.transpose(t), radius))
