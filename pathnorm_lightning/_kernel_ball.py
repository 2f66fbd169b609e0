"""Compiled CPU kernel (numba) of the row-wise l1-ball projection, :func:`_baselines.project_rows`.

Per row, Michelot's algorithm instead of a sort: the threshold of the entries kept,
``theta = (sum_{|u_j| > theta} |u_j| - r) / #{j : |u_j| > theta}``, is iterated from the whole
row; the kept set only shrinks, and once it stops shrinking ``theta`` is exact. A few passes
over a row (five on a trained 784-wide row) replace its sort: 8x faster than the sort on a
784-200 layer. Arithmetic in float64, whatever the weights' dtype.

References:
    Michelot, "A finite algorithm for finding the projection of a point onto the canonical
    simplex of R^n", J. Optim. Theory Appl. 50, 1986.
"""

from __future__ import annotations

import numba
import numpy as np
from torch import Tensor


@numba.njit(nogil=True)
def _project_rows(z: np.ndarray, radius: float) -> None:  # pragma: no cover - compiled
    """Each row of ``z`` (n, m), C-contiguous, onto ``{||row||_1 <= radius}``, in place
    (``radius > 0``; rows inside are left as they are)."""
    n, m = z.shape
    for i in range(n):
        row = z[i]
        total = 0.0
        for j in range(m):
            total += abs(np.float64(row[j]))
        if total <= radius:
            continue
        count, theta = m, (total - radius) / m
        while True:  # the kept set {|u| > theta} shrinks until it is stable
            kept, s = 0, 0.0
            for j in range(m):
                a = abs(np.float64(row[j]))
                if a > theta:
                    kept += 1
                    s += a
            if kept >= count or kept == 0:
                break
            count, theta = kept, (s - radius) / kept
        for j in range(m):
            v = np.float64(row[j])
            row[j] = v - min(max(v, -theta), theta)


def project_rows_(w: Tensor, radius: float) -> None:
    """:func:`_project_rows` on a CPU float32/float64 C-contiguous tensor, in place."""
    _project_rows(w.detach().numpy(), float(radius))
