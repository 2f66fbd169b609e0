"""Exhaustive float64 NumPy reference for the 1-path-norm prox and the baselines.

Backend-neutral layout: a *layer pair* is given per hidden unit ``i`` by
``x[i] = outgoing weights`` (length p) and ``y[i] = incoming weights`` (length m), i.e.
``X`` has shape (n, p) and ``Y`` has shape (n, m). In torch layout ``X = w_out.T``,
``Y = w_in``; in Keras Dense layout ``X = kernel_out``, ``Y = kernel_in.T``.

Per unit the prox solves (exactly, by enumerating every support pair)::

    min_{v, w}  1/2 ||v - x||^2 + 1/2 ||w - y||^2 + lam * ||v||_1 * ||w||_1

This is deliberately slow and simple: it is the yardstick every fast implementation is
held against, not something to train with.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]


def _check(lam: float) -> float:
    lam = float(lam)
    if not np.isfinite(lam) or lam < 0:
        raise ValueError(f"lam must be a finite number >= 0, got {lam!r}")
    return lam


def objective(v: F64, w: F64, x: F64, y: F64, lam: float) -> float:
    """h(v, w) = 1/2||v-x||^2 + 1/2||w-y||^2 + lam ||v||_1 ||w||_1 for one unit."""
    return float(
        0.5 * np.sum((v - x) ** 2)
        + 0.5 * np.sum((w - y) ** 2)
        + lam * np.sum(np.abs(v)) * np.sum(np.abs(w))
    )


def prox_unit(x: F64, y: F64, lam: float) -> tuple[F64, F64, float]:
    """Exact prox of one hidden unit by enumerating every support pair (s_v, s_w).

    Returns ``(v, w, h)`` with ``h`` the objective value of the minimiser. Every candidate
    is a genuine point (its objective is evaluated directly), so the minimum over them is
    the global minimum: every minimiser is one of these candidates (stationarity).
    """
    lam = _check(lam)
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    ax, ay = np.abs(x), np.abs(y)
    xs, ys = np.sort(ax)[::-1], np.sort(ay)[::-1]
    cx = np.concatenate([[0.0], np.cumsum(xs)])
    cy = np.concatenate([[0.0], np.cumsum(ys)])
    # Trivial points: (v, w) = (x, 0) and (0, y).
    best_v, best_w = x.copy(), np.zeros_like(y)
    best_h = objective(best_v, best_w, x, y, lam)
    cand_v, cand_w = np.zeros_like(x), y.copy()
    h = objective(cand_v, cand_w, x, y, lam)
    if h < best_h:
        best_v, best_w, best_h = cand_v, cand_w, h
    for k in range(1, x.size + 1):
        for m in range(1, y.size + 1):
            d = 1.0 - k * m * lam * lam
            if d <= 0.0:
                continue
            a = (cx[k] - k * lam * cy[m]) / d  # ||v||_1
            b = (cy[m] - m * lam * cx[k]) / d  # ||w||_1
            if a < 0 or b < 0:
                continue
            # The candidate keeps the top-k of |x| and top-m of |y|, shifted by the other
            # side's norm; it is a point of the non-negative orthant only if both last
            # kept entries stay >= 0.
            if xs[k - 1] - lam * b < 0 or ys[m - 1] - lam * a < 0:
                continue
            v = np.zeros_like(x)
            w = np.zeros_like(y)
            iv = np.argsort(-ax, kind="stable")[:k]
            iw = np.argsort(-ay, kind="stable")[:m]
            v[iv] = np.sign(x[iv]) * (ax[iv] - lam * b)
            w[iw] = np.sign(y[iw]) * (ay[iw] - lam * a)
            h = objective(v, w, x, y, lam)
            if h < best_h:
                best_v, best_w, best_h = v, w, h
    return best_v, best_w, best_h


def prox_path_norm(X: F64, Y: F64, lam: float) -> tuple[F64, F64]:
    """Exact prox of ``lam * sum_i ||X[i]||_1 ||Y[i]||_1`` (neutral layout, see module doc)."""
    X = np.asarray(X, dtype=np.float64)
    Y = np.asarray(Y, dtype=np.float64)
    if X.ndim != 2 or Y.ndim != 2 or X.shape[0] != Y.shape[0]:
        raise ValueError(f"X (n, p) and Y (n, m) must pair; got {X.shape} and {Y.shape}")
    V = np.empty_like(X)
    W = np.empty_like(Y)
    for i in range(X.shape[0]):
        V[i], W[i], _ = prox_unit(X[i], Y[i], lam)
    return V, W


def path_norm_objective(V: F64, W: F64, X: F64, Y: F64, lam: float) -> float:
    """The prox objective summed over units (neutral layout)."""
    return float(
        0.5 * np.sum((V - X) ** 2)
        + 0.5 * np.sum((W - Y) ** 2)
        + lam * np.sum(np.abs(V).sum(1) * np.abs(W).sum(1))
    )


def prox_l1(w: F64, lam: float) -> F64:
    """Soft-thresholding: prox of ``lam * ||w||_1``."""
    lam = _check(lam)
    w = np.asarray(w, dtype=np.float64)
    return np.sign(w) * np.maximum(np.abs(w) - lam, 0.0)


def project_l1_ball(u: F64, radius: float) -> F64:
    """Euclidean projection of one vector onto {z : ||z||_1 <= radius} (sort-based)."""
    u = np.asarray(u, dtype=np.float64)
    if np.sum(np.abs(u)) <= radius:
        return u.copy()
    if radius == 0:
        return np.zeros_like(u)
    a = np.sort(np.abs(u))[::-1]
    cs = np.cumsum(a)
    j = np.arange(1, a.size + 1)
    rho = np.nonzero(a - (cs - radius) / j > 0)[0][-1]
    theta = (cs[rho] - radius) / (rho + 1)
    return np.sign(u) * np.maximum(np.abs(u) - theta, 0.0)


def project_rows_l1_ball(w: F64, radius: float) -> F64:
    """Each row of ``w`` onto the l1 ball of ``radius`` (so ||w||_inf <= radius)."""
    radius = float(radius)
    if not np.isfinite(radius) or radius < 0:
        raise ValueError(f"radius must be a finite number >= 0, got {radius!r}")
    w = np.asarray(w, dtype=np.float64)
    return np.stack([project_l1_ball(r, radius) for r in w]) if w.size else w.copy()


def path_norm(X: F64, Y: F64) -> float:
    """1-path-norm sum_i ||X[i]||_1 ||Y[i]||_1 (neutral layout)."""
    return float(np.sum(np.abs(X).sum(1) * np.abs(Y).sum(1)))
