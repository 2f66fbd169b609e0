"""Compiled CPU kernel of the exact path-norm prox (numba): the band algorithm, one unit at a time.

The same mathematics as :func:`pathnorm_lightning.functional._prox_rows_band` (see its
docstring), written as loops that numba compiles to machine code, so the prox costs a few
passes over the weights instead of the dispatch of ~130 tensor operations. Per hidden unit:

1. sort the short side ``|x|`` (p entries), prefix sums;
2. one pass over the long side ``|y|``: its squared norm, and the count, sum and sum of
   squares of the entries above ``tau_hi = lam ||x||_1`` (always in the support);
3. the lower bound ``tau_lo = lam a_lo`` (entries at or below it are never in the support);
4. a second pass collects the band ``tau_lo < |y| <= tau_hi`` (usually empty or tiny in
   training) and sorts it;
5. for every ``k`` the largest feasible ``l`` in the band (bisection), the candidate's
   objective, and the argmin over ``(0, y)``, the support pairs by ``k``, and ``(x, 0)`` (first
   minimum wins, as ``argmin`` in the tensor versions).

All arithmetic is float64, whatever the weights' dtype. Every unit's thresholds are computed
(reading only) before any weight is written, so non-finite weights are reported with nothing
changed, and the prox can write straight into the parameters (in place).
"""

from __future__ import annotations

import math

import numba
import numpy as np

# Relative widening of the band bounds (as the tensor version's 64 eps of float32: the band
# only needs to contain every entry that can change support, a wider band costs nothing).
_MARGIN = 64 * 2.0**-23


@numba.njit(cache=True, nogil=True)
def _sort_desc(a: np.ndarray, count: int) -> None:  # pragma: no cover - compiled
    """Sort ``a[:count]`` in place, descending (insertion sort for the usual tiny counts)."""
    if count <= 24:
        for i in range(1, count):
            v = a[i]
            j = i - 1
            while j >= 0 and a[j] < v:
                a[j + 1] = a[j]
                j -= 1
            a[j + 1] = v
    else:
        s = np.sort(a[:count])
        for i in range(count):
            a[i] = s[count - 1 - i]


# Reassociation lets LLVM vectorise the row reductions (the sums change in the last bits of a
# float64, far below the tolerances); no "nnan"/"ninf": the finite check and inf must work.
_FAST = {"reassoc", "nsz", "contract"}


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _row_stats(
    row: np.ndarray, tau: float
) -> tuple[float, int, float, float, float, bool]:  # pragma: no cover - compiled
    """Of ``|row|``: the sum of squares; the count, sum, sum of squares and sum of squared
    excess over ``tau`` of the entries above ``tau``; whether all are finite. One vectorised
    pass."""
    big = 1.7976931348623157e308
    sq = 0.0
    c = 0
    s = 0.0
    q = 0.0
    e = 0.0
    finite = True
    for j in range(row.shape[0]):
        v = abs(np.float64(row[j]))
        finite &= bool(v <= big)
        v2 = v * v
        sq += v2
        above = v > tau
        c += 1 if above else 0
        s += v if above else 0.0
        q += v2 if above else 0.0
        r = v - tau if above else 0.0
        e += r * r
    return sq, c, s, q, e, finite


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _count_band(row: np.ndarray, lo: float, hi: float) -> int:  # pragma: no cover - compiled
    """Number of entries with ``lo < |r| <= hi`` (one vectorised pass)."""
    count = 0
    for j in range(row.shape[0]):
        v = abs(np.float64(row[j]))
        count += 1 if (v > lo) & (v <= hi) else 0
    return count


@numba.njit(cache=True, nogil=True)
def _collect_band(
    row: np.ndarray, lo: float, hi: float, out: np.ndarray
) -> int:  # pragma: no cover - compiled
    """Write the entries with ``lo < |r| <= hi`` to ``out``, return their count (a branchy
    scan: the band is sparse, a few per cent at most, so the branch is well predicted)."""
    count = 0
    for j in range(row.shape[0]):
        v = abs(np.float64(row[j]))
        if (v > lo) & (v <= hi):
            out[count] = v
            count += 1
    return count


