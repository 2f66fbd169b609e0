"""Hand-written and seeded inputs of the test vectors (see :mod:`shared_spec.generate`): the
authors' conformance vector, units with ties, equal norms and zeros."""

from __future__ import annotations

import numpy as np

from shared_spec.reference import F64, minimiser_margin

# The authors' conformance vector (docs/errata.md), torch layout: W1 = w_in (3, 4), W2 = w_out (2, 3).
ERRATA_LAM = 0.1
ERRATA_W1 = [
    [0.4116, 0.1772, -0.2248, 0.1030],
    [0.3919, -0.0149, 0.1139, 0.4613],
    [-0.2737, 0.3785, -0.0665, -0.0034],
]
ERRATA_W2 = [[0.4999, 0.5504, -0.2444], [-0.0930, 0.5427, -0.2093]]
ERRATA_PROX_W1 = [
    [0.3671, 0.1327, -0.1802, 0.0585],
    [0.2962, 0.0, 0.0182, 0.3656],
    [-0.2407, 0.3455, -0.0335, 0.0],
]
ERRATA_PROX_W2 = [[0.4261, 0.4824, -0.1825], [-0.0191, 0.4747, -0.1473]]
#: The printed values are rounded to 4 decimals.
ERRATA_ATOL = 1e-4


def uniform(seed: int, shape: tuple[int, int], scale: float = 1.0) -> F64:
    """Uniform in [-scale, scale), rounded to 4 decimals (readable and seed-stable)."""
    rng = np.random.default_rng(seed)
    return np.round(scale * (2.0 * rng.random(shape) - 1.0), 4)


def f32(a: F64) -> F64:
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


def equal_norm_pair() -> tuple[F64, F64]:
    # Per unit ||x||^2 == ||y||^2 exactly (dyadic entries): under a huge lam both (x, 0) and
    # (0, y) are minimisers.
    X = np.array([[0.5, -0.25], [0.75, 0.0], [-0.5, 0.5]])
    Y = np.array([[-0.25, 0.5, 0.0], [0.0, 0.0, -0.75], [0.5, -0.5, 0.0]])
    return X, Y


def ties() -> tuple[F64, F64]:
    # Repeated magnitudes within and across the two sides of a unit, mixed signs.
    X = np.array(
        [
            [0.5, -0.5, 0.25, 0.25],
            [-0.375, 0.375, -0.375, 0.125],
            [0.25, 0.25, 0.25, 0.25],
            [1.0, -0.5, 0.5, 0.0],
        ]
    )
    Y = np.array(
        [
            [0.5, 0.5, -0.5, 0.25, 0.125],
            [0.375, -0.375, 0.0, 0.375, -0.375],
            [-0.25, 0.25, -0.25, 0.25, -0.25],
            [0.5, 0.5, 1.0, -1.0, 0.0],
        ]
    )
    return X, Y


def zeros() -> tuple[F64, F64]:
    X = uniform(301, (6, 3))
    Y = uniform(302, (6, 5))
    X[1] = 0.0  # unit 1 has no outgoing weights
    Y[2] = 0.0  # unit 2 has no incoming weights
    X[3], Y[3] = 0.0, 0.0  # unit 3 is dead
    X[4, 1] = Y[4, 0] = Y[4, 3] = 0.0  # scattered zero entries
    X[5, 2] = Y[5, 4] = 0.0
    return X, Y


def _signed(rng: np.random.Generator, x: F64, y: F64) -> tuple[F64, F64]:
    """``x`` and ``y`` with random signs, each permuted (the solver must sort, not assume)."""
    sx, sy = rng.choice([-1.0, 1.0], x.size), rng.choice([-1.0, 1.0], y.size)
    return (sx * x)[rng.permutation(x.size)], (sy * y)[rng.permutation(y.size)]


