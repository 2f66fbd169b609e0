"""Building one test vector (see :mod:`shared_spec.generate`, which lists them all): a case's
expected values from :mod:`shared_spec.reference`, its tolerances, and the checks that it has
the property it was written for (a unique minimiser, inputs representable in its dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shared_spec import layouts
from shared_spec import reference as ref
from shared_spec._inputs import f32, uniform
from shared_spec.reference import F64

#: Tolerances a backend compares with, by the dtype it runs the case in.
TOLERANCE: dict[str, dict[str, float]] = {
    "float64": {"rtol": 1e-9, "atol": 1e-12, "objective_rtol": 1e-9, "objective_atol": 1e-12},
    "float32": {"rtol": 1e-5, "atol": 1e-6, "objective_rtol": 1e-5, "objective_atol": 1e-6},
}
#: Relative objective margin within which a rival candidate could be returned by an exact
#: implementation that rounds in that dtype (see :func:`reference.minimiser_margin`).
REL_MARGIN = {"float64": 1e-12, "float32": 1e-6}


class GenerationError(RuntimeError):
    """A generated case does not have the property the generator meant it to have."""


def _clean(a: F64) -> list[Any]:
    """``a`` as nested lists, -0.0 written as 0.0 (no meaning in a weight, noise in a file)."""
    return (np.asarray(a, dtype=np.float64) + 0.0).tolist()


def first_unique(
    seed: int, n: int, p: int, m: int, lam: float, dtype: str, tries: int = 50
) -> tuple[F64, F64]:
    """A float32-representable random layer pair whose prox at ``lam`` is clearly unique.

    Random float32 layers often have a unit where two candidates are within float32 rounding
    of each other; such a layer only tests the objective. Seeds ``seed, seed + 1000, ...`` are
    tried in order, so the choice is deterministic.
    """
    for t in range(tries):
        X = f32(uniform(seed + 1000 * t, (n, p)))
        Y = f32(uniform(seed + 1000 * t + 1, (n, m)))
        if ref.minimiser_margin(X, Y, lam, REL_MARGIN[dtype])[1] == 0.0:
            return X, Y
    raise GenerationError(f"no seed from {seed} gives a unique minimiser")


def _tolerance(dtype: str, overrides: dict[str, float] | None) -> dict[str, float]:
    tol = dict(TOLERANCE[dtype])
    tol.update(overrides or {})
    return tol


def _check_dtype_inputs(name: str, dtype: str, arrays: Sequence[F64], scalar: float) -> None:
    if dtype != "float32":
        return
    for a in (*arrays, np.array([scalar])):
        if not np.array_equal(f32(a), a):
            raise GenerationError(f"{name}: float32 case with inputs not representable in float32")


def prox_case(
    name: str,
    description: str,
    X: F64,
    Y: F64,
    lam: float,
    *,
    dtype: str = "float64",
    unique: bool | None = True,
    tolerance: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A ``path_norm_prox`` case; ``unique`` is what the case is meant to be (None: either)."""
    X, Y = np.asarray(X, dtype=np.float64), np.asarray(Y, dtype=np.float64)
    _check_dtype_inputs(name, dtype, (X, Y), lam)
    tol = _tolerance(dtype, tolerance)
    V, W = ref.prox_path_norm(X, Y, lam)
    _, spread = ref.minimiser_margin(X, Y, lam, REL_MARGIN[dtype])
    is_unique = spread <= tol["atol"]
    if unique is not None and unique != is_unique:
        raise GenerationError(
            f"{name}: meant to be {'unique' if unique else 'non-unique'}, "
            f"but rival minimisers lie {spread:.3g} apart"
        )
    if not is_unique:
        # per unit, a point passes when its objective is within this margin of the minimum
        tol["rival_rtol"] = REL_MARGIN[dtype]
    return {
        "name": name,
        "kind": "path_norm_prox",
        "description": description,
        "dtype": dtype,
        "unique": bool(is_unique),
        "tolerance": tol,
        "inputs": {"X": _clean(X), "Y": _clean(Y), "lam": float(lam)},
        "expected": {
            "V": _clean(V),
            "W": _clean(W),
            "objective": ref.path_norm_objective(V, W, X, Y, lam),
        },
    }


def _elementwise_case(
    kind: str,
    key: str,
    op: Callable[[F64, float], F64],
    name: str,
    description: str,
    w: F64,
    value: float,
    dtype: str,
) -> dict[str, Any]:
    w = np.asarray(w, dtype=np.float64)
    _check_dtype_inputs(name, dtype, (w,), value)
    return {
        "name": name,
        "kind": kind,
        "description": description,
        "dtype": dtype,
        "unique": True,
        "tolerance": _tolerance(dtype, None),
        "inputs": {"w": _clean(w), key: float(value)},
        "expected": {"w": _clean(op(w, value))},
    }


def l1_case(name: str, description: str, w: F64, lam: float, dtype: str = "float64") -> dict:
    """An ``l1_prox`` (soft-thresholding) case."""
    return _elementwise_case("l1_prox", "lam", ref.prox_l1, name, description, w, lam, dtype)


def ball_case(name: str, description: str, w: F64, radius: float, dtype: str = "float64") -> dict:
    """An ``l1_ball_rows`` (row-wise projection onto the l1 ball) case."""
    return _elementwise_case(
        "l1_ball_rows", "radius", ref.project_rows_l1_ball, name, description, w, radius, dtype
    )


def conv_case(
    name: str,
    description: str,
    network: str,
    first: F64,
    second: F64,
    lam: float,
) -> dict[str, Any]:
    """A ``path_norm_prox`` case of a convolutional pair: the units ``(X, Y)`` of the torch
    weights ``first`` and ``second`` (see :mod:`shared_spec.layouts`), and under
    ``layers`` the pair in torch's and Keras's own layouts, inputs and expected values."""
    X, Y = layouts.units(network, first, second)
    case = prox_case(name, description, X, Y, lam)
    V, W = np.array(case["expected"]["V"]), np.array(case["expected"]["W"])
    new_first, new_second = layouts.weights(network, V, W, first.shape, second.shape)

    def both(a: F64, b: F64) -> dict[str, Any]:
        k_a, k_b = layouts.keras_kernels(network, a, b)
        return {
            "torch": {"first": _clean(a), "second": _clean(b)},
            "keras": {"first": _clean(k_a), "second": _clean(k_b)},
        }

    case["inputs"]["layers"] = {"network": network, **both(first, second)}
    case["expected"]["layers"] = both(new_first, new_second)
    return case
