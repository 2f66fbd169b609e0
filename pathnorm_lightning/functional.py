"""Pure tensor functions: the exact 1-path-norm prox, its bounds and the paper's baselines.

Layout (torch, two ``nn.Linear`` layers ``Linear(m, n) -> act -> Linear(n, p)``):
``w_in`` is the first layer's weight, shape (n, m); ``w_out`` the second's, shape (p, n).
Hidden unit ``i`` owns the row ``w_in[i, :]`` (incoming) and the column ``w_out[:, i]``
(outgoing). The 1-path-norm is ``sum_i ||w_out[:, i]||_1 * ||w_in[i, :]||_1``; biases are
not part of it.

The prox solves, separately for every hidden unit (x = outgoing, y = incoming weights)::

    min_{v, w}  1/2 ||v - x||^2 + 1/2 ||w - y||^2 + lam * ||v||_1 * ||w||_1

exactly. The objective is non-convex; every minimiser is a stationary point
``v = S(x, lam ||w||_1)``, ``w = S(y, lam ||v||_1)`` (S = soft-threshold) fixed by its support
sizes ``(k, l)`` (top-k of |x|, top-l of |y|), or one of the trivial points ``(x, 0)`` and
``(0, y)``. The feasible supports form a staircase (downward closed, Lemma 4 of the paper) and
the objective decreases along it (Lemma 8), so the minimiser lies among the pairs
``(k, L(k))``, ``L(k)`` the largest feasible ``l`` for ``k``. Two tensor implementations
evaluate all of them at once, with no Python loop over units or support sizes:

* ``_prox_rows`` ("sort"): one sort per row, cumulative sums, a fixed-length vectorised
  binary search for ``L(k)`` and an argmin; nothing waits on the device. On CUDA it is replayed
  as a CUDA graph (``_GraphedSort``).
* ``_prox_rows_band`` ("band"): sorts only the thin band of the long side whose entries can
  enter or leave the support (see its docstring).

and ``pathnorm_lightning._kernel`` ("kernel", the CPU default when numba is installed) compiles
the band algorithm unit by unit to machine code: the same mathematics in a few passes over the
weights, without the dispatch of a hundred tensor operations.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from types import ModuleType
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "NonFiniteWeightsError",
    "path_norm",
    "product_bound",
    "project_rows_l1_ball",
    "project_rows_l1_ball_",
    "prox_l1",
    "prox_l1_",
    "prox_path_norm",
    "prox_path_norm_",
]


def _check_scalar(value: float | Tensor, name: str) -> float:
    if isinstance(value, (str, bytes, bool)) or value is None:
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = float(value.item())
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


class NonFiniteWeightsError(ValueError):
    """A weight given to the prox holds NaN or inf (the prox is undefined there)."""


def _check_matrix(w: Tensor, name: str, check_finite: bool) -> None:
    if not isinstance(w, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"{name} must be a 2-D weight matrix, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {w.dtype}")
    if check_finite:
        _check_finite(w, name)


def _finite_flag(weights: Sequence[Tensor]) -> Tensor | None:
    """On-device 0-d bool: whether every entry is finite (None for no entries), in one pass:
    min/max propagate NaN and expose +-inf (about 7x cheaper on CPU than ``isfinite(w).all()``,
    which allocates a mask)."""
    ends = [e.reshape(1) for w in weights if w.numel() for e in torch.aminmax(w.detach())]
    return torch.isfinite(torch.cat(ends)).all() if ends else None


def _check_finite(w: Tensor, name: str) -> None:
    """Raise on NaN/inf, with one host sync."""
    flag = _finite_flag([w])
    if flag is not None and not bool(flag):
        raise _non_finite(name)


def _non_finite(name: str) -> NonFiniteWeightsError:
    return NonFiniteWeightsError(
        f"{name} contains NaN or inf; the prox of non-finite weights is undefined "
        "(check the learning rate and the loss for divergence)"
    )


def _check_pair(w_in: Tensor, w_out: Tensor, check_finite: bool) -> None:
    _check_matrix(w_in, "w_in", check_finite)
    _check_matrix(w_out, "w_out", check_finite)
    if w_in.shape[0] != w_out.shape[1]:
        raise ValueError(
            f"w_in (n, m) = {tuple(w_in.shape)} and w_out (p, n) = {tuple(w_out.shape)} do not "
            f"pair: w_in.shape[0] must equal w_out.shape[1] (the hidden width n)"
        )
    if w_in.device != w_out.device:
        raise ValueError(f"w_in is on {w_in.device} but w_out is on {w_out.device}")
    if w_in.dtype != w_out.dtype:
        raise ValueError(
            f"w_in is {w_in.dtype} but w_out is {w_out.dtype}: the prox couples both in one "
            "precision; cast one to the other's dtype"
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_SCRATCH = threading.local()


def _scratch(like: Tensor, n_float: int, n_long: int) -> tuple[list[Tensor], list[Tensor]]:
    """Reusable scratch tensors shaped like ``like`` (per thread, a few recent shapes).

    A training loop calls the prox with the same shapes at every step; reusing the large
    temporaries avoids fresh allocations, which glibc serves with new pages (page faults) once
    it has returned freed memory to the OS. That was more than half of the prox's time.
    """
    cache: OrderedDict[tuple, tuple[list[Tensor], list[Tensor]]] | None = getattr(
        _SCRATCH, "cache", None
    )
    if cache is None:
        cache = _SCRATCH.cache = OrderedDict()
    key = (tuple(like.shape), like.dtype, like.device, n_float, n_long)
    bufs = cache.get(key)
    if bufs is None:
        bufs = (
            [torch.empty_like(like) for _ in range(n_float)],
            [torch.empty(like.shape, dtype=torch.long, device=like.device) for _ in range(n_long)],
        )
        if like.numel() > _SCRATCH_MAX_NUMEL:  # big layers: keep no memory between calls
            return bufs
        cache[key] = bufs
        while len(cache) > 4:
            cache.popitem(last=False)
    cache.move_to_end(key)
    return bufs


# Layers up to this many weights keep their scratch tensors between calls (at most 4 shapes
# per thread, 7 numbers of scratch per weight: about 56 MB per shape at this bound in float32).
_SCRATCH_MAX_NUMEL = 1 << 21


def _soft_threshold(
    z: Tensor, t: Tensor, *, scratch: Tensor | None = None, out: Tensor | None = None
) -> Tensor:
    """``sign(z) max(|z| - t, 0)`` with a per-row threshold ``t`` (n, 1); ``t = inf`` gives 0.

    ``z - clip(z, -t, t)``, computed in ``scratch`` and written to ``out`` (may be ``z``).
    """
    clipped = torch.maximum(z, -t, out=scratch) if scratch is not None else torch.maximum(z, -t)
    torch.minimum(clipped, t, out=clipped)
    return torch.sub(z, clipped, out=out if out is not None else clipped)


def _prox_rows(x: Tensor, y: Tensor, lam: float | Tensor) -> tuple[Tensor, Tensor]:
    """Exact prox per row pair: ``x`` (n, p) outgoing, ``y`` (n, m) incoming weights.

    ``lam`` may be a 0-d float64 tensor on the weights' device (the CUDA graph feeds it so): no
    Python branch depends on its value, and it rounds as a Python float would.
    """
    n, p = x.shape
    m = y.shape[1]
    if p > m:  # enumerate the shorter side, search the longer one (the problem is symmetric)
        w, v = _prox_rows(y, x, lam)
        return v, w
    dt = x.dtype
    lam2 = lam * lam
    ax, ay = x.abs(), y.abs()
    xs = torch.sort(ax, dim=1, descending=True).values
    ys = torch.sort(ay, dim=1, descending=True).values
    zero = x.new_zeros(n, 1)
    cx = xs.cumsum(1)  # cx[:, k - 1] = X_k, the sum of the k largest |x|
    cy = torch.cat([zero, ys.cumsum(1)], 1)  # cy[:, l] = Y_l
    cx2 = (xs * xs).cumsum(1)
    cy2 = torch.cat([zero, (ys * ys).cumsum(1)], 1)
    yl = torch.cat([zero, ys], 1)  # yl[:, l] = l-th largest |y| (l >= 1)
    by = cy - torch.arange(m + 1, device=x.device, dtype=dt) * yl  # Y_l - l y_l >= 0
    k = torch.arange(1, p + 1, device=x.device, dtype=dt)
    ax_k = cx - k * xs  # X_k - k x_k >= 0
    lam_x = lam * cx
    l_max = 1.0 / (k * lam2)  # inf for lam = 0

    # (k, l) is feasible iff d = 1 - k l lam^2 > 0 and the last kept entries of both candidate
    # vectors are >= 0; multiplied through by d:
    #   v_k >= 0  <=>  x_k + lam^2 l (X_k - k x_k) >= lam Y_l
    #   w_l >= 0  <=>  y_l + lam^2 k (Y_l - l y_l) >= lam X_k   (vacuous for l = 0)
    # L(k) = the largest feasible l in [0, m] for k = 1..p. l = 0 is always feasible and the
    # feasible set is downward closed in l, so L(k) is built bit by bit (binary lifting): try
    # L + 2^j from the top bit down, keep it when feasible. One gather per step fetches
    # (lam Y_l, y_l, Y_l - l y_l); columns past m hold lam Y_l = inf, which fails the first test,
    # so no step needs clamping. Every step is a fixed set of tensor operations (nothing waits
    # on the device), about a dozen, for bit_length(m) steps.
    top = 1 << (m.bit_length() - 1)
    table = torch.stack([lam * cy, yl, by], 1)  # (n, 3, m + 1): planes copy row by row
    pad = table.new_zeros(n, 3, top)
    pad[:, 0] = math.inf
    table = torch.cat([table, pad], 2)
    lam2_k = lam2 * k
    lo = torch.zeros(n, p, dtype=torch.long, device=x.device)
    bit = top
    while bit:
        cand = lo + bit  # >= 1, <= m + top
        lf = cand.to(dt)
        g = table.gather(2, cand.unsqueeze(1).expand(n, 3, p))
        ok = torch.addcmul(xs, lam2 * lf, ax_k) >= g[:, 0]
        ok &= torch.addcmul(g[:, 1], lam2_k, g[:, 2]) >= lam_x
        ok &= lf < l_max
        lo = torch.where(ok, cand, lo)
        bit >>= 1

    lf = lo.to(dt)
    d = 1.0 - k * lf * lam2
    ly = cy.gather(1, lo)
    a = ((cx - k * lam * ly) / d).clamp_min(0)  # ||v||_1 of the candidate
    b = ((ly - lf * lam * cx) / d).clamp_min(0)  # ||w||_1 of the candidate
    h = _candidate_objective(cx, cy2.gather(1, lo), cx2, ly, k, lf, lam * b, lam * a, lam)
    # Candidates: (0, y) (= k = 0, l = m), (k, L(k)) for k = 1..p, and (x, 0) (Lemma 8 makes
    # it redundant when L(p) > 0; kept for safety). Thresholds: lam * b for v, lam * a for w.
    h = torch.cat([-0.5 * cy2[:, m:], h, -0.5 * cx2[:, p - 1 :]], 1)
    inf = torch.full_like(zero, math.inf)
    t_v = torch.cat([inf, lam * b, zero], 1)
    t_w = torch.cat([zero, torch.where(lo == 0, math.inf, lam * a), inf], 1)
    best = h.argmin(1, keepdim=True)
    return _soft_threshold(x, t_v.gather(1, best)), _soft_threshold(y, t_w.gather(1, best))


def _candidate_objective(
    big_x: Tensor,
    ly2: Tensor,
    cx2: Tensor,
    ly: Tensor,
    k: Tensor,
    lf: Tensor,
    t_v: Tensor,
    t_w: Tensor,
    lam: float | Tensor,
) -> Tensor:
    """Objective (up to 1/2 (||x||^2 + ||y||^2)) of the point that support sizes ``(k, l)``
    and thresholds ``t_v = lam b``, ``t_w = lam a`` produce, from that point's own l1 norms
    ``X_k - k t_v`` and ``Y_l - l t_w``: near ``d = 1 - k l lam^2 = 0``, ``a`` and ``b`` carry
    rounding amplified by ``1 / d``, and the closed form in ``a, b`` could misrank nearly equal
    candidates. ``big_x``, ``ly``: X_k and Y_l; ``cx2``, ``ly2``: their sums of squares."""
    nv = (big_x - k * t_v).clamp_min(0)
    nw = (ly - lf * t_w).clamp_min(0)
    return 0.5 * (k * t_v * t_v + lf * t_w * t_w - cx2 - ly2) + lam * nv * nw


def _compact(ay: Tensor, band: Tensor, k_max: int, scratch: list[Tensor] | None) -> Tensor:
    """The band entries of each row, left-aligned in an (r, k_max) block (zero padded)."""
    band_i = scratch[0].copy_(band) if scratch else band.long()  # integer scans are faster
    slot = torch.cumsum(band_i, 1, out=scratch[1] if scratch else None).mul_(band_i)
    # band entries go to 1..count, the rest to column 0, which is dropped
    return ay.new_zeros(ay.shape[0], k_max + 1).scatter_(1, slot, ay)[:, 1:]


def _band_sorted(ay: Tensor, band: Tensor, scratch: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Entries of ``ay`` (>= 0) where the float mask ``band`` is 1, per row, sorted descending.

    Returns ``(B, count)``: ``B`` of shape (n, K), zero padded, ``K`` the largest count. Only the
    compacted (n, K) block is sorted. When few rows hold band entries (the usual case in
    training: a handful of rows, one or two entries each), only those rows are compacted.
    ``scratch``: two int64 tensors shaped like ``ay``.
    """
    n = ay.shape[0]
    count = band.sum(1, keepdim=True)
    k_max = int(count.max()) if n else 0  # one host sync: the band width sizes the block
    if k_max == 0:
        return ay.new_zeros(n, 0), count
    rows = torch.nonzero(count[:, 0]).squeeze(1)
    if 2 * rows.numel() <= n:
        sub = _compact(ay.index_select(0, rows), band.index_select(0, rows), k_max, None)
        sub = torch.sort(sub, dim=1, descending=True).values
        return ay.new_zeros(n, k_max).index_copy_(0, rows, sub), count
    block = _compact(ay, band, k_max, scratch)
    return torch.sort(block, dim=1, descending=True).values, count


