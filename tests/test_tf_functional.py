"""pathnorm_tf.functional: exactness against the NumPy reference, graph/XLA modes, dtypes, errors."""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

from pathnorm_tf import (
    NonFiniteWeightsError,
    _band,
    path_norm,
    product_bound,
    project_linf_operator_norm,
    project_rows_l1_ball,
    prox_l1,
    prox_path_norm,
)
from shared_spec import reference as ref

# The authors' conformance vector (docs/errata.md), torch layout; Keras kernels are the transposes.
W1 = np.array(
    [
        [0.4116, 0.1772, -0.2248, 0.1030],
        [0.3919, -0.0149, 0.1139, 0.4613],
        [-0.2737, 0.3785, -0.0665, -0.0034],
    ]
)
W2 = np.array([[0.4999, 0.5504, -0.2444], [-0.0930, 0.5427, -0.2093]])
W1_PROX = np.array(
    [
        [0.3671, 0.1327, -0.1802, 0.0585],
        [0.2962, 0.0, 0.0182, 0.3656],
        [-0.2407, 0.3455, -0.0335, 0.0],
    ]
)
W2_PROX = np.array([[0.4261, 0.4824, -0.1825], [-0.0191, 0.4747, -0.1473]])


def random_pair(rng: np.random.Generator, m: int, n: int, p: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.standard_normal((m, n)), rng.standard_normal((n, p))


def reference_keras(
    k_in: np.ndarray, k_out: np.ndarray, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    v, w = ref.prox_path_norm(k_out, k_in.T, lam)
    return w.T, v


def test_authors_vector() -> None:
    k_in, k_out = prox_path_norm(tf.constant(W1.T), tf.constant(W2.T), 0.1)
    np.testing.assert_allclose(k_in.numpy(), W1_PROX.T, atol=1e-4)
    np.testing.assert_allclose(k_out.numpy(), W2_PROX.T, atol=1e-4)
    assert k_in.dtype == tf.float64 and k_in.shape == (4, 3) and k_out.shape == (3, 2)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("lam", [1e-3, 0.05, 0.3, 1.5])
def test_matches_exhaustive_reference(seed: int, lam: float) -> None:
    rng = np.random.default_rng(seed)
    m, n, p = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.integers(1, 5))
    if seed % 2:
        m, p = p, m  # both orientations: p <= m and p > m (the swapped enumeration)
    k_in, k_out = random_pair(rng, m, n, p)
    got_in, got_out = prox_path_norm(k_in, k_out, lam)
    exp_in, exp_out = reference_keras(k_in, k_out, lam)
    got_obj = ref.path_norm_objective(got_out.numpy(), got_in.numpy().T, k_out, k_in.T, lam)
    exp_obj = ref.path_norm_objective(exp_out, exp_in.T, k_out, k_in.T, lam)
    assert got_obj <= exp_obj + 1e-12 * max(1.0, abs(exp_obj))
    np.testing.assert_allclose(got_in.numpy(), exp_in, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got_out.numpy(), exp_out, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("lam", [1e-4, 0.02, 0.3])
def test_band_method_equals_sort_method_also_when_the_band_overflows(
    seed: int, lam: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(100 + seed)
    k_in, k_out = random_pair(rng, 60, 20, 3 + seed)
    k_in[rng.random(k_in.shape) < 0.2] = 0.0
    want = [t.numpy() for t in prox_path_norm(k_in, k_out, lam, method="sort")]
    for block in (64, 2, 1):  # 2 and 1: most bands are wider -> whole-row sort fallback
        monkeypatch.setattr(_band, "BAND_BLOCK", block)
        got = [t.numpy() for t in prox_path_norm(k_in, k_out, lam, method="band")]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
            np.testing.assert_array_equal(g == 0, w == 0)


def test_band_overflow_flag() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 2)), rng.standard_normal((8, 20))
    *_, wide = _band.wide_band(_band.band_setup(tf.constant(x), tf.constant(y), 0, 0.05, 0.05**2))
    assert not bool(wide)  # m = 20 <= BAND_BLOCK: the block always holds the band
    assert _band.BAND_BLOCK >= 20
    x, y = rng.standard_normal((8, 10)), rng.standard_normal((8, 784))
    *_, wide = _band.wide_band(_band.band_setup(tf.constant(x), tf.constant(y), 0, 0.01, 0.01**2))
    assert bool(wide)  # lam = 0.01 on unit-scale weights: the band is wider than the block
    got = [t.numpy() for t in prox_path_norm(y.T, x, 0.01)]  # so "auto" redoes it by sorting
    want = [t.numpy() for t in prox_path_norm(y.T, x, 0.01, method="sort")]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_bad_method() -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        prox_path_norm(np.ones((2, 2)), np.ones((2, 2)), 0.1, method="fast")


def test_lam_zero_is_identity_and_huge_lam_keeps_one_side() -> None:
    rng = np.random.default_rng(3)
    k_in, k_out = random_pair(rng, 7, 5, 3)
    a, b = prox_path_norm(k_in, k_out, 0.0)
    np.testing.assert_array_equal(a.numpy(), k_in)
    np.testing.assert_array_equal(b.numpy(), k_out)
    a, b = prox_path_norm(k_in, k_out, 1e6)
    for i in range(5):
        keep_in = np.sum(k_in[:, i] ** 2) > np.sum(k_out[i] ** 2)  # a tie keeps (x, 0)
        np.testing.assert_array_equal(a.numpy()[:, i], k_in[:, i] if keep_in else 0.0)
        np.testing.assert_array_equal(b.numpy()[i], 0.0 if keep_in else k_out[i])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tensor_lam", [False, True])
def test_enormous_lam_is_capped_not_nan(dtype: str, tensor_lam: bool) -> None:
    # lam^2 would overflow float32; for lam >= 1 the prox no longer depends on lam.
    rng = np.random.default_rng(8)
    k_in, k_out = (a.astype(dtype) for a in random_pair(rng, 7, 5, 3))
    lam: object = tf.constant(1e30, dtype) if tensor_lam else 1e30
    a, b = prox_path_norm(k_in, k_out, lam)
    a1, b1 = prox_path_norm(k_in, k_out, 1.0)
    np.testing.assert_array_equal(a.numpy(), a1.numpy())
    np.testing.assert_array_equal(b.numpy(), b1.numpy())
    assert np.all(np.isfinite(a.numpy())) and np.all(np.isfinite(b.numpy()))


def test_signs_preserved_and_zeros_stay_zero() -> None:
    rng = np.random.default_rng(4)
    k_in, k_out = random_pair(rng, 9, 6, 4)
    k_in[2, :] = 0.0
    k_out[:, 1] = 0.0
    a, b = (t.numpy() for t in prox_path_norm(k_in, k_out, 0.2))
    assert np.all(a[2] == 0) and np.all(b[:, 1] == 0)
    assert np.all(a * k_in >= 0) and np.all(b * k_out >= 0)


def _modes() -> dict[str, object]:
    def f(a: tf.Tensor, b: tf.Tensor, lam: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return prox_path_norm(a, b, lam, check_finite=False)

    return {
        "eager": f,
        "tf.function": tf.function(f),
        "xla": tf.function(f, jit_compile=True),
    }


@pytest.mark.parametrize("mode", ["eager", "tf.function", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_graph_and_xla_modes_agree(mode: str, dtype: str) -> None:
    rng = np.random.default_rng(5)
    k_in, k_out = random_pair(rng, 30, 12, 4)
    fn = _modes()[mode]
    lam = tf.constant(0.08, dtype)
    got_in, got_out = fn(tf.constant(k_in, dtype), tf.constant(k_out, dtype), lam)  # type: ignore[operator]
    exp_in, exp_out = reference_keras(
        k_in.astype(dtype).astype(np.float64), k_out.astype(dtype).astype(np.float64), 0.08
    )
    tol = 1e-12 if dtype == "float64" else 1e-5
    assert got_in.dtype == tf.as_dtype(dtype)
    np.testing.assert_allclose(got_in.numpy(), exp_in, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_out.numpy(), exp_out, rtol=tol, atol=tol)
    assert np.count_nonzero(got_in.numpy()) == np.count_nonzero(exp_in)


def test_xla_compiles_a_large_hidden_to_hidden_pair_and_agrees_with_eager() -> None:
    # 512-512-512 takes every band tier and the sort fallback into one XLA program: it must
    # compile in seconds (a switch_case over the tiers once took XLA minutes here).
    rng = np.random.default_rng(9)
    k_in = tf.constant(rng.standard_normal((512, 512)) * 0.06, tf.float32)
    k_out = tf.constant(rng.standard_normal((512, 512)) * 0.06, tf.float32)
    xla = tf.function(lambda a, b: prox_path_norm(a, b, 1e-3), jit_compile=True)
    started = time.perf_counter()
    got_in, got_out = xla(k_in, k_out)
    compile_s = time.perf_counter() - started
    # Against the float64 prox: float32 sums over 512 entries round at about 1e-5 relative,
    # in eager code and under XLA alike (they sum in different orders).
    ref_in, ref_out = prox_path_norm(tf.cast(k_in, tf.float64), tf.cast(k_out, tf.float64), 1e-3)
    eager_in, eager_out = prox_path_norm(k_in, k_out, 1e-3)
    for got, eager, want in ((got_in, eager_in, ref_in), (got_out, eager_out, ref_out)):
        err_xla = np.abs(got.numpy() - want.numpy()).max()
        err_eager = np.abs(eager.numpy() - want.numpy()).max()
        assert err_xla <= 2e-5 and err_eager <= 2e-5, (err_xla, err_eager)
    assert compile_s < 120, f"XLA took {compile_s:.0f} s to compile the prox"


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_half_precision_computed_in_float32(dtype: tf.DType) -> None:
    rng = np.random.default_rng(6)
    k_in, k_out = random_pair(rng, 8, 5, 3)
    a16, b16 = tf.cast(k_in, dtype), tf.cast(k_out, dtype)
    got_in, got_out = prox_path_norm(a16, b16, 0.1)
    exp_in, exp_out = prox_path_norm(tf.cast(a16, tf.float32), tf.cast(b16, tf.float32), 0.1)
    assert got_in.dtype == dtype and got_out.dtype == dtype
    np.testing.assert_array_equal(got_in.numpy(), tf.cast(exp_in, dtype).numpy())
    np.testing.assert_array_equal(got_out.numpy(), tf.cast(exp_out, dtype).numpy())


def test_variables_and_empty_shapes() -> None:
    k_in = tf.Variable(np.ones((3, 2)))
    k_out = tf.Variable(np.ones((2, 1)))
    a, b = prox_path_norm(k_in, k_out, 0.1)
    assert a.shape == (3, 2) and b.shape == (2, 1)
    a, b = prox_path_norm(np.zeros((3, 0)), np.zeros((0, 2)), 0.1)
    assert a.shape == (3, 0) and b.shape == (0, 2)


def test_bounds() -> None:
    k_in, k_out = W1.T, W2.T
    expected = float(np.sum(np.abs(W2).sum(0) * np.abs(W1).sum(1)))
    assert float(path_norm(k_in, k_out)) == pytest.approx(expected, rel=1e-14)
    assert float(path_norm(k_in, k_out)) == pytest.approx(ref.path_norm(k_out, k_in.T), rel=1e-14)
    prod = float(np.abs(W2).sum() * np.abs(W1).sum(1).max())
    assert float(product_bound(k_in, k_out)) == pytest.approx(prod, rel=1e-14)
    assert float(product_bound(k_in, k_out)) >= float(path_norm(k_in, k_out))
    with tf.GradientTape() as tape:
        v = tf.Variable(k_in)
        value = path_norm(v, k_out)
    assert tape.gradient(value, v) is not None


def test_prox_l1_and_projections() -> None:
    rng = np.random.default_rng(7)
    w = rng.standard_normal((6, 4))
    np.testing.assert_allclose(prox_l1(w, 0.3).numpy(), ref.prox_l1(w, 0.3), rtol=0, atol=0)
    np.testing.assert_allclose(
        project_rows_l1_ball(w, 1.2).numpy(), ref.project_rows_l1_ball(w, 1.2), atol=1e-14
    )
    # Dense kernel (in, out): the l_inf operator norm is the largest column l1 norm.
    proj = project_linf_operator_norm(w, 1.2).numpy()
    np.testing.assert_allclose(proj, ref.project_rows_l1_ball(w.T, 1.2).T, atol=1e-14)
    assert np.abs(proj).sum(0).max() <= 1.2 + 1e-12
    assert np.all(project_linf_operator_norm(w, 0.0).numpy() == 0)
    inside = w / np.abs(w).sum(0).max()
    np.testing.assert_array_equal(project_linf_operator_norm(inside, 1.0).numpy(), inside)


BAD_LAMS = [(-0.1, "finite number >= 0"), (float("nan"), "finite"), (float("inf"), "finite")]
BAD_LAMS += [(10**400, "finite number >= 0, got an int too large for a float")]


@pytest.mark.parametrize(
    ("lam", "error", "match"),
    [
        *((lam, ValueError, match) for lam, match in BAD_LAMS),
        ("x", TypeError, "real number"),
        (b"1", TypeError, "real number"),
        (None, TypeError, "real number"),
        (True, TypeError, "real number"),
        (np.bool_(True), TypeError, "real number"),
        (1 + 0j, TypeError, "real number"),
        (tf.constant("0.1"), TypeError, "real number"),
    ],
)
def test_bad_lam(lam: object, error: type[Exception], match: str) -> None:
    # Not a real number: TypeError; a real that is NaN, inf or negative: ValueError (as torch).
    with pytest.raises(error, match=match):
        prox_path_norm(np.ones((2, 2)), np.ones((2, 2)), lam)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        prox_l1(np.ones((2, 2)), lam)  # type: ignore[arg-type]
    with pytest.raises(error, match=match.replace("lam", "radius")):
        project_rows_l1_ball(np.ones((2, 2)), lam)  # type: ignore[arg-type]


def test_bad_tensor_lam_and_radius() -> None:
    with pytest.raises(ValueError, match="scalar"):
        prox_path_norm(np.ones((2, 2)), np.ones((2, 2)), tf.constant([0.1, 0.2]))
    with pytest.raises(ValueError, match="finite number >= 0"):
        prox_path_norm(np.ones((2, 2)), np.ones((2, 2)), tf.constant(-1.0))
    with pytest.raises(ValueError, match="radius must be a finite number >= 0"):
        project_linf_operator_norm(np.ones((2, 2)), -1.0)


def test_symbolic_lam_is_checked_when_the_graph_runs() -> None:
    fn = tf.function(lambda lam: prox_path_norm(tf.ones((2, 2)), tf.ones((2, 2)), lam)[0])
    np.testing.assert_allclose(fn(tf.constant(0.0)).numpy(), 1.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="lam must be a finite number >= 0"):
        fn(tf.constant(-1.0))


@pytest.mark.parametrize(
    ("k_in", "k_out", "match"),
    [
        (np.ones((3, 2)), np.ones((3, 2)), r"do not pair: kernel_in.shape\[1\] must equal"),
        (np.ones(3), np.ones((3, 2)), "kernel_in must be a 2-D kernel"),
        (np.ones((3, 2)), np.ones((2, 2, 1)), "kernel_out must be a 2-D kernel"),
        (np.ones((3, 2), dtype=np.int32), np.ones((2, 2)), "floating dtype"),
        (np.array([[np.nan, 1.0]]), np.ones((2, 2)), "kernel_in contains NaN or inf"),
        (np.ones((1, 2)), np.array([[np.inf, 1.0], [1.0, 1.0]]), "kernel_out contains NaN or inf"),
        ("weights", np.ones((2, 2)), "kernel_in must be"),
        (np.ones((3, 2), np.float16), np.ones((2, 2)), r"same dtype; cast one"),
        (np.ones((3, 2), np.float32), np.ones((2, 2), np.float64), r"same dtype; cast one"),
    ],
)
def test_bad_kernels(k_in: object, k_out: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prox_path_norm(k_in, k_out, 0.1)
    if "NaN" in match:  # the error has its own type, as on the torch side
        with pytest.raises(NonFiniteWeightsError):
            prox_path_norm(k_in, k_out, 0.1)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("baseline", [prox_l1, project_rows_l1_ball, project_linf_operator_norm])
def test_the_baselines_refuse_non_finite_weights(baseline: Any, bad: float) -> None:
    w = np.array([[1.0, bad, -2.0]])
    with pytest.raises(NonFiniteWeightsError, match="contains NaN or inf"):
        baseline(w, 10.0)
    assert baseline(w, 10.0, check_finite=False).shape == (1, 3)


def test_kernels_of_two_dtypes_are_refused_by_every_pair_function() -> None:
    # Before, float16 + float64 kernels were computed at float16 precision without a word.
    k_in, k_out = tf.ones((3, 2), tf.float16), tf.ones((2, 2), tf.float64)
    for fn in (path_norm, product_bound, lambda a, b: prox_path_norm(a, b, 0.1, method="sort")):
        with pytest.raises(ValueError, match=r"kernel_in \(float16\) and kernel_out \(float64\)"):
            fn(k_in, k_out)


def test_finite_check_is_optional_and_a_graph_assertion() -> None:
    bad = np.array([[np.nan, 1.0]])
    prox_path_norm(bad, np.ones((2, 2)), 0.1, check_finite=False)  # no error
    fn = tf.function(lambda a: prox_path_norm(a, tf.ones((2, 2), tf.float64), 0.1)[0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="kernel_in contains NaN or inf"):
        fn(tf.constant(bad))


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("method", ["band", "sort"])
def test_nearly_equal_candidates_near_d_zero_are_ranked_by_their_points(
    method: str, jit: bool
) -> None:
    # As on the torch side: k l lam^2 = 1 - 2e-9, where the closed-form objective of the
    # support pair (1, 1) came out below the better trivial point (0, y) (by 1.6e-12).
    y = np.array([[0.01171875], [1.793585252161581e-06]])  # kernel_in (m, n) = (2, 1)
    x = np.array([[0.0, 0.01171875]])  # kernel_out (n, p) = (1, 2)
    fn = tf.function(lambda a, b: prox_path_norm(a, b, 0.999999999, method=method), jit_compile=jit)
    new_in, new_out = fn(tf.constant(y), tf.constant(x))
    assert np.array_equal(new_out.numpy(), np.zeros((1, 2)))  # v = 0
    assert np.array_equal(new_in.numpy(), y)  # w = y


@pytest.mark.parametrize("mode", ["eager", "xla"])
@pytest.mark.parametrize("method", ["band", "sort"])
def test_candidates_are_ranked_unshifted_when_one_side_is_tiny(method: str, mode: str) -> None:
    # docs/errata.md, section 5: ranked by the objective shifted by (|x|^2 + |y|^2) / 2, the
    # point keeping both sides (9.995e-22) tied with (x, 0) in float64 (5e-19), and y was zeroed.
    k_in, k_out = np.array([[1e-9]]), np.array([[1.0]])  # neutral x = [1.0], y = [1e-9]
    lam = 1e-12

    def prox(a: tf.Tensor, b: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return prox_path_norm(a, b, lam, method=method)

    fn = prox if mode == "eager" else tf.function(prox, jit_compile=True)
    new_in, new_out = fn(tf.constant(k_in, tf.float64), tf.constant(k_out, tf.float64))
    x, y = k_out[0], k_in[:, 0]
    *_, want = ref.prox_unit(x, y, lam)
    got = ref.objective(new_out.numpy()[0], new_in.numpy()[:, 0], x, y, lam)
    assert got == pytest.approx(want, rel=1e-9, abs=0)
    assert new_in.numpy()[0, 0] > 0  # y is kept
