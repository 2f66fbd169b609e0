"""The compiled CPU kernel of the exact path-norm prox (numba), one hidden unit at a time.

Read :mod:`pathnorm_lightning._sort` first: it is the same mathematics in its shortest exact
form (candidates ``(k, L(k))`` from one sort per row, cumulative sums and a binary search).
This kernel finds the same minimiser without sorting the long side ``|y|`` in full: the
minimiser's incoming support is ``{j : |y_j| > lam a*}`` with ``a* = ||v||_1``, and cheap
bounds on ``lam a*`` leave only a thin band of entries (usually none) whose membership is
open. Per hidden unit:

1. sort the short side ``|x|`` (numpy sorts all rows at once when p > 16), prefix sums (and
   suffix sums of squares);
2. one vectorised pass over ``|y|``: its l1 norm, the count, sum and sum of squares of the
   entries above ``tau_hi = lam ||x||_1`` (always in the support), the sum of squares of the
   others, and the count of those within 1/16 below it;
3. bounds ``tau_lo <= lam a* <= hi`` (:func:`_tau_lo`, :func:`_unit`): entries above the upper
   bound are in the support, those at or below the lower one are out;
4. a second pass counts the band between them (skipped in the usual case, see :func:`_unit`);
   only a non-empty band is collected and sorted;
5. for every ``k`` the largest feasible ``l`` in the band (bisection), the candidate's
   objective (unshifted: the squares left out are summed directly), and the first minimum in
   the tie order of ``_sort`` (:func:`_best`).

All arithmetic is float64, whatever the weights' dtype. Every unit's thresholds are computed
(reading only) before any weight is written, so non-finite weights are reported with nothing
changed, and the prox can write straight into the parameters (in place). Units are
independent: :func:`_prox_par` splits them in contiguous blocks over threads (the same code
per unit, so the same bits), which ``_kernel`` uses on layers large enough to gain from it
when torch trains on more than one thread.

Every compiled function lives in this one file: numba's on-disk cache of the entry point
(:func:`_prox_all`) is keyed on its file's source alone, and its callees' code is linked into
it, so a callee in another file could change without invalidating the cache. The Python
side (argument handling, the planned entry, the one-time compile) is :mod:`._kernel`.
"""

from __future__ import annotations

import math

import numba
import numpy as np

# --- the long-row passes, vectorised by LLVM: reassociation lets it vectorise the reductions
# (the sums change in the last bits of a float64, far below the tolerances); no "nnan"/"ninf":
# the finite check and inf must work.
_FAST = {"reassoc", "nsz", "contract"}
_BIG = 1.7976931348623157e308  # the largest float64


@numba.njit(nogil=True)
def _all_finite(row: np.ndarray) -> bool:  # pragma: no cover - compiled
    """Whether every entry is finite (for a float64 row whose l1 norm overflowed)."""
    for j in range(row.shape[0]):
        if not abs(np.float64(row[j])) <= _BIG:
            return False
    return True


@numba.njit(nogil=True, fastmath=_FAST)
def _row_stats(
    row: np.ndarray, tau: float, near: float
) -> tuple[float, float, int, float, float, int]:  # pragma: no cover - compiled
    """Of ``|row|``: the sum, and the sum of squares of the entries at or below ``tau``; the
    count, sum and sum of squares of the entries above ``tau``; the number of entries in
    ``(near, tau]`` (float counters and masks as factors: LLVM vectorises those, not selects).
    NaN or inf makes the sum NaN or inf. The two sums of squares are kept apart (not a total
    and a part): the objectives need the squares left out, which a difference would cancel."""
    l1 = sq_lo = 0.0
    c = s = q = above_near = 0.0
    for j in range(row.shape[0]):
        v = abs(np.float64(row[j]))
        v2 = v * v
        l1 += v
        above = 1.0 if v > tau else 0.0
        sq_lo += v2 * (1.0 - above)
        c += above
        s += v * above
        q += v2 * above
        above_near += 1.0 if v > near else 0.0
    return l1, sq_lo, int(c), s, q, int(above_near - c)


