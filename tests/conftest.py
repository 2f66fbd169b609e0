"""Fixtures shared by several test modules."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("triton") is not None:
    # Without a GPU, the Triton prox runs under Triton's interpreter, which must be chosen
    # before triton is first imported (torch's compiler, which Lightning loads, imports it).
    # Importing triton before TensorFlow matters too: triton's LLVM loaded after TensorFlow's
    # aborts the process, and any test module may load TensorFlow first.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton  # noqa: F401


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
