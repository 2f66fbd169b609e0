"""Fixtures shared by several test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


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
