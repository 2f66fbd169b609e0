"""The XLA-friendly formulations the band and sort methods share.

Each function gives the values of the plain TensorFlow op it stands for (bit for bit, or as any
exact sort would), which it runs eagerly and in plain graphs; under XLA on CPU
(:func:`~pathnorm_tf._common.tracing_for_xla`) it takes the form XLA compiles to the fewest and
cheapest loops: sorts of short rows by ranking or a bitonic network, small gathers and argmins
by chains of selects, reductions over the long side folded into one pass (:func:`_fold`),
per-unit values materialized so that the loops that broadcast them do not recompute them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from pathnorm_tf._common import tracing_for_xla

# Reductions over the long side first combine this many slices elementwise (see fold).
_SPLITS = 8
# Rows of the short side at most this long are sorted by ranking (pairwise comparisons).
_RANK_SORT_MAX = 16
# Under XLA, short rows (at most this many columns) are cumsummed by one masked reduction.
_UNROLL_CUMSUM = 32
# Under XLA, rows of at most this many columns are indexed by a chain of selects, not a gather,
# while the chain's work (entries picked times columns) stays below _PICK_LIMIT: XLA copies the
# chain into each consumer, which on large blocks (512-512-512) costs more than the gather.
_UNROLL_PICK = 16
_PICK_LIMIT = 1 << 15
EPS = {tf.float32: 2.0**-23, tf.float64: 2.0**-52}
BITS = {tf.float32: tf.int32, tf.float64: tf.int64}


def gather_rows(t: tf.Tensor, idx: tf.Tensor) -> tf.Tensor:
    return tf.gather(t, idx, axis=1, batch_dims=1)


def _select_chain(columns: int, entries: int) -> bool:
    """Whether to index ``columns`` columns for ``entries`` entries by a chain of selects (see
    :data:`_UNROLL_PICK`) rather than a gather."""
    return tracing_for_xla() and columns <= _UNROLL_PICK and entries * columns <= _PICK_LIMIT


def pick_rows(t: tf.Tensor, idx: tf.Tensor) -> tf.Tensor:
    """``t[i, idx[i, j]]`` for ``t`` (n, q) and ``idx`` (n, r) in ``[0, q)``. Under XLA, for
    small blocks (see ``_UNROLL_PICK``), a chain of selects: elementwise, so fused into its
    consumers (XLA on CPU runs each gather, and the index array it builds for it, as thunks of
    their own); otherwise a gather."""
    q = int(t.shape[1])
    if not _select_chain(q, idx.shape.num_elements()):
        return gather_rows(t, idx)
    out = tf.broadcast_to(t[:, :1], tf.shape(idx))
    for c in range(1, q):
        out = tf.where(tf.equal(idx, c), t[:, c : c + 1], out)
    return out


def at_least(h: tf.Tensor, *ts: tf.Tensor) -> tuple[tf.Tensor, ...]:
    """Each of ``ts`` (n, q) at the first index of the least ``h`` (n, q) per row, as columns
    (n, 1): ``gather_rows(t, argmin_rows(h))``; a row whose least value is NaN gives the
    last index. Under XLA, for small blocks (see ``_UNROLL_PICK``), one reduction (the
    least value) and a fused chain of selects from the last index to the first."""
    q = int(h.shape[1])
    if not _select_chain(q, h.shape.num_elements()):
        best = argmin_rows(h)
        return tuple(gather_rows(t, best) for t in ts)
    (h,) = materialized(h)
    least = tf.reduce_min(h, axis=1, keepdims=True)
    out = [t[:, q - 1 :] for t in ts]
    for c in range(q - 2, -1, -1):
        at = tf.equal(h[:, c : c + 1], least)
        out = [tf.where(at, t[:, c : c + 1], o) for t, o in zip(ts, out, strict=True)]
    return tuple(out)


def argmin_rows(h: tf.Tensor) -> tf.Tensor:
    """Per row the first index of the least value, as a column (n, 1) of int32 (``tf.argmin``).
    Under XLA from two plain reductions, the least value and the least index holding it (XLA on
    CPU runs an argmin as a slower variadic reduction); a row whose least value is NaN gives the
    last index, as XLA's argmin does for a row of NaNs."""
    if not tracing_for_xla():
        return tf.argmin(h, axis=1, output_type=tf.int32)[:, tf.newaxis]
    k = int(h.shape[1])
    least = tf.reduce_min(h, axis=1, keepdims=True)
    iota = tf.range(k, dtype=tf.int32)[tf.newaxis, :]
    return tf.reduce_min(tf.where(tf.equal(h, least), iota, k - 1), axis=1, keepdims=True)


