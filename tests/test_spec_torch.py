"""Torch conformance: every shared spec vector, in the vector's dtype, with its tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pathnorm_lightning import (
    project_rows_l1_ball,
    project_rows_l1_ball_,
    prox_l1,
    prox_path_norm,
    prox_path_norm_,
)
from shared_spec import Case, iter_cases

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
CASES = list(iter_cases())


def _tensor(a: np.ndarray | None, case: Case, device: str) -> torch.Tensor:
    assert a is not None
    return torch.tensor(a, dtype=getattr(torch, case.dtype), device=device)


def _scalar(value: float | None) -> float:
    assert value is not None
    return value


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_torch_passes_the_vector(case: Case, device: str) -> None:
    dtype = getattr(torch, case.dtype)
    if case.kind == "path_norm_prox":
        w_in_np, w_out_np = case.torch_layout()  # Y, X.T
        w_in, w_out = _tensor(w_in_np, case, device), _tensor(w_out_np, case, device)
        new_in, new_out = prox_path_norm(w_in, w_out, _scalar(case.lam))
        assert new_in.dtype == new_out.dtype == dtype
        assert new_in.device == w_in.device
        assert new_in.shape == w_in.shape and new_out.shape == w_out.shape
        # Back to neutral layout: V = new w_out.T, W = new w_in.
        case.check(_numpy(new_out).T, _numpy(new_in))
        # The in-place form on the same vector gives the identical result.
        prox_path_norm_(w_in, w_out, _scalar(case.lam))
        assert torch.equal(w_in, new_in) and torch.equal(w_out, new_out)
    elif case.kind == "l1_prox":
        out = prox_l1(_tensor(case.w, case, device), _scalar(case.lam))
        assert out.dtype == dtype
        case.check(_numpy(out))
    else:
        w = _tensor(case.w, case, device)
        out = project_rows_l1_ball(w, _scalar(case.radius))
        assert out.dtype == dtype
        case.check(_numpy(out))
        project_rows_l1_ball_(w, _scalar(case.radius))
        assert torch.equal(w, out)


def test_every_kind_and_dtype_is_exercised() -> None:
    seen = {(c.kind, c.dtype) for c in CASES}
    kinds = ("path_norm_prox", "l1_prox", "l1_ball_rows")
    assert seen == {(k, d) for k in kinds for d in ("float32", "float64")}
    assert sum(c.unique for c in CASES if c.kind == "path_norm_prox") >= 30


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.kind == "path_norm_prox" and c.dtype == "float32" and c.unique],
    ids=lambda c: c.id,
)
def test_float32_tolerance_has_headroom(case: Case) -> None:
    """The float32 tolerance is not tuned to the edge: torch's error uses at most a third of it."""
    w_in_np, w_out_np = case.torch_layout()
    new_in, new_out = prox_path_norm(
        torch.tensor(w_in_np, dtype=torch.float32),
        torch.tensor(w_out_np, dtype=torch.float32),
        _scalar(case.lam),
    )
    for got, want in ((_numpy(new_out).T, case.V), (_numpy(new_in), case.W)):
        assert want is not None
        used = np.abs(got - want) / (case.atol + case.rtol * np.abs(want))
        assert used.max() <= 1 / 3, used.max()