@numba.njit(nogil=True, fastmath=_FAST)
def _hits(row: np.ndarray, lo: float, hi: float) -> float:  # pragma: no cover - compiled
    """Number of entries with ``lo < |r| <= hi`` (vectorised; on a slice: LLVM does not
    vectorise the loop over an index range of the whole row)."""
    hits = 0.0
    for j in range(row.shape[0]):
        v = abs(np.float64(row[j]))
        hits += 1.0 if (v > lo) & (v <= hi) else 0.0
    return hits


@numba.njit(nogil=True)
def _collect_band(
    row: np.ndarray, lo: float, hi: float, out: np.ndarray
) -> int:  # pragma: no cover - compiled
    """Write the entries with ``lo < |r| <= hi`` to ``out``, return their count. The band is
    sparse (a handful of entries): blocks are tested vectorised, only blocks with a hit are
    scanned."""
    m = row.shape[0]
    count = 0
    for start in range(0, m, _BLOCK):
        stop = min(start + _BLOCK, m)
        if _hits(row[start:stop], lo, hi) > 0:
            for j in range(start, stop):
                v = abs(np.float64(row[j]))
                if (v > lo) & (v <= hi):
                    out[count] = v
                    count += 1
    return count


_BLOCK = 128


@numba.njit(nogil=True, fastmath=_FAST)
def _above(
    row: np.ndarray, lo: float, hi: float
) -> tuple[int, int, float, float, float]:  # pragma: no cover
    """Of ``|row|``: the number of entries in ``(lo, hi]``; the count, sum and sum of squares
    of those above ``hi``; the sum of squares of those at or below ``lo`` (float counters, as
    in :func:`_row_stats`)."""
    n_lo = 0.0
    c = 0.0
    s = 0.0
    q = 0.0
    q_lo = 0.0
    for j in range(row.shape[0]):
        v = abs(np.float64(row[j]))
        v2 = v * v
        above = 1.0 if v > hi else 0.0
        above_lo = 1.0 if v > lo else 0.0
        n_lo += above_lo
        c += above
        s += v * above
        q += v2 * above
        q_lo += v2 * (1.0 - above_lo)
    return int(n_lo - c), int(c), s, q, q_lo


# --- per unit: bounds, candidates, the tie order; then the entry point
# Relative widening of the band bounds (as the tensor version's 64 eps of float32: the band
# only needs to contain every entry that can change support, a wider band costs nothing).
_MARGIN = 64 * 2.0**-23
# Pass 1 also counts the entries within 1/16 below tau_hi (none: the band pass may be skipped).
_NEAR = 1 - 1 / 16


