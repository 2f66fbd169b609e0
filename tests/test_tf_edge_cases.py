"""pathnorm_tf.functional at the edges: every finite magnitude, exact ties, empty layers."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from pathnorm_tf import path_norm, product_bound, prox_path_norm
from shared_spec import reference as ref

METHODS = ["band", "sort", "auto"]
# Eagerly every method; under XLA "band" and "sort" only: "auto" is "band" (prox_path_norm takes
# the band path for every method but "sort", a choice made in Python while tracing), so under
# XLA it would compile the very program "band" compiles (several seconds each).
# test_auto_traces_the_band_program checks that the two trace to the same program.
MODES = [(method, False) for method in METHODS] + [(method, True) for method in METHODS[:2]]
MODE_IDS = [f"{method}-{'xla' if jit else 'eager'}" for method, jit in MODES]


def prox_fn(method: str, jit: bool, lam: float) -> Callable[..., tuple[tf.Tensor, tf.Tensor]]:
    def fn(k_in: tf.Tensor, k_out: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return prox_path_norm(k_in, k_out, lam, method=method, check_finite=False)

    return tf.function(fn, jit_compile=True) if jit else fn


def reference_keras(
    k_in: np.ndarray, k_out: np.ndarray, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    v, w = ref.prox_path_norm(k_out, k_in.T, lam)
    return w.T, v


def test_auto_traces_the_band_program() -> None:
    # The premise of MODES: under tf.function (and so under XLA) method="auto" traces the very
    # program method="band" traces, op for op (and not the one "sort" traces).
    specs = (tf.TensorSpec((40, 4), tf.float32), tf.TensorSpec((4, 3), tf.float32))

    def program(method: str) -> tuple[list[str], list[list[str]]]:
        fn = tf.function(lambda a, b: prox_path_norm(a, b, 0.15, method=method, check_finite=False))
        graph = fn.get_concrete_function(*specs).graph.as_graph_def()
        functions = sorted([node.op for node in f.node_def] for f in graph.library.function)
        return [node.op for node in graph.node], functions

    band = program("band")
    assert len(band[0]) + sum(map(len, band[1])) > 100
    assert program("auto") == band
    assert program("sort") != band


# --- every finite magnitude (scale equivariance per unit) ------------------------------------


def scaled_units(scales: np.ndarray, m: int, p: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Unit-scale normal kernels (Keras layout), hidden unit i multiplied by ``scales[i]``."""
    rng = np.random.default_rng(seed)
    n = len(scales)
    k_in = rng.standard_normal((m, n)) * scales[np.newaxis, :]
    k_out = rng.standard_normal((n, p)) * scales[:, np.newaxis]
    return k_in, k_out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(9, 3), (3, 9)], ids=["m>p", "p>m"])
