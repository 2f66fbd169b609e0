"""The exact prox in tensor ops ("sort"): the shortest exact algorithm; read this one first.

Per hidden unit (row ``i``) with outgoing weights ``x`` (length p) and incoming weights ``y``
(length m), the prox solves::

    min_{v, w}  1/2 ||v - x||^2 + 1/2 ||w - y||^2 + lam * ||v||_1 * ||w||_1

The objective is non-convex; every minimiser is a stationary point ``v = S(x, lam ||w||_1)``,
``w = S(y, lam ||v||_1)`` (``S`` = soft-threshold) fixed by its support sizes ``(k, l)`` (the
top-k of ``|x|``, the top-l of ``|y|``), or one of the trivial points ``(x, 0)`` and ``(0, y)``.
The feasible supports form a staircase (downward closed, Lemma 4 of the paper) and the
objective decreases along it (Lemma 8), so the minimiser lies among ``(k, L(k))``, ``L(k)`` the
largest feasible ``l`` for ``k``. Every row is sorted once; cumulative sums give every
candidate in closed form; a fixed-length binary search finds ``L(k)``; an argmin picks the
best. No Python loop over units, and nothing waits on the device.

Ties: candidates are ranked in the order ``(x, 0)``, ``(0, y)``, then the support pairs in
increasing ``k`` (outgoing entries kept), and the first minimum wins.

Exact at every finite magnitude: the prox is scale-equivariant (``prox(s x, s y) = s prox(x,
y)`` for the same ``lam``), so each unit is scaled by a power of two to a largest entry near 1,
its thresholds are computed there and scaled back onto the original weights.

The TensorFlow twin, ``pathnorm_tf/_sort.py``, is the same mathematics (candidates, tie order)
under a different contract, on purpose: its ``prox_rows`` takes rows its caller already scaled
and returns the thresholds ``(t_v, t_w)`` (applied by the caller in the kernels' dtype), and it
finds ``L(k)`` by a bisection of static ``batch_dims`` gathers (what XLA compiles well). Here
:func:`prox_rows` scales the rows and returns the weights, and :func:`_largest_feasible` finds
``L(k)`` by binary lifting (the cheapest form for eager torch). Both are held to the same
exhaustive reference (``shared_spec``).

References:
    Latorre, Rolland, Hallak, Cevher, "Efficient Proximal Mapping of the 1-path-norm of
    Shallow Networks", ICML 2020 (Lemmas 4 and 8, Algorithm 2); its errata in
    ``docs/errata.md``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pathnorm_lightning._common import ldexp_rows, unit_exponents


def prox_rows(x: Tensor, y: Tensor, lam: float | Tensor) -> tuple[Tensor, Tensor]:
    """The exact prox ``(v, w)`` (new tensors) of every unit: rows of ``x`` (n, p), its outgoing
    weights (``w_out.T``), and of ``y`` (n, m), its incoming ones (``w_in``); float32 or float64.

    ``lam``: the prox step, in ``[0, 2]`` (larger steps give the same prox as 2), a float or a
    0-d float64 tensor on the weights' device (the CUDA graph feeds it so): no Python branch
    depends on its value, and it rounds as a Python float would.
    """
    e = unit_exponents(x, y)
    xn, yn = ldexp_rows(x, -e), ldexp_rows(y, -e)
    if x.shape[1] <= y.shape[1]:  # enumerate the shorter side, search the longer one
        t_x, t_y = thresholds(xn, yn, lam, short_is_out=True)
    else:
        t_y, t_x = thresholds(yn, xn, lam, short_is_out=False)
    return soft_threshold(x, ldexp_rows(t_x, e)), soft_threshold(y, ldexp_rows(t_y, e))


def soft_threshold(z: Tensor, t: Tensor) -> Tensor:
    """``sign(z) max(|z| - t, 0)`` with a per-row threshold ``t`` (n, 1) (``inf`` gives 0), as
    ``z - clip(z, -t, t)``: branch-free, and exact in the kept entries."""
    clipped = torch.maximum(z, -t)
    torch.minimum(clipped, t, out=clipped)
    return torch.sub(z, clipped, out=clipped)


def thresholds(
    s: Tensor, g: Tensor, lam: float | Tensor, short_is_out: bool
) -> tuple[Tensor, Tensor]:
    """Soft-threshold levels ``(t_s, t_g)`` (n, 1) of the prox for the short side ``s`` (n, p)
    and the long side ``g`` (n, m), ``p <= m``; ``inf`` zeroes a side. ``short_is_out``: whether
    ``s`` holds the outgoing weights (it fixes the tie order)."""
    n, p = s.shape
    lam2 = lam * lam
    xs = torch.sort(s.abs(), dim=1, descending=True).values
    ys = torch.sort(g.abs(), dim=1, descending=True).values
    zero = s.new_zeros(n, 1)
    cx = xs.cumsum(1)  # cx[:, k - 1] = X_k, the sum of the k largest |s|
    cy = torch.cat([zero, ys.cumsum(1)], 1)  # cy[:, l] = Y_l
    # Squares of the entries left out, summed directly from the small end (never as a total
    # minus a prefix sum: that difference cancels where the kept entries dominate).
    sx2 = _suffix_squares(xs)  # sx2[:, j]: sum_{i >= j} xs_i^2
    tx2 = torch.cat([sx2[:, 1:], zero], 1)  # tx2[:, k - 1]: left out of the top k
    ty2 = torch.cat([_suffix_squares(ys), zero], 1)  # ty2[:, l]: left out of the top l
    yl = torch.cat([zero, ys], 1)  # yl[:, l] = l-th largest |g| (l >= 1)
    k = torch.arange(1, p + 1, device=s.device, dtype=s.dtype)
    lo = _largest_feasible(xs, cx, cy, yl, k, lam)

    lf = lo.to(s.dtype)
    d = 1.0 - k * lf * lam2
    ly = cy.gather(1, lo)
    a = ((cx - k * lam * ly) / d).clamp_min(0)  # ||v||_1 of the candidate
    b = ((ly - lf * lam * cx) / d).clamp_min(0)  # ||w||_1 of the candidate
    h = candidate_objective(cx, ty2.gather(1, lo), tx2, ly, k, lf, lam * b, lam * a, lam)
    t_s = lam * b
    t_g = torch.where(lo == 0, math.inf, lam * a)
    # Trivial candidates: keep s, zero g (threshold inf on g), and keep g, zero s. (k, 0) with
    # L(k) = 0 coincides with keeping s shrunk by 0: it is (s, 0) again, harmless in a tie.
    inf = torch.full_like(zero, math.inf)
    keep_s = (0.5 * ty2[:, :1], zero, inf)  # the objective: half of |g|^2
    keep_g = (0.5 * sx2[:, :1], inf, zero)  # half of |s|^2
    if short_is_out:  # order: (x, 0) = keep_s, (0, y) = keep_g, pairs by increasing k
        parts = [keep_s, keep_g, (h, t_s, t_g)]
    else:  # x is the long side: (x, 0) = keep_g; pairs by decreasing l = increasing k
        parts = [keep_g, keep_s, (h.flip(1), t_s.flip(1), t_g.flip(1))]
    h_all, ts_all, tg_all = (torch.cat([part[j] for part in parts], 1) for j in range(3))
    best = h_all.argmin(1, keepdim=True)  # the first minimum
    return ts_all.gather(1, best), tg_all.gather(1, best)


def _largest_feasible(
    xs: Tensor, cx: Tensor, cy: Tensor, yl: Tensor, k: Tensor, lam: float | Tensor
) -> Tensor:
    """``L(k)``, the largest feasible ``l`` in ``[0, m]`` for ``k = 1..p`` (int64, (n, p)).

    ``(k, l)`` is feasible iff ``d = 1 - k l lam^2 > 0`` and the last kept entries of both
    candidate vectors are >= 0; multiplied through by ``d``:

    * ``v_k >= 0  <=>  x_k + lam^2 l (X_k - k x_k) >= lam Y_l``
    * ``w_l >= 0  <=>  y_l + lam^2 k (Y_l - l y_l) >= lam X_k``  (vacuous for l = 0)

    ``l = 0`` is always feasible and the feasible set is downward closed in ``l``, so ``L(k)`` is
    built bit by bit (binary lifting): try ``L + 2^j`` from the top bit down, keep it when
    feasible. One gather per step fetches ``(lam Y_l, y_l, Y_l - l y_l)``; columns past ``m``
    hold ``lam Y_l = inf``, which fails the first test, so no step needs clamping.
    """
    n, p = xs.shape
    m = cy.shape[1] - 1
    dt = xs.dtype
    lam2 = lam * lam
    by = cy - torch.arange(m + 1, device=xs.device, dtype=dt) * yl  # Y_l - l y_l >= 0
    ax_k = cx - k * xs  # X_k - k x_k >= 0
    lam_x = lam * cx
    l_max = 1.0 / (k * lam2)  # inf for lam = 0
    top = 1 << (m.bit_length() - 1)
    table = torch.stack([lam * cy, yl, by], 1)  # (n, 3, m + 1): planes copy row by row
    pad = table.new_zeros(n, 3, top)
    pad[:, 0] = math.inf
    table = torch.cat([table, pad], 2)
    lam2_k = lam2 * k
    lo = torch.zeros(n, p, dtype=torch.long, device=xs.device)
    bit = top
    while bit:
        cand = lo + bit  # >= 1, <= m + top
        lf = cand.to(dt)
        got = table.gather(2, cand.unsqueeze(1).expand(n, 3, p))
        ok = torch.addcmul(xs, lam2 * lf, ax_k) >= got[:, 0]
        ok &= torch.addcmul(got[:, 1], lam2_k, got[:, 2]) >= lam_x
        ok &= lf < l_max
        lo = torch.where(ok, cand, lo)
        bit >>= 1
    return lo


def _suffix_squares(zs: Tensor) -> Tensor:
    """``out[:, j] = sum_{i >= j} zs[:, i]^2``, summed from the last (smallest) entry up."""
    return (zs * zs).flip(1).cumsum(1).flip(1)


def candidate_objective(
    big_x: Tensor,
    ty2: Tensor,
    tx2: Tensor,
    ly: Tensor,
    k: Tensor,
    lf: Tensor,
    t_v: Tensor,
    t_w: Tensor,
    lam: float | Tensor,
) -> Tensor:
    """Objective of the point that support sizes ``(k, l)`` and thresholds ``t_v = lam b``,
    ``t_w = lam a`` produce, from that point's own l1 norms ``X_k - k t_v`` and ``Y_l - l
    t_w``: near ``d = 1 - k l lam^2 = 0``, ``a`` and ``b`` carry rounding amplified by ``1 /
    d``, and the closed form in ``a, b`` could misrank nearly equal candidates. ``big_x``,
    ``ly``: ``X_k`` and ``Y_l``; ``tx2``, ``ty2``: the sums of squares of the entries left out
    (below the top k of ``|x|``, the top l of ``|y|``). Unshifted: a shift by ``1/2 (||x||^2 +
    ||y||^2)`` would hide differences below float64's resolution of it.
    """
    nv = (big_x - k * t_v).clamp_min(0)
    nw = (ly - lf * t_w).clamp_min(0)
    return 0.5 * (k * t_v * t_v + tx2 + lf * t_w * t_w + ty2) + lam * nv * nw