@numba.njit(nogil=True)
def _sort_desc(a: np.ndarray, count: int) -> None:  # pragma: no cover - compiled
    """Sort ``a[:count]`` in place, descending: insertion sort for the usual tiny counts,
    Shell sort (Ciura's gaps) up to a few hundred, numba's quicksort beyond."""
    if count > 400:
        a[:count].sort()  # ascending, in place, then reversed
        for i in range(count // 2):
            a[i], a[count - 1 - i] = a[count - 1 - i], a[i]
        return
    for gap in _GAPS:
        if gap >= count:
            continue
        for i in range(gap, count):
            v = a[i]
            j = i
            while j >= gap and a[j - gap] < v:
                a[j] = a[j - gap]
                j -= gap
            a[j] = v


_GAPS = (132, 57, 23, 10, 4, 1)


@numba.njit(nogil=True)
def _shrink_sum(xs: np.ndarray, t: float) -> float:  # pragma: no cover - compiled
    """``sum_j (xs_j - t)_+`` for ``xs`` sorted descending."""
    total = 0.0
    for j in range(xs.shape[0]):
        if xs[j] <= t:
            break
        total += xs[j] - t
    return total


# `_prefix`, `_tau_lo` and `_unit` are inlined into `_thresholds` (in numba IR): as calls they
# cost 2-6% of the whole prox on the paper's shapes (A/B); inlining `_best` too buys under 1%
# more and doubles the compile time.
@numba.njit(nogil=True, inline="always")
def _prefix(xs: np.ndarray, cx: np.ndarray, sx2: np.ndarray) -> None:  # pragma: no cover
    """Prefix sums of ``xs``, and suffix sums of its squares (``sx2[j] = sum_{i >= j} xs_i^2``,
    ``sx2[p] = 0``: the squares left out of the top ``j``, summed from the small end)."""
    acc = 0.0
    p = xs.shape[0]
    for j in range(p):
        acc += xs[j]
        cx[j] = acc
    acc2 = 0.0
    sx2[p] = 0.0
    for j in range(p - 1, -1, -1):
        acc2 += xs[j] * xs[j]
        sx2[j] = acc2


@numba.njit(nogil=True, inline="always")
def _tau_lo(xs: np.ndarray, sx2: np.ndarray, lam: float, g_y: float) -> float:  # pragma: no cover
    """``lam a_lo``: a non-trivial minimiser has ``||v||_1 >= a_lo``, from ``G(a) >= C_x(a)``.

    ``G(a) = C_x(a) + E_y(lam a)`` is the objective minimised over the points with
    ``||v||_1 = a`` (``C_x``: half the squared distance from ``|x|`` to the simplex of radius
    ``a``, decreasing; ``E_y >= 0``: the Moreau envelope of ``||.||_1`` at ``y``), and
    ``min(G(||x||_1), G(0))`` bounds the minimum from above, so ``C_x(a_lo)`` equals that bound.
    ``g_y >= G(||x||_1) = 1/2 (|y|^2 - sum_{|y_j| > tau} (|y_j| - tau)^2)``, ``tau = lam
    ||x||_1``, rounded up by the caller. On the piece where ``k`` entries of ``|x|`` exceed
    ``theta``, ``C_x = 1/2 (k theta^2 + tail_k)`` and ``a = X_k - k theta``.
    """
    p = xs.shape[0]
    xsq = sx2[0]
    g_best = min(g_y, 0.5 * xsq)
    if g_best >= 0.5 * xsq:
        theta_g = xs[0]
    else:
        theta_g = 0.0
        for k in range(1, p + 1):
            # on piece k, theta^2 = t2 / k; test the piece before taking a root
            t2 = max(2 * g_best - sx2[k], 0.0)
            below = xs[k] if k < p else 0.0
            if t2 <= k * xs[k - 1] * xs[k - 1] and t2 >= k * below * below:
                theta = math.sqrt(t2 / k)
                if theta <= xs[k - 1] and theta >= below and theta > theta_g:
                    theta_g = theta
    a_lo = 0.0
    for j in range(p):
        if xs[j] > theta_g:
            a_lo += xs[j] - theta_g
    return lam * a_lo * (1 - _MARGIN)


@numba.njit(nogil=True, inline="always")
def _unit(
    xs: np.ndarray,
    cx: np.ndarray,
    sx2: np.ndarray,
    y: np.ndarray,
    lam: float,
    short_is_out: bool,
    band: np.ndarray,
    cb: np.ndarray,
    tb2: np.ndarray,
) -> tuple[float, float, float, bool]:  # pragma: no cover - compiled
    """Thresholds ``(t_x, t_y)`` of one unit (``xs``: sorted ``|x|`` with its prefix sums and
    suffix sums of squares, ``y`` the long row), ``||y||_1``, and whether ``y`` is finite.
    ``band``, ``cb``, ``tb2``: scratch of length m + 1."""
    p = xs.shape[0]
    m = y.shape[0]
    x1 = cx[p - 1]
    # Pass 1 over the long side: everything above tau_hi is in the support.
    tau_hi = lam * x1 * (1 + _MARGIN)
    near = tau_hi * _NEAR
    y1, sq_lo, c_hi, s_hi, q_hi, n_near = _row_stats(y, tau_hi, near)
    ysq = q_hi + sq_lo
    if not y1 <= _BIG and not _all_finite(y):  # NaN or inf (or a float64 sum overflowed)
        return np.nan, np.nan, y1, False
    # Fixed-point bounds: a non-trivial minimiser has a* = A(B(lam a*)) with
    # A(b) = sum (|x| - lam b)_+ and B(t) = sum (|y| - t)_+, both decreasing; from
    # B(0) = ||y||_1 >= B(t*) >= B(tau_hi): lam A(||y||_1) <= t* <= lam A(B(tau_hi)).
    # Widened by far more than their float64 rounding.
    err = _MARGIN * (x1 + p * lam * y1)
    tau_lo = lam * (_shrink_sum(xs, lam * y1) - err)
    hi = lam * (_shrink_sum(xs, lam * (s_hi - c_hi * tau_hi)) + err)
    # Pass 2: the band tau_lo < |y| <= tau_hi (usually empty), and what lies above. Not
    # needed when no entry lies in (near, tau_hi] and both bounds are above `near`: the
    # entries at or below tau_hi are then at or below tau_lo (out of the support, no band)
    # and below hi (the same entries lie above a lowered tau_hi): the usual case in training.
    skip = n_near == 0 and hi >= near
    if not (skip and tau_lo >= near):  # the tighter lower bound only matters then
        # |y|^2 - sum_{|y| > tau_hi} (|y| - tau_hi)^2, raised by its rounding (each sum within
        # (m + 1) ulps of ysq, tau_hi s_hi <= q_hi <= ysq).
        g_y = 0.5 * (sq_lo + tau_hi * (2 * s_hi - c_hi * tau_hi))
        tau_lo = max(tau_lo, _tau_lo(xs, sx2, lam, g_y + (m + 8) * 2.0**-52 * ysq))
    # sq_out: the squares of the entries out of every candidate's support (at or below tau_lo)
    if skip and tau_lo >= near:  # every entry at or below tau_hi is at or below near <= tau_lo
        n_band = 0
        tau_hi = min(hi, tau_hi)
        sq_out = sq_lo
    elif hi < tau_hi:
        tau_hi = hi
        n_band, c_hi, s_hi, _, sq_out = _above(y, tau_lo, tau_hi)
    else:
        n_band, _, _, _, sq_out = _above(y, tau_lo, tau_hi)
    count = 0
    if n_band > 0:
        count = _collect_band(y, tau_lo, tau_hi, band)
    _sort_desc(band, count)
    cb[0] = 0.0
    for t in range(count):
        cb[t + 1] = cb[t] + band[t]
    # tb2[j]: the squares left out when the first j band entries are taken, from the small end
    tb2[count] = sq_out
    for t in range(count - 1, -1, -1):
        tb2[t] = tb2[t + 1] + band[t] * band[t]
    t_x, t_y = _best(xs, cx, sx2, lam, ysq, c_hi, s_hi, tau_hi, band, cb, tb2, count,
                     short_is_out)  # fmt: skip
    return t_x, t_y, y1, True


@numba.njit(nogil=True)
def _best(
    xs: np.ndarray,
    cx: np.ndarray,
    sx2: np.ndarray,
    lam: float,
    ysq: float,
    c_hi: int,
    s_hi: float,
    tau_hi: float,
    band: np.ndarray,
    cb: np.ndarray,
    tb2: np.ndarray,
    count: int,
    short_is_out: bool,
) -> tuple[float, float]:  # pragma: no cover - compiled
    """The minimiser's thresholds among the trivial points and ``(k, c_hi + j*(k))``, ``k =
    1..p``, ``j*`` the largest feasible band index. Tie order: ``(x, 0)``, ``(0, y)``, pairs
    by increasing outgoing count (see :func:`pathnorm_lightning._sort.thresholds`). The
    objectives are unshifted (see :func:`pathnorm_lightning._sort.candidate_objective`):
    ``sx2[k]`` and ``tb2[j]`` are the squares of the entries left out."""
    p = xs.shape[0]
    lam2 = lam * lam
    nt_h = np.inf
    nt_tx = 0.0
    nt_ty = 0.0
    for k in range(1, p + 1):
        big_x = cx[k - 1]
        lo = _band_index(k, xs[k - 1], big_x, lam, c_hi, s_hi, tau_hi, band, cb, count)
        if lo < 0:
            continue
        ly = s_hi + cb[lo]
        lf = float(c_hi + lo)
        d = 1.0 - k * lf * lam2
        t_v = lam * max((ly - lf * lam * big_x) / d, 0.0)  # lam ||w||_1 of the candidate
        t_w = lam * max((big_x - k * lam * ly) / d, 0.0)  # lam ||v||_1 of the candidate
        # the objective from the point's own l1 norms (see _sort.candidate_objective)
        nv = max(big_x - k * t_v, 0.0)
        nw = max(ly - lf * t_w, 0.0)
        h = 0.5 * (k * t_v * t_v + sx2[k] + lf * t_w * t_w + tb2[lo]) + lam * nv * nw
        # k counts the outgoing entries when x is the outgoing side: first minimum; else k
        # counts incoming ones, and the last minimum has the fewest outgoing entries.
        if h < nt_h or (h == nt_h and not short_is_out):
            nt_h, nt_tx, nt_ty = h, t_v, (np.inf if lf == 0 else t_w)
    h_keep_x = 0.5 * ysq  # (x, 0): the objective is 1/2 |y|^2
    h_keep_y = 0.5 * sx2[0]  # (0, y): 1/2 |x|^2
    if short_is_out:  # (x, 0) first, then (0, y)
        best_h, best_tx, best_ty = h_keep_x, 0.0, np.inf
        if h_keep_y < best_h:
            best_h, best_tx, best_ty = h_keep_y, np.inf, 0.0
    else:  # the long side y is the outgoing one: (0_x, y) is the point "(x, 0)" of the rule
        best_h, best_tx, best_ty = h_keep_y, np.inf, 0.0
        if h_keep_x < best_h:
            best_h, best_tx, best_ty = h_keep_x, 0.0, np.inf
    if nt_h < best_h:
        return nt_tx, nt_ty
    return best_tx, best_ty


@numba.njit(nogil=True)
def _band_index(
    k: int,
    xk: float,
    big_x: float,
    lam: float,
    c_hi: int,
    s_hi: float,
    tau_hi: float,
    band: np.ndarray,
    cb: np.ndarray,
    count: int,
) -> int:  # pragma: no cover - compiled
    """The largest ``j`` in ``[0, count]`` with ``(k, c_hi + j)`` feasible, or -1 (bisection:
    the feasible set is downward closed in ``l``).

    ``Y_l = s_hi + (sum of the first j band entries)``, ``y_l = band[j - 1]``; ``tau_hi`` stands
    in for ``y_l`` at ``j = 0`` (the true one is larger). The test of ``w_l >= 0`` grows with
    ``y_l`` (``d > 0``), so a pair passing with the stand-in is truly feasible, and the
    minimiser's pair passes: its ``lam a* <= tau_hi``.
    """
    lam2 = lam * lam
    ax_k = big_x - k * xk  # X_k - k x_k >= 0
    lo = -1
    hi = count + 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        big_y = s_hi + cb[mid]
        yl = tau_hi if mid == 0 else band[mid - 1]
        lf = float(c_hi + mid)
        ok = xk + lam2 * lf * ax_k >= lam * big_y
        ok = ok and yl + lam2 * k * (big_y - lf * yl) >= lam * big_x
        ok = ok and k * lam2 * lf < 1.0  # d = 1 - k l lam^2 > 0
        if ok:
            lo = mid
        else:
            hi = mid
    return lo


@numba.njit(nogil=True)
def _thresholds(
    x: np.ndarray,
    y: np.ndarray,
    lam: float,
    check_finite: bool,
    short_is_out: bool,
    t_x: np.ndarray,
    t_y: np.ndarray,
    x_sorted: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """Per unit ``i`` (row of ``x`` (n, p), row of ``y`` (n, m), p <= m) the soft-threshold
    levels of the prox: ``t_x[i]`` for ``x[i]`` and ``t_y[i]`` for ``y[i]`` (``inf``: all zero).
    ``x_sorted``: ``|x|`` in float64, rows sorted descending, or empty (each row sorted here).
    A unit whose largest entry lies outside ``[2^-400, 2^400]`` (float64 only) is solved scaled
    by a power of two (the prox is scale-equivariant), so that no square overflows or underflows.

    Returns -1, or with ``check_finite`` the first unit holding a NaN or inf (and stops).
    """
    n, p = x.shape
    m = y.shape[1]
    big = 1.7976931348623157e308
    xs = np.empty(p)
    cx = np.empty(p)
    sx2 = np.empty(p + 1)  # sx2[j]: sum of xs[j:]^2
    band = np.empty(m + 1)
    cb = np.empty(m + 1)  # cb[j]: sum of the first j band entries
    tb2 = np.empty(m + 1)  # tb2[j]: sum of the squares left out after the first j
    scaled = np.empty(m)
    presorted = x_sorted.shape[0] > 0
    for i in range(n):
        for j in range(p):
            xs[j] = x_sorted[i, j] if presorted else abs(np.float64(x[i, j]))
        if check_finite:
            for j in range(p):
                if not xs[j] <= big:
                    return i
        if not presorted:
            _sort_desc(xs, p)
        _prefix(xs, cx, sx2)
        tx, ty, y1, finite = _unit(xs, cx, sx2, y[i], lam, short_is_out, band, cb, tb2)
        if check_finite and not finite:
            return i
        # max(|x|) <= top <= m max(|y|): outside the safe range, scale by the largest entry.
        top = max(xs[0], y1)
        if finite and xs[0] <= big and top > 0 and (top > _SAFE_HI or top < _SAFE_LO):
            top = xs[0]
            for j in range(m):
                top = max(top, abs(np.float64(y[i, j])))
            e = math.frexp(top)[1]
            for j in range(p):
                xs[j] = math.ldexp(xs[j], -e)
            for j in range(m):
                scaled[j] = math.ldexp(abs(np.float64(y[i, j])), -e)
            _prefix(xs, cx, sx2)
            tx, ty, _, _ = _unit(xs, cx, sx2, scaled, lam, short_is_out, band, cb, tb2)
            tx, ty = math.ldexp(tx, e), math.ldexp(ty, e)
        t_x[i] = tx
        t_y[i] = ty
    return -1


_SAFE_HI = 2.0**400
_SAFE_LO = 2.0**-400


@numba.njit(nogil=True)
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


# Short sides longer than this are sorted by numpy before the kernel runs.
_PRESORT = 16


@numba.njit(cache=True, nogil=True)
def _prox_all(
    short: np.ndarray,
    long: np.ndarray,
    lam: float,
    check_finite: bool,
    short_is_out: bool,
    x_sorted: np.ndarray,
) -> int:  # pragma: no cover - compiled
    n = short.shape[0]
    t_short = np.empty(n)
    t_long = np.empty(n)
    bad = _thresholds(short, long, lam, check_finite, short_is_out, t_short, t_long, x_sorted)
    if bad >= 0:
        return bad
    _shrink_rows(short, t_short)
    _shrink_rows(long, t_long)
    return -1


@numba.njit(cache=True, nogil=True, parallel=True)
def _prox_par(
    short_t: np.ndarray,
    long: np.ndarray,
    lam: float,
    chunks: int,
    check_finite: bool,
    short_is_out: bool,
    x_sorted: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """:func:`_prox_all` with the units in ``chunks`` contiguous blocks, one per thread (the
    same per-unit code, so the same bits; every threshold is found before any weight is
    written, and the first non-finite unit is the one :func:`_prox_all` reports). It takes
    the short side transposed, ``short_t`` (p, n): ``w_out`` itself, C-contiguous also when
    p = 1. The caller sets numba's thread count to ``chunks``."""
    short = short_t.T
    n = short.shape[0]
    t_short = np.empty(n)
    t_long = np.empty(n)
    bad = np.full(chunks, -1)
    presorted = x_sorted.shape[0] > 0
    for k in numba.prange(chunks):
        lo, hi = k * n // chunks, (k + 1) * n // chunks
        xs = x_sorted[lo:hi] if presorted else x_sorted
        b = _thresholds(
            short[lo:hi],
            long[lo:hi],
            lam,
            check_finite,
            short_is_out,
            t_short[lo:hi],
            t_long[lo:hi],
            xs,
        )
        if b >= 0:
            bad[k] = lo + b
    first = -1
    for k in range(chunks):
        if first < 0 and bad[k] >= 0:
            first = bad[k]
    if first < 0:
        for k in numba.prange(chunks):
            lo, hi = k * n // chunks, (k + 1) * n // chunks
            _shrink_rows(short[lo:hi], t_short[lo:hi])
            _shrink_rows(long[lo:hi], t_long[lo:hi])
    return first
