"""Hand-written and seeded inputs of the test vectors (see :mod:`shared_spec.generate`): the
authors' conformance vector, units with ties, equal norms and zeros."""

from __future__ import annotations

import numpy as np

from shared_spec.reference import F64

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
