"""Baselines the benchmarks compare against (CPU, NumPy, per-unit Python loops).

``prox_per_unit_loop`` mirrors the authors' public NumPy code: a Python loop over hidden units,
each unit sorted and solved by the paper's Algorithms 3 + 4 (maximal feasibility boundary walk).
"""

from __future__ import annotations

import numpy as np

from shared_spec import reference


def _prox_unit_mfb(x: np.ndarray, y: np.ndarray, lam: float) -> tuple[np.ndarray, np.ndarray]:
    ax, ay = np.abs(x), np.abs(y)
    xs, ys = np.sort(ax)[::-1], np.sort(ay)[::-1]
    cx = np.concatenate([[0.0], np.cumsum(xs)])
    cy = np.concatenate([[0.0], np.cumsum(ys)])
    p, m = xs.size, ys.size
    lam2 = lam * lam

    def ok(k: int, l: int) -> bool:
        d = 1.0 - k * l * lam2
        if d <= 0:
            return False
        if k and d * xs[k - 1] + lam2 * l * cx[k] - lam * cy[l] < 0:
            return False
        return not (l and d * ys[l - 1] + lam2 * k * cy[l] - lam * cx[k] < 0)

    frontier, k, l, maximal = [], 0, m, True
    while k <= p and l >= 0:
        if not ok(k, l):
            if maximal and k > 0:
                frontier.append((k - 1, l))
                maximal = False
            l -= 1
        else:
            k += 1
            maximal = True
    if k == p + 1:
        frontier.append((p, l))
    best = (0.5 * float(xs @ xs), 0.0, float(cy[m]), 0, m)  # (h, a, b, k, l) of (0, y)
    h_x = 0.5 * float(ys @ ys)  # objective of (x, 0)
    if h_x < best[0]:
        best = (h_x, float(cx[p]), 0.0, p, 0)
    for k, l in frontier:
        d = 1.0 - k * l * lam2
        a = (cx[k] - k * lam * cy[l]) / d
        b = (cy[l] - l * lam * cx[k]) / d
        h = (
            0.5 * (k * (lam * b) ** 2 + float(xs[k:] @ xs[k:]))
            + 0.5 * (l * (lam * a) ** 2 + float(ys[l:] @ ys[l:]))
            + lam * a * b
        )
        if h < best[0]:
            best = (h, a, b, k, l)
    _, a, b, k, l = best
    v = np.sign(x) * np.maximum(ax - lam * b, 0) if k else np.zeros_like(x)
    w = np.sign(y) * np.maximum(ay - lam * a, 0) if l else np.zeros_like(y)
    return v, w


def prox_per_unit_loop(
    w_in: np.ndarray, w_out: np.ndarray, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """Torch layout in, torch layout out; one Python iteration per hidden unit."""
    new_in = np.empty_like(w_in)
    new_out = np.empty_like(w_out)
    for i in range(w_in.shape[0]):
        new_out[:, i], new_in[i] = _prox_unit_mfb(w_out[:, i], w_in[i], lam)
    return new_in, new_out


def exhaustive_units(w_in: np.ndarray, w_out: np.ndarray, lam: float, units: int) -> None:
    """The exhaustive reference on the first ``units`` hidden units (for extrapolated timing)."""
    for i in range(units):
        reference.prox_unit(w_out[:, i], w_in[i], lam)
