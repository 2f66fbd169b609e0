"""The device code of the Triton prox (:mod:`pathnorm_lightning._triton` checks and launches;
its notation): the maths of the shortest exact algorithm, :mod:`pathnorm_lightning._sort` (read
that one first), as one Triton kernel laid out for registers.

One program handles a block of units (one unit for wide layers), each loaded whole into
registers (both sides, strided reads: no copies or transposes). Per unit, with the shorter side
enumerated (``k`` entries kept) and the longer one searched (``l`` entries kept):

1. the unit scaled by a power of two (exact; the prox is scale-equivariant) so that its largest
   magnitude lies in [1, 2): no square below can overflow or underflow at any finite weight;
2. the short side sorted descending (a bitonic network in registers, :func:`_sort_desc_fn`)
   and its prefix sums, and the squares after each entry (:func:`_tail_sq_fn`), in float64
   whatever the weights' dtype (the CPU kernel's guarantee: a float32 result is the float32
   rounding of thresholds computed in float64);
3. the long side's columns ``l`` with their last kept entry ``y_l``, prefix sums ``Y_l`` and
   the squares of the entries left out. Band search (long sides of 256 or more): a
   non-trivial minimiser thresholds the long side at ``lam a <= lam ||x||_1`` (``a =
   ||v||_1``), so its support holds every entry above ``tau = lam ||x||_1 (1 + 2^-16)`` and
   no zero; only the band ``(0, tau]``
   (in training a handful of entries) is gathered through global scratch and sorted, after
   the smallest entry above ``tau``. A block of units whose band has more than 63 entries is
   left untouched, and a second launch runs the full search on those units only: the whole
   long side sorted, every ``l`` a column (also the only search for shorter long sides);
4. for every ``k``, ``L(k)``: the largest feasible ``l`` among the columns, testing all pairs
   ``(k, l)`` of a block of ``k`` at once (a tile; the tests of
   :func:`pathnorm_lightning._sort._largest_feasible`);
5. each candidate's objective in closed form from its own l1 norms (unshifted: the squares
   of the entries left out summed directly), and the first minimum in
   the order ``(x, 0)``, ``(0, y)``, then ``(k, L(k))`` by increasing ``k`` (``k`` counts the
   kept entries of the shorter side), strict ``<``: the tie rule of the exhaustive reference;
6. the soft-thresholds, written in place: ``v = sign(x) max(|x| - lam b, 0)`` and
   ``w = sign(y) max(|y| - lam a, 0)`` (``b = ||w||_1``), computed in float64 and rounded
   once to the weights' dtype (half precision through float32, as torch casts).
"""

from __future__ import annotations

from typing import Any

__all__ = ["build"]


def _import_tl() -> Any:
    try:
        import triton.language
    except ImportError:  # no triton: _triton.available() is False and nothing is built
        return None
    return triton.language


tl: Any = _import_tl()
_sort_desc: Any = None  # the jitted helpers, set by build()
_flip: Any = None
_to_bf16: Any = None
_sorted_abs: Any = None
_search: Any = None
_tail_combine: Any = None
_tail_sq: Any = None
_scale: Any = None
_trivial: Any = None
_band: Any = None
_soft_threshold: Any = None
_solve: Any = None


def build(triton: Any) -> Any:
    """The jitted kernel ``_prox_units``, built with the imported ``triton``; its helpers are
    jitted into this module's globals, where the kernel finds them when it is compiled."""
    jit = triton.jit
    globals().update(
        _sort_desc=jit(_sort_desc_fn),
        _flip=jit(_flip_fn),
        _to_bf16=jit(_to_bf16_fn),
        _sorted_abs=jit(_sorted_abs_fn),
        _search=jit(_search_fn),
        _tail_combine=jit(_tail_combine_fn),
        _tail_sq=jit(_tail_sq_fn),
        _scale=jit(_scale_fn),
        _trivial=jit(_trivial_fn),
        _band=jit(_band_fn),
        _soft_threshold=jit(_soft_threshold_fn),
        _solve=jit(_solve_fn),
    )
    # Integer arguments are not specialised (Triton would compile a variant for every
    # combination of values equal to 1 or divisible by 16): one compilation per dtype,
    # block configuration and flags.
    ints = ["s_unit", "s_elem", "P", "l_unit", "l_elem", "M", "N", "lam_bits", "R"]
    return triton.jit(do_not_specialize=ints)(_prox_units)


