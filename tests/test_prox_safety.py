"""The torch prox where careless code gives a silent wrong answer: autograd after an in-place
prox, extreme magnitudes, empty layers, aliased weights, method checks that must not depend on
lam, and exact ties (one documented rule in every method)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pathnorm_lightning import (
    PathNormBound,
    ProductBound,
    product_bound,
    project_rows_l1_ball,
    prox_path_norm,
    prox_path_norm_,
)
from shared_spec import reference

METHODS = ["kernel", "sort"]


# --- autograd sees the in-place prox -----------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("shape", [(8, 5, 3), (3, 5, 8)], ids=["p<m", "p>m"])
def test_in_place_prox_moves_the_version_counter(
    method: str, dtype: torch.dtype, shape: tuple[int, int, int]
) -> None:
    m, n, p = shape
    g = torch.Generator().manual_seed(0)
    w_in = torch.randn(n, m, generator=g).to(dtype).requires_grad_()
    w_out = torch.randn(p, n, generator=g).to(dtype).requires_grad_()
    loss = (w_in * w_in).sum() + (w_out * w_out).sum()  # saves both weights
    versions = (w_in._version, w_out._version)
    prox_path_norm_(w_in, w_out, 0.05, method=method)  # type: ignore[arg-type]
    assert w_in._version > versions[0] and w_out._version > versions[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# --- exact at every finite magnitude -----------------------------------------------------------


def _units(seed: int, n: int, p: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, p)) * (rng.random((n, p)) < 0.8)
    y = rng.normal(size=(n, m)) * (rng.random((n, m)) < 0.8)
    y[0] *= 1e-3  # a unit whose sides differ in scale
    return x, y


def _unit_objectives(v: np.ndarray, w: np.ndarray, x: np.ndarray, y: np.ndarray, lam: float):
    return np.array([reference.objective(*t, lam) for t in zip(v, w, x, y, strict=True)])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(12, 3, 7), (12, 7, 3), (5, 20, 40)], ids=str)
def test_exact_at_every_float64_magnitude(method: str, shape: tuple[int, int, int]) -> None:
    # prox_lam(s x, s y) = s prox_lam(x, y): the result at scale s, scaled back by the power
    # of two nearest to s (exact), attains the reference's minimum of the scaled-back layer.
    n, p, m = shape
    x0, y0 = _units(sum(shape), n, p, m)
    for scale in [1e-300, 2.0**-700, 1e-160, 3e-20, 1.0, 7e19, 1e154, 2.0**700, 1e300]:
        back = 2.0 ** -round(np.log2(scale))
        x, y = x0 * scale, y0 * scale  # rounded once: the layer the prox is given
        xn, yn = x * back, y * back
        for lam in (1e-3, 0.05, 0.4):
            new_in, new_out = prox_path_norm(
                torch.tensor(y),
                torch.tensor(x.T),
                lam,
                method=method,  # type: ignore[arg-type]
            )
            assert torch.isfinite(new_in).all() and torch.isfinite(new_out).all()
            v, w = new_out.numpy().T * back, new_in.numpy() * back
            h = _unit_objectives(v, w, xn, yn, lam)
            h_ref = np.array(
                [reference.prox_unit(a, b, lam)[2] for a, b in zip(xn, yn, strict=True)]
            )
            np.testing.assert_allclose(h, h_ref, rtol=1e-9, atol=1e-300, err_msg=f"{scale} {lam}")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("exponent", [-149, -140, -130, -120, -60, 0, 60, 100, 120, 126])
def test_exact_over_the_float32_range_subnormals_included(method: str, exponent: int) -> None:
    # Layers whose largest entries are near 2^exponent in float32 (from subnormal to near the
    # largest float32): the result is the float32 rounding of the exact prox of those weights.
    x0, y0 = _units(exponent + 200, 10, 3, 9)
    top = np.abs(np.concatenate([x0, y0], 1)).max(1, keepdims=True)
    s = 2.0**exponent
    x32 = (x0 / top * s).astype(np.float32)
    y32 = (y0 / top * s).astype(np.float32)
    back = 2.0**-exponent
    xn, yn = x32.astype(np.float64) * back, y32.astype(np.float64) * back  # exact
    for lam in (1e-3, 0.05, 0.4):
        new_in, new_out = prox_path_norm(
            torch.from_numpy(y32),
            torch.from_numpy(x32.T.copy()),
            lam,
            method=method,  # type: ignore[arg-type]
        )
        v_ref, w_ref = reference.prox_path_norm(xn, yn, lam)
        ulp = 2.0 ** max(-149, exponent - 23) * back  # float32 spacing at the top, scaled back
        tol = 4 * ulp + 1e-5
        np.testing.assert_allclose(new_out.double().numpy().T * back, v_ref, rtol=0, atol=tol)
        np.testing.assert_allclose(new_in.double().numpy() * back, w_ref, rtol=0, atol=tol)


# --- empty layers ------------------------------------------------------------------------------


def test_bounds_and_projection_of_empty_layers() -> None:
    w_in, w_out = torch.ones(0, 4), torch.ones(3, 0)  # no hidden units
    assert float(product_bound(w_in, w_out)) == 0.0
    for metric in (ProductBound(), PathNormBound()):
        metric.update([w_in, w_out])
        assert float(metric.compute()) == 0.0
    for shape in [(3, 0), (0, 3)]:
        w = torch.ones(shape)
        assert project_rows_l1_ball(w, 1.0).shape == shape
    new_in, new_out = prox_path_norm(w_in, w_out, 0.1)
    assert new_in.shape == (0, 4) and new_out.shape == (3, 0)


# --- aliased and expanded weights --------------------------------------------------------------


def test_aliased_weights_are_refused_before_anything_is_written() -> None:
    w = torch.randn(4, 4)
    kept = w.clone()
    with pytest.raises(ValueError, match=r"w_in and w_out share memory"):
        prox_path_norm_(w, w, 0.1)
    base = torch.randn(10, 10)
    kept_base = base.clone()
    with pytest.raises(ValueError, match=r"share memory"):
        prox_path_norm_(base[:5, :], base[4:7, :5], 0.1)  # row 4 is in both
    assert torch.equal(w, kept) and torch.equal(base, kept_base)
    # Separate parts of one storage are fine, and so is the out-of-place prox of aliases.
    want = prox_path_norm(base[:5, :].clone(), base[5:8, :5].clone(), 0.1)
    got = prox_path_norm_(base[:5, :], base[5:8, :5], 0.1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    a, b = prox_path_norm(w, w, 0.1)
    want_a, want_b = prox_path_norm(w.clone(), w.clone(), 0.1)
    assert torch.equal(a, want_a) and torch.equal(b, want_b)


@pytest.mark.parametrize("method", METHODS)
def test_expanded_weights_are_refused_in_place(method: str) -> None:
    row = torch.randn(1, 6)
    w_in, w_out = row.expand(4, 6), torch.randn(3, 4)
    kept_row, kept_out = row.clone(), w_out.clone()
    with pytest.raises(ValueError, match=r"w_in is an expanded tensor \(stride 0"):
        prox_path_norm_(w_in, w_out, 0.1, method=method)  # type: ignore[arg-type]
    assert torch.equal(row, kept_row) and torch.equal(w_out, kept_out)
    new_in, _ = prox_path_norm(w_in, w_out, 0.1, method=method)  # type: ignore[arg-type]
    assert new_in.shape == (4, 6)


@pytest.mark.parametrize("method", METHODS)
def test_views_whose_entries_overlap_are_refused_in_place(method: str) -> None:
    # unfold: 5 rows of 4 over 12 floats (strides (2, 1)); before, the prox wrote through the
    # overlaps and left a point 0.09 above the minimum of the objective.
    base = torch.randn(12)
    w_in, w_out = base.unfold(0, 4, 2), torch.randn(3, 5)
    kept = base.clone()
    with pytest.raises(ValueError, match="w_in is a view whose entries overlap in memory"):
        prox_path_norm_(w_in, w_out, 0.1, method=method)  # type: ignore[arg-type]
    assert torch.equal(base, kept)
    strided = torch.randn(6, 8)[::2, 1::3]  # gaps, no overlap: still written in place
    prox_path_norm_(strided, torch.randn(2, 3), 0.1, method=method)  # type: ignore[arg-type]


# --- method checks do not depend on lam --------------------------------------------------------


@pytest.mark.parametrize("lam", [0.0, 0.1])
def test_kernel_on_a_non_cpu_tensor_is_refused_whatever_lam(lam: float) -> None:
    w_in, w_out = torch.ones(3, 4, device="meta"), torch.ones(2, 3, device="meta")
    with pytest.raises(ValueError, match=r'method="kernel" runs on CPU tensors; these are on meta'):
        prox_path_norm(w_in, w_out, lam, method="kernel", check_finite=False)


# --- ties: (x, 0), then (0, y), then the support pairs by increasing k; first minimum wins --------

TIES = [
    ([[0.5, -0.25]], [[-0.25, 0.5, 0.0]], 1e6),
    ([[3.0, 4.0]], [[0.0, -5.0, 0.0, 0.0]], 10.0),  # ||x||^2 = ||y||^2 = 25, p < m
    ([[1.0, 2.0, -2.0, 0.0, 0.0]], [[-3.0]], 50.0),  # ||x||^2 = ||y||^2 = 9, p > m
    ([[2.0, 0.0]], [[0.0, 2.0]], 1.5),  # p = m
    ([[0.5, -0.25], [3.0, 4.0]], [[-0.25, 0.5, 0.0], [0.0, 0.0, 5.0]], 1e300),
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", range(len(TIES)))
def test_exact_ties_follow_the_reference_order(method: str, dtype: torch.dtype, case: int) -> None:
    x, y, lam = (np.array(t, dtype=np.float64) if i < 2 else t for i, t in enumerate(TIES[case]))
    v_ref, w_ref = reference.prox_path_norm(x, y, lam)  # type: ignore[arg-type]
    assert np.array_equal(v_ref, x) and not w_ref.any()  # the reference keeps x
    new_in, new_out = prox_path_norm(
        torch.tensor(y, dtype=dtype),
        torch.tensor(x.T, dtype=dtype),
        lam,
        method=method,  # type: ignore[arg-type]
    )
    assert np.array_equal(new_out.double().numpy().T, v_ref)
    assert np.array_equal(new_in.double().numpy(), w_ref)