def cumsum_cols(a: tf.Tensor) -> tf.Tensor:
    """``tf.cumsum(a, axis=1)`` for the short rows of the band method (p, band widths). Under
    XLA up to ``_UNROLL_CUMSUM`` columns are summed by one masked, fused reduction (XLA on CPU
    runs a cumsum as a reduce-window thunk of its own, a chain of adds as one thunk per column).
    A non-finite entry spoils its row's earlier sums too (inf * 0); such a row's prox is
    undefined anyway."""
    cols = int(a.shape[1])
    if cols > _UNROLL_CUMSUM or cols == 0 or not tracing_for_xla():
        return tf.cumsum(a, axis=1)
    # out[:, j] = sum_k a[:, k] [k <= j]: one fused reduction over a (rows, cols, cols) mask.
    upper = tf.constant(np.triu(np.ones((cols, cols))), a.dtype)  # upper[k, j] = [k <= j]
    return tf.reduce_sum(a[:, :, tf.newaxis] * upper, axis=1)


def sort_rows_desc(a: tf.Tensor) -> tf.Tensor:
    """Each row of ``a`` (>= 0, shape (n, p)) sorted descending (the same values by any
    method; under XLA, the one XLA on CPU runs fastest)."""
    p = int(a.shape[1])
    if p == 1:
        return a
    xla = tracing_for_xla()
    if p <= _RANK_SORT_MAX and xla:
        # rank_j = #{i : a_i > a_j or (a_i == a_j and i < j)} is a permutation; column r of the
        # result is the one entry of rank r (a sum of it and zeros: exact). Sums of p
        # elementwise terms (XLA fuses them; its sort of short rows costs far more).
        idx = tf.range(p)[tf.newaxis, :]
        cols = [a[:, i : i + 1] for i in range(p)]
        rank = tf.add_n(
            [tf.cast((c > a) | ((c == a) & (idx > i)), tf.int32) for i, c in enumerate(cols)]
        )
        zero = tf.zeros_like(a)
        return tf.add_n([tf.where(rank[:, j : j + 1] == idx, c, zero) for j, c in enumerate(cols)])
    if not xla:  # (TensorFlow's own sort kernel is fast)
        # |values| >= +0 sort like their bit patterns read as integers (cheaper than floats).
        int_dtype = tf.int64 if a.dtype == tf.float64 else tf.int32
        s = tf.sort(tf.bitcast(a, int_dtype), axis=1, direction="DESCENDING")
        return tf.bitcast(s, a.dtype)
    return _bitonic_sort_desc(a)


def _bitonic_sort_desc(a: tf.Tensor) -> tf.Tensor:
    """Each row of ``a`` (>= 0, shape (n, q)) sorted descending by a bitonic network (XLA on CPU
    sorts through a slow comparator-driven TopK): ``log2(q') (log2(q') + 1) / 2`` elementwise
    max/min stages (``q'``: q rounded up to a power of two, padded with -1), exact like any
    sort."""
    n, q = int(a.shape[0]), int(a.shape[1])
    size = 1 << (q - 1).bit_length()
    if size > q:
        a = tf.concat([a, tf.fill([n, size - q], tf.constant(-1.0, a.dtype))], 1)
    k = 2
    while k <= size:
        j = k // 2
        while j >= 1:
            # Pairs (i, i + j) in blocks of 2j; a block runs descending iff bit k of i is 0.
            blocks = size // (2 * j)
            desc = tf.constant([((b * 2 * j) & k) == 0 for b in range(blocks)])[:, tf.newaxis]
            pairs = tf.reshape(a, [n, blocks, 2, j])
            first, second = pairs[:, :, 0, :], pairs[:, :, 1, :]
            hi, lo = tf.maximum(first, second), tf.minimum(first, second)
            a = tf.stack([tf.where(desc, hi, lo), tf.where(desc, lo, hi)], 2)
            a = tf.reshape(a, [n, size])
            j //= 2
        k *= 2
    return a[:, :q]


