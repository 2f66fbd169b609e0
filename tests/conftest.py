"""Fixtures shared by several test modules."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

#: Test files that never load torch: a process that runs only these (as .ci/pytest_files.py runs
#: each TensorFlow file) skips torch and Triton, about 2 s and 0.25 GiB of a process.
TORCH_FREE = frozenset(
    {
        "test_spec_tf.py",
        "test_tf_band_fast.py",
        "test_tf_compact.py",
        "test_tf_edge_cases.py",
        "test_tf_functional.py",
        "test_tf_optimizers.py",
        "test_tf_private_api.py",
    }
)


def _torch_free(config: pytest.Config) -> bool:
    """Whether every test file this process runs is in TORCH_FREE."""
    names = {Path(str(arg).split("::")[0]).name for arg in config.args}
    return bool(names) and names <= TORCH_FREE


def pytest_configure(config: pytest.Config) -> None:
    # (Before collection: no test module is imported yet.)
    if _torch_free(config) or importlib.util.find_spec("triton") is None:
        return
    # Without a GPU, the Triton prox runs under Triton's interpreter, which must be chosen
    # before triton is first imported (torch's compiler, which Lightning loads, imports it).
    # Importing triton before TensorFlow matters too: triton's LLVM loaded after TensorFlow's
    # aborts the process, and any test module may load TensorFlow first.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton  # noqa: F401


def pytest_collection_finish(session: pytest.Session) -> None:
    if _torch_free(session.config) and "torch" in sys.modules:
        raise pytest.UsageError(
            "a test file in TORCH_FREE (tests/conftest.py) imports torch: take it out of the set"
        )


@pytest.fixture
def float64_keras() -> Iterator[None]:
    """Keras in float64 for one test (imported lazily: torch-only runs never load TensorFlow)."""
    import keras

    # The global dtype policy is fixed from floatx the first time any layer is built (possibly
    # by an earlier test module), so set both.
    old, old_policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_floatx(old)
    keras.config.set_dtype_policy(old_policy)


@pytest.fixture
def sort_prox(monkeypatch: pytest.MonkeyPatch) -> None:
    """PathNormSGD and ProxOptimizer take their 1-path-norm prox by method="sort" in one test.

    For the tests of *what* the optimizers prox (pairs, names, frozen and recurrent layers,
    saving, metrics), not of the prox's values: "sort" and "band" (the default) are the same
    exact prox (test_tf_band_fast, test_spec_tf, test_tf_edge_cases), called the same way, and
    the band's program is several times larger: about 1.5 s of tracing per pair and trace in a
    graph (the sort's 0.2 s), 4 s per pair under XLA (the sort's 1 s). The tests of the step's
    values (test_tf_optimizers: test_one_fit_step_is_prox_of_the_sgd_step and others) keep the
    default method in every mode."""
    from pathnorm_tf import optimizers

    prox = functools.partial(optimizers._prox_kernels, method="sort")
    monkeypatch.setattr(optimizers, "_prox_kernels", prox)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard",
        default=None,
        help="K/N: run only the K-th (0-based) of N contiguous slices of the collected tests "
        "(.ci/pytest_files.py splits a file whose process would hold too much memory)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    spec = config.getoption("--shard")
    if spec is None:
        return
    k, _, n = str(spec).partition("/")
    if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise pytest.UsageError(f"--shard must be K/N with 0 <= K < N, got {spec!r}")
    lo, hi = (len(items) * int(k)) // int(n), (len(items) * (int(k) + 1)) // int(n)
    config.hook.pytest_deselected(items=items[:lo] + items[hi:])
    items[:] = items[lo:hi]
