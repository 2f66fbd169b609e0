"""Torch conformance: every shared spec vector, in the vector's dtype, with its tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pathnorm_lightning import (
    layers,
    project_rows_l1_ball,
    project_rows_l1_ball_,
    prox_l1,
    prox_path_norm,
    prox_path_norm_,
)
from pathnorm_lightning._common import optional_module
from pathnorm_lightning.functional import METHODS
from shared_spec import Case, iter_cases
from shared_spec.layouts import NETWORKS

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


# --- convolutional pairs through the layer seam ----------------------------------------------

CONV_CASES = [c for c in CASES if c.layers is not None]


def _conv_modules(case: Case, device: str) -> tuple[nn.Module, nn.Module]:
    """Bias-free torch modules holding the case's torch weights (float64)."""
    assert case.layers is not None
    dims, flat = NETWORKS[case.layers.network]
    first_w, second_w = (torch.tensor(a, device=device) for a in case.layers.torch)
    conv = nn.Conv1d if dims == 1 else nn.Conv2d
    first = conv(first_w.shape[1], first_w.shape[0], tuple(first_w.shape[2:]), bias=False)
    if flat:
        second: nn.Module = nn.Linear(second_w.shape[1], second_w.shape[0], bias=False)
    else:
        second = conv(second_w.shape[1], second_w.shape[0], tuple(second_w.shape[2:]), bias=False)
    first, second = first.to(device, torch.float64), second.to(device, torch.float64)
    with torch.no_grad():
        first.weight.copy_(first_w)
        second.weight.copy_(second_w)
    return first, second


def _seam_methods(device: str) -> list[str]:
    triton = optional_module("pathnorm_lightning._triton")
    runs = triton is not None and triton.available()
    return [m for m in METHODS if (m != "kernel" or device == "cpu") and (m != "triton" or runs)]


def test_conv_vectors_cover_every_network() -> None:
    assert {c.layers.network for c in CONV_CASES if c.layers} == set(NETWORKS)
    assert all(c.unique and c.dtype == "float64" for c in CONV_CASES)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: c.id)
def test_torch_seam_passes_the_conv_vector(case: Case, device: str) -> None:
    """The prox through the seam on the native torch weights gives the vector's native
    result, with every method: the seam's views assign each weight to the vector's unit."""
    assert case.layers is not None
    for method in _seam_methods(device):
        first, second = _conv_modules(case, device)
        assert layers.flatten_positions(first, second) == case.layers.flatten_positions
        layers.prox_pair_(first, second, _scalar(case.lam), method=method)  # type: ignore[arg-type]
        case.check_layers("torch", _numpy(first.weight), _numpy(second.weight))
