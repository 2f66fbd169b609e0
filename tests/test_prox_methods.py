"""The torch prox algorithms ("kernel", "sort") against the exhaustive reference.

The compiled kernel skips sorting most of the long side (a band around the support
threshold); these cases aim at its corners: ties at the threshold, many equal magnitudes, lam
at the k*l*lam^2 = 1 boundary, rows of zeros, huge dynamic range, and the kernel's paths
(presorted short sides, long rows, the narrowed band, in-place and non-contiguous weights).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import pathnorm_lightning.functional as F
from pathnorm_lightning import NonFiniteWeightsError, prox_path_norm, prox_path_norm_
from pathnorm_lightning._sort import prox_rows
from shared_spec import reference

METHODS = ["kernel", "sort"]


def _objective(
    w_in: torch.Tensor, w_out: torch.Tensor, x: np.ndarray, y: np.ndarray, lam: float
) -> float:
    return reference.path_norm_objective(w_out.double().numpy().T, w_in.double().numpy(), x, y, lam)


def _random_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, float]:
    n, m, p = int(rng.integers(1, 4)), int(rng.integers(1, 10)), int(rng.integers(1, 7))
    y = rng.normal(size=(n, m))
    x = rng.normal(size=(n, p))
    style = int(rng.integers(0, 6))
    if style == 0:  # many equal magnitudes
        y = np.sign(y) * rng.choice([0.5, 1.0], size=y.shape)
        x = np.sign(x) * rng.choice([0.5, 1.0], size=x.shape)
    elif style == 1:  # exact zeros and zero rows
        y *= rng.random(size=y.shape) < 0.5
        x *= rng.random(size=x.shape) < 0.5
        if n > 1:
            y[0] = 0.0
    elif style == 2:  # huge dynamic range
        y *= 10.0 ** rng.uniform(-6, 6, size=y.shape)
        x *= 10.0 ** rng.uniform(-6, 6, size=x.shape)
    elif style == 3:  # coarse grid: ties everywhere, including at the threshold
        y, x = np.round(y, 1), np.round(x, 1)
    lam = float(10 ** rng.uniform(-3, 0.5))
    if style == 4:  # k * l * lam^2 next to 1
        k, l = int(rng.integers(1, p + 1)), int(rng.integers(1, m + 1))
        lam = float((1 + rng.choice([-1e-9, -1e-6, 0.0, 1e-6])) / np.sqrt(k * l))
    return x, y, lam


@pytest.mark.parametrize("method", METHODS)
def test_exact_on_random_corner_cases(method: str) -> None:
    rng = np.random.default_rng(20261125 + (1 << 15))
    cases = 1500
    for _ in range(cases):
        x, y, lam = _random_case(rng)
        new_in, new_out = prox_path_norm(torch.tensor(y), torch.tensor(x.T), lam, method=method)  # type: ignore[arg-type]
        v_ref, w_ref = reference.prox_path_norm(x, y, lam)
        h_ref = reference.path_norm_objective(v_ref, w_ref, x, y, lam)
        h = _objective(new_in, new_out, x, y, lam)
        assert h <= h_ref + 1e-9 * max(1.0, abs(h_ref)), (x.tolist(), y.tolist(), lam, h, h_ref)
        # signs preserved, zeros stay zero
        assert np.all(new_in.numpy() * y >= 0) and np.all(new_out.numpy().T * x >= 0)
        assert np.all(new_in.numpy()[y == 0] == 0) and np.all(new_out.numpy().T[x == 0] == 0)


@pytest.mark.parametrize("method", METHODS)
def test_exact_with_entries_planted_next_to_the_support_threshold(method: str) -> None:
    # Incoming weights at, just below and within 1/16 of tau = lam ||x||_1 (the kernel skips its
    # band pass when no entry lies in (15/16 tau, tau] and its bounds are closer than that),
    # at 15/16 tau exactly, and below: small lam, where the bounds are tight.
    rng = np.random.default_rng(20261126)
    for _ in range(700):
        n, m, p = int(rng.integers(1, 4)), int(rng.integers(1, 10)), int(rng.integers(1, 5))
        x = rng.normal(size=(n, p))
        lam = float(10 ** rng.uniform(-4, -0.5))
        y = rng.normal(size=(n, m)) * (rng.random((n, m)) < 0.8)
        tau = lam * np.abs(x).sum(1, keepdims=True)
        pick = rng.random((n, m))
        planted = [
            (0.15, tau * (1 - 1 / 16)),
            (0.25, tau * (1 - 1 / 32)),
            (0.35, tau),
            (0.40, tau * (1 - 2.0**-52)),
            (0.50, tau * rng.uniform(0, 1, size=(n, m))),
        ]
        low = 0.0
        for high, value in planted:
            sel = (pick >= low) & (pick < high)
            y = np.where(
                sel, np.broadcast_to(value, y.shape) * rng.choice([-1, 1], size=y.shape), y
            )
            low = high
        new_in, new_out = prox_path_norm(torch.tensor(y), torch.tensor(x.T), lam, method=method)  # type: ignore[arg-type]
        v_ref, w_ref = reference.prox_path_norm(x, y, lam)
        h_ref = reference.path_norm_objective(v_ref, w_ref, x, y, lam)
        h = _objective(new_in, new_out, x, y, lam)
        assert h <= h_ref + 1e-9 * max(1.0, abs(h_ref)), (x.tolist(), y.tolist(), lam, h, h_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(300, 40, 10), (50, 30, 1), (20, 25, 60), (64, 16, 64)])
@pytest.mark.parametrize("lam", [1e-4, 1e-2, 0.2])
def test_kernel_and_sort_agree_on_larger_layers(
    dtype: torch.dtype, shape: tuple[int, int, int], lam: float
) -> None:
    m, n, p = shape
    g = torch.Generator().manual_seed(m * 7 + n * 3 + p)
    w_in = torch.randn(n, m, generator=g, dtype=dtype) * 0.05
    w_out = torch.randn(p, n, generator=g, dtype=dtype) * 0.05
    # a sparse-trained look: many tiny entries just around the thresholds
    w_in = w_in * (torch.rand(n, m, generator=g, dtype=dtype) < 0.3) + 1e-4 * torch.randn(
        n, m, generator=g, dtype=dtype
    )
    b_in, b_out = prox_path_norm(w_in, w_out, lam, method="sort")
    a_in, a_out = prox_path_norm(w_in, w_out, lam, method="kernel")
    # both compute in float64 whatever the weights' dtype: float64 results differ in the last
    # bits (summation order), float32 ones are the same rounding of those, to the bit
    tol = 1e-12 if dtype == torch.float64 else 0.0
    torch.testing.assert_close(a_in, b_in, rtol=tol, atol=tol)
    torch.testing.assert_close(a_out, b_out, rtol=tol, atol=tol)


def test_unknown_method_is_rejected() -> None:
    with pytest.raises(ValueError, match="method must be"):
        prox_path_norm(torch.ones(2, 3), torch.ones(1, 2), 0.1, method="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("lam", ["0.1", True, None, 1j, torch.tensor(True)])
def test_non_numeric_lam_is_rejected(lam: object) -> None:
    with pytest.raises(TypeError, match="lam must be a real number"):
        prox_path_norm(torch.ones(2, 3), torch.ones(1, 2), lam)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_in_place_writes_the_same_result(method: str, dtype: torch.dtype) -> None:
    # lopsided; float32/64 contiguous weights take the direct in-place write
    g = torch.Generator().manual_seed(7)
    w_in = (torch.randn(64, 300, generator=g) * 0.05).to(dtype)
    w_out = (torch.randn(5, 64, generator=g) * 0.05).to(dtype)
    want_in, want_out = prox_path_norm(w_in, w_out, 3e-3, method=method)  # type: ignore[arg-type]
    got_in, got_out = w_in.clone(), w_out.clone()
    prox_path_norm_(got_in, got_out, 3e-3, method=method)  # type: ignore[arg-type]
    assert torch.equal(got_in, want_in) and torch.equal(got_out, want_out)
    assert (want_in == 0).any()  # the case exercises the threshold


def test_results_do_not_share_memory_with_reused_scratch() -> None:
    g = torch.Generator().manual_seed(8)
    layers = [
        (torch.randn(40, 200, generator=g), torch.randn(3, 40, generator=g)) for _ in range(2)
    ]
    first_in, first_out = prox_path_norm(*layers[0], 0.01)
    kept_in, kept_out = first_in.clone(), first_out.clone()
    prox_path_norm(*layers[1], 0.01)  # same shapes: the scratch tensors are reused
    assert torch.equal(first_in, kept_in) and torch.equal(first_out, kept_out)


def test_kernel_is_the_cpu_default_and_sort_the_fallback_without_numba(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(9)
    w_in, w_out = torch.randn(30, 200, generator=g) * 0.05, torch.randn(3, 30, generator=g)
    kernel = prox_path_norm(w_in, w_out, 0.01, method="kernel")
    sort = prox_path_norm(w_in, w_out, 0.01, method="sort")
    calls: list[str] = []
    real_kernel, real_sort = F._prox_kernel, F._prox_sort

    def spy_kernel(*args: Any) -> Any:
        calls.append("kernel")
        return real_kernel(*args)

    def spy_sort(*args: Any, **kwargs: Any) -> Any:
        calls.append("sort")
        return real_sort(*args, **kwargs)

    monkeypatch.setattr(F, "_prox_kernel", spy_kernel)
    monkeypatch.setattr(F, "_prox_sort", spy_sort)
    auto = prox_path_norm(w_in, w_out, 0.01)
    assert calls == ["kernel"] and all(torch.equal(a, b) for a, b in zip(auto, kernel, strict=True))
    monkeypatch.setattr(F, "_kernel_module", lambda: None)  # as if numba were not installed
    auto = prox_path_norm(w_in, w_out, 0.01)
    assert calls == ["kernel", "sort"]
    assert all(torch.equal(a, b) for a, b in zip(auto, sort, strict=True))
    with pytest.raises(ValueError, match="needs numba"):
        prox_path_norm(w_in, w_out, 0.01, method="kernel")


@pytest.mark.parametrize("where", ["w_in", "w_out"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_kernel_reports_non_finite_weights_and_writes_nothing(where: str, bad: float) -> None:
    g = torch.Generator().manual_seed(10)
    w_in, w_out = torch.randn(30, 200, generator=g), torch.randn(3, 30, generator=g)
    if where == "w_in":
        w_in[25, -1] = bad  # a late unit: the kernel has processed earlier ones
    else:
        w_out[-1, 25] = bad
    kept_in, kept_out = w_in.clone(), w_out.clone()
    with pytest.raises(NonFiniteWeightsError, match=f"{where} contains NaN or inf"):
        prox_path_norm_(w_in, w_out, 0.01, method="kernel")
    torch.testing.assert_close(w_in, kept_in, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(w_out, kept_out, rtol=0, atol=0, equal_nan=True)
    prox_path_norm_(w_in, w_out, 0.01, method="kernel", check_finite=False)  # no check: no error


@pytest.mark.parametrize("swap", [False, True], ids=["p<m", "p>m"])
def test_kernel_in_place_on_non_contiguous_and_half_weights(swap: bool) -> None:
    g = torch.Generator().manual_seed(11)
    m, p = (200, 3) if not swap else (3, 200)
    w_in = (torch.randn(m, 30, generator=g) * 0.05).t()  # a transposed view: not contiguous
    w_out = torch.randn(p, 30, generator=g) * 0.05
    want_in, want_out = prox_path_norm(w_in, w_out, 0.01, method="sort")
    got_in, got_out = w_in.clone(memory_format=torch.preserve_format), w_out.clone()
    assert not got_in.is_contiguous()
    prox_path_norm_(got_in, got_out, 0.01, method="kernel")
    torch.testing.assert_close(got_in, want_in, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-7)
    half_in, half_out = w_in.to(torch.float16), w_out.to(torch.float16)
    h_in, h_out = prox_path_norm(half_in, half_out, 0.01, method="kernel")
    r_in, r_out = prox_path_norm(half_in.float(), half_out.float(), 0.01, method="kernel")
    assert h_in.dtype == torch.float16 and torch.equal(h_in, r_in.half())
    assert torch.equal(h_out, r_out.half())


def test_kernel_is_float64_accurate_on_float32_weights() -> None:
    # The kernel computes in float64 whatever the weights' dtype: on float32 weights its result
    # is the exact prox rounded to float32, also where two candidates' objectives differ by
    # less than float32 resolution.
    torch.manual_seed(0)
    for _ in range(3):
        w_in = torch.nn.Linear(784, 200).weight.detach()
        w_out = torch.nn.Linear(200, 1).weight.detach()
        x, y = w_out.double().numpy().T, w_in.double().numpy()
        v_ref, w_ref = reference.prox_path_norm(x, y, 1e-3)
        got_in, got_out = prox_path_norm(w_in, w_out, 1e-3, method="kernel")
        np.testing.assert_allclose(got_out.double().numpy().T, v_ref, rtol=0, atol=1e-8)
        np.testing.assert_allclose(got_in.double().numpy(), w_ref, rtol=0, atol=1e-8)


@pytest.mark.parametrize("seed", range(4))
def test_kernel_exact_on_wide_rows(seed: int) -> None:
    # Long rows (several blocks of the kernel's band scan) and long short sides (sorted by
    # numpy before the kernel), in the regime where the band bounds narrow the band to a few
    # entries, with ties and zeros.
    rng = np.random.default_rng(900 + seed)
    for case in range(12):
        n, m = 3, int(rng.integers(130, 300))
        p = int(rng.integers(17, 41)) if case % 2 else int(rng.integers(1, 17))
        y = rng.uniform(-1, 1, size=(n, m)) / np.sqrt(m)
        x = rng.uniform(-1, 1, size=(n, p)) / np.sqrt(n)
        if case % 3 == 1:  # coarse grid: ties, also at the thresholds
            y, x = np.round(y, 2), np.round(x, 1)
        if case % 4 == 2:  # zeros
            y *= rng.random(size=y.shape) < 0.6
            x *= rng.random(size=x.shape) < 0.6
        lam = float(10 ** rng.uniform(-4, -0.5))
        new_in, new_out = prox_path_norm(torch.tensor(y), torch.tensor(x.T), lam, method="kernel")
        v_ref, w_ref = reference.prox_path_norm(x, y, lam)
        h_ref = reference.path_norm_objective(v_ref, w_ref, x, y, lam)
        h = _objective(new_in, new_out, x, y, lam)
        assert h <= h_ref + 1e-9 * max(1.0, abs(h_ref)), (seed, case, lam)
        np.testing.assert_allclose(new_in.numpy(), w_ref, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(new_out.numpy().T, v_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_nearly_equal_candidates_near_d_zero_are_ranked_by_their_points(method: str) -> None:
    # k l lam^2 = 1 - 2e-9: the support pair's norms a, b carry rounding amplified 5e8 times,
    # and its closed-form objective came out below the trivial point (0, y), which is better
    # by 1.6e-12 (found by hypothesis). Candidates are now ranked by the objective of the
    # point each one produces.
    x = np.array([[0.0, 0.01171875]])
    y = np.array([[0.01171875, 1.793585252161581e-06]])
    lam = 0.999999999
    new_in, new_out = prox_path_norm(torch.tensor(y), torch.tensor(x.T), lam, method=method)  # type: ignore[arg-type]
    assert np.array_equal(new_out.numpy(), np.zeros((2, 1)))  # v = 0
    assert np.array_equal(new_in.numpy(), y)  # w = y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sort_with_lam_as_a_float64_tensor_equals_the_float(dtype: torch.dtype) -> None:
    # The CUDA graph feeds lam as a float64 device scalar: it must round as the Python float
    # does, so that graph replays equal eager calls to the bit.
    rng = np.random.default_rng(11)
    for _ in range(500):
        x, y, lam = _random_case(rng)
        xt, yt = torch.tensor(x, dtype=dtype), torch.tensor(y, dtype=dtype)
        want = prox_rows(xt, yt, lam)
        got = prox_rows(xt, yt, torch.tensor(lam, dtype=torch.float64))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (x, y, lam)


def _at_once(work: Callable[[int], None], n: int = 4) -> list[BaseException]:
    """``work(0)`` ... ``work(n - 1)`` in ``n`` threads released together; their errors."""
    import threading

    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            work(i)
        except BaseException as err:  # reported by the caller
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_kernel_first_calls_from_several_threads_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first call compiles (or loads) every signature and then forbids compiling; a second
    # thread arriving meanwhile must wait for that, not compile after it ("compilation
    # disabled"). A reload gives the module a fresh, uncompiled state.
    import importlib

    kernel = pytest.importorskip("pathnorm_lightning._kernel")
    importlib.reload(importlib.import_module("pathnorm_lightning._kernel_jit"))  # new dispatchers
    importlib.reload(kernel)
    results: list[tuple[int, np.ndarray]] = []
    cases = []
    for _ in range(4):
        rng = np.random.default_rng(0)
        short = rng.standard_normal((20, 3)).astype(np.float32)
        cases.append((short, rng.standard_normal((20, 30)).astype(np.float32)))

    def work(i: int) -> None:
        short, long = cases[i]
        kernel.prox_inplace(short, long, 1e-2, True, True)
        results.append((i, long))

    errors = _at_once(work)
    assert not errors
    assert len(results) == 4
    for _, long in results[1:]:
        np.testing.assert_array_equal(long, results[0][1])


# float16's smallest normal and subnormal numbers, float32's (2^-126, 2^-149) and between,
# then float64's smallest normal-ish and subnormal (5e-324) numbers.
TINY_LAMS = [2.0**-14, 2.0**-24, 2.0**-126, 1e-39, 2.0**-149, 1e-300, 5e-324]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_a_tiny_lam_is_exact_in_every_dtype(method: str, dtype: torch.dtype) -> None:
    # A lam below every dtype's normal range leaves the layer as it is (the TF band once zeroed
    # most of a float32 layer there); the reference's minimiser rounded once to the dtype.
    rng = np.random.default_rng(3)
    eps = torch.finfo(dtype).eps
    for n, m, p in ((5, 6, 3), (5, 3, 6)):
        w_in = torch.tensor(rng.standard_normal((n, m))).to(dtype)
        w_out = torch.tensor(rng.standard_normal((p, n))).to(dtype)
        x, y = w_out.double().numpy().T, w_in.double().numpy()
        for lam in TINY_LAMS:
            v, w = reference.prox_path_norm(x, y, lam)
            got_in, got_out = prox_path_norm(w_in, w_out, lam, method=method)  # type: ignore[arg-type]
            for got, want, orig in ((got_in, w, w_in), (got_out, v.T, w_out)):
                assert got.dtype == dtype
                g = got.double().numpy()
                np.testing.assert_array_equal(g == 0, want == 0, err_msg=f"lam={lam}")
                np.testing.assert_array_less(np.abs(g - want), eps * np.abs(want) + 1e-300)
                if lam <= 2.0**-126 or (dtype == torch.float16 and lam <= 2.0**-24):
                    assert torch.equal(got, orig), lam


def test_kernel_exact_on_rows_mixing_huge_and_tiny_magnitudes() -> None:
    # The kernel's one pass over a long row sums |y| and |y|^2; its lower bound on the support
    # threshold takes |y|^2 - sum_{|y| > tau} (|y| - tau)^2 from their difference. Rows mixing
    # magnitudes 1e-6..1e3 with many entries at or next to tau = lam ||x||_1 make it cancel.
    rng = np.random.default_rng(20261127)
    for _ in range(150):
        n, m, p = 2, int(rng.integers(20, 50)), int(rng.integers(1, 5))
        x = rng.normal(size=(n, p))
        lam = float(10 ** rng.uniform(-3, -0.5))
        tau = lam * np.abs(x).sum(1, keepdims=True)
        y = np.sign(rng.normal(size=(n, m))) * 10.0 ** rng.uniform(-6, 3, size=(n, m))
        at = tau * (1 + rng.choice([-1e-7, 0.0, 1e-12, 1e-4], size=(n, m)))
        y = np.where(rng.random(size=(n, m)) < 0.5, np.sign(y) * at, y)
        new_in, new_out = prox_path_norm(torch.tensor(y), torch.tensor(x.T), lam, method="kernel")
        v_ref, w_ref = reference.prox_path_norm(x, y, lam)
        h_ref = reference.path_norm_objective(v_ref, w_ref, x, y, lam)
        h = _objective(new_in, new_out, x, y, lam)
        assert h <= h_ref + 1e-9 * max(1.0, abs(h_ref)), (x.tolist(), y.tolist(), lam, h, h_ref)


def test_kernel_row_whose_sum_overflows_is_finite_and_solved_scaled() -> None:
    # Finite float64 entries whose l1 norm overflows: the kernel's finite test on the row's sum
    # falls back to testing each entry (no error), and the unit is solved scaled by a power of
    # two, so the result is the unscaled layer's, scaled (prox_lam(s x, s y) = s prox_lam(x, y)).
    rng = np.random.default_rng(20261128)
    x, y = rng.normal(size=(2, 3)), rng.normal(size=(2, 40))
    y[0] = np.sign(y[0]) * (1 + rng.random(40))  # its sum, ~60 * 2^1019, overflows
    scale = 2.0**1019
    for lam in (1e-3, 0.05):
        w_in, w_out = torch.tensor(y * scale), torch.tensor(x.T * scale)
        assert math.isinf(float(w_in[0].abs().sum())) and bool(torch.isfinite(w_in).all())
        got_in, got_out = prox_path_norm(w_in, w_out, lam, method="kernel", check_finite=True)
        ref_in, ref_out = prox_path_norm(torch.tensor(y), torch.tensor(x.T), lam, method="kernel")
        assert torch.equal(got_in, ref_in * scale) and torch.equal(got_out, ref_out * scale)


@pytest.fixture
def two_torch_threads() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _parallel_kernel() -> Any:
    kernel = pytest.importorskip("pathnorm_lightning._kernel", reason="needs numba")
    if not kernel._parallel_ok():
        pytest.skip(
            "the kernel's threaded entry is not used here: numba's threading layer is not "
            "OpenMP or TBB, or the entry did not compile (see the RuntimeWarning)"
        )
    return kernel


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [1, 10, 40])  # 40: the short side presorted by numpy
@pytest.mark.usefixtures("two_torch_threads")
def test_kernel_on_several_threads_is_bit_identical_to_one(dtype: type, p: int) -> None:
    # The units split in contiguous blocks, one per thread, each solved by the serial code.
    kernel = _parallel_kernel()
    rng = np.random.default_rng(p)
    for case in range(6):
        n, m = int(rng.integers(64, 300)), int(rng.integers(p, 900))
        long = rng.uniform(-1, 1, size=(n, m)) / np.sqrt(m)
        short = rng.uniform(-1, 1, size=(p, n)).T / np.sqrt(n)  # F-contiguous, as w_out.T
        if case % 3 == 1:  # ties, also at the thresholds, and zeros
            long, short = np.round(long, 2), np.round(short, 1)
            long *= rng.random(size=long.shape) < 0.6
        lam = float(10 ** rng.uniform(-4, -0.5))
        long, short = long.astype(dtype), np.asfortranarray(short.astype(dtype))
        x_sorted = -np.sort(-np.abs(short), axis=1).astype(np.float64) if p > 16 else None
        want_s, want_l = short.copy(order="F"), long.copy()
        assert kernel._prox_all(want_s, want_l, lam, True, True, kernel._NOT_SORTED) == -1
        s, ll = short.copy(order="F"), long.copy()
        assert kernel.prox_inplace(s, ll, lam, True, True) == -1  # parallel at 2 torch threads
        assert np.array_equal(s, want_s) and np.array_equal(ll, want_l), case
        s, ll = short.copy(order="C"), long.copy()  # a C-contiguous copy: one thread if p > 1
        assert kernel.prox_inplace(s, ll, lam, True, True) == -1
        assert np.array_equal(s, want_s) and np.array_equal(ll, want_l), case
        for chunks in (2, 3, 7):
            s, ll = short.copy(order="F"), long.copy()
            pre = kernel._NOT_SORTED if x_sorted is None else x_sorted.copy()
            assert kernel._prox_par(s.T, ll, lam, chunks, True, True, pre) == -1
            assert np.array_equal(s, want_s) and np.array_equal(ll, want_l), (case, chunks)


@pytest.mark.parametrize("where", ["w_in", "w_out"])
@pytest.mark.parametrize("units", [[150], [10, 150], [199]], ids=["second", "both", "last"])
@pytest.mark.usefixtures("two_torch_threads")
def test_kernel_on_several_threads_reports_the_first_non_finite_unit(
    where: str, units: list[int]
) -> None:
    kernel = _parallel_kernel()
    g = torch.Generator().manual_seed(12)
    w_in, w_out = torch.randn(200, 784, generator=g), torch.randn(10, 200, generator=g)
    for u in units:
        if where == "w_in":
            w_in[u, 3] = math.nan
        else:
            w_out[4, u] = math.inf
    kept_in, kept_out = w_in.clone(), w_out.clone()
    short, long = w_out.numpy().T, w_in.numpy()
    assert (
        kernel._prox_par(w_out.numpy(), long, 0.01, 2, True, True, kernel._NOT_SORTED) == units[0]
    )
    assert kernel._prox_all(short, long, 0.01, True, True, kernel._NOT_SORTED) == units[0]
    torch.testing.assert_close(w_in, kept_in, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(w_out, kept_out, rtol=0, atol=0, equal_nan=True)
    assert kernel._chunks(200, 784) == min(2, kernel.numba.get_num_threads())
    with pytest.raises(NonFiniteWeightsError, match=f"{where} contains NaN or inf"):
        prox_path_norm_(w_in, w_out, 0.01, method="kernel")
    torch.testing.assert_close(w_in, kept_in, rtol=0, atol=0, equal_nan=True)


@pytest.mark.usefixtures("two_torch_threads")
def test_kernel_threads_follow_torch_and_the_layer_size() -> None:
    kernel = _parallel_kernel()
    assert kernel._chunks(200, 784) == min(2, kernel.numba.get_num_threads())
    assert kernel._chunks(200, 100) == 1  # too few weights to pay for waking a thread
    assert kernel._chunks(40, 4000) == 1  # too few units for two blocks
    torch.set_num_threads(1)  # a process set to one thread (a sweep's worker) keeps one
    assert kernel._chunks(200, 784) == 1


def _prox_in_child(w_in: torch.Tensor, w_out: torch.Tensor, queue: Any) -> None:
    torch.set_num_threads(2)
    prox_path_norm_(w_in, w_out, 1e-3, method="kernel")
    queue.put((w_in.numpy().copy(), w_out.numpy().copy()))


@pytest.mark.usefixtures("two_torch_threads")
def test_kernel_in_a_forked_child_after_the_parent_ran_it_on_two_threads() -> None:
    # numba ends (SIGTERM) a forked child that launches parallel code after its parent did
    # with GNU OpenMP; the kernel keeps such a child to one thread, with the same result.
    import multiprocessing
    from queue import Empty

    kernel = _parallel_kernel()
    g = torch.Generator().manual_seed(13)
    w_in, w_out = torch.randn(200, 784, generator=g) * 0.05, torch.randn(10, 200, generator=g)
    want_in, want_out = w_in.clone(), w_out.clone()
    assert kernel._chunks(200, 784) == min(2, kernel.numba.get_num_threads())
    prox_path_norm_(want_in, want_out, 1e-3, method="kernel")  # the parent launches
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_prox_in_child, args=(w_in, w_out, queue), daemon=True)
    child.start()
    got = None
    for _ in range(120):  # the result, unless the child died first
        try:
            got = queue.get(timeout=1)
            break
        except Empty:
            if not child.is_alive():
                break
    child.join(timeout=60)
    if child.is_alive():  # hung: never leave it behind
        child.kill()
    assert child.exitcode == 0 and got is not None
    assert np.array_equal(got[0], want_in.numpy()) and np.array_equal(got[1], want_out.numpy())


@pytest.mark.usefixtures("two_torch_threads")
def test_kernel_without_its_parallel_entry_warns_and_runs_on_one_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel = pytest.importorskip("pathnorm_lightning._kernel", reason="needs numba")

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no parallel backend")

    kernel._compile()  # the one-thread entry, before compiling breaks
    monkeypatch.setattr(kernel, "_parallel_pid", None)
    monkeypatch.setattr(kernel, "_compile_signatures", broken)
    g = torch.Generator().manual_seed(14)
    w_in, w_out = torch.randn(200, 784, generator=g) * 0.05, torch.randn(10, 200, generator=g)
    want = prox_path_norm(w_in, w_out, 1e-3, method="sort")
    with pytest.warns(RuntimeWarning, match="no parallel backend.*runs on one thread"):
        got = prox_path_norm(w_in, w_out, 1e-3, method="kernel")
    assert kernel._chunks(200, 784) == 1
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)


@pytest.mark.usefixtures("two_torch_threads")
def test_kernel_on_several_threads_called_from_several_threads_at_once() -> None:
    # Each calling thread gets its own OpenMP team (and numba thread count): same bits.
    _parallel_kernel()
    g = torch.Generator().manual_seed(15)
    layers = [
        (torch.randn(200, 784, generator=g) * 0.05, torch.randn(10, 200, generator=g))
        for _ in range(4)
    ]
    want = [prox_path_norm(a, b, 1e-3, method="kernel") for a, b in layers]

    def work(i: int) -> None:
        for _ in range(25):
            a, b = layers[i][0].clone(), layers[i][1].clone()
            prox_path_norm_(a, b, 1e-3, method="kernel")
            assert torch.equal(a, want[i][0]) and torch.equal(b, want[i][1])

    errors = _at_once(work)
    assert not errors