def test_float64_is_exact_from_1e_minus_300_to_1e300(method: str, shape: tuple[int, int]) -> None:
    # Before, squared norms overflowed (>~1e154) or underflowed (<~1e-160) in float64 and the
    # prox came out far from the minimiser. prox(s x, s y) = s prox(x, y) with the same lam.
    scales = 10.0 ** np.arange(-300, 301, 50, dtype=np.float64)
    lam = 0.15
    m, p = shape
    k_in, k_out = scaled_units(scales, m, p, seed=0)
    unit_in, unit_out = reference_keras(k_in / scales, k_out / scales[:, None], lam)
    want_in, want_out = unit_in * scales, unit_out * scales[:, None]
    assert 0 < np.count_nonzero(want_in) < want_in.size  # a prox that keeps and zeroes entries
    got_in, got_out = (t.numpy() for t in prox_fn(method, False, lam)(k_in, k_out))
    np.testing.assert_allclose(got_in / scales, unit_in, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got_out / scales[:, None], unit_out, rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(got_in == 0, want_in == 0)
    np.testing.assert_array_equal(got_out == 0, want_out == 0)


@pytest.mark.parametrize(("method", "jit"), MODES, ids=MODE_IDS)
def test_float32_is_exact_over_its_whole_range_subnormals_included(method: str, jit: bool) -> None:
    # Before, the float32 band came out up to 3x the optimal objective at <~1e-18 or >~1e19.
    # (2^125: the unit's long-side sums overflow float32, so the scaled fallback runs)
    exps = np.array([-149, -140, -128, -124, -120, -75, -60, -30, 0, 30, 60, 90, 120, 125])
    scales = 2.0 ** exps.astype(np.float64) * 1.3  # (not a power of two)
    lam = 0.15
    k_in, k_out = scaled_units(scales, 40, 4, seed=1)
    k_in, k_out = k_in.astype(np.float32), k_out.astype(np.float32)  # subnormals round here
    # TensorFlow runs its CPU kernels with denormals-are-zero and flush-to-zero: in every op
    # (a Dense layer's matmul as the prox) a subnormal float32 is 0, and a result below the
    # smallest normal number becomes 0. The prox is exact for the weights as TF sees them.
    tiny = np.finfo(np.float32).tiny  # 2^-126
    flushed = [np.where(np.abs(k) < tiny, 0.0, k.astype(np.float64)) for k in (k_in, k_out)]
    want_in, want_out = reference_keras(*flushed, lam)
    got_in, got_out = (t.numpy() for t in prox_fn(method, jit, lam)(k_in, k_out))
    assert got_in.dtype == np.float32
    unit_max = np.maximum(np.abs(k_in).max(0), np.abs(k_out).max(1))  # per hidden unit
    bound_in, bound_out = 1e-6 * unit_max + tiny, (1e-6 * unit_max + tiny)[:, None]
    np.testing.assert_array_less(np.abs(got_in - want_in), np.broadcast_to(bound_in, k_in.shape))
    np.testing.assert_array_less(
        np.abs(got_out - want_out), np.broadcast_to(bound_out, k_out.shape)
    )
    normal = unit_max >= 2.0**-100  # where every kept entry rounds to a nonzero float32
    np.testing.assert_array_equal((got_in == 0)[:, normal], (want_in == 0)[:, normal])
    assert 0 < np.count_nonzero(want_in) < want_in.size


# --- exact ties: the first candidate wins, (x, 0), (0, y), then by increasing k -------------

# Neutral layout: x = outgoing (kernel_out row), y = incoming (kernel_in column) of one unit.
TIES = {
    # ||x||^2 = ||y||^2 = 0.3125 and lam so large that only the trivial points remain
    "issue": (np.array([[0.5, -0.25]]), np.array([[-0.25, 0.5, 0.0]]), 1e6),
    "equal-norms": (np.array([[1.0, 0.0]]), np.array([[0.5, -0.5, 0.5, 0.5]]), 50.0),
    # p > m: the methods enumerate the incoming side (roles swapped inside)
    "swapped": (np.array([[0.5, 0.5, -0.5, 0.5]]), np.array([[0.0, -1.0]]), 3.0),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("method", "jit"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("case", sorted(TIES))
def test_exact_ties_keep_the_outgoing_side(
    case: str, method: str, jit: bool, dtype: type[np.floating]
) -> None:
    x, y, lam = TIES[case]
    v_ref, w_ref, _ = ref.prox_unit(x[0], y[0], lam)  # the reference's order: (x, 0) first
    np.testing.assert_array_equal(v_ref, x[0])
    np.testing.assert_array_equal(w_ref, 0.0)
    k_in, k_out = y.T.astype(dtype), x.astype(dtype)  # Keras layout
    new_in, new_out = prox_fn(method, jit, lam)(k_in, k_out)
    np.testing.assert_array_equal(new_out.numpy(), k_out)  # v = x
    np.testing.assert_array_equal(new_in.numpy(), np.zeros_like(k_in))  # w = 0


# --- empty layers ------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "p"), [(3, 0, 2), (0, 2, 3), (3, 2, 0)])
def test_bounds_of_an_empty_layer_are_zero(m: int, n: int, p: int) -> None:
    # Before, product_bound returned NaN (0 * the max over no column, -inf) for n = 0.
    k_in, k_out = tf.zeros((m, n), tf.float64), tf.zeros((n, p), tf.float64)
    assert float(product_bound(k_in, k_out)) == 0.0
    assert float(path_norm(k_in, k_out)) == 0.0
    new_in, new_out = prox_path_norm(k_in, k_out, 0.1)
    assert new_in.shape == (m, n) and new_out.shape == (n, p)


@pytest.mark.parametrize(("method", "jit"), MODES, ids=MODE_IDS)
def test_zero_outgoing_weights_keep_tiny_incoming_ones(method: str, jit: bool) -> None:
    # x = 0 leaves nothing to scale by, and the squares of these y underflow float32 (they are
    # ~2^-70): ||y||^2 must not be lost, or (x, 0) = (0, 0) would tie with (0, y) and win.
    y = np.array([[3.0, -1.0, 2.0], [0.0, 0.0, 0.0]], np.float32).T * np.float32(2.0**-70)
    x = np.zeros((2, 4), np.float32)
    new_in, new_out = prox_fn(method, jit, 1e6)(y, x)
    np.testing.assert_array_equal(new_in.numpy(), y)  # (0, y) for the first unit
    np.testing.assert_array_equal(new_out.numpy(), x)


@pytest.mark.parametrize(("method", "jit"), MODES, ids=MODE_IDS)
def test_a_long_side_far_beyond_the_short_one_is_exact(method: str, jit: bool) -> None:
    # float32 unit 0: |y| / |x| ~ 2^130, so the band's long-side sums overflow even after the
    # unit is scaled by its short side: the band hands that unit to the sort; unit 1 is ordinary.
    k_in = np.array([[1e10, -3e9], [0.5, -0.25], [2e9, 1.0]], np.float32)  # (m, n) = (3, 2)
    k_out = np.array([[1e-29, 0.0], [0.25, -0.5]], np.float32)  # (n, p) = (2, 2)
    lam = 0.01
    want_in, want_out = reference_keras(k_in.astype(np.float64), k_out.astype(np.float64), lam)
    got_in, got_out = (t.numpy() for t in prox_fn(method, jit, lam)(k_in, k_out))
    np.testing.assert_allclose(got_in, want_in, rtol=1e-6, atol=1e-35)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-6, atol=1e-35)


# --- a tiny lam: the layer stays as it is, in every dtype -------------------------------------

# float16's smallest normal and subnormal numbers, float32's (2^-126, 2^-149) and between,
# then float64's smallest normal-ish and subnormal (5e-324) numbers.
TINY_LAMS = [2.0**-14, 2.0**-24, 2.0**-126, 1e-39, 2.0**-149, 1e-300, 5e-324]


TINY_CASES = [(dtype, method, False) for dtype in (np.float16, np.float32, np.float64)
              for method in METHODS] + [(np.float32, "band", True)]  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "method", "jit"),
    TINY_CASES,
    ids=[f"{np.dtype(d).name}-{m}-{'xla' if j else 'eager'}" for d, m, j in TINY_CASES],
)
def test_a_tiny_lam_is_exact_in_every_dtype(
    dtype: type[np.floating], method: str, jit: bool
) -> None:
    # Before, the band (the default) zeroed most of a float32 or float16 layer for any lam under
    # 2^-126 (1e-39, 1e-300): lam ||x||_1 rounded to 0 in float32, and the smallest kept |y|,
    # which that bound stands in for, then failed its feasibility test. XLA (one compile: the
    # band in float32, where float16 is computed too): lam is a float64 tensor, as the
    # optimizers pass lam * lr.
    rng = np.random.default_rng(3)
    layers = [  # Keras layout (m, n), (n, p): m > p, and p > m (eagerly)
        (rng.standard_normal((6, 5)).astype(dtype), rng.standard_normal((5, 3)).astype(dtype)),
        (rng.standard_normal((3, 5)).astype(dtype), rng.standard_normal((5, 6)).astype(dtype)),
    ][: 1 if jit else 2]

    def prox_all(lam: Any) -> list[tf.Tensor]:
        return [t for k in layers for t in prox_path_norm(*k, lam, method=method)]

    if jit:
        compiled = tf.function(prox_all, jit_compile=True)
        with warnings.catch_warnings():  # (a tensor lam is not checked under XLA: it says so)
            warnings.simplefilter("ignore", UserWarning)
            results = [compiled(tf.constant(lam, tf.float64)) for lam in TINY_LAMS]
    else:
        results = [prox_all(lam) for lam in TINY_LAMS]
    eps = float(np.finfo(dtype).eps)  # one rounding of the float64 minimiser to dtype
    for lam, got in zip(TINY_LAMS, results, strict=True):
        for (k_in, k_out), g_in, g_out in zip(layers, got[0::2], got[1::2], strict=True):
            want = reference_keras(k_in.astype(np.float64), k_out.astype(np.float64), lam)
            for g, w, k in ((g_in, want[0], k_in), (g_out, want[1], k_out)):
                g = g.numpy()
                assert g.dtype == dtype
                np.testing.assert_array_equal(g == 0, w == 0, err_msg=f"lam={lam}")
                np.testing.assert_array_less(np.abs(g - w), eps * np.abs(w) + 1e-300)
                if lam <= 2.0**-126 or (dtype == np.float16 and lam <= 2.0**-24):
                    np.testing.assert_array_equal(g, k, err_msg=f"lam={lam}")