def _to_bf16_fn(x):  # pragma: no cover - compiled by Triton
    """float32 to the nearest bfloat16, ties to even, on the bits (finite values; NaN and inf
    only occur in flagged units)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


def _flip_fn(N_DIMS: tl.constexpr, J: tl.constexpr):  # pragma: no cover - compiled by Triton
    """Bit ``J`` of the position, as a tensor of shape [1, .., 2, .., 1] (the ``2`` at axis
    ``N_DIMS - 1 - J``) that broadcasts against the hypercube view."""
    return tl.reshape(tl.arange(0, 2), [1] * (N_DIMS - J - 1) + [2] + [1] * J)


def _sort_desc_fn(
    x, N_DIMS: tl.constexpr, LOG_ROW: tl.constexpr
):  # pragma: no cover - compiled by Triton
    """Rows of ``x`` (2^(N_DIMS - LOG_ROW), 2^LOG_ROW), integers >= 0, sorted descending: the
    bitonic network of ``tl.sort`` on the hypercube view, each compare-and-swap taking the
    partner from one sum over its size-2 axis (wrapping integer arithmetic, exact): Triton's
    interpreter runs that as one numpy call, ``tl.sort``'s reduction as a Python loop per entry
    (minutes for a test's layer)."""
    h = tl.reshape(x, [2] * N_DIMS)
    for stage in tl.static_range(1, LOG_ROW + 1):
        # Within a stage, runs of 2^stage entries are merged in alternating directions; the
        # last stage merges whole rows, descending.
        if stage < LOG_ROW:
            flip = _flip(N_DIMS, stage)
        else:
            flip = 1
        for i in tl.static_range(stage):  # partners at distance 2^(stage - 1 - i)
            partner = tl.sum(h, axis=N_DIMS - stage + i, keep_dims=True) - h
            upper = (flip ^ _flip(N_DIMS, stage - 1 - i)) != 0  # takes the larger one
            h = tl.where(upper, tl.maximum(h, partner), tl.minimum(h, partner))
    return tl.reshape(h, x.shape)


def _sorted_abs_fn(a, WIDE: tl.constexpr, N_DIMS: tl.constexpr, LOG_ROW: tl.constexpr):
    """Rows of the magnitudes ``a`` (float64 when ``WIDE``, else float32) sorted descending, as
    float64 (sorted as their bit patterns: integers order like non-negative floats)."""
    if WIDE:
        return _sort_desc(a.to(tl.int64, bitcast=True), N_DIMS, LOG_ROW).to(
            tl.float64, bitcast=True
        )
    else:
        out = _sort_desc(a.to(tl.int32, bitcast=True), N_DIMS, LOG_ROW)
        return out.to(tl.float32, bitcast=True).to(tl.float64)


def _tail_combine_fn(s1, e1, m1, s2, e2, m2):  # pragma: no cover - compiled by Triton
    """Combine two runs of squares ``(sum, sum without the largest entry's, largest entry)``;
    symmetric in its two arguments, so the scan's direction and operand order do not matter."""
    first = m1 >= m2
    return s1 + s2, tl.where(first, e1 + s2, s1 + e2), tl.maximum(m1, m2)


def _tail_sq_fn(v):  # pragma: no cover - compiled by Triton
    """``out[:, c] = sum_{j > c} v[:, j]^2`` for rows ``v >= 0`` sorted descending: the squares
    left out when the first ``c + 1`` entries are kept, summed directly (never a total minus a
    prefix sum, which cancels where the kept entries dominate)."""
    v2 = v * v
    _, tail, _ = tl.associative_scan((v2, tl.zeros_like(v2), v), 1, _tail_combine, reverse=True)
    return tail


def _search_fn(
    xs,  # (UNITS, BLOCK_P) the short side, sorted descending, scaled; cx: prefix sums
    cx,
    tx2,  # tx2[:, k - 1]: the squares of the entries after the k largest
    ycol,  # (UNITS or 1, NCOL) per column: the last kept long-side entry y_l,
    big_y,  # Y_l, the sum of the l largest,
    y2col,  # the sum of the squares of the long side's other entries,
    lcol,  # l (float64),
    col_ok,  # whether the column is a candidate
    lam,
    P,
    best_h,  # (UNITS,) the best candidate so far: objective and both thresholds
    best_ts,
    best_tl,
    BLOCK_P: tl.constexpr,
    NCOL: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # pragma: no cover - compiled by Triton
    """The candidates ``(k, L(k))`` for ``k = 1..P`` against the best so far (strict ``<``, by
    increasing ``k``): for a block of ``k`` at a time, every column's feasibility, ``L(k)`` the
    last feasible column, the candidate's thresholds and objective. A ``k`` with no feasible
    column has no candidate (its ``(k, 0)`` point is never better than ``(x, 0)``)."""
    inf = float("inf")
    lam2 = lam * lam
    op = tl.arange(0, BLOCK_P)
    kr = tl.arange(0, BLOCK_K)
    cidx = tl.arange(0, NCOL)[None, None, :]
    for k0 in range(0, P, BLOCK_K):
        kidx = k0 + kr  # k - 1
        pick_k = (kidx[:, None] == op[None, :])[None, :, :]  # (1, BLOCK_K, BLOCK_P)
        xk = tl.sum(tl.where(pick_k, xs[:, None, :], 0.0), axis=2)  # (UNITS, BLOCK_K)
        big_x = tl.sum(tl.where(pick_k, cx[:, None, :], 0.0), axis=2)
        x2k = tl.sum(tl.where(pick_k, tx2[:, None, :], 0.0), axis=2)
        kf = (kidx + 1).to(tl.float64)[None, :]
        ax_k = big_x - kf * xk  # X_k - k x_k >= 0
        k_lam2 = kf * lam2
        # (UNITS, BLOCK_K, NCOL): the feasibility of the pairs (k, l) of this block of k
        by = big_y - lcol * ycol  # Y_l - l y_l >= 0 (per block: fewer live registers)
        ok = (
            xk[:, :, None] + (lam2 * lcol)[:, None, :] * ax_k[:, :, None] >= lam * big_y[:, None, :]
        )
        ok &= ycol[:, None, :] + k_lam2[:, :, None] * by[:, None, :] >= (lam * big_x)[:, :, None]
        ok &= k_lam2[:, :, None] * lcol[:, None, :] < 1.0
        ok &= col_ok[:, None, :]
        last = tl.max(tl.where(ok, cidx, -1), axis=2)  # the column of L(k); -1: none
        at = cidx == last[:, :, None]
        lf = tl.sum(tl.where(at, lcol[:, None, :], 0.0), axis=2)
        ly = tl.sum(tl.where(at, big_y[:, None, :], 0.0), axis=2)
        ly2 = tl.sum(tl.where(at, y2col[:, None, :], 0.0), axis=2)
        d = 1.0 - kf * lf * lam2
        a = tl.maximum((big_x - kf * lam * ly) / d, 0.0)  # ||v||_1 of the candidate
        b = tl.maximum((ly - lf * lam * big_x) / d, 0.0)  # ||w||_1
        t_s = lam * b
        t_l = lam * a
        # the objective from the point's own l1 norms, unshifted (see
        # _sort.candidate_objective); x2k, ly2: the squares of the entries left out
        nv = tl.maximum(big_x - kf * t_s, 0.0)
        nw = tl.maximum(ly - lf * t_l, 0.0)
        h = 0.5 * (kf * t_s * t_s + x2k + lf * t_l * t_l + ly2) + lam * nv * nw
        h = tl.where((last >= 0) & (kidx < P)[None, :], h, inf)
        h_min = tl.min(h, axis=1)
        first = tl.min(tl.where(h == h_min[:, None], kidx[None, :], BLOCK_P), axis=1)
        chosen = kidx[None, :] == first[:, None]
        better = h_min < best_h
        best_h = tl.where(better, h_min, best_h)
        best_ts = tl.where(better, tl.sum(tl.where(chosen, t_s, 0.0), axis=1), best_ts)
        best_tl = tl.where(better, tl.sum(tl.where(chosen, t_l, 0.0), axis=1), best_tl)
    return best_h, best_ts, best_tl


def _scale_fn(abs_s, abs_l):  # pragma: no cover - compiled by Triton
    """``(up1, up2, down1, down2)``: the unit scaled by ``2^sh = up1 up2``, ``sh = 1023 -`` (the
    biased exponent of its largest magnitude), lands its largest in [1, 2); two factors so that
    each stays a normal float64. ``down1 down2 = 2^-sh`` scales back."""
    f64 = tl.float64
    big = tl.maximum(tl.max(abs_s, axis=1), tl.max(abs_l, axis=1)).to(f64)
    expo = (big.to(tl.int64, bitcast=True) >> 52) & 2047
    sh = 1023 - expo
    s1 = sh >> 1
    s2 = sh - s1
    up1 = ((s1 + 1023) << 52).to(f64, bitcast=True)
    up2 = ((s2 + 1023) << 52).to(f64, bitcast=True)
    down1 = ((1023 - s1) << 52).to(f64, bitcast=True)
    down2 = ((1023 - s2) << 52).to(f64, bitcast=True)
    return up1, up2, down1, down2


def _trivial_fn(
    xsq, ysq, SWAPPED: tl.constexpr, UNITS: tl.constexpr
):  # pragma: no cover - compiled by Triton
    """``(best_h, best_ts, best_tl)`` of the trivial points, in the reference's order: (x, 0)
    first, then (0, y) if strictly better. Thresholds: ``t_s`` for the short side, ``t_l`` for
    the long one (inf: all zero)."""
    f64 = tl.float64
    inf = float("inf")
    h_s = 0.5 * ysq  # keep the short side, zero the long one: 1/2 |long|^2
    h_l = 0.5 * xsq
    zero = tl.zeros([UNITS], f64)
    infs = tl.full([UNITS], inf, f64)
    if SWAPPED:  # x is the long side: keep-long comes first
        take = h_s < h_l
        best_h = tl.where(take, h_s, h_l)
        best_ts = tl.where(take, zero, infs)
        best_tl = tl.where(take, infs, zero)
    else:
        take = h_l < h_s
        best_h = tl.where(take, h_l, h_s)
        best_ts = tl.where(take, infs, zero)
        best_tl = tl.where(take, zero, infs)
    return best_h, best_ts, best_tl


def _band_fn(
    u,
    u_ok,
    l_mask,
    ya,  # (UNITS, BLOCK_M) the long side's magnitudes, scaled, unsorted
    xs,  # the short side sorted, scaled, its prefix sums and tails of squares
    cx,
    tx2,
    x1,  # ||x||_1 (scaled)
    lam,
    P,
    band_ptr,
    need_ptr,
    best_h,
    best_ts,
    best_tl,
    UNITS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BAND: tl.constexpr,
    BAND_K: tl.constexpr,
    LOG_U: tl.constexpr,
    LOG_BAND: tl.constexpr,
):  # pragma: no cover - compiled by Triton
    """The band search (mode 1): ``(u_ok, best_h, best_ts, best_tl)``, ``u_ok`` cleared for the
    units it leaves to the full search (mode 2, the next launch; marked in ``need_ptr``)."""
    f64 = tl.float64
    inf = float("inf")
    # See the module doc, step 3 (no zero is in the support: a zero stays zero only at a = 0,
    # the point (0, y)). Column 0: the smallest entry above tau, l = the count above tau.
    tau = lam * x1 * (1.0 + 1.0 / 65536)  # far above the rounding of a
    above = ya > tau[:, None]
    inband = (ya > 0.0) & (ya <= tau[:, None]) & l_mask
    c_hi = tl.sum(above.to(tl.int32), axis=1)
    has_top = c_hi > 0
    n_col = tl.sum(inband.to(tl.int32), axis=1) + has_top.to(tl.int32)
    use_band = tl.max(n_col, axis=0) <= BAND
    tl.store(need_ptr + u, tl.where(use_band, 0, 1) + tl.zeros([UNITS], tl.int32), mask=u_ok)
    u_ok = u_ok & (tl.zeros([UNITS], tl.int32) + use_band.to(tl.int32) != 0)
    if use_band:
        top = tl.where(has_top, tl.min(tl.where(above, ya, inf), axis=1), 0.0)
        s_hi = tl.sum(tl.where(above, ya, 0.0), axis=1) - top  # without column 0's entry
        base = (c_hi - has_top.to(tl.int32)).to(f64)
        # Gather the columns through global scratch (a scatter into registers has no Triton
        # form), then sort them.
        row = band_ptr + u.to(tl.int64) * BAND
        slot = tl.cumsum(inband.to(tl.int32), axis=1) - 1 + has_top.to(tl.int32)[:, None]
        tl.store(row, top, mask=has_top & u_ok)
        tl.store(row[:, None] + slot, ya, mask=inband)
        tl.debug_barrier()  # the block's stores are visible to all of its threads
        ob = tl.arange(0, BAND)
        col_ok = ob[None, :] < n_col[:, None]
        band = tl.load(row[:, None] + ob[None, :], mask=col_ok & u_ok[:, None], other=0.0)
        zb = _sort_desc(band.to(tl.int64, bitcast=True), LOG_U + LOG_BAND, LOG_BAND)
        zb = zb.to(f64, bitcast=True)
        best_h, best_ts, best_tl = _search(
            xs,
            cx,
            tx2,
            zb,
            s_hi[:, None] + tl.cumsum(zb, axis=1),
            _tail_sq(zb),  # the band's entries after the column (no others are left out)
            base[:, None] + (ob + 1).to(f64)[None, :],
            col_ok,
            lam,
            P,
            best_h,
            best_ts,
            best_tl,
            BLOCK_P,
            BAND,
            BAND_K,
        )
    return u_ok, best_h, best_ts, best_tl


def _soft_threshold_fn(z, t, WIDE: tl.constexpr, BF16: tl.constexpr):  # pragma: no cover
    """``z - clip(z, -t, t) = sign(z) max(|z| - t, 0)`` in float64, rounded once to the weights'
    dtype: float32 as the CPU kernel and torch's casts do, bfloat16 then to nearest on the bits
    (Triton's interpreter truncates)."""
    z64 = z.to(tl.float64)
    new = z64 - tl.minimum(tl.maximum(z64, -t), t)
    if not WIDE:
        new = new.to(tl.float32)
    if BF16:
        new = _to_bf16(new)
    return new


def _solve_fn(
    u,  # (UNITS,) the units of this block
    u_ok,  # which of them to solve
    s_ptr,  # the shorter side of every unit: entries at s_ptr + unit * s_unit + j * s_elem
    s_unit,
    s_elem,
    P,
    l_ptr,  # the longer side
    l_unit,
    l_elem,
    M,
    N,  # units
    lam_ptr,
    lam_bits,
    flag_ptr,
    band_ptr,  # float64 scratch, BAND per unit (mode 1)
    need_ptr,  # int32 per unit: 1 where the band search left the unit to the full one
    MODE: tl.constexpr,  # 0: full search; 1: band search, or defer; 2: the deferred units
    LAM_FROM_PTR: tl.constexpr,
    HAS_FLAG: tl.constexpr,
    SWAPPED: tl.constexpr,  # the shorter side is w_in's rows (else w_out's columns)
    WIDE: tl.constexpr,  # float64 weights (else float32 or narrower: sorted as float32)
    BF16: tl.constexpr,  # bfloat16 weights
    UNITS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,  # k per tile of the full search
    BAND: tl.constexpr,  # columns of the band search
    BAND_K: tl.constexpr,  # k per tile of the band search
    LOG_U: tl.constexpr,  # log2(UNITS)
    LOG_P: tl.constexpr,  # log2(BLOCK_P)
    LOG_M: tl.constexpr,
    LOG_BAND: tl.constexpr,
):  # pragma: no cover - compiled by Triton
    """The prox of the units ``u`` where ``u_ok``, written in place (see the module doc)."""
    f64 = tl.float64
    inf = float("inf")
    u64 = u.to(tl.int64)
    op = tl.arange(0, BLOCK_P)
    om = tl.arange(0, BLOCK_M)
    s_mask = u_ok[:, None] & (op < P)[None, :]
    l_mask = u_ok[:, None] & (om < M)[None, :]
    s_off = u64[:, None] * s_unit + op.to(tl.int64)[None, :] * s_elem
    l_off = u64[:, None] * l_unit + om.to(tl.int64)[None, :] * l_elem
    zs = tl.load(s_ptr + s_off, mask=s_mask, other=0.0)
    zl = tl.load(l_ptr + l_off, mask=l_mask, other=0.0)
    if WIDE:
        abs_s = tl.abs(zs.to(f64))
        abs_l = tl.abs(zl.to(f64))
    else:  # magnitudes are exact in float32; sorting them there moves half the bytes
        abs_s = tl.abs(zs.to(tl.float32))
        abs_l = tl.abs(zl.to(tl.float32))

    # NaN fails every comparison: `< inf` is false exactly for NaN and +-inf.
    bad_s = tl.max(tl.where(abs_s < inf, 0, 1), axis=1)
    bad_l = tl.max(tl.where(abs_l < inf, 0, 1), axis=1)
    if HAS_FLAG and MODE != 2:  # (a deferred unit was flagged by the band search)
        if SWAPPED:
            code = bad_s * 1 + bad_l * 2  # short = w_in (1), long = w_out (2)
        else:
            code = bad_s * 2 + bad_l * 1
        tl.atomic_or(flag_ptr + tl.zeros([UNITS], tl.int32), code, mask=code != 0)

    up1, up2, down1, down2 = _scale(abs_s, abs_l)
    xs = _sorted_abs(abs_s, WIDE, LOG_U + LOG_P, LOG_P) * up1[:, None] * up2[:, None]
    cx = tl.cumsum(xs, axis=1)  # cx[:, k - 1] = X_k, the sum of the k largest
    tx2 = _tail_sq(xs)  # tx2[:, k - 1]: the squares of the entries after the k largest
    x1 = tl.sum(tl.where((op == P - 1)[None, :], cx, 0.0), axis=1)  # ||x||_1
    xsq = tl.sum(xs * xs, axis=1)
    ya = abs_l.to(f64) * up1[:, None] * up2[:, None]  # the long side, scaled, unsorted
    ysq = tl.sum(ya * ya, axis=1)

    if LAM_FROM_PTR:
        lam = tl.minimum(tl.load(lam_ptr).to(f64), 2.0)
    else:
        lam = lam_bits.to(tl.int64).to(f64, bitcast=True)

    best_h, best_ts, best_tl = _trivial(xsq, ysq, SWAPPED, UNITS)
    if MODE == 1:
        u_ok, best_h, best_ts, best_tl = _band(
            u,
            u_ok,
            l_mask,
            ya,
            xs,
            cx,
            tx2,
            x1,
            lam,
            P,
            band_ptr,
            need_ptr,
            best_h,
            best_ts,
            best_tl,
            UNITS,
            BLOCK_P,
            BAND,
            BAND_K,
            LOG_U,
            LOG_BAND,
        )
    else:
        # Full search: the long side sorted whole, every l = 1..M a column.
        ys = _sorted_abs(abs_l, WIDE, LOG_U + LOG_M, LOG_M) * up1[:, None] * up2[:, None]
        best_h, best_ts, best_tl = _search(
            xs,
            cx,
            tx2,
            ys,
            tl.cumsum(ys, axis=1),  # Y_l at column l - 1
            _tail_sq(ys),  # the squares of the entries after the l largest
            (om + 1).to(f64)[None, :],
            (om < M)[None, :],
            lam,
            P,
            best_h,
            best_ts,
            best_tl,
            BLOCK_P,
            BLOCK_M,
            BLOCK_K,
        )

    # Back to the weights' scale (t = inf stays inf; a threshold past the float64 range zeroes
    # the side, as it should).
    ts = (best_ts * down1 * down2)[:, None]
    tls = (best_tl * down1 * down2)[:, None]
    s_mask &= u_ok[:, None]
    l_mask &= u_ok[:, None]
    # Read again rather than kept in registers through the search (cache hits).
    zs = tl.load(s_ptr + s_off, mask=s_mask, other=0.0)
    zl = tl.load(l_ptr + l_off, mask=l_mask, other=0.0)
    tl.store(s_ptr + s_off, _soft_threshold(zs, ts, WIDE, BF16), mask=s_mask)
    tl.store(l_ptr + l_off, _soft_threshold(zl, tls, WIDE, BF16), mask=l_mask)


def _prox_units(
    s_ptr,  # the shorter side of every unit: entries at s_ptr + unit * s_unit + j * s_elem
    s_unit,
    s_elem,
    P,
    l_ptr,  # the longer side
    l_unit,
    l_elem,
    M,
    N,  # units
    lam_ptr,
    lam_bits,
    flag_ptr,
    band_ptr,  # float64 scratch, BAND per unit (mode 1)
    need_ptr,  # int32 per unit: 1 where the band search left the unit to the full one
    R,  # blocks of units per program (mode 2; else 1)
    MODE: tl.constexpr,  # 0: full search; 1: band search, or defer; 2: the deferred units
    LAM_FROM_PTR: tl.constexpr,
    HAS_FLAG: tl.constexpr,
    SWAPPED: tl.constexpr,  # the shorter side is w_in's rows (else w_out's columns)
    WIDE: tl.constexpr,  # float64 weights (else float32 or narrower: sorted as float32)
    BF16: tl.constexpr,  # bfloat16 weights
    UNITS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,  # k per tile of the full search
    BAND: tl.constexpr,  # columns of the band search
    BAND_K: tl.constexpr,  # k per tile of the band search
    LOG_U: tl.constexpr,  # log2(UNITS)
    LOG_P: tl.constexpr,  # log2(BLOCK_P)
    LOG_M: tl.constexpr,
    LOG_BAND: tl.constexpr,
):  # pragma: no cover - compiled by Triton
    """The kernel: ``R`` blocks of ``UNITS`` units per program. Mode 2 walks many units per
    program and solves only those the band search deferred (usually none): a few programs with
    little to do, rather than one per unit."""
    if MODE == 2:
        steps = R
    else:
        steps: tl.constexpr = 1  # type: ignore[no-redef]  # one step: the loop folds away
    for j in range(0, steps):
        first = (tl.program_id(0) * steps + j) * UNITS
        u = first + tl.arange(0, UNITS)
        go = first < N
        if MODE == 2:  # (mode 1 decided for whole blocks: its first unit speaks for all)
            go = go & (tl.load(need_ptr + first, mask=go, other=0) != 0)
        if go:
            _solve(
                u,
                u < N,
                s_ptr,
                s_unit,
                s_elem,
                P,
                l_ptr,
                l_unit,
                l_elem,
                M,
                N,
                lam_ptr,
                lam_bits,
                flag_ptr,
                band_ptr,
                need_ptr,
                MODE,
                LAM_FROM_PTR,
                HAS_FLAG,
                SWAPPED,
                WIDE,
                BF16,
                UNITS,
                BLOCK_P,
                BLOCK_M,
                BLOCK_K,
                BAND,
                BAND_K,
                LOG_U,
                LOG_P,
                LOG_M,
                LOG_BAND,
            )