def boundary_units(k: int, l_: int, eps: float) -> tuple[F64, F64]:
    """Units for lam = (1 -/+ eps) / sqrt(k l), where the support pair (k, l) is feasible below.

    Below the boundary the pair (k, l) keeps a point only when the kept sums satisfy
    ``|y|_(1..l) sum = sqrt(l/k) |x|_(1..k) sum`` to within a relative ``eps``; random units
    never land there. Units 0 to 2 are built on it: k kept |x| entries, l kept |y| entries with
    that ratio (equal magnitudes; unequal magnitudes; the ratio off by eps/2, which moves the
    split between v and w), and tails of at most 2e-4, small enough that (k, l) stays the
    minimiser below and that no two candidates tie above. Units 3 and 4 are random.
    """
    p, m = max(k + 1, 3), max(l_ + 1, 4)
    rng = np.random.default_rng(410 + 10 * k + l_)
    ratio = np.sqrt(l_ / k)
    equal = (np.full(k, 0.75), np.full(l_, 0.75 / ratio), 4e-5, 2e-5)
    xk = 1.3 * np.round(rng.uniform(0.8, 1.2, k), 4)
    yl = np.round(rng.uniform(0.8, 1.2, l_), 4)
    unequal = (xk, yl * (ratio * xk.sum() / yl.sum()), 1e-4, -2e-4)
    offset = (np.full(k, 0.5), np.full(l_, 0.5 / ratio * (1 + eps / 2)), 0.0, 5e-5)
    X, Y = uniform(400 + 10 * k + l_, (5, p), 2.0), uniform(401 + 10 * k + l_, (5, m), 2.0)
    for i, (kept_x, kept_y, tail_x, tail_y) in enumerate((equal, unequal, offset)):
        X[i], Y[i] = _signed(
            rng, np.r_[kept_x, np.full(p - k, tail_x)], np.r_[kept_y, np.full(m - l_, tail_y)]
        )
    return X, Y


def exact_boundary_units(
    lam: float, pairs: tuple[tuple[int, int], ...], shape: tuple[int, int, int], seed: int
) -> tuple[F64, F64]:
    """Units for lam with k l lam^2 == 1 exactly, where each listed pair (k, l) divides 0 by 0.

    Unit i (one per pair) holds dyadic entries (multiples of lam / 64) whose top-l sum of |y| is
    exactly sqrt(l/k) times the top-k sum of |x| (k, l powers of 2, so the ratio is exact). Then
    d = 1 - k l lam^2 and both numerators of the pair's closed form are exactly 0: a solver that
    does not skip d == 0 gets NaN norms, which pass sign tests (every comparison with NaN is
    false), and a NaN objective wins under np.argmin or torch.min. Each such unit is drawn
    until its minimiser is unique. The other units are random.
    """
    n, p, m = shape
    rng = np.random.default_rng(seed)
    X, Y = uniform(seed + 1, (n, p), lam * 4), uniform(seed + 2, (n, m), lam * 4)
    for i, (k, l_) in enumerate(pairs):
        while True:
            x = np.round(rng.uniform(-1, 1, p) * 32) / 8 * lam
            y = np.round(rng.uniform(-1, 1, m) * 32) / 8 * lam
            ax, ay = np.sort(np.abs(x))[::-1], np.sort(np.abs(y))[::-1]
            top = np.argsort(-np.abs(y), kind="stable")[:l_]
            shift = (np.sqrt(l_ / k) * ax[:k].sum() - ay[:l_].sum()) / l_  # exact: l_ = 2^j
            kept = np.abs(y[top]) + shift
            if (y[top] == 0).any() or kept.min() <= (ay[l_] if l_ < m else 0.0):
                continue
            y[top] = np.sign(y[top]) * kept
            # a unique minimiser, clearly (the flat face of the pair may hold the optimum)
            if minimiser_margin(x[None], y[None], lam, 1e-12)[1] == 0.0:
                X[i], Y[i] = x, y
                break
    return X, Y