def _prox_rows_band(
    x: Tensor, y: Tensor, lam: float, out_y: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Exact prox per row pair without sorting the long side (``y``, m >= p) in full.

    The minimiser is either the trivial point ``(0, y)`` or a stationary point with
    ``a = ||v||_1`` in ``[a_lo, ||x||_1]``, so its incoming support is ``{j : |y_j| > lam a}``:
    every entry above ``tau_hi = lam ||x||_1`` is in it, every entry at or below
    ``tau_lo = lam a_lo`` is out. ``a_lo`` comes from ``G(a) >= C_x(a)``, where
    ``G(a) = C_x(a) + E_y(lam a)`` is the objective minimised over all points with
    ``||v||_1 = a`` (``C_x``: half the squared distance from |x| to the simplex of radius a,
    decreasing; ``E_y >= 0``: the Moreau envelope of ``||.||_1`` at y), and from the upper bound
    ``min(G(||x||_1), G(0))`` on the minimum. Only the band ``tau_lo < |y| <= tau_hi`` is sorted,
    then every support pair ``(k, l)`` with ``l`` in the band is a candidate. Elementwise work
    on the long side is kept to float arithmetic (comparisons to bool are slow on CPU) and to
    reused scratch tensors. The new ``y`` is written to ``out_y`` when given (may be ``y``).
    """
    (n, p), m = x.shape, y.shape[1]
    dt, dev = x.dtype, x.device
    lam2 = lam * lam
    eps = torch.finfo(dt).eps
    margin = 64 * eps
    (f_ay, f_hi, f_band), longs = _scratch(y, 3, 2)
    ax, ay = x.abs(), torch.abs(y, out=f_ay)
    xs = torch.sort(ax, dim=1, descending=True).values if p > 1 else ax
    cx = xs.cumsum(1)  # cx[:, k - 1] = sum of the k largest |x|
    cx2 = (xs * xs).cumsum(1)
    x1, xsq = cx[:, p - 1 :], cx2[:, p - 1 :]
    ysq = torch.linalg.vector_norm(ay, dim=1, keepdim=True).square()

    tau_hi = lam * x1 * (1 + margin)
    r_hi = torch.sub(ay, tau_hi, out=f_hi).clamp_min_(0)
    r_sum = r_hi.sum(1, keepdim=True)
    r_sq = torch.linalg.vector_norm(r_hi, dim=1, keepdim=True).square()
    in_hi = r_hi.sign_()
    c_hi = in_hi.sum(1, keepdim=True)
    s_hi = r_sum + c_hi * tau_hi  # sum and sum of squares of the |y| above tau_hi
    q_hi = r_sq + 2 * tau_hi * r_sum + c_hi * tau_hi * tau_hi
    # Upper bound on the minimum: G at a = ||x||_1 (1 + margin) (E_y is increasing), or G(0).
    # ysq - r_sq cancels when tau_hi is tiny against |y|: raised by the rounding of both sums
    # (each within (m + 1) eps of its value), so that the bound stays above the minimum.
    g_best = torch.minimum(0.5 * (ysq - r_sq) + (m + 2) * eps * ysq, 0.5 * xsq)
    # C_x(a_lo) = g_best: on the piece where k entries of |x| exceed theta,
    # C_x = 1/2 (k theta^2 + tail_k) and a = X_k - k theta.
    kk = torch.arange(1, p + 1, device=dev, dtype=dt)
    theta = ((2 * g_best - (xsq - cx2)).clamp_min(0) / kk).sqrt()
    below = torch.cat([xs[:, 1:], xs.new_zeros(n, 1)], 1)
    on_piece = (theta <= xs) & (theta >= below)
    theta_g = (theta * on_piece).amax(1, keepdim=True)
    theta_g = torch.where(g_best >= 0.5 * xsq, xs[:, :1], theta_g)
    a_lo = (ax - theta_g).clamp_min(0).sum(1, keepdim=True)
    tau_lo = lam * a_lo * (1 - margin)
    # The second lower bound of pathnorm_tf's band method: ||w||_1 <= ||y||_1 <= B =
    # sqrt(m) ||y||_2 (widened by its rounding), so ||v||_1 >= sum (|x| - lam B)_+.
    big_b = (m * ysq * (1 + (m + 2) * eps)).sqrt() * (1 + 2 * eps)
    a_cs = (ax - lam * big_b).clamp_min(0).sum(1, keepdim=True)
    a_cs -= (p + 2) * eps * (x1 + p * lam * big_b)
    tau_lo = torch.maximum(tau_lo, lam * a_cs * (1 - margin))
    # tau_lo <= tau_hi holds for finite weights. With non-finite ones (check_finite=False: the
    # prox is undefined, but must not index out of range) a NaN bound is replaced by tau_hi, so
    # the band mask stays in {0, 1} (torch.sign(NaN) is 0).
    tau_lo = torch.fmin(tau_lo, tau_hi)
    band_mask = torch.sub(ay, tau_lo, out=f_band).clamp_min_(0).sign_().sub_(in_hi)
    band, count = _band_sorted(ay, band_mask, longs)

    kb = band.shape[1]
    zero = x.new_zeros(n, 1)
    ly_all = s_hi + torch.cat([zero, band.cumsum(1)], 1)  # sum of the (c_hi + j) largest |y|
    # The (c_hi + j)-th largest |y|. For j = 0 it is > tau_hi; tau_hi stands in for it: a
    # candidate with b >= 0 has a <= ||x||_1, so its last kept entry passes either way, and a
    # candidate that passes with the stand-in has w_l > 0, hence b > 0.
    yl_all = torch.cat([tau_hi, band], 1)
    j = torch.arange(kb + 1, device=dev, dtype=dt)
    l_all = c_hi + j  # (n, kb + 1)
    # Feasibility of (k, l), multiplied through by d = 1 - k l lam^2 > 0:
    #   v_k >= 0  <=>  x_k + lam^2 l (X_k - k x_k) >= lam Y_l
    #   w_l >= 0  <=>  y_l + lam^2 k (Y_l - l y_l) >= lam X_k
    ax_k = cx - kk * xs  # X_k - k x_k >= 0
    by_l = ly_all - l_all * yl_all  # Y_l - l y_l >= 0
    lam_x, lam_y = lam * cx, lam * ly_all
    l_max = 1.0 / (kk * lam2)  # d > 0  <=>  l < 1 / (k lam^2)

    if n * p * (kb + 1) <= _BAND_FULL_LIMIT:
        # Every pair (k, c_hi + j) at once, shape (n, p, kb + 1); keep the largest feasible j.
        feas = torch.addcmul(
            xs.unsqueeze(2), (lam2 * l_all).unsqueeze(1), ax_k.unsqueeze(2)
        ) >= lam_y.unsqueeze(1)
        feas &= torch.addcmul(
            yl_all.unsqueeze(1), (lam2 * kk).view(1, p, 1), by_l.unsqueeze(1)
        ) >= lam_x.unsqueeze(2)
        # d > 0, and j within this row's band (l = inf past it)
        feas &= torch.where(j <= count, l_all, math.inf).unsqueeze(1) < l_max.view(1, p, 1)
        j_star = (feas.to(dt) * (j + 1)).amax(2) - 1  # -1: not even (k, c_hi) is feasible
        valid = j_star >= 0
        jj = j_star.clamp_min(0).long()
    else:
        # Wide bands: bisection for the largest feasible j per k (the feasible set is
        # downward closed in l), as in _prox_rows.
        def feasible(ji: Tensor) -> Tensor:
            lj, lyj = l_all.gather(1, ji), lam_y.gather(1, ji)
            ok = torch.addcmul(xs, lam2 * lj, ax_k) >= lyj
            ok &= torch.addcmul(yl_all.gather(1, ji), lam2 * kk, by_l.gather(1, ji)) >= lam_x
            return ok & (lj < l_max)

        jj = torch.zeros(n, p, dtype=torch.long, device=dev)
        hi_j = (count.long() + 1).expand(n, p).clone()
        for _ in range(max(1, math.ceil(math.log2(kb + 2)))):
            mid = (jj + hi_j) >> 1
            ok = feasible(mid.clamp_max(kb))
            jj = torch.where(ok, mid, jj)
            hi_j = torch.where(ok, hi_j, mid)
        valid = feasible(torch.zeros_like(jj))

    # The candidate of each k: support (k, c_hi + j*), shape (n, p).
    lf = l_all.gather(1, jj)
    ly = ly_all.gather(1, jj)
    ly2 = q_hi + torch.cat([zero, (band * band).cumsum(1)], 1).gather(1, jj)
    d = 1.0 - kk * lf * lam2
    a = ((cx - kk * lam * ly) / d).clamp_min(0)  # ||v||_1 of the candidate
    b = ((ly - lf * lam * cx) / d).clamp_min(0)  # ||w||_1 of the candidate
    h = _candidate_objective(cx, ly2, cx2, ly, kk, lf, lam * b, lam * a, lam)
    h = torch.where(valid, h, math.inf)
    # Candidates: (0, y), the support pairs, (x, 0); thresholds lam * b for v, lam * a for w.
    h = torch.cat([-0.5 * ysq, h, -0.5 * xsq], 1)
    inf = torch.full_like(zero, math.inf)
    t_v = torch.cat([inf, lam * b, zero], 1)
    t_w = torch.cat([zero, torch.where(lf == 0, math.inf, lam * a), inf], 1)
    best = h.argmin(1, keepdim=True)
    w = _soft_threshold(y, t_w.gather(1, best), scratch=f_hi, out=out_y)
    return _soft_threshold(x, t_v.gather(1, best)), (w if out_y is not None else w.clone())


# Largest (n * p * band) evaluated in one shot by _prox_rows_band before it bisects instead.
_BAND_FULL_LIMIT = 1 << 15


def prox_path_norm(
    w_in: Tensor,
    w_out: Tensor,
    lam: float | Tensor,
    *,
    check_finite: bool = True,
    method: Literal["auto", "kernel", "band", "sort"] = "auto",
) -> tuple[Tensor, Tensor]:
    """Exact prox of ``lam * path_norm``: ``argmin 1/2||A - w_in||^2 + 1/2||B - w_out||^2 + lam P(A, B)``.

    Args:
        w_in: first layer weight, shape (n, m).
        w_out: second layer weight, shape (p, n).
        lam: prox step, finite and >= 0 (inside proximal SGD: ``lr * lambda``).
        check_finite: raise :class:`NonFiniteWeightsError` (a ``ValueError``) on NaN/inf
            weights (free with the CPU kernel; elsewhere one device sync, which hot paths on
            accelerators may skip when the weights are known to be finite).
        method: ``"kernel"``: the band algorithm compiled by numba, a few passes over the
            weights per call (CPU only; the fastest there by far; the first call of a process
            loads it from numba's cache, or compiles it in a few seconds on a new machine).
            ``"band"``: the same algorithm in torch ops, sorting only the band of the long side
            that can change support (one host sync for the band width). ``"sort"`` sorts whole
            rows and never syncs (for accelerators; on CUDA it runs as a CUDA graph, captured
            at the second call with a layer shape and replayed after, unless the environment
            sets ``PATHNORM_CUDA_GRAPHS=0``). ``"auto"``: ``"kernel"`` on CPU when numba is
            installed; else ``"band"`` on CPU when the shorter side is at most a quarter of the
            longer one, else ``"sort"``. All are exact and return the same minimiser.

    Returns:
        ``(w_in_new, w_out_new)``, new tensors of the input dtypes. Half precision inputs are
        computed in float32 and cast back.
    """
    return _prox(w_in, w_out, lam, check_finite, method, in_place=False)


_KERNEL: object = None  # the compiled kernel module once imported, False if numba is missing


def _kernel_module() -> ModuleType | None:
    """``pathnorm_lightning._kernel`` (numba), or None when numba is not installed."""
    global _KERNEL
    if _KERNEL is None:
        try:
            from pathnorm_lightning import _kernel
        except ImportError:
            _KERNEL = False
        else:
            _KERNEL = _kernel
    return _KERNEL if isinstance(_KERNEL, ModuleType) else None


def _auto_method(w_in: Tensor, w_out: Tensor) -> str:
    """``"kernel"`` on CPU with numba; else ``"band"`` on CPU when the shorter side is at most a
    quarter of the longer one (the band pays off there), else ``"sort"``."""
    cpu = w_in.device.type == "cpu"
    if cpu and _kernel_module() is not None:
        return "kernel"
    lopsided = 4 * min(w_in.shape[1], w_out.shape[0]) <= max(w_in.shape[1], w_out.shape[0])
    return "band" if cpu and lopsided else "sort"


def _prox_kernel(
    w_in: Tensor, w_out: Tensor, lam: float, check_finite: bool, in_place: bool
) -> tuple[Tensor, Tensor]:
    """The compiled CPU kernel (``method="kernel"``), on contiguous float32/64 working copies,
    or straight on ``w_in`` when it is one (in place)."""
    kernel = _kernel_module()
    if kernel is None:
        raise ValueError(
            'method="kernel" needs numba (pip install numba, or the "torch" extra of '
            'pathnorm); method="band" and "sort" work without it'
        )
    if w_in.device.type != "cpu":
        raise ValueError(f'method="kernel" runs on CPU tensors; these are on {w_in.device}')
    cd = _compute_dtype(w_in.dtype)
    n, m = w_in.shape
    p = w_out.shape[0]

    def working(w: Tensor) -> Tensor:  # C-contiguous, dtype cd: ``w`` itself when possible
        if in_place and w.dtype == cd and w.is_contiguous():
            return w.detach()
        return torch.empty(w.shape, dtype=cd).copy_(w.detach())

    a, b = working(w_in), working(w_out)  # (n, m), (p, n)
    threads = torch.get_num_threads()  # large layers use as many threads as torch's ops
    with torch.no_grad():
        if p <= m:  # the short side is read and written through the transposed view
            bad = kernel.prox_inplace(b.numpy().T, a.numpy(), lam, check_finite, threads)
        else:  # the kernel sorts the first (short) side: swap roles (the problem is symmetric)
            long = torch.empty(n, p, dtype=cd).copy_(b.t())  # rows are scanned: contiguous
            bad = kernel.prox_inplace(a.numpy(), long.numpy(), lam, check_finite, threads)
            if bad < 0:
                b.copy_(long.t())
        if bad >= 0:  # unit `bad` holds a NaN or inf; nothing was written
            raise _non_finite("w_out" if bool(torch.isfinite(w_in[bad]).all()) else "w_in")
        if in_place:
            for w, work in ((w_in, a), (w_out, b)):
                if work.data_ptr() != w.data_ptr():
                    w.copy_(work)
            return w_in, w_out
    return a.to(w_in.dtype), b.to(w_out.dtype)


def _prox(
    w_in: Tensor,
    w_out: Tensor,
    lam: float | Tensor,
    check_finite: bool,
    method: str,
    in_place: bool,
) -> tuple[Tensor, Tensor]:
    lam = _check_scalar(lam, "lam")
    _check_pair(w_in, w_out, check_finite=False)
    if method not in ("auto", "kernel", "band", "sort"):
        raise ValueError(f"method must be 'auto', 'kernel', 'band' or 'sort', got {method!r}")
    trivial = lam == 0.0 or w_in.numel() == 0 or w_out.numel() == 0
    if not trivial:
        if method == "auto":
            method = _auto_method(w_in, w_out)
    # For lam >= 1 no support pair is feasible (k l lam^2 >= 1): only the two trivial points
    # remain and the prox no longer depends on lam. Capping keeps lam^2 finite.
    lam = min(lam, 2.0)
    graph = None if trivial or method != "sort" else _cuda_graph(w_in, w_out)
    if graph is not None:  # it checks finiteness too, with one sync for both matrices
        return graph(w_in, w_out, lam, check_finite, in_place)
    # The kernel checks finiteness in its first pass over the weights, for free.
    if check_finite and (trivial or method != "kernel"):
        _check_finite(w_in, "w_in")
        _check_finite(w_out, "w_out")
    if trivial:
        return (w_in, w_out) if in_place else (w_in.detach().clone(), w_out.detach().clone())
    if method == "kernel":
        return _prox_kernel(w_in, w_out, lam, check_finite, in_place)
    cd = _compute_dtype(w_in.dtype)
    # Rows of x are units: sorting and scanning along strided rows is much slower, so copy.
    x, y = w_out.detach().to(cd).t().contiguous(), w_in.detach().to(cd)
    with torch.no_grad():
        if method == "sort":
            v, w = _prox_rows(x, y, lam)
        elif x.shape[1] <= y.shape[1]:
            # In place, w_in takes the result directly (no large temporary) when it can.
            direct = in_place and w_in.dtype == cd and w_in.is_contiguous()
            v, w = _prox_rows_band(x, y, lam, out_y=w_in.detach() if direct else None)
        else:  # the band algorithm sorts the short side: swap roles (the problem is symmetric)
            w, v = _prox_rows_band(y, x, lam)
        if in_place:
            if w.data_ptr() != w_in.data_ptr():
                w_in.copy_(w)
            w_out.copy_(v.t())
            return w_in, w_out
    return w.to(w_in.dtype), v.t().to(w_out.dtype).contiguous()


class _GraphedSort:
    """The ``"sort"`` prox of one layer shape as a CUDA graph, replayed at every call.

    Eagerly, the algorithm is a few hundred small kernels whose launches from Python cost
    several milliseconds per call (several SGD steps of the paper's network on an H100), while
    the GPU itself is busy for a fraction of that. Captured once, a call is a few launches: copy
    the weights and ``lam`` into the graph's input buffers, replay, copy the results out. The
    graph also computes whether the weights are finite, so ``check_finite`` costs one host
    sync for both matrices. The graph keeps its intermediates allocated while it is cached.
    """

    def __init__(self, w_in: Tensor, w_out: Tensor) -> None:
        device = w_in.device
        self.w_in = torch.empty(w_in.shape, dtype=w_in.dtype, device=device)
        self.w_out = torch.empty(w_out.shape, dtype=w_out.dtype, device=device)
        self.lam = torch.zeros((), dtype=torch.float64, device=device)
        self.lock = threading.Lock()
        self.done = torch.cuda.Event()  # the last call's copies out: the next one waits for it
        with torch.no_grad(), torch.cuda.device(device):
            self.w_in.copy_(w_in)
            self.w_out.copy_(w_out)
            self.lam.fill_(1e-3)
            # Warm up on a side stream (library handles, workspaces), then capture.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._compute()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._compute()

    def _compute(self) -> tuple[Tensor, Tensor, Tensor]:
        cd = _compute_dtype(self.w_in.dtype)
        x, y = self.w_out.to(cd).t().contiguous(), self.w_in.to(cd)
        v, w = _prox_rows(x, y, self.lam)
        finite = torch.isfinite(torch.stack([*torch.aminmax(y), *torch.aminmax(x)])).view(2, 2)
        return w.to(self.w_in.dtype), v.t().to(self.w_out.dtype), finite.all(1)

    def __call__(
        self, w_in: Tensor, w_out: Tensor, lam: float, check_finite: bool, in_place: bool
    ) -> tuple[Tensor, Tensor]:
        with self.lock, torch.no_grad(), torch.cuda.device(w_in.device):
            stream = torch.cuda.current_stream()
            stream.wait_event(self.done)  # (no-op before the first call)
            try:
                self.w_in.copy_(w_in)
                self.w_out.copy_(w_out)
                self.lam.fill_(lam)
                self.graph.replay()
                new_in, new_out, finite = self.out
                if check_finite:
                    ok_in, ok_out = finite.tolist()  # the one host sync
                    if not (ok_in and ok_out):
                        raise _non_finite("w_in" if not ok_in else "w_out")
                if in_place:
                    w_in.copy_(new_in)
                    w_out.copy_(new_out)
                    return w_in, w_out
                fmt = torch.contiguous_format
                return new_in.clone(memory_format=fmt), new_out.clone(memory_format=fmt)
            finally:  # a call on another stream waits until this one is done with the buffers
                self.done.record(stream)


_GRAPHS: OrderedDict[tuple, _GraphedSort | None] = OrderedDict()
_SEEN: OrderedDict[tuple, None] = OrderedDict()  # shapes called once so far
_GRAPHS_LOCK = threading.Lock()
_GRAPHS_MAX = 16  # layer shapes whose graphs (and their intermediates) stay cached


def _cuda_graph(w_in: Tensor, w_out: Tensor) -> _GraphedSort | None:
    """The graph for this pair's shapes, dtypes and device, captured on the second call with
    them (a one-off call runs eagerly), or None: not CUDA, ``PATHNORM_CUDA_GRAPHS=0``, inside
    another capture, first call, or capture failed."""
    if w_in.device.type != "cuda" or os.environ.get("PATHNORM_CUDA_GRAPHS", "1") == "0":
        return None
    if torch.cuda.is_current_stream_capturing():  # the caller's own graph records the ops
        return None
    key = (w_in.device, w_in.dtype, w_out.dtype, tuple(w_in.shape), tuple(w_out.shape))
    with _GRAPHS_LOCK:
        if key in _GRAPHS:
            _GRAPHS.move_to_end(key)
            return _GRAPHS[key]
        if key not in _SEEN:
            _SEEN[key] = None
            while len(_SEEN) > 4 * _GRAPHS_MAX:
                _SEEN.popitem(last=False)
            return None
        del _SEEN[key]
        try:
            graph: _GraphedSort | None = _GraphedSort(w_in, w_out)
        except RuntimeError as err:  # e.g. an allocator setting that forbids capture
            warnings.warn(
                f"pathnorm: could not capture the prox as a CUDA graph ({err}); running its "
                "kernels one by one (slower; set PATHNORM_CUDA_GRAPHS=0 to skip the attempt)",
                RuntimeWarning,
                stacklevel=4,
            )
            graph = None
        _GRAPHS[key] = graph
        while len(_GRAPHS) > _GRAPHS_MAX:
            _, old = _GRAPHS.popitem(last=False)
            if old is not None:  # its memory returns to the allocator: let its last call end
                old.done.synchronize()
        return graph


def prox_path_norm_(
    w_in: Tensor,
    w_out: Tensor,
    lam: float | Tensor,
    *,
    check_finite: bool = True,
    method: Literal["auto", "kernel", "band", "sort"] = "auto",
) -> tuple[Tensor, Tensor]:
    """In-place :func:`prox_path_norm`: overwrites ``w_in`` and ``w_out`` (parameters too)."""
    return _prox(w_in, w_out, lam, check_finite, method, in_place=True)


def path_norm(w_in: Tensor, w_out: Tensor) -> Tensor:
    """1-path-norm ``sum_i ||w_out[:, i]||_1 ||w_in[i, :]||_1`` (a 0-d tensor, differentiable).

    It upper-bounds the (l_inf, l_1) Lipschitz constant of ``x -> w_out act(w_in x)`` for any
    activation with slope in [0, 1] (Theorem 1 of the paper).
    """
    _check_pair(w_in, w_out, check_finite=False)
    return (w_out.abs().sum(0) * w_in.abs().sum(1)).sum()


def product_bound(w_in: Tensor, w_out: Tensor) -> Tensor:
    """Layer-wise bound ``||w_out^T||_{inf,1} * ||w_in||_inf`` = ``sum|w_out| * max_i ||w_in[i]||_1``."""
    _check_pair(w_in, w_out, check_finite=False)
    return w_out.abs().sum() * w_in.abs().sum(1).amax()


def prox_l1(w: Tensor, lam: float | Tensor) -> Tensor:
    """Soft-thresholding ``sign(w) max(|w| - lam, 0)``: the prox of ``lam ||w||_1``."""
    lam = _check_scalar(lam, "lam")
    if not isinstance(w, Tensor) or not w.is_floating_point():
        raise ValueError("w must be a floating-point torch.Tensor")
    return torch.sign(w) * (w.abs() - lam).clamp_min(0)


def prox_l1_(w: Tensor, lam: float | Tensor) -> Tensor:
    """In-place :func:`prox_l1`."""
    new = prox_l1(w, lam)
    with torch.no_grad():
        w.copy_(new)
    return w


def project_rows_l1_ball(w: Tensor, radius: float | Tensor) -> Tensor:
    """Project each row of ``w`` (shape (n, m)) onto ``{z : ||z||_1 <= radius}``.

    On an ``nn.Linear`` weight this enforces ``||w||_inf <= radius`` (the l_inf operator norm
    is the largest row l1 norm): the layer-wise constraint of Parseval-style training. Exact
    (sort-based, Duchi et al. 2008), vectorised over rows.
    """
    radius = _check_scalar(radius, "radius")
    _check_matrix(w, "w", check_finite=False)
    cd = _compute_dtype(w.dtype)
    u = w.detach().to(cd)
    if radius == 0.0:
        return torch.zeros_like(w)
    au = u.abs()
    s = torch.sort(au, dim=1, descending=True).values
    cs = s.cumsum(1)
    j = torch.arange(1, u.shape[1] + 1, device=u.device, dtype=cd)
    rho = ((s - (cs - radius) / j) > 0).sum(1, keepdim=True).clamp_min(1)
    theta = ((cs.gather(1, rho - 1) - radius) / rho.to(cd)).clamp_min(0)
    inside = au.sum(1, keepdim=True) <= radius
    out = torch.where(inside, u, torch.sign(u) * (au - theta).clamp_min(0))
    return out.to(w.dtype)


def project_rows_l1_ball_(w: Tensor, radius: float | Tensor) -> Tensor:
    """In-place :func:`project_rows_l1_ball`."""
    new = project_rows_l1_ball(w, radius)
    with torch.no_grad():
        w.copy_(new)
    return w
