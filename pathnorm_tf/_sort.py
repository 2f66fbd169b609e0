"""The ``"sort"`` method: the shortest exact algorithm, read this one first.

Every minimiser of the unit problem (x = outgoing, y = incoming weights of one hidden unit)::

    min_{v, w}  1/2 ||v - x||^2 + 1/2 ||w - y||^2 + lam * ||v||_1 * ||w||_1

is a trivial point ``(x, 0)`` or ``(0, y)``, or a stationary point fixed by its support sizes
``(k, l)``: ``v`` keeps the top-k of ``|x|`` shrunk by ``lam ||w||_1``, ``w`` the top-l of
``|y|`` shrunk by ``lam ||v||_1``. For each k only the largest feasible ``l = L(k)`` can win,
found by a bisection of ``ceil(log2(m + 2))`` fixed steps over whole sorted rows; the least
objective over the candidates is the minimum. Ties: the first candidate of least objective wins,
in the order ``(x, 0)``, ``(0, y)``, then ``(k, L(k))`` by increasing k (the order of
``shared_spec.reference.prox_unit``).

Unlike its torch twin ``pathnorm_lightning/_sort.py`` (same mathematics, candidates and tie
order, held to the same exhaustive reference), :func:`prox_rows` takes rows its caller already
scaled by a power of two (:func:`pathnorm_tf.functional._sort_thresholds`) and returns the
thresholds ``(t_v, t_w)``, which the caller applies to the kernels in their own dtype (no
float64 pass over the long side); and :func:`largest_feasible_l` bisects in a fixed number of
static steps, each a ``batch_dims`` gather, which XLA compiles well (torch finds ``L(k)`` by
binary lifting from one stacked table, the cheapest form for eager torch).

References:
    Latorre, Rolland, Hallak, Cevher, *Efficient Proximal Mapping of the 1-path-norm of
    Shallow Networks*, ICML 2020 (Algorithm 2; docs/errata.md lists what its printed form
    misses).
"""

from __future__ import annotations

import math

import tensorflow as tf

from pathnorm_tf._xla import argmin_rows, sort_rows_desc


