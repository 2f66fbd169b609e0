"""``lam`` and ``radius`` on both backends: the same values accepted, with the same results, and
the same exception, type and message, for every other (one rule: :mod:`shared_spec.scalars`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
# Lightning before TensorFlow: the other order aborts in torch's triton import
import pathnorm_lightning as pnl  # noqa: E402

tf = pytest.importorskip("tensorflow")
import pathnorm_tf as pntf  # noqa: E402

F32_TENTH = float(np.float32(0.1))
#: id -> (the value, made when the test runs; the float it stands for, or the exception type)
CANDIDATES: dict[str, tuple[Callable[[], Any], float | type[Exception]]] = {
    "python_float": (lambda: 0.1, 0.1),
    "python_int": (lambda: 1, 1.0),
    "zero": (lambda: 0, 0.0),
    "np_float32": (lambda: np.float32(0.1), F32_TENTH),
    "np_float64": (lambda: np.float64(0.1), 0.1),
    "np_int64": (lambda: np.int64(2), 2.0),
    "np_0d_array": (lambda: np.array(0.1), 0.1),
    "np_0d_int_array": (lambda: np.array(3), 3.0),
    "torch_0d": (lambda: torch.tensor(0.1), F32_TENTH),
    "torch_0d_requires_grad": (lambda: torch.tensor(0.1, requires_grad=True), F32_TENTH),
    "tf_0d": (lambda: tf.constant(0.1), F32_TENTH),
    "tf_0d_variable": (lambda: tf.Variable(0.1, dtype=tf.float64), 0.1),
    "np_1_element": (lambda: np.array([0.1]), ValueError),
    "np_1x1": (lambda: np.array([[0.1]]), ValueError),
    "np_2_elements": (lambda: np.array([0.1, 0.2]), ValueError),
    "torch_1_element": (lambda: torch.tensor([0.1]), ValueError),
    "tf_1_element": (lambda: tf.constant([0.1]), ValueError),
    "np_true": (lambda: np.True_, TypeError),
    "np_0d_bool_array": (lambda: np.array(False), TypeError),
    "python_true": (lambda: True, TypeError),
    "torch_bool": (lambda: torch.tensor(True), TypeError),
    "tf_bool": (lambda: tf.constant(True), TypeError),
    "none": (lambda: None, TypeError),
    "string": (lambda: "0.1", TypeError),
    "complex": (lambda: 1j, TypeError),
    "list": (lambda: [0.1], TypeError),
    "nan": (lambda: float("nan"), ValueError),
    "np_inf": (lambda: np.float32("inf"), ValueError),
    "negative": (lambda: -1, ValueError),
    "huge_int": (lambda: 10**400, ValueError),
}

_W = np.random.default_rng(0).standard_normal((3, 4))  # (n, m): torch's w_in, tf's kernel_in.T
_V = np.random.default_rng(1).standard_normal((2, 3))  # (p, n): torch's w_out


def _torch(fn: str, value: Any) -> np.ndarray:
    w, v = torch.tensor(_W), torch.tensor(_V)
    if fn == "prox_path_norm":
        return np.concatenate([t.numpy().ravel() for t in pnl.prox_path_norm(w, v, value)])
    return getattr(pnl, fn)(w, value).numpy()


def _keras(fn: str, value: Any) -> np.ndarray:
    if fn == "prox_path_norm":
        k_in, k_out = pntf.prox_path_norm(tf.constant(_W.T), tf.constant(_V.T), value)
        return np.concatenate([k_in.numpy().T.ravel(), k_out.numpy().T.ravel()])
    return getattr(pntf, fn)(tf.constant(_W), value).numpy()


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", the result) or (the exception's type name, its message)."""
    try:
        return "ok", call()
    except Exception as e:  # any type: the types are compared
        return type(e).__name__, str(e)


def _unprefixed(message: str) -> str:
    """A callback's message without its owner (``PathNormProx: lam ...`` -> ``lam ...``)."""
    return re.sub(r"^[A-Za-z]+: ", "", message)


@pytest.mark.parametrize("fn", ["prox_path_norm", "prox_l1", "project_rows_l1_ball"])
@pytest.mark.parametrize("case", CANDIDATES)
def test_functions_take_the_same_scalars_with_the_same_errors(fn: str, case: str) -> None:
    make, expected = CANDIDATES[case]
    name = "radius" if fn == "project_rows_l1_ball" else "lam"
    got_torch = _outcome(lambda: _torch(fn, make()))
    got_keras = _outcome(lambda: _keras(fn, make()))
    if isinstance(expected, float):
        assert got_torch[0] == "ok", got_torch
        assert got_keras[0] == "ok", got_keras
        # the value counts as the float it holds, on each backend exactly
        np.testing.assert_array_equal(got_torch[1], _torch(fn, expected))
        np.testing.assert_array_equal(got_keras[1], _keras(fn, expected))
        np.testing.assert_allclose(got_torch[1], got_keras[1], rtol=1e-12, atol=1e-12)
        return
    assert got_torch == got_keras  # the same type and message, word for word
    assert got_torch[0] == expected.__name__, got_torch
    assert got_torch[1].startswith(f"{name} must be a "), got_torch
    if case.startswith(("np_1", "np_2", "torch_1", "tf_1")):
        assert got_torch[1].startswith(f"{name} must be a scalar (a number, or a 0-d array")


@pytest.mark.parametrize("case", CANDIDATES)
def test_prox_callback_and_optimizer_take_the_same_scalars(case: str) -> None:
    """torch's ``PathNormProx(lam=...)`` and Keras's ``PathNormSGD(lam=...)``: the same values
    accepted (stored as the same float), the same exception types otherwise."""
    make, expected = CANDIDATES[case]
    got_torch = _outcome(lambda: pnl.PathNormProx(lam=make()).lam)
    got_keras = _outcome(lambda: pntf.PathNormSGD(0.1, lam=make()).lam)
    if isinstance(expected, float):
        assert got_torch == got_keras == ("ok", expected)
        assert type(got_torch[1]) is float and type(got_keras[1]) is float
    else:
        assert got_torch[0] == got_keras[0] == expected.__name__, (got_torch, got_keras)


@pytest.mark.parametrize(
    "case", [c for c, (_, expected) in CANDIDATES.items() if not isinstance(expected, float)]
)
def test_prox_callback_and_optimizer_give_the_same_messages(case: str) -> None:
    make, _ = CANDIDATES[case]
    got_torch = _outcome(lambda: pnl.PathNormProx(lam=make()))
    got_keras = _outcome(lambda: pntf.PathNormSGD(0.1, lam=make()))
    assert got_torch[1].startswith("PathNormProx: lam must be a ")
    if case == "none":  # None is the Keras keyword's default: an argument not given
        assert got_keras == (
            "TypeError",
            "PathNormSGD needs lam (a finite number >= 0), e.g. lam=1e-4",
        )
        return
    assert _unprefixed(got_torch[1]) == _unprefixed(got_keras[1])