@numba.njit(cache=True, nogil=True)
def _thresholds(
    x: np.ndarray, y: np.ndarray, lam: float, check_finite: bool, t_x: np.ndarray, t_y: np.ndarray
) -> int:  # pragma: no cover - compiled
    """Per unit ``i`` (row of ``x`` (n, p), row of ``y`` (n, m), p <= m) the soft-threshold
    levels of the prox: ``t_x[i]`` for ``x[i]`` and ``t_y[i]`` for ``y[i]`` (``inf``: all zero).

    Returns -1, or with ``check_finite`` the first unit holding a NaN or inf (and stops).
    """
    n, p = x.shape
    m = y.shape[1]
    lam2 = lam * lam
    big = 1.7976931348623157e308
    xs = np.empty(p)
    cx = np.empty(p)
    cx2 = np.empty(p)
    band = np.empty(m + 1)
    cb = np.empty(m + 1)  # cb[j]: sum of the first j band entries
    cb2 = np.empty(m + 1)  # and of their squares
    for i in range(n):
        for j in range(p):
            xs[j] = abs(np.float64(x[i, j]))
        if check_finite:
            for j in range(p):
                if not xs[j] <= big:
                    return i
        _sort_desc(xs, p)
        acc = 0.0
        acc2 = 0.0
        for j in range(p):
            acc += xs[j]
            acc2 += xs[j] * xs[j]
            cx[j] = acc
            cx2[j] = acc2
        x1 = cx[p - 1]
        xsq = cx2[p - 1]

        # Pass 1 over the long side: everything above tau_hi is in the support.
        tau_hi = lam * x1 * (1 + _MARGIN)
        ysq, c_hi, s_hi, q_hi, r_sq, finite = _row_stats(y[i], tau_hi)
        if check_finite and not finite:
            return i

        # tau_lo = lam a_lo with C_x(a_lo) = min(G(||x||_1), G(0)) (see the tensor version).
        g_best = min(0.5 * (ysq - r_sq), 0.5 * xsq)
        if g_best >= 0.5 * xsq:
            theta_g = xs[0]
        else:
            theta_g = 0.0
            for k in range(1, p + 1):
                # on piece k, theta^2 = t2 / k; test the piece before taking a root
                t2 = max(2 * g_best - (xsq - cx2[k - 1]), 0.0)
                below = xs[k] if k < p else 0.0
                if t2 <= k * xs[k - 1] * xs[k - 1] and t2 >= k * below * below:
                    theta = math.sqrt(t2 / k)
                    if theta <= xs[k - 1] and theta >= below and theta > theta_g:
                        theta_g = theta
        a_lo = 0.0
        for j in range(p):
            if xs[j] > theta_g:
                a_lo += xs[j] - theta_g
        tau_lo = lam * a_lo * (1 - _MARGIN)

        # Pass 2: the band tau_lo < |y| <= tau_hi (usually empty), sorted descending.
        count = 0
        if _count_band(y[i], tau_lo, tau_hi):  # in training the band is usually empty
            count = _collect_band(y[i], tau_lo, tau_hi, band)
        _sort_desc(band, count)
        cb[0] = 0.0
        cb2[0] = 0.0
        for t in range(count):
            cb[t + 1] = cb[t] + band[t]
            cb2[t + 1] = cb2[t] + band[t] * band[t]

        # Candidates: (0, y) first, then (k, c_hi + j*(k)) for k = 1..p, then (x, 0).
        best_h = -0.5 * ysq
        best_tx = np.inf
        best_ty = 0.0
        for k in range(1, p + 1):
            xk = xs[k - 1]
            big_x = cx[k - 1]
            ax_k = big_x - k * xk  # X_k - k x_k >= 0
            lam_x = lam * big_x
            k_lam2 = k * lam2
            # Largest j in [0, count] with (k, c_hi + j) feasible; the feasible set is downward
            # closed in l. Y_l = s_hi + (sum of the first j band entries), y_l = band[j - 1]
            # (tau_hi stands in for j = 0, as in the tensor version).
            lo = -1
            hi = count + 1
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                big_y = s_hi + cb[mid]
                yl = tau_hi if mid == 0 else band[mid - 1]
                lf = float(c_hi + mid)
                ok = xk + lam2 * lf * ax_k >= lam * big_y
                ok = ok and yl + lam2 * k * (big_y - lf * yl) >= lam_x
                ok = ok and k_lam2 * lf < 1.0  # d = 1 - k l lam^2 > 0
                if ok:
                    lo = mid
                else:
                    hi = mid
            if lo < 0:
                continue
            ly = s_hi + cb[lo]
            ly2 = q_hi + cb2[lo]
            lf = float(c_hi + lo)
            d = 1.0 - k * lf * lam2
            a = max((big_x - k * lam * ly) / d, 0.0)  # ||v||_1 of the candidate
            b = max((ly - lf * lam * big_x) / d, 0.0)  # ||w||_1 of the candidate
            h = 0.5 * lam2 * (k * b * b + lf * a * a) - 0.5 * (cx2[k - 1] + ly2) + lam * a * b
            if h < best_h:
                best_h = h
                best_tx = lam * b
                best_ty = np.inf if lf == 0 else lam * a
        if -0.5 * xsq < best_h:
            best_tx = 0.0
            best_ty = np.inf
        t_x[i] = best_tx
        t_y[i] = best_ty
    return -1


@numba.njit(cache=True, nogil=True)
def _shrink_rows(z: np.ndarray, t: np.ndarray) -> None:  # pragma: no cover - compiled
    """In place, row by row: ``z[i] = sign(z[i]) max(|z[i]| - t[i], 0)`` (``t[i] = inf``: 0).

    One array, updated in place: with separate input and output arrays that may alias, LLVM
    guards its vector loop by an overlap test and falls back to a scalar loop (6x slower).
    """
    n, m = z.shape
    for i in range(n):
        ti = t[i]
        row = z[i]
        for j in range(m):
            v = np.float64(row[j])
            row[j] = v - min(max(v, -ti), ti)  # branch-free: the signs are random


def prox_inplace(short: np.ndarray, long: np.ndarray, lam: float, check_finite: bool) -> int:
    """Exact prox of every unit, in place: rows of ``short`` (n, p) and ``long`` (n, m), p <= m.

    Both arrays C-contiguous, of one float dtype, ``0 < lam <= 2``. Returns -1, or (with
    ``check_finite``) the index of the first unit holding a NaN or inf, with nothing written.
    """
    n = short.shape[0]
    t_short = np.empty(n)
    t_long = np.empty(n)
    bad = _thresholds(short, long, lam, check_finite, t_short, t_long)
    if bad >= 0:
        return int(bad)
    _shrink_rows(short, t_short)
    _shrink_rows(long, t_long)
    return -1
