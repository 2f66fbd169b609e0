"""Exhaustive float64 NumPy reference for the 1-path-norm prox and the baselines.

Neutral layout (see :mod:`shared_spec`): per hidden unit ``i``, ``X[i]`` (length p) holds the
outgoing and ``Y[i]`` (length m) the incoming weights. Per unit the prox solves, exactly, by
enumerating every support pair::

    min_{v, w}  1/2 ||v - x||^2 + 1/2 ||w - y||^2 + lam * ||v||_1 * ||w||_1

Deliberately slow and simple: the yardstick every fast implementation is held against.
"""

from __future__ import annotations

from collections.abc import Iterator

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
    """Exact prox of one hidden unit: ``(v, w, h)``, the first candidate of least objective
    ``h`` (in the order of :func:`prox_unit_candidates`). Every minimiser is a candidate
    (stationarity) and each objective is evaluated on the point itself, so the least is the
    global minimum."""
    h, v, w = min(_candidates(x, y, lam), key=lambda c: c[0])
    return v, w, h


def prox_path_norm(X: F64, Y: F64, lam: float) -> tuple[F64, F64]:
    """Exact prox of ``lam * sum_i ||X[i]||_1 ||Y[i]||_1`` (neutral layout, see module doc)."""
    X, Y = np.asarray(X, dtype=np.float64), np.asarray(Y, dtype=np.float64)
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


def unit_objectives(V: F64, W: F64, X: F64, Y: F64, lam: float) -> F64:
    """Each unit's term of :func:`path_norm_objective`: ``h(V[i], W[i], X[i], Y[i])``."""
    return (
        0.5 * np.sum((V - X) ** 2, 1)
        + 0.5 * np.sum((W - Y) ** 2, 1)
        + lam * (np.abs(V).sum(1) * np.abs(W).sum(1))
    )


def unit_scales(X: F64, Y: F64) -> F64:
    """Each unit's scale ``1 + 1/2 (||X[i]||^2 + ||Y[i]||^2)``, as in :func:`minimiser_margin`."""
    return 1.0 + 0.5 * (np.sum(X * X, 1) + np.sum(Y * Y, 1))


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


def prox_unit_candidates(x: F64, y: F64, lam: float) -> list[tuple[float, F64, F64]]:
    """Every candidate point that :func:`prox_unit` compares, as ``(h, v, w)`` tuples.

    The trivial points ``(x, 0)`` and ``(0, y)`` come first, then one point per feasible support
    pair (k, l), by increasing k, then l. The global minimisers of the unit are exactly the
    candidates of least ``h``; the list lets a caller measure how clearly the minimiser wins
    (see :func:`minimiser_margin`).
    """
    return list(_candidates(x, y, lam))


def _candidates(x: F64, y: F64, lam: float) -> Iterator[tuple[float, F64, F64]]:
    lam = _check(lam)
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ax, ay = np.abs(x), np.abs(y)
    order_x, order_y = np.argsort(-ax, kind="stable"), np.argsort(-ay, kind="stable")
    xs, ys = ax[order_x], ay[order_y]
    cx = np.concatenate([[0.0], np.cumsum(xs)])
    cy = np.concatenate([[0.0], np.cumsum(ys)])
    for v, w in ((x.copy(), np.zeros_like(y)), (np.zeros_like(x), y.copy())):
        yield objective(v, w, x, y, lam), v, w
    for k in range(1, x.size + 1):
        for j in range(1, y.size + 1):
            d = 1.0 - k * j * lam * lam
            if d <= 0.0:
                continue
            a, b = (cx[k] - k * lam * cy[j]) / d, (cy[j] - j * lam * cx[k]) / d  # ||v||_1, ||w||_1
            # top-k of |x| and top-j of |y|, shrunk by the other side's norm: a point only if
            # both last kept entries stay >= 0
            if a < 0 or b < 0 or xs[k - 1] - lam * b < 0 or ys[j - 1] - lam * a < 0:
                continue
            v, w = np.zeros_like(x), np.zeros_like(y)
            iv, iw = order_x[:k], order_y[:j]
            v[iv] = np.sign(x[iv]) * (ax[iv] - lam * b)
            w[iw] = np.sign(y[iw]) * (ay[iw] - lam * a)
            yield objective(v, w, x, y, lam), v, w