def prefix_sums(a: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """For |values| ``a`` (n, q): ``c[:, k]`` = sum of the k largest, ``tail2[:, k]`` = sum of
    the squares of all but the k largest, ``top[:, k]`` = the k-th largest (index 0 padded with
    0); each (n, q + 1). ``tail2`` is summed from the small end (a reverse cumsum), never as a
    total minus a prefix: that difference cancels when the dropped entries are tiny beside the
    kept ones (docs/errata.md, section 5)."""
    s = sort_rows_desc(a)
    zero = tf.zeros_like(s[:, :1])
    c = tf.concat([zero, tf.cumsum(s, axis=1)], 1)
    tail2 = tf.concat([tf.cumsum(s * s, axis=1, reverse=True), zero], 1)
    top = tf.concat([zero, s], 1)
    return c, tail2, top


def candidate_objective(
    big_x: tf.Tensor,
    ly: tf.Tensor,
    k: tf.Tensor,
    lf: tf.Tensor,
    t_v: tf.Tensor,
    t_w: tf.Tensor,
    tail_x: tf.Tensor,
    tail_y: tf.Tensor,
    lam: tf.Tensor,
) -> tf.Tensor:
    """Objective of the point that support sizes ``(k, l)`` and thresholds ``t_v = lam b``,
    ``t_w = lam a`` produce: ``1/2 (k t_v^2 + tail_x + l t_w^2 + tail_y) + lam ||v||_1
    ||w||_1``, ``tail_x``, ``tail_y`` the sums of squares of the entries of ``|x|``, ``|y|``
    outside the supports (the dropped entries' distance to 0), summed directly.

    Unshifted: ranking the objective minus ``1/2 (||x||^2 + ||y||^2)`` (as this code once did)
    loses candidates' differences below float64's resolution of that shift, where one side is
    tiny beside the other and ``lam`` is tiny (docs/errata.md, section 5). The l1 norms are the
    point's own, ``X_k - k t_v`` and ``Y_l - l t_w`` (as the torch side): near ``d = 1 - k l
    lam^2 = 0``, ``a`` and ``b`` carry rounding amplified by ``1 / d``, and the closed form in
    ``a, b`` could misrank nearly equal candidates."""
    nv = tf.maximum(big_x - k * t_v, 0.0)
    nw = tf.maximum(ly - lf * t_w, 0.0)
    return 0.5 * (k * t_v * t_v + tail_x + lf * t_w * t_w + tail_y) + lam * nv * nw


def prox_rows(
    x: tf.Tensor,
    y: tf.Tensor,
    lam: float | tf.Tensor,
    lam2: float | tf.Tensor,
    swapped: bool = False,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Exact prox thresholds per row pair: ``x`` (n, p) outgoing, ``y`` (n, m) incoming weights
    of one float dtype; ``lam`` in [0, 2] and ``lam2 = lam * lam``, rounded once; ``swapped``:
    ``x`` holds the incoming weights (the caller swapped them; only the tie order depends on it).

    Returns:
        ``(t_v, t_w)``, each (n, 1): ``v = S(x, t_v)``, ``w = S(y, t_w)`` (``inf``: the row
        becomes 0).
    """
    p, m = int(x.shape[1]), int(y.shape[1])
    if p > m:  # enumerate the shorter side, bisect on the longer one (the problem is symmetric)
        t_w, t_v = prox_rows(y, x, lam, lam2, not swapped)
        return t_v, t_w
    dtype = x.dtype
    ax, ay = tf.abs(x), tf.abs(y)
    cx, tx2, xk = prefix_sums(ax)  # xk[:, k] = k-th largest |x|
    cy, ty2, yl = prefix_sums(ay)
    zero = tf.zeros_like(cx[:, :1])

    # --- Candidates (k, L(k)) for k = 0..p: k is the column index. ---
    k_int = tf.range(p + 1)[tf.newaxis, :]
    k = tf.cast(k_int, dtype)  # (1, p + 1), broadcast against (n, p + 1)
    big_l = largest_feasible_l(cx, xk, cy, yl, lam, lam2)

    lf = tf.cast(big_l, dtype)
    d = 1.0 - k * lf * lam2
    ly = tf.gather(cy, big_l, axis=1, batch_dims=1)
    a = tf.maximum((cx - k * lam * ly) / d, 0.0)  # ||v||_1 of the candidate
    b = tf.maximum((ly - lf * lam * cx) / d, 0.0)  # ||w||_1 of the candidate
    ty2_l = tf.gather(ty2, big_l, axis=1, batch_dims=1)
    h = candidate_objective(cx, ly, k, lf, lam * b, lam * a, tx2, ty2_l, lam)

    # --- The trivial point (x, 0), objective ||y||^2 / 2; column 0 (k = 0, L(0) = m) is (0, y),
    # objective ||x||^2 / 2 (both totals summed alike: an exact tie stays a tie). ---
    ks = k_int + tf.zeros_like(big_l)
    x_zero = (0.5 * ty2[:, :1], cx[:, p:], zero, ks[:, p:], tf.zeros_like(big_l[:, :1]))
    h, a, b, ks, ls = (
        tie_order(c, c0, swapped) for c, c0 in zip((h, a, b, ks, big_l), x_zero, strict=True)
    )

    # --- Selection: the least objective, first index on ties. ---
    best = argmin_rows(h)
    a_star = tf.gather(a, best, axis=1, batch_dims=1)
    b_star = tf.gather(b, best, axis=1, batch_dims=1)
    v_keep = tf.gather(ks, best, axis=1, batch_dims=1) > 0
    w_keep = tf.gather(ls, best, axis=1, batch_dims=1) > 0
    inf = tf.constant(float("inf"), dtype)
    return tf.where(v_keep, lam * b_star, inf), tf.where(w_keep, lam * a_star, inf)


def largest_feasible_l(
    cx: tf.Tensor,
    xk: tf.Tensor,
    cy: tf.Tensor,
    yl: tf.Tensor,
    lam: float | tf.Tensor,
    lam2: float | tf.Tensor,
) -> tf.Tensor:
    """``L(k)`` (int32, (n, p + 1)), the largest feasible ``l`` in [0, m] for every k = 0..p, by
    bisection: l = 0 is always feasible and the feasible set is downward closed in l, so a fixed
    number of halvings (``ceil(log2(m + 2))``, static) is exact. ``cx``, ``xk`` (n, p + 1) are
    the :func:`prefix_sums` of ``|x|`` (sums, k-th largest); ``cy``, ``yl`` (n, m + 1) those of
    ``|y|``."""
    m = int(cy.shape[1]) - 1
    k_int = tf.range(int(cx.shape[1]))[tf.newaxis, :]
    k = tf.cast(k_int, cx.dtype)

    def feasible(l_idx: tf.Tensor) -> tf.Tensor:
        # (k, l) is feasible iff k l lam^2 < 1 and the last kept entries of both candidate
        # vectors are >= 0; multiplied through by d = 1 - k l lam^2 > 0 to avoid dividing.
        lf = tf.cast(l_idx, cx.dtype)
        d = 1.0 - k * lf * lam2
        ly = tf.gather(cy, l_idx, axis=1, batch_dims=1)
        y_last = tf.gather(yl, l_idx, axis=1, batch_dims=1)
        v_ok = (k_int == 0) | (d * xk + lam2 * lf * cx - lam * ly >= 0)
        w_ok = (l_idx == 0) | (d * y_last + lam2 * k * ly - lam * cx >= 0)
        return (d > 0) & v_ok & w_ok

    lo = tf.zeros_like(cx, dtype=tf.int32)
    hi = tf.fill(tf.shape(lo), tf.constant(m + 1, tf.int32))
    for _ in range(max(1, math.ceil(math.log2(m + 2)))):  # length depends on log2(m) only
        mid = (lo + hi) // 2
        ok = feasible(tf.minimum(mid, m))
        lo = tf.where(ok, mid, lo)
        hi = tf.where(ok, hi, mid)
    return lo


def tie_order(pairs: tf.Tensor, x_zero: tf.Tensor, swapped: bool) -> tf.Tensor:
    """Candidate columns in the order of the tie rule: ``(x, 0)``, ``(0, y)``, then the
    stationary points by increasing support size of the outgoing weights. ``pairs`` (n, q + 1)
    holds ``(0, y)`` (column 0), then ``(k, L(k))`` for k = 1..q of the enumerated side;
    ``x_zero`` (n, 1) the candidate with all of the enumerated side kept. ``swapped``: the
    enumerated side holds the *incoming* weights, so ``x_zero`` and column 0 trade roles and
    increasing k is decreasing outgoing support."""
    if not swapped:
        return tf.concat([x_zero, pairs], 1)
    return tf.concat([pairs[:, :1], x_zero, tf.reverse(pairs[:, 1:], [1])], 1)