def materialized(*ts: tf.Tensor) -> tuple[tf.Tensor, ...]:
    """``ts`` unchanged (per-unit values), computed once. XLA would otherwise fuse their
    float64 expressions into every loop over the long side that broadcasts them, and recompute
    them there once per element (its optimization barrier is expanded away on CPU before
    fusion). A reduction is not fused into a consumer: the max of ``t``'s bit pattern, as an
    integer, and the lowest integer is that bit pattern (NaN, inf and -0 too; a float max
    would not keep NaN on XLA's CPU backend)."""
    if not tracing_for_xla():
        return ts
    out = []
    for t in ts:
        bits = tf.bitcast(t, BITS[t.dtype])
        lowest = tf.fill(tf.shape(bits), BITS[t.dtype].min)
        out.append(tf.bitcast(tf.reduce_max(tf.stack([bits, lowest], -1), -1), t.dtype))
    return tuple(out)


def unit(t: tf.Tensor, unit_axis: int) -> tf.Tensor:
    """A per-unit column (n, 1) laid out to broadcast against the long side."""
    return t if unit_axis == 0 else tf.reshape(t, [1, -1])


def _fold(t: tf.Tensor, unit_axis: int, combine: Any) -> list[tf.Tensor]:
    """Pieces of a long-side tensor whose reductions, combined, reduce ``t`` per unit. XLA on CPU
    does not fuse an elementwise producer into a reduction (it writes the producer out first: a
    pass over memory per reduced expression) but fuses an elementwise ``combine`` of ``_SPLITS``
    slices with it: the long side is read once and only a block of 1 / _SPLITS of its size is
    written (then reduced, with the few remaining entries as a second piece)."""
    axis = 1 - unit_axis
    size = int(t.shape[axis])
    step = size // _SPLITS
    if step == 0 or not tracing_for_xla():  # (otherwise each slice would be a copy)
        return [t]

    def part(start: int, stop: int) -> tf.Tensor:
        return t[start:stop] if axis == 0 else t[:, start:stop]

    acc = part(0, step)
    for i in range(1, _SPLITS):
        acc = combine(acc, part(i * step, (i + 1) * step))
    return [acc] + ([part(_SPLITS * step, size)] if _SPLITS * step < size else [])


def reduce_units(fn: Any, t: tf.Tensor, unit_axis: int) -> tf.Tensor:
    """``fn`` (``tf.reduce_sum`` or ``tf.reduce_max``) over each unit's entries of a long-side
    tensor, as a column (n, 1) (see :func:`_fold`)."""
    combine = tf.add if fn is tf.reduce_sum else tf.maximum
    pieces = [fn(piece, axis=1 - unit_axis) for piece in _fold(t, unit_axis, combine)]
    out = pieces[0] if len(pieces) == 1 else combine(pieces[0], pieces[1])
    return tf.reshape(out, [-1, 1])


def unit_sums(a: tf.Tensor, b: tf.Tensor, unit_axis: int) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-unit sums (n, 1) of two long-side tensors in one pass over the long side: the real
    and imaginary parts of one folded, reduced complex tensor.

    A complex addition adds each part exactly as a real one would, so each part is a real sum
    in the order :func:`reduce_units` takes (within ``(m - 1) eps`` of the sum of magnitudes,
    as any order). Under XLA on CPU a fusion has one output and is one loop, so the fold is one
    loop writing both parts; the reduction stays complex since taking the parts first would let
    XLA split the fold into two loops (each a full pass over the long side).
    """
    axis = 1 - unit_axis
    pieces = _fold(tf.complex(a, b), unit_axis, tf.add)
    total = tf.add_n([tf.reduce_sum(c, axis=axis) for c in pieces])
    re, im = (tf.reshape(part(total), [-1, 1]) for part in (tf.math.real, tf.math.imag))
    return re, im
