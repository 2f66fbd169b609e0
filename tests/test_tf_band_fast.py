"""pathnorm_tf band prox: the narrow-band tiers, packed counts and sliced reductions.

Randomized float64 cases against the exhaustive reference (``shared_spec.reference``), eagerly
and under XLA, aimed at every extraction tier of ``_prox_band`` (band width 0, 1, 2, 3-4, 5-8,
9-16, the top_k block, the whole-row sort fallback), ties among band entries, zeros, a huge
dynamic range, tiny and huge lam and lam at the ``k l lam^2 = 1`` boundary; plus white-box
checks of the pieces (band extraction with ties, exact packed counts, sliced reductions, row
sorts: rank sort, bitonic network).
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from pathnorm_tf import _band, _xla, functional, prox_path_norm
from shared_spec import reference as ref

# (m, n, p): kernel_in (m, n), kernel_out (n, p). Dense layout (m >= p) and the swapped one
# (p > m, m < 8: no slicing), a long side that is no multiple of 8 with p = 1, and m > 32 (the
# top_k block and the sort fallback).
SHAPES = [(40, 6, 3), (5, 4, 9), (67, 5, 1), (100, 4, 2)]
KINDS = ["glorot", "ties", "zeros", "range", "boundary"]
SEEDS = range(12)
# Band widths that select each extraction path of _prox_band (BAND_BLOCK = 32).
BUCKETS = [(0, 0), (1, 1), (2, 2), (3, 4), (5, 32), (33, 10**9)]


def make_case(shape: tuple[int, int, int], kind: str, seed: int) -> tuple[Any, Any, float]:
    """Dense kernels (float64) and a lam for one randomized case."""
    m, n, p = shape
    rng = np.random.default_rng([seed, *shape, KINDS.index(kind)])
    k_in = rng.standard_normal((m, n)) * np.sqrt(2 / (m + n))
    k_out = rng.standard_normal((n, p)) * np.sqrt(2 / (n + p))
    lam = float(10 ** rng.uniform(-4, 0))  # band widths from 0 to the whole long side
    if kind == "ties":
        # The long side takes few distinct magnitudes: many equal entries inside the band.
        long_ = k_in if m >= p else k_out
        levels = rng.choice([0.05, 0.1, 0.15, 0.2], size=long_.shape)
        long_[...] = np.sign(rng.standard_normal(long_.shape)) * levels / np.sqrt(m + p)
    elif kind == "zeros":
        k_in[rng.random(k_in.shape) < 0.4] = 0.0
        k_out[rng.random(k_out.shape) < 0.3] = 0.0
        k_in[:, 0] = 0.0  # a unit with no incoming weights
        k_out[n - 1, :] = 0.0  # and one with no outgoing weights
    elif kind == "range":
        k_in *= 10.0 ** rng.uniform(-6, 2, k_in.shape)
        k_out *= 10.0 ** rng.uniform(-3, 1, k_out.shape)
        lam = float(10 ** rng.uniform(-6, -1))
    elif kind == "boundary":
        # lam at (or one ulp around) 1 / sqrt(k l): d = 1 - k l lam^2 crosses 0 for that pair;
        # weights large enough that the support pairs compete with the trivial points.
        k_in *= 20.0
        k_out *= 20.0
        k, l_ = int(rng.integers(1, min(m, p) + 1)), int(rng.integers(1, max(m, p) + 1))
        lam = float(np.nextafter(1.0 / np.sqrt(k * l_), [-1.0, 0.0, 2.0][seed % 3]))
    if kind == "glorot" and seed == 0:
        lam = 1e-12  # no band: every unit keeps its whole support
    if kind == "glorot" and seed == 1:
        lam = 5.0  # beyond the cap (2): only the trivial points
    return k_in, k_out, lam


def band_width(k_in: Any, k_out: Any, lam: float) -> int:
    """The widest band of the case, as ``_prox_kernels`` sees it."""
    m, p = k_in.shape[0], k_out.shape[1]
    lam = min(lam, functional._LAM_CAP)
    if p > m:
        b = _band.band_setup(tf.constant(k_in.T), tf.constant(k_out), 0, lam, lam * lam)
    else:
        b = _band.band_setup(tf.constant(k_out), tf.constant(k_in), 1, lam, lam * lam)
    return int(b.width.numpy())


@cache
def xla_prox(shape: tuple[int, int, int]) -> Callable[..., Any]:
    del shape  # one compiled function per shape (the cache key)

    def prox(a: tf.Tensor, b: tf.Tensor, lam: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return prox_path_norm(a, b, lam, check_finite=False)

    return tf.function(prox, jit_compile=True)


def check_against_reference(got: tuple[Any, Any], k_in: Any, k_out: Any, lam: float) -> None:
    exp_out, exp_in_t = ref.prox_path_norm(k_out, k_in.T, lam)
    got_in, got_out = got
    obj = ref.path_norm_objective(got_out, got_in.T, k_out, k_in.T, lam)
    exp_obj = ref.path_norm_objective(exp_out, exp_in_t, k_out, k_in.T, lam)
    assert obj <= exp_obj + 1e-12 * max(1.0, abs(exp_obj))
    scale = max(1.0, float(np.max(np.abs(k_in))), float(np.max(np.abs(k_out))))
    _, spread = ref.minimiser_margin(k_out, k_in.T, lam, 1e-13)
    if spread <= 1e-9 * scale:  # a unique minimiser at rounding level: the same point
        np.testing.assert_allclose(got_in, exp_in_t.T, rtol=1e-9, atol=1e-12 * scale)
        np.testing.assert_allclose(got_out, exp_out, rtol=1e-9, atol=1e-12 * scale)


def assert_same(a: tuple[Any, Any], b: tuple[Any, Any], rtol: float) -> None:
    for got, want in zip(a, b, strict=True):
        scale = max(1.0, float(np.max(np.abs(want))))
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-14 * scale)
        np.testing.assert_array_equal(got == 0, want == 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_band_prox_matches_reference_eager_and_xla(shape: tuple[int, int, int], kind: str) -> None:
    xla = xla_prox(shape)
    for seed in SEEDS:
        k_in, k_out, lam = make_case(shape, kind, seed)
        band = [t.numpy() for t in prox_path_norm(k_in, k_out, lam, method="band")]
        check_against_reference((band[0], band[1]), k_in, k_out, lam)
        by_sort = [t.numpy() for t in prox_path_norm(k_in, k_out, lam, method="sort")]
        assert_same((band[0], band[1]), (by_sort[0], by_sort[1]), rtol=1e-11)
        lam_t = tf.constant(lam, tf.float64)
        compiled = [t.numpy() for t in xla(tf.constant(k_in), tf.constant(k_out), lam_t)]
        assert_same((compiled[0], compiled[1]), (band[0], band[1]), rtol=1e-11)


def test_cases_cover_every_band_path() -> None:
    """The randomized cases reach every extraction tier, the top_k block and the fallback."""
    hit = {bucket: 0 for bucket in BUCKETS}
    for shape in SHAPES:
        for kind in KINDS:
            for seed in SEEDS:
                w = band_width(*make_case(shape, kind, seed))
                for lo, hi in BUCKETS:
                    hit[(lo, hi)] += lo <= w <= hi
    assert _band.FAST_TIERS == (0, 1, 2, 4) and _band.BAND_BLOCK == 32
    assert all(count >= 3 for count in hit.values()), hit


# ---------------------------------------------------------------------------------------------
# The pieces
# ---------------------------------------------------------------------------------------------


def sorted_band(ay: Any, lo: Any, hi: Any, kb: int) -> Any:
    """NumPy: per row the entries with lo < |y| <= hi, descending, zero padded to kb."""
    out = np.zeros((ay.shape[0], kb))
    for i, row in enumerate(ay):
        vals = np.sort(row[(row > lo[i]) & (row <= hi[i])])[::-1]
        out[i, : vals.size] = vals
    return out


@pytest.mark.parametrize("unit_axis", [0, 1])
@pytest.mark.parametrize("kb", _band.FAST_TIERS[1:])
@pytest.mark.parametrize("jit", [False, True])
def test_narrow_band_extraction_with_ties(unit_axis: int, kb: int, jit: bool) -> None:
    rng = np.random.default_rng(kb + 10 * unit_axis)
    n, m = 7, 53
    # Few distinct magnitudes: runs of equal entries inside the band, also across its edges.
    ay = rng.choice([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6], size=(n, m))
    y = ay * np.sign(rng.standard_normal((n, m)))
    lo, hi = np.full((n, 1), 0.1), np.full((n, 1), 0.4)
    lo[2], hi[2] = 0.45, 0.5  # an empty band
    lo[3], hi[3] = 0.15, 0.3  # edges exactly at entry values (lo excluded, hi included)
    for i in range(n):  # at most kb entries per row: drop extra band entries
        inside = np.flatnonzero((ay[i] > lo[i]) & (ay[i] <= hi[i]))
        y[i, inside[kb:]] = 0.0
    want = sorted_band(np.abs(y), lo[:, 0], hi[:, 0], kb)
    count = ((np.abs(y) > lo) & (np.abs(y) <= hi)).sum(1, keepdims=True).astype(np.float64)
    assert count.max() == kb  # the block is full in some row

    def extract(y_t: tf.Tensor) -> tf.Tensor:
        b = _band.band_setup(tf.ones([n, 2], tf.float64), y_t, unit_axis, 0.1, 0.01)
        b = b._replace(tau_lo=tf.constant(lo), tau_hi=tf.constant(hi), count=tf.constant(count))
        return _band.narrow_band(b, kb)

    fn = tf.function(extract, jit_compile=True) if jit else extract
    got = fn(tf.constant(y if unit_axis == 0 else y.T)).numpy()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("unit_axis", [0, 1])
@pytest.mark.parametrize("m", [3, 8, 67, 200, 4100])  # 4100: float32 counts unpacked
def test_packed_counts_are_exact(dtype: tf.DType, unit_axis: int, m: int) -> None:
    rng = np.random.default_rng(m)
    n, p = 9, 3
    x = rng.standard_normal((n, p))
    y = rng.standard_normal((n, m)) * rng.choice([0.0, 1e-3, 1.0], size=(n, m))
    lam = 0.05
    b = _band.band_setup(
        tf.constant(x, dtype),
        tf.constant(y if unit_axis == 0 else y.T, dtype),
        unit_axis,
        lam,
        lam**2,
    )
    ay = np.abs(y.astype(dtype.as_numpy_dtype))
    tau_hi, tau_lo = b.tau_hi.numpy(), b.tau_lo.numpy()
    np.testing.assert_array_equal(b.c_hi.numpy(), (ay > tau_hi).sum(1, keepdims=True))
    np.testing.assert_array_equal(
        b.count.numpy(), ((ay > tau_lo) & (ay <= tau_hi)).sum(1, keepdims=True)
    )
    assert b.width.numpy() == b.count.numpy().max()


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("unit_axis", [0, 1])
@pytest.mark.parametrize("size", [1, 7, 8, 9, 16, 67, 784])
def test_sliced_reductions(unit_axis: int, size: int, jit: bool) -> None:
    # In a graph (eagerly, _fold does not slice): a sliced fold, then the remainder.
    rng = np.random.default_rng(size)
    t = rng.standard_normal((5, size))
    t_in = tf.constant(t if unit_axis == 0 else t.T)

    def reduce(fn: Any) -> Any:
        return tf.function(lambda u: _xla.reduce_units(fn, u, unit_axis), jit_compile=jit)

    total = reduce(tf.reduce_sum)(t_in).numpy()
    np.testing.assert_allclose(total, t.sum(1, keepdims=True), rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(reduce(tf.reduce_max)(t_in).numpy(), t.max(1, keepdims=True))
    pair = tf.function(lambda u: _xla.unit_sums(u, u * u, unit_axis), jit_compile=jit)(t_in)
    np.testing.assert_allclose(pair[0].numpy(), total, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(pair[1].numpy(), (t * t).sum(1, keepdims=True), rtol=1e-13)


@pytest.mark.parametrize("unit_axis", [0, 1])
def test_unit_sums_is_one_pass_over_the_long_side_under_xla(unit_axis: int) -> None:
    # Both sums of a pair come from one loop over the long side (a fusion of XLA's CPU
    # backend has one output): the fold stays complex through the reduction. Taking the real
    # and imaginary parts before it let XLA split the fold into one loop per part, once
    # their consumers differ (as in the prox), which this test's consumers reproduce.
    rng = np.random.default_rng(unit_axis)
    t = rng.standard_normal((6, 40))
    t_in = tf.constant(t if unit_axis == 0 else t.T)

    def sums(u: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        total, squares = _xla.unit_sums(tf.abs(u), u * u, unit_axis)
        return tf.sqrt(total) + 1.0, tf.reduce_max(squares)

    fn = tf.function(sums, jit_compile=True)
    hlo = fn.experimental_get_compiler_ir(t_in)(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY") :]
    (param,) = re.findall(r"(%\S+) = f64\[\d+,\d+\]\{[\d,]+\} parameter\(0\)", entry)
    loops = [
        line
        for line in entry.splitlines()
        if " fusion(" in line and re.search(param + r"[,)]", line)
    ]
    assert len(loops) == 1, loops
    got_total, got_max = (v.numpy() for v in fn(t_in))
    np.testing.assert_allclose(got_total[:, 0], np.sqrt(np.abs(t).sum(1)) + 1.0, rtol=1e-14)
    np.testing.assert_allclose(got_max, (t * t).sum(1).max(), rtol=1e-14)


@pytest.mark.parametrize("p", [2, 3, 10, 16, 17, 64, 100, 513])
def test_row_sorts(p: int) -> None:
    """Eagerly and in a plain graph TensorFlow's sort; under XLA the rank sort (p <= 16) or
    the bitonic network (padded to a power of two): the same values."""
    rng = np.random.default_rng(p)
    a = np.abs(rng.choice([0.0, 0.5, 1.0, rng.random()], size=(30, p)))  # ties and zeros
    a[:10] = rng.random((10, p))
    want = -np.sort(-a, axis=1)
    np.testing.assert_array_equal(_xla.sort_rows_desc(tf.constant(a)).numpy(), want)
    for jit in (False, True):
        sort = tf.function(_xla.sort_rows_desc, jit_compile=jit)
        np.testing.assert_array_equal(sort(tf.constant(a)).numpy(), want)
        got32 = sort(tf.constant(a.astype(np.float32))).numpy()
        np.testing.assert_array_equal(got32, want.astype(np.float32))


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("cols", [1, 2, 10, 32, 33])
def test_short_cumsums_under_xla_equal_cumsum(dtype: tf.DType, cols: int) -> None:
    # Under XLA, rows of at most 32 columns are summed by one masked reduction (a cumsum is a
    # reduce-window thunk of its own there); longer rows, and eager code, keep tf.cumsum.
    rng = np.random.default_rng(cols)
    a = tf.constant(rng.standard_normal((7, cols)) * 10.0 ** rng.uniform(-3, 3, (7, cols)), dtype)
    got = tf.function(_xla.cumsum_cols, jit_compile=True)(a).numpy()
    want = np.cumsum(a.numpy().astype(np.float64), axis=1)
    eps = 2e-7 if dtype == tf.float32 else 4e-16
    bound = cols * eps * np.cumsum(np.abs(a.numpy().astype(np.float64)), axis=1)
    assert np.all(np.abs(got - want) <= bound)
    eager = _xla.cumsum_cols(a).numpy()
    np.testing.assert_array_equal(eager, tf.cumsum(a, axis=1).numpy())


def band_bounds(k_in: Any, k_out: Any, lam: float, dtype: tf.DType) -> tuple[Any, Any]:
    """``(tau_lo, tau_hi)`` per unit (n,) as ``_band_setup`` computes them (Dense layout)."""
    b = _band.band_setup(tf.constant(k_out, dtype), tf.constant(k_in, dtype), 1, lam, lam * lam)
    return b.tau_lo.numpy()[:, 0].astype(np.float64), b.tau_hi.numpy()[:, 0].astype(np.float64)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("kind", ["glorot", "equal", "zeros"])
def test_band_bounds_hold_for_the_exact_minimiser(dtype: tf.DType, kind: str) -> None:
    """Every non-trivial minimiser's threshold on the long side, ``t = lam ||v||_1``, lies in
    ``[tau_lo, tau_hi]``, so no entry at or below ``tau_lo`` is kept and every entry above
    ``tau_hi`` is. Aimed at the ``sqrt(m) ||y||_2`` bound: equal magnitudes make it an
    equality (``||y||_1 = sqrt(m) ||y||_2``) and a tiny ``lam`` puts the threshold right next
    to it (there ``tau_lo`` is within 2e-11 of ``t``; a bound 10% too tight fails this test)."""
    rng = np.random.default_rng(["glorot", "equal", "zeros"].index(kind))
    m, n, p = 61, 40, 3
    checked = 0
    for _ in range(25):
        k_in = rng.standard_normal((m, n)) * np.sqrt(2 / (m + n))
        k_out = rng.standard_normal((n, p)) * np.sqrt(2 / (n + p))
        lam = float(10 ** rng.uniform(-6, -0.5))
        if kind == "equal":
            k_in = np.sign(k_in) * rng.choice([0.01, 0.1, 1.0])
            lam = float(10 ** rng.uniform(-7, -2))
        elif kind == "zeros":
            k_in[rng.random(k_in.shape) < 0.7] = 0.0
        k_in = k_in.astype(dtype.as_numpy_dtype).astype(np.float64)
        k_out = k_out.astype(dtype.as_numpy_dtype).astype(np.float64)
        v, w = ref.prox_path_norm(k_out, k_in.T, lam)
        tau_lo, tau_hi = band_bounds(k_in, k_out, lam, dtype)
        ay = np.abs(k_in.T)
        for i in range(n):
            if not (v[i].any() and w[i].any()):
                continue  # a trivial point: handled as its own candidate
            checked += 1
            t = lam * np.abs(v[i]).sum()
            assert tau_lo[i] <= t * (1 + 1e-12) and t <= tau_hi[i] * (1 + 1e-12), (i, lam)
            kept = w[i] != 0
            assert not np.any(kept & (ay[i] <= tau_lo[i])) and np.all(kept[ay[i] > tau_hi[i]])
        got_in, got_out = (
            t.numpy().astype(np.float64)
            for t in prox_path_norm(
                k_in.astype(dtype.as_numpy_dtype), k_out.astype(dtype.as_numpy_dtype), lam
            )
        )
        obj = ref.path_norm_objective(got_out, got_in.T, k_out, k_in.T, lam)
        best = ref.path_norm_objective(v, w, k_out, k_in.T, lam)
        tol = 1e-12 if dtype == tf.float64 else 1e-5
        assert obj <= best + tol * max(1.0, abs(best))
    assert checked > 300


def test_band_is_narrow_for_a_small_prox_step() -> None:
    """With the prox step of training (lam = 1e-5 on Glorot-scale weights of 784-200-10), the
    lower bound is within 1% of ``tau_hi`` (the ``sqrt(m) ||y||_2`` bound; the bound from the
    objective alone is about 10% below it), so at most a few entries fall in the band."""
    rng = np.random.default_rng(0)
    k_in = (rng.standard_normal((784, 200)) * 0.05).astype(np.float32)
    k_in[rng.random(k_in.shape) < 0.03] = 3e-6  # entries just below tau_hi (about 4e-6)
    k_out = (rng.standard_normal((200, 10)) * 0.1).astype(np.float32)
    tau_lo, tau_hi = band_bounds(k_in, k_out, 1e-5, tf.float32)
    assert np.median(tau_lo / tau_hi) > 0.99
    assert np.all(tau_lo <= tau_hi)
    band = ((np.abs(k_in.T) > tau_lo[:, None]) & (np.abs(k_in.T) <= tau_hi[:, None])).sum()
    assert band <= 2


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("k", [1, 2, 12, 40])
def test_argmin_under_xla_is_the_first_least_index(dtype: tf.DType, k: int) -> None:
    # Under XLA two plain reductions replace tf.argmin; eagerly tf.argmin itself.
    rng = np.random.default_rng(k)
    h = rng.choice([-1.0, 0.0, 0.5, rng.standard_normal()], size=(50, k))  # many ties
    h[:10] = rng.standard_normal((10, k))
    h[10, :] = np.inf
    want = np.argmin(h, axis=1)[:, None]  # numpy: the first least index too
    for jit in (False, True):
        got = tf.function(_xla.argmin_rows, jit_compile=jit)(tf.constant(h, dtype))
        np.testing.assert_array_equal(got.numpy(), want)
    nan_row = tf.constant(np.full((1, k), np.nan), dtype)
    got = tf.function(_xla.argmin_rows, jit_compile=True)(nan_row)
    assert got.numpy()[0, 0] == k - 1  # in range, as XLA's argmin of a NaN row


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("q", [1, 2, 12, 16, 40])
def test_selects_under_xla_equal_gathers(dtype: tf.DType, q: int) -> None:
    # _pick_rows / _at_least: chains of selects under XLA (q <= 16 here), gathers otherwise; the
    # same entries, the first least index on ties and the last one for a row of NaNs.
    rng = np.random.default_rng(q)
    h = rng.choice([-1.0, 0.0, 0.5, rng.standard_normal()], size=(60, q))  # many ties
    h[:10] = rng.standard_normal((10, q))
    h[10, :] = np.inf
    h[11, :] = np.nan
    h[12, :] = -np.inf
    t1 = rng.standard_normal((60, q))
    t2 = np.where(rng.random((60, q)) < 0.2, np.inf, rng.standard_normal((60, q)))
    idx = rng.integers(0, q, size=(60, 7)).astype(np.int32)
    best = np.argmin(np.where(np.isnan(h), np.inf, h), axis=1)
    best[11] = q - 1
    for jit in (False, True):
        pick = tf.function(_xla.pick_rows, jit_compile=jit)
        got = pick(tf.constant(t1, dtype), tf.constant(idx)).numpy()
        np.testing.assert_array_equal(got, np.take_along_axis(t1.astype(got.dtype), idx, 1))
        at = tf.function(_xla.at_least, jit_compile=jit)
        args = (tf.constant(h, dtype), tf.constant(t1, dtype), tf.constant(t2, dtype))
        g1, g2 = (t.numpy()[:, 0] for t in at(*args))
        rows = np.arange(60) if jit else np.arange(60) != 11  # (eagerly: tf.argmin's NaN rule)
        np.testing.assert_array_equal(g1[rows], t1.astype(g1.dtype)[np.arange(60), best][rows])
        np.testing.assert_array_equal(g2[rows], t2.astype(g2.dtype)[np.arange(60), best][rows])


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_materialized_is_bit_exact_under_xla(dtype: tf.DType) -> None:
    # The barrier against XLA's recomputation must be an identity: NaN, infs and -0 included.
    t = np.array([[np.nan, -np.inf, np.inf, -0.0, 0.0, 1e-300, -2.5, 3e38]])
    f = tf.function(lambda a: _xla.materialized(a * 2, a)[0], jit_compile=True)
    got = f(tf.constant(t, dtype)).numpy()
    want = (t.astype(dtype.as_numpy_dtype) * 2).astype(got.dtype)
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{got.itemsize}"))
