"""The ``"band"`` method (the default): sort only the part of the long side that can change.

Same candidates and minimiser as :mod:`pathnorm_tf._sort` (read it first). Bounds on
``||v||_1`` fix most of the long side's support: every ``|y_j| > tau_hi = lam ||x||_1`` is kept
and no ``|y_j| <= tau_lo`` (``tau_lo`` from a lower bound on ``||v||_1``), so only the *band*
``tau_lo < |y| <= tau_hi`` is sorted, then the largest feasible band index is found for every
k and the least objective is taken. Shapes stay static (the band block has a fixed width; a
wider band falls back to the whole-row sort), so it runs eagerly, in graphs and under XLA.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import tensorflow as tf

from pathnorm_tf._sort import candidate_objective, prox_rows, tie_order
from pathnorm_tf._xla import (
    EPS,
    at_least,
    cumsum_cols,
    gather_rows,
    materialized,
    pick_rows,
    reduce_units,
    sort_rows_desc,
    unit,
    unit_sums,
)

# Static width of the widest band block (a top_k); a wider band takes the whole-row sort.
BAND_BLOCK = 32
# Bands of at most this many entries in every unit are extracted by repeated max reductions over
# the long side (two per entry) instead of a top_k, which XLA on CPU runs as a slow partial sort
# of every row. The tiers fit the Keras epoch benchmark (784-200-10 trained by PathNormSGD: bands
# of 0 to 4 entries in ~97% of its steps); a wider band takes the top_k block.
FAST_TIERS = (0, 1, 2, 4)
# Largest (n * p * (band + 1)) evaluated in one shot before bisecting instead (as torch).
_BAND_FULL_LIMIT = 1 << 15


class Band(NamedTuple):
    """What every band tier needs; per-unit values are columns (n, 1) (``k`` runs along 1)."""

    x: tf.Tensor  # short side (n, p), neutral layout, float64
    y: tf.Tensor  # long side: (n, m) if unit_axis == 0, (m, n) (Dense kernel) if 1; any float
    unit_axis: int
    lam: float | tf.Tensor
    lam2: float | tf.Tensor
    xs: tf.Tensor  # |x| sorted descending, (n, p)
    cx: tf.Tensor  # cx[:, k - 1] = sum of the k largest |x|
    cx2: tf.Tensor
    tx2: tf.Tensor  # tx2[:, k - 1] = sum of the squares of all but the k largest |x|
    kk: tf.Tensor  # k = 1..p, (1, p)
    ysq: tf.Tensor
    tau_hi: tf.Tensor
    tau_lo: tf.Tensor
    c_hi: tf.Tensor  # number and sum of the |y| above tau_hi
    s_hi: tf.Tensor
    q_lo: tf.Tensor  # sum of the squares of the |y| at or below tau_lo (never in a support)
    count: tf.Tensor  # band entries per unit (float)
    width: tf.Tensor  # 0-d: the largest count
    swapped: bool  # x holds the incoming weights (only the tie order depends on it)
    in_range: tf.Tensor  # (n, 1): no long-side sum overflowed, no sum of squares underflowed
    y_scale: tf.Tensor | None  # (n, 1) in y's dtype: the long side is |y| times it (None: 1)

    def abs_y(self) -> tf.Tensor:
        """``|y|``, scaled per unit by ``y_scale`` (one fused elementwise expression)."""
        return tf.abs(_scaled(self.y, self.y_scale, self.unit_axis))

    def unit(self, t: tf.Tensor) -> tf.Tensor:
        return unit(t, self.unit_axis)

    def reduce(self, fn: Any, t: tf.Tensor) -> tf.Tensor:
        return reduce_units(fn, t, self.unit_axis)

    def band_values(self) -> tf.Tensor:
        """``|y|`` on the band ``tau_lo < |y| <= tau_hi``, 0 elsewhere (``y``-shaped, y's dtype;
        compared in the bounds' dtype)."""
        ay = self.abs_y()
        lo, hi = (self.unit(tf.cast(t, ay.dtype)) for t in (self.tau_lo, self.tau_hi))
        in_band = (ay > lo) & (ay <= hi)  # (both bounds are ld values: exact)
        return tf.where(in_band, ay, tf.zeros_like(ay))


def band_setup(
    x: tf.Tensor,
    y: tf.Tensor,
    unit_axis: int,
    lam: float | tf.Tensor,
    lam2: float | tf.Tensor,
    swapped: bool = False,
    y_scale: tf.Tensor | None = None,
) -> Band:
    """The band problem (:class:`Band`: bounds ``tau_hi``, ``tau_lo``, statistics) of the short
    side ``x`` (n, p), float64, and the long side ``y``: (n, m) with ``unit_axis = 0`` or a Dense
    kernel (m, n) with ``unit_axis = 1``, float32 or float64. ``lam`` is in [0, 2] and ``lam2 =
    lam * lam``, rounded once; ``swapped``: ``x`` holds the incoming weights (only the tie order
    depends on it); ``y_scale`` (n, 1) in ``y``'s dtype, or None, scales the long side per unit
    inside the passes over it (never materialized).

    XLA on CPU does not fuse an elementwise producer into a reduction and runs one loop per
    fusion, so the long side is read in two passes: ``||y||^2`` with the sum of squares above
    ``tau_hi``, then (given ``tau_lo``) the packed counts with the sum above ``tau_hi``, each
    pair folded and reduced as one complex sum (:func:`pathnorm_tf._xla.unit_sums`).
    """
    p = int(x.shape[1])
    m = int(y.shape[1 - unit_axis])
    dt, ld = x.dtype, y.dtype  # per-unit work in dt (float64); the long side in its own ld
    eps = EPS[ld]  # (the long side is summed and compared in ld: its rounding rules)
    margin = 64 * eps
    ax = tf.abs(x)
    xs = sort_rows_desc(ax)
    cx = cumsum_cols(xs)
    cx2 = cumsum_cols(xs * xs)
    tx2 = _tails(xs * xs)
    x1 = cx[:, p - 1 :]
    # The bounds are rounded to ld once (within their margins) and kept out of the loops over
    # the long side (see materialized); every comparison with the long side uses them.
    (tau_hi_l,) = materialized(_upper_in(lam * x1 * (1 + margin), ld))
    tau_hi = tf.cast(tau_hi_l, dt)
    ay = tf.abs(_scaled(y, y_scale, unit_axis))
    r_hi = tf.maximum(ay - unit(tau_hi_l, unit_axis), 0.0)
    # (the plain sums: an exact tie between ||x||^2 and ||y||^2 stays a tie)
    ysq, r_sq = (tf.cast(t, dt) for t in unit_sums(ay * ay, r_hi * r_hi, unit_axis))
    kk = tf.cast(tf.range(1, p + 1), dt)[tf.newaxis, :]
    tau_lo = _tau_lo(ax, xs, cx, cx2, tx2, ysq, r_sq, lam, m, eps)
    (tau_lo_l,) = materialized(tf.minimum(tf.cast(tau_lo, ld), tau_hi_l))
    tau_lo = tf.cast(tau_lo_l, dt)
    c_hi, count, r_sum, q_lo = _band_counts(ay, r_hi, tau_hi_l, tau_lo_l, unit_axis, dt)
    s_hi = r_sum + c_hi * tau_hi  # sum of the |y| above tau_hi
    return Band(
        x, y, unit_axis, lam, lam2, xs, cx, cx2, tx2, kk, ysq, tau_hi, tau_lo, c_hi, s_hi, q_lo,
        count, tf.reduce_max(count), swapped, _sums_in_range(ysq, s_hi, c_hi), y_scale,
    )  # fmt: skip


def _tails(sq: tf.Tensor) -> tf.Tensor:
    """For squares ``sq`` (n, p) of entries sorted descending: column ``k - 1`` (k = 1..p) is
    the sum of all but the first k, summed directly from the small end (never a total minus a
    prefix, which cancels where the dropped entries are tiny beside the kept ones)."""
    rev = tf.reverse(cumsum_cols(tf.reverse(sq, [1])), [1])  # rev[:, i] = sum of sq[:, i:]
    return tf.concat([rev[:, 1:], tf.zeros_like(sq[:, :1])], 1)


def _upper_in(t: tf.Tensor, ld: tf.DType) -> tf.Tensor:
    """``t`` (float64, >= 0) rounded to ``ld`` without falling below it. A positive ``t`` under
    float32's smallest normal number (a tiny ``lam``, 1e-39 or 1e-300, on float32 or float16
    weights) becomes that number, not 0 (TensorFlow flushes subnormals to 0): ``tau_hi`` stands
    in for the smallest kept ``|y|``, whose feasibility test it must pass."""
    t_l = tf.cast(t, ld)
    if ld == tf.float64:  # (t is already in ld)
        return t_l
    return tf.where(t > 0, tf.maximum(t_l, tf.constant(2.0**-126, ld)), t_l)


def _scaled(y: tf.Tensor, scale: tf.Tensor | None, unit_axis: int) -> tf.Tensor:
    """``y`` times its unit's ``scale`` (a power of two: exact), or ``y`` when None."""
    return y if scale is None else y * unit(scale, unit_axis)


def _sums_in_range(ysq: tf.Tensor, s_hi: tf.Tensor, c_hi: tf.Tensor) -> tf.Tensor:
    """Whether each unit's long-side sums are usable ((n, 1) bool): finite, and ``||y||^2`` not
    lost to underflow, which Cauchy-Schwarz exposes: the ``c_hi`` entries above ``tau_hi``,
    summing to ``s_hi``, alone give ``c_hi ||y||^2 >= s_hi^2`` (halved for rounding).

    With ``x`` scaled to a largest entry near 1 (see ``pathnorm_tf.functional``), squares of
    ``y`` that underflow are below the objective's resolution, except where ``x = 0``: then
    ``tau_hi = 0``, every nonzero entry is above it, and the test catches the loss."""
    return tf.math.is_finite(ysq) & tf.math.is_finite(s_hi) & (c_hi * ysq >= 0.5 * s_hi * s_hi)


def _tau_lo(
    ax: tf.Tensor,
    xs: tf.Tensor,
    cx: tf.Tensor,
    cx2: tf.Tensor,
    tx2: tf.Tensor,
    ysq: tf.Tensor,
    r_sq: tf.Tensor,
    lam: float | tf.Tensor,
    m: int,
    eps: float,
) -> tf.Tensor:
    """A lower bound on ``lam ||v||_1`` of the minimiser (n, 1), lowered by more than its
    rounding: no ``|y_j|`` at or below it is in the incoming support. ``ax`` is ``|x|`` (n, p),
    ``xs`` the same sorted descending, ``cx``, ``cx2`` the cumsums of ``xs`` and ``xs^2``,
    ``tx2`` the sums of the squares outside the top k (see :func:`_tails`);
    ``ysq`` is ``||y||^2`` and ``r_sq`` the sum of ``(|y| - tau_hi)_+^2`` per unit; ``m`` the
    long side's length, ``eps`` its unit roundoff."""
    p, dt = int(ax.shape[1]), ax.dtype
    margin = 64 * eps
    x1, xsq = cx[:, p - 1 :], cx2[:, p - 1 :]
    # Upper bound on the minimum, and from it a lower bound a_lo on ||v||_1.
    # ysq - r_sq cancels when tau_hi is tiny against |y|: raised by the rounding of both sums
    # (each within (m + 1) eps of its value), so that the bound stays above the minimum.
    g_best = tf.minimum(0.5 * (ysq - r_sq) + (m + 2) * eps * ysq, 0.5 * xsq)
    kk = tf.cast(tf.range(1, p + 1), dt)[tf.newaxis, :]
    theta = tf.sqrt(tf.maximum(2 * g_best - tx2, 0.0) / kk)
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
    return tf.maximum(tau_lo, lam * a_cs * (1 - margin))


def _band_counts(
    ay: tf.Tensor,
    r_hi: tf.Tensor,
    tau_hi_l: tf.Tensor,
    tau_lo_l: tf.Tensor,
    unit_axis: int,
    dt: tf.DType,
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """Per unit (n, 1) in ``dt``: how many ``|y|`` lie above ``tau_hi`` and in the band, the
    sum of ``r_hi = (|y| - tau_hi)_+``, from one pass over the long side (see
    :func:`pathnorm_tf._xla.unit_sums`; two where the counts do not pack: a float32 long side of
    more than 4095 entries), and the sum of the squares of the ``|y|`` at or below ``tau_lo``
    (the entries no candidate keeps), summed directly: never ``||y||^2`` minus the squares
    above, which cancels where the dropped entries are tiny beside the kept ones."""
    ld = ay.dtype
    m = int(ay.shape[1 - unit_axis])
    # Both counts from one reduction of (|y| > tau_lo) + K (|y| > tau_hi), K a power of two > m
    # (tau_lo <= tau_hi): integers below 2^24 (2^53 in float64) sum exactly in any order. The
    # 0/1 |y| > t equals torch's sign(max(|y| - t, 0)): a - b > 0 iff a > b.
    in_hi = tf.cast(ay > unit(tau_hi_l, unit_axis), ld)
    above_lo = tf.cast(ay > unit(tau_lo_l, unit_axis), ld)
    pack = 2.0 ** math.ceil(math.log2(m + 1))
    if pack * (m + 1) <= 2.0 ** (53 if ld == tf.float64 else 24):
        packed, r_sum = (
            tf.cast(t, dt) for t in unit_sums(above_lo + pack * in_hi, r_hi, unit_axis)
        )
        c_hi = tf.floor(packed / pack)
        count = packed - pack * c_hi - c_hi
    else:
        c_hi, r_sum = (tf.cast(t, dt) for t in unit_sums(in_hi, r_hi, unit_axis))
        count = tf.cast(reduce_units(tf.reduce_sum, above_lo - in_hi, unit_axis), dt)
    below_sq = tf.where(ay > unit(tau_lo_l, unit_axis), tf.zeros_like(ay), ay * ay)
    q_lo = tf.cast(reduce_units(tf.reduce_sum, below_sq, unit_axis), dt)
    return c_hi, count, r_sum, q_lo


class _Feasibility(NamedTuple):
    """The terms of the feasibility test of support pairs ``(k, c_hi + j)``, multiplied
    through by ``d = 1 - k l lam^2 > 0``::

        v_k >= 0  <=>  x_k + lam^2 l (X_k - k x_k) >= lam Y_l
        w_l >= 0  <=>  y_l + lam^2 k (Y_l - l y_l) >= lam X_k

    ``k`` runs along the columns of the (n, p) terms, ``j`` along those of the (n, kb + 1) ones.
    """

    xs: tf.Tensor  # x_k, (n, p)
    ax_k: tf.Tensor  # X_k - k x_k
    lam_x: tf.Tensor  # lam X_k
    lam2_k: tf.Tensor  # lam^2 k, (1, p)
    l_max: tf.Tensor  # 1 / (k lam^2): d > 0 <=> l < l_max
    l_all: tf.Tensor  # l = c_hi + j, (n, kb + 1)
    yl_all: tf.Tensor  # y_l
    by_l: tf.Tensor  # Y_l - l y_l
    lam_y: tf.Tensor  # lam Y_l
    lam2: float | tf.Tensor
    count: tf.Tensor  # band entries per unit, (n, 1)


def _every_pair(f: _Feasibility, w: int) -> tuple[tf.Tensor, tf.Tensor]:
    """Every pair ``(k, c_hi + j)`` with ``j < w`` at once, (n, p, w): per k the largest
    feasible ``j`` (int32, (n, p)) and whether there is one. Taken only when ``w`` exceeds the
    band width (later ``j`` are infeasible by the ``j <= count`` mask)."""
    p, kb = int(f.xs.shape[1]), int(f.l_all.shape[1]) - 1
    dt = f.xs.dtype
    l_w = f.l_all[:, :w]
    j_w = tf.cast(tf.range(w), dt)[tf.newaxis, :]
    feas = (
        f.xs[:, :, None] + (f.lam2 * l_w)[:, None, :] * f.ax_k[:, :, None] >= f.lam_y[:, None, :w]
    )
    feas &= (
        f.yl_all[:, None, :w] + tf.reshape(f.lam2_k, [1, p, 1]) * f.by_l[:, None, :w]
        >= f.lam_x[:, :, None]
    )
    l_in = tf.where(j_w <= f.count, l_w, tf.constant(float("inf"), dt))
    feas &= l_in[:, None, :] < tf.reshape(f.l_max, [1, p, 1])
    j_star = tf.reduce_max(tf.cast(feas, dt) * (j_w + 1)[:, None, :], 2) - 1
    # (the clip only matters for NaN weights, which must not index out of range)
    return tf.clip_by_value(tf.cast(j_star, tf.int32), 0, kb), j_star >= 0


def _bisect_band(f: _Feasibility) -> tuple[tf.Tensor, tf.Tensor]:
    """As :func:`_every_pair`, by a bisection over the block (for large blocks)."""
    n, p, kb = int(f.xs.shape[0]), int(f.xs.shape[1]), int(f.l_all.shape[1]) - 1

    def feasible(ji: tf.Tensor) -> tf.Tensor:
        lj, lyj = gather_rows(f.l_all, ji), gather_rows(f.lam_y, ji)
        ok = f.xs + f.lam2 * lj * f.ax_k >= lyj
        ok &= gather_rows(f.yl_all, ji) + f.lam2_k * gather_rows(f.by_l, ji) >= f.lam_x
        return ok & (lj < f.l_max)

    lo = tf.zeros([n, p], tf.int32)
    # count <= kb unless the band overflows (then the result is discarded); NaN -> 1
    hi = tf.broadcast_to(tf.clip_by_value(tf.cast(f.count, tf.int32), 0, kb) + 1, [n, p])
    for _ in range(max(1, math.ceil(math.log2(kb + 2)))):  # depends on the block width only
        mid = (lo + hi) // 2
        ok = feasible(tf.minimum(mid, kb))
        lo = tf.where(ok, mid, lo)
        hi = tf.where(ok, hi, mid)
    return lo, feasible(tf.zeros_like(lo))


def band_candidates(b: Band, band: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Thresholds ``(t_x, t_y)`` (n, 1) from the sorted band ``band`` (n, kb), zero padded."""
    x, cx, cx2, tx2, kk, lam, lam2 = b.x, b.cx, b.cx2, b.tx2, b.kk, b.lam, b.lam2
    n, p = int(x.shape[0]), int(x.shape[1])
    kb = int(band.shape[1])
    dt = x.dtype
    inf = tf.constant(float("inf"), dt)
    zero = tf.zeros_like(x[:, :1])
    ly_all = b.s_hi + tf.concat([zero, cumsum_cols(band)], 1)  # sum of c_hi + j largest
    yl_all = tf.concat([b.tau_hi, band], 1)  # the (c_hi + j)-th largest; tau_hi stands in at j=0
    l_all = b.c_hi + tf.cast(tf.range(kb + 1), dt)[tf.newaxis, :]  # (n, kb + 1)
    f = _Feasibility(
        b.xs, cx - kk * b.xs, lam * cx, lam2 * kk, 1.0 / (kk * lam2),
        l_all, yl_all, ly_all - l_all * yl_all, lam * ly_all, lam2, b.count,
    )  # fmt: skip
    if n * p * (kb + 1) <= _BAND_FULL_LIMIT:
        jj, valid = _every_pair(f, kb + 1)
    elif n * p <= _BAND_FULL_LIMIT:
        full = tf.cast(n * p, dt) * (b.width + 1) <= _BAND_FULL_LIMIT
        jj, valid = tf.cond(
            full, lambda: _every_pair(f, _BAND_FULL_LIMIT // (n * p)), lambda: _bisect_band(f)
        )
    else:
        jj, valid = _bisect_band(f)

    lf = pick_rows(l_all, jj)
    ly = pick_rows(ly_all, jj)
    # the dropped squares of y: those below the band, and the band's beyond the support
    band_tail = _tails(tf.concat([zero, band * band], 1))  # [:, j]: sum of band[:, j:]^2
    ty2 = b.q_lo + pick_rows(band_tail, jj)
    d = 1.0 - kk * lf * lam2
    a = tf.maximum((cx - kk * lam * ly) / d, 0.0)  # ||v||_1 of the candidate
    bb = tf.maximum((ly - lf * lam * cx) / d, 0.0)  # ||w||_1 of the candidate
    h = candidate_objective(cx, ly, kk, lf, lam * bb, lam * a, tx2, ty2, lam)
    h = tf.where(valid, h, inf)
    # Candidates: (0, y) (objective ||x||^2 / 2), the support pairs, (x, 0) (||y||^2 / 2);
    # thresholds lam * b for v, lam * a for w (in the order of the tie rule, see tie_order)
    infs = tf.fill(tf.shape(zero), inf)
    h = tie_order(tf.concat([0.5 * cx2[:, p - 1 :], h], 1), 0.5 * b.ysq, b.swapped)
    t_v = tie_order(tf.concat([infs, lam * bb], 1), zero, b.swapped)
    t_w = tie_order(tf.concat([zero, tf.where(lf == 0, inf, lam * a)], 1), infs, b.swapped)
    return at_least(h, t_v, t_w)


def narrow_band(b: Band, kb: int) -> tf.Tensor:
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
        end = cumsum_cols(tf.concat(ends, 1))  # (n, kb - 1)
        which = tf.reduce_sum(tf.cast(end[:, tf.newaxis, :] <= slot[:, :, tf.newaxis], tf.int32), 2)
        band = gather_rows(tf.concat(tops, 1), which)
    else:
        band = tops[0]
    band = tf.cast(band, dt)
    return tf.where(slot < b.count, band, tf.zeros_like(band))


def wide_band(b: Band) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The band tier with a top_k block of :data:`BAND_BLOCK` columns: ``(t_x, t_y, too_wide)``;
    ``too_wide`` (0-d bool) flags a band wider than the block, where the result is invalid."""
    vals = b.band_values()
    if b.unit_axis == 1:
        vals = tf.transpose(vals)
    kb = min(BAND_BLOCK, int(vals.shape[1]))
    band = tf.cast(tf.math.top_k(vals, k=kb, sorted=True).values, b.x.dtype)
    t_x, t_y = band_candidates(b, band)
    return t_x, t_y, b.width > kb


def prox_band(b: Band) -> tuple[tf.Tensor, tf.Tensor]:
    """Exact prox thresholds ``(t_x, t_y)`` (n, 1), float64 (``inf``: the unit's side becomes 0),
    of :func:`band_setup`'s problem ``b``. The band is extracted by the cheapest tier that holds
    it: :data:`FAST_TIERS` (repeated max reductions), then a top_k block of :data:`BAND_BLOCK`
    columns, then the whole-row sort of :mod:`pathnorm_tf._sort`."""
    x, y, unit_axis, lam, lam2 = b.x, b.y, b.unit_axis, b.lam, b.lam2

    def neutral_y() -> tf.Tensor:
        ys = _scaled(y, b.y_scale, unit_axis)
        return tf.cast(ys if unit_axis == 0 else tf.transpose(ys), x.dtype)

    def wide() -> tuple[tf.Tensor, tf.Tensor]:
        t_x, t_y, too_wide = wide_band(b)
        return tf.cond(
            too_wide, lambda: prox_rows(x, neutral_y(), lam, lam2, b.swapped), lambda: (t_x, t_y)
        )

    tiers = sorted({min(t, BAND_BLOCK, int(y.shape[1 - unit_axis])) for t in FAST_TIERS})

    def narrow(kb: int) -> tuple[tf.Tensor, tf.Tensor]:
        if kb == 0:  # no band anywhere: only j = 0
            return band_candidates(b, tf.zeros_like(b.count))
        return band_candidates(b, narrow_band(b, kb))

    def tier(i: int) -> tuple[tf.Tensor, tf.Tensor]:
        if i == len(tiers):
            return wide()
        kb = tiers[i]
        return tf.cond(b.width <= kb, lambda: narrow(kb), lambda: tier(i + 1))

    # (nested conds, not one tf.switch_case: XLA compiles a switch over large blocks very slowly)
    return tier(0)