def _unit_candidate_objectives(x: F64, y: F64, lam: float) -> F64:
    """:func:`prox_unit_candidates` vectorised over l (trivial points first), each objective
    evaluated on the candidate point: one row ``(h, k, l, a, b)`` per candidate, whose sorted
    ``|v|`` is ``|x|``'s top-k minus ``lam b`` and sorted ``|w|`` is ``|y|``'s top-l minus
    ``lam a``."""
    xs, ys = np.sort(np.abs(x))[::-1], np.sort(np.abs(y))[::-1]
    cx = np.concatenate([[0.0], np.cumsum(xs)])
    cy = np.concatenate([[0.0], np.cumsum(ys)])
    p, m = x.size, y.size
    rows = [
        np.array(
            [[0.5 * float(ys @ ys), p, 0, cx[p], 0.0], [0.5 * float(xs @ xs), 0, m, 0.0, cy[m]]]
        )
    ]
    j = np.arange(1, m + 1)
    for k in range(1, p + 1):
        d = 1.0 - k * j * lam * lam
        with np.errstate(divide="ignore", invalid="ignore"):
            a = (cx[k] - k * lam * cy[j]) / d
            b = (cy[j] - j * lam * cx[k]) / d
        ok = (d > 0) & (a >= 0) & (b >= 0) & (xs[k - 1] - lam * b >= 0) & (ys[j - 1] - lam * a >= 0)
        if not ok.any():
            continue
        a, b, jj = a[ok], b[ok], j[ok]
        vs = np.where(np.arange(p) < k, xs - lam * b[:, None], 0.0)
        ws = np.where(np.arange(m) < jj[:, None], ys - lam * a[:, None], 0.0)
        h = 0.5 * np.sum((vs - xs) ** 2, 1) + 0.5 * np.sum((ws - ys) ** 2, 1)
        h += lam * vs.sum(1) * ws.sum(1)
        rows.append(np.stack([h, np.full(h.size, k), jj, a, b], 1))
    return np.concatenate(rows)


def minimiser_margin(X: F64, Y: F64, lam: float, rel_margin: float) -> tuple[float, float]:
    """How clearly the exact prox of a layer pair is determined (neutral layout).

    For every unit, candidates whose objective is within ``rel_margin * (1 + s)`` of the best
    (``s = 1/2 (||x||^2 + ||y||^2)``, the unit's scale) count as *rivals*: an implementation
    rounding at that level may return any of them.

    Returns:
        ``(gap, spread)``: ``gap`` is the least relative objective gap, over units, between
        the best candidate and the best candidate at a different point (``inf`` when every
        unit has a single candidate point); ``spread`` is the largest max-abs distance from a
        unit's best point to any of its rivals. The minimiser is unique, for a backend that
        compares points at tolerance ``tol``, when ``spread <= tol``.
    """
    lam = _check(lam)
    X, Y = np.asarray(X, dtype=np.float64), np.asarray(Y, dtype=np.float64)
    gap, spread = float("inf"), 0.0
    for x, y in zip(X, Y, strict=True):
        cand = _unit_candidate_objectives(x, y, lam)
        xs, ys = np.sort(np.abs(x))[::-1], np.sort(np.abs(y))[::-1]
        ip, im = np.arange(x.size), np.arange(y.size)

        def point(row: F64, xs: F64 = xs, ys: F64 = ys, ip: F64 = ip, im: F64 = im) -> F64:
            _, k, l_, a, b = row
            return np.concatenate(
                [np.where(ip < k, xs - lam * b, 0.0), np.where(im < l_, ys - lam * a, 0.0)]
            )

        scale = 1.0 + 0.5 * (float(x @ x) + float(y @ y))
        order = np.argsort(cand[:, 0], kind="stable")
        h0, p0 = cand[order[0], 0], point(cand[order[0]])
        for c in order[1:]:
            dist = float(np.max(np.abs(point(cand[c]) - p0)))
            if dist > 0.0:
                gap = min(gap, float(cand[c, 0] - h0) / scale)
            if cand[c, 0] - h0 > rel_margin * scale:
                break
            spread = max(spread, dist)
    return float(gap), spread
