"""The long-row passes of the compiled prox kernel (:mod:`._kernel`), vectorised by LLVM.

Per unit, :func:`_row_stats` reads the row once (its norms and the statistics of the entries
above the support threshold ``tau``); :func:`_above` reads it again when the bounds lower
``tau`` past an entry or leave a band, and :func:`_collect_band` gathers that band (only
blocks holding an entry of it are scanned). Arithmetic in float64, whatever the row's dtype.

Numba's on-disk cache of the entry point (in :mod:`._kernel`) is keyed on ``_kernel.py``'s
source alone: after editing this module, touch ``_kernel.py`` (or clear ``__pycache__``).
"""

from __future__ import annotations

import numba
import numpy as np

# Reassociation lets LLVM vectorise the row reductions (the sums change in the last bits of a
# float64, far below the tolerances); no "nnan"/"ninf": the finite check and inf must work.
_FAST = {"reassoc", "nsz", "contract"}
_BIG = 1.7976931348623157e308  # the largest float64


@numba.njit(nogil=True)
def _all_finite(row: np.ndarray) -> bool:  # pragma: no cover - compiled
    """Whether every entry is finite (for a float64 row whose l1 norm overflowed)."""
    for j in range(row.shape[0]):
        if not abs(np.float64(row[j])) <= _BIG:
            return False
    return True


@numba.njit(nogil=True, fastmath=_FAST)
def _row_stats(
    row: np.ndarray, tau: float, near: float
) -> tuple[float, float, int, float, float, int]:  # pragma: no cover - compiled
    """Of ``|row|``: the sum and the sum of squares; the count, sum and sum of squares of the
    entries above ``tau``; the number of entries in ``(near, tau]``. One vectorised pass (LLVM
    vectorises it with float counters and masks as factors, not with selects). A NaN or inf
    entry makes the sum NaN or inf."""
    l1 = sq = 0.0
    c = s = q = above_near = 0.0
    for j in range(row.shape[0]):
        v = abs(np.float64(row[j]))
        v2 = v * v
        l1 += v
        sq += v2
        above = 1.0 if v > tau else 0.0
        c += above
        s += v * above
        q += v2 * above
        above_near += 1.0 if v > near else 0.0
    return l1, sq, int(c), s, q, int(above_near - c)


@numba.njit(nogil=True, fastmath=_FAST)
def _hits(row: np.ndarray, lo: float, hi: float) -> float:  # pragma: no cover - compiled
    """Number of entries with ``lo < |r| <= hi`` (vectorised; on a slice: LLVM does not
    vectorise the loop over an index range of the whole row)."""
    hits = 0.0
    for j in range(row.shape[0]):
        v = abs(np.float64(row[j]))
        hits += 1.0 if (v > lo) & (v <= hi) else 0.0
    return hits


@numba.njit(nogil=True)
def _collect_band(
    row: np.ndarray, lo: float, hi: float, out: np.ndarray
) -> int:  # pragma: no cover - compiled
    """Write the entries with ``lo < |r| <= hi`` to ``out``, return their count. The band is
    sparse (a handful of entries): blocks are tested vectorised, only blocks with a hit are
    scanned."""
    m = row.shape[0]
    count = 0
    for start in range(0, m, _BLOCK):
        stop = min(start + _BLOCK, m)
        if _hits(row[start:stop], lo, hi) > 0:
            for j in range(start, stop):
                v = abs(np.float64(row[j]))
                if (v > lo) & (v <= hi):
                    out[count] = v
                    count += 1
    return count


_BLOCK = 128


@numba.njit(nogil=True, fastmath=_FAST)
def _above(
    row: np.ndarray, lo: float, hi: float
) -> tuple[int, int, float, float]:  # pragma: no cover
    """Of ``|row|``: the number of entries in ``(lo, hi]``, and the count, sum and sum of
    squares of those above ``hi`` (one vectorised pass; float counters, as in :func:`_row_stats`)."""
    n_lo = 0.0
    c = 0.0
    s = 0.0
    q = 0.0
    for j in range(row.shape[0]):
        v = abs(np.float64(row[j]))
        above = 1.0 if v > hi else 0.0
        n_lo += 1.0 if v > lo else 0.0
        c += above
        s += v * above
        q += v * v * above
    return int(n_lo - c), int(c), s, q
