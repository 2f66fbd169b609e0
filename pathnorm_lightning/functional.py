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
``(k, L(k))``, ``L(k)`` the largest feasible ``l`` for ``k``. We evaluate all of them at once:
one sort per row, cumulative sums, a vectorised bisection for ``L(k)`` and an argmin. There is
no Python loop over units or support sizes; the bisection runs ``ceil(log2(m + 1))`` fixed
steps, so nothing waits on the device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
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


def _check_matrix(w: Tensor, name: str, check_finite: bool) -> None:
    if not isinstance(w, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"{name} must be a 2-D weight matrix, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {w.dtype}")
    if check_finite and not bool(torch.isfinite(w).all()):
        raise ValueError(
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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _prox_rows(x: Tensor, y: Tensor, lam: float) -> tuple[Tensor, Tensor]:
    """Exact prox per row pair: ``x`` (n, p) outgoing, ``y`` (n, m) incoming weights."""
    n, p = x.shape
    m = y.shape[1]
    if p > m:  # enumerate the shorter side, bisect on the longer one (the problem is symmetric)
        w, v = _prox_rows(y, x, lam)
        return v, w
    lam2 = lam * lam
    ax, ay = x.abs(), y.abs()
    xs = torch.sort(ax, dim=1, descending=True).values
    ys = torch.sort(ay, dim=1, descending=True).values
    zero = x.new_zeros(n, 1)
    cx = torch.cat([zero, xs.cumsum(1)], 1)  # cx[:, k] = sum of the k largest |x|
    cy = torch.cat([zero, ys.cumsum(1)], 1)
    cx2 = torch.cat([zero, (xs * xs).cumsum(1)], 1)
    cy2 = torch.cat([zero, (ys * ys).cumsum(1)], 1)
    xk = torch.cat([zero, xs], 1)  # xk[:, k] = k-th largest |x| (k >= 1)
    yl = torch.cat([zero, ys], 1)

    k = torch.arange(p + 1, device=x.device, dtype=x.dtype).expand(n, p + 1)
    kx = cx  # X_k for every k, shape (n, p + 1)
    k_is_zero = k == 0

    def feasible(l_idx: Tensor) -> Tensor:
        # (k, l) is feasible iff k l lam^2 < 1 and the last kept entries of both candidate
        # vectors are >= 0; multiplied through by d = 1 - k l lam^2 > 0 to avoid dividing.
        lf = l_idx.to(x.dtype)
        d = 1.0 - k * lf * lam2
        ly = cy.gather(1, l_idx)
        y_last = yl.gather(1, l_idx)
        v_ok = k_is_zero | (d * xk + lam2 * lf * kx - lam * ly >= 0)
        w_ok = (l_idx == 0) | (d * y_last + lam2 * k * ly - lam * kx >= 0)
        return (d > 0) & v_ok & w_ok

    # Bisection for L(k) = the largest feasible l in [0, m]; l = 0 is always feasible and the
    # feasible set is downward closed in l, so fixed-length bisection is exact.
    lo = torch.zeros(n, p + 1, dtype=torch.long, device=x.device)
    hi = torch.full_like(lo, m + 1)
    for _ in range(max(1, math.ceil(math.log2(m + 2)))):
        mid = (lo + hi) // 2
        ok = feasible(mid.clamp_max(m))
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    big_l = lo

    lf = big_l.to(x.dtype)
    d = 1.0 - k * lf * lam2
    ly = cy.gather(1, big_l)
    a = ((kx - k * lam * ly) / d).clamp_min(0)  # ||v||_1 of the candidate
    b = ((ly - lf * lam * kx) / d).clamp_min(0)  # ||w||_1 of the candidate
    # Objective up to the constant 1/2 (||x||^2 + ||y||^2).
    h = 0.5 * lam2 * (k * b * b + lf * a * a) - 0.5 * (cx2 + cy2.gather(1, big_l)) + lam * a * b
    # The trivial point (x, 0) (Lemma 8 makes it redundant when L(p) > 0; kept for safety).
    h = torch.cat([h, -0.5 * cx2[:, p:]], 1)
    a = torch.cat([a, cx[:, p:]], 1)
    b = torch.cat([b, zero], 1)
    ks = torch.cat([k, k[:, p:]], 1)
    ls = torch.cat([lf, zero], 1)
    best = h.argmin(1, keepdim=True)
    a_star, b_star = a.gather(1, best), b.gather(1, best)
    v_keep = ks.gather(1, best) > 0
    w_keep = ls.gather(1, best) > 0
    v = torch.where(v_keep, torch.sign(x) * (ax - lam * b_star).clamp_min(0), 0.0)
    w = torch.where(w_keep, torch.sign(y) * (ay - lam * a_star).clamp_min(0), 0.0)
    return v, w


def prox_path_norm(
    w_in: Tensor, w_out: Tensor, lam: float | Tensor, *, check_finite: bool = True
) -> tuple[Tensor, Tensor]:
    """Exact prox of ``lam * path_norm``: ``argmin 1/2||A - w_in||^2 + 1/2||B - w_out||^2 + lam P(A, B)``.

    Args:
        w_in: first layer weight, shape (n, m).
        w_out: second layer weight, shape (p, n).
        lam: prox step, finite and >= 0 (inside proximal SGD: ``lr * lambda``).
        check_finite: raise on NaN/inf weights (costs one device sync; disable on hot paths
            where the weights are known to be finite).

    Returns:
        ``(w_in_new, w_out_new)``, new tensors of the input dtypes. Half precision inputs are
        computed in float32 and cast back.
    """
    lam = _check_scalar(lam, "lam")
    _check_pair(w_in, w_out, check_finite)
    if lam == 0.0 or w_in.numel() == 0 or w_out.numel() == 0:
        return w_in.detach().clone(), w_out.detach().clone()
    cd = _compute_dtype(w_in.dtype)
    with torch.no_grad():
        v, w = _prox_rows(w_out.detach().to(cd).t(), w_in.detach().to(cd), lam)
    return w.to(w_in.dtype), v.t().to(w_out.dtype).contiguous()


def prox_path_norm_(
    w_in: Tensor, w_out: Tensor, lam: float | Tensor, *, check_finite: bool = True
) -> tuple[Tensor, Tensor]:
    """In-place :func:`prox_path_norm`: overwrites ``w_in`` and ``w_out`` (parameters too)."""
    new_in, new_out = prox_path_norm(w_in, w_out, lam, check_finite=check_finite)
    with torch.no_grad():
        w_in.copy_(new_in)
        w_out.copy_(new_out)
    return w_in, w_out


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
