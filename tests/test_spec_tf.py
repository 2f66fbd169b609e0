"""Every shared_spec vector passes in TensorFlow (Keras layout), with the vector's tolerance."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

from pathnorm_tf import project_rows_l1_ball, prox_l1, prox_path_norm
from shared_spec.loader import Case, iter_cases

CASES = list(iter_cases())


def test_every_kind_is_covered() -> None:
    assert {c.kind for c in CASES} == {"path_norm_prox", "l1_prox", "l1_ball_rows"}
    assert {c.dtype for c in CASES} == {"float32", "float64"}
    xla = [c for c, mode in PROX_RUNS if mode == "xla"]
    assert {c.dtype for c in xla} == {"float32", "float64"}


PROX_CASES = [c for c in CASES if c.kind == "path_norm_prox"]
# Every case eagerly with both methods; under XLA (one compilation per shape, ~1 s each) every fourth case, which
# covers both dtypes, single and multi output and the wide pairs.
PROX_RUNS = (
    [(c, "eager") for c in PROX_CASES]
    + [(c, "sort") for c in PROX_CASES]
    + [(c, "xla") for c in PROX_CASES[::4]]
)


@pytest.mark.parametrize(
    ("case", "mode"), PROX_RUNS, ids=lambda v: v if isinstance(v, str) else v.id
)
def test_path_norm_prox_vector(case: Case, mode: str) -> None:
    k_in, k_out = (tf.constant(a.astype(case.np_dtype)) for a in case.keras_layout())
    assert case.lam is not None
    if mode == "eager":  # method="auto": the band method
        got_in, got_out = prox_path_norm(k_in, k_out, case.lam)
    elif mode == "sort":
        got_in, got_out = prox_path_norm(k_in, k_out, case.lam, method="sort")
    else:
        fn = tf.function(lambda a, b: prox_path_norm(a, b, case.lam), jit_compile=True)
        got_in, got_out = fn(k_in, k_out)
    assert got_in.dtype == k_in.dtype and got_out.dtype == k_out.dtype
    # Back to the neutral layout: V = kernel_out, W = kernel_in.T.
    case.check(got_out.numpy().astype(np.float64), got_in.numpy().T.astype(np.float64))


@pytest.mark.parametrize("case", [c for c in CASES if c.kind == "l1_prox"], ids=lambda c: c.id)
def test_l1_prox_vector(case: Case) -> None:
    assert case.w is not None and case.lam is not None
    got = prox_l1(tf.constant(case.w.astype(case.np_dtype)), case.lam)
    case.check(got.numpy().astype(np.float64))


@pytest.mark.parametrize("case", [c for c in CASES if c.kind == "l1_ball_rows"], ids=lambda c: c.id)
def test_l1_ball_rows_vector(case: Case) -> None:
    assert case.w is not None and case.radius is not None
    got = project_rows_l1_ball(tf.constant(case.w.astype(case.np_dtype)), case.radius)
    case.check(got.numpy().astype(np.float64))
