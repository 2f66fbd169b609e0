"""The main job's compacted network in Keras (``pathnorm_experiments.compaction.measure`` with
``pathnorm_tf.compact``): the units, parameters and outputs before and after, the MLP and the
conv network of ``test_compaction_main.py`` (torch) in Keras layout. A process of its own, as every file that
loads TensorFlow."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from pathnorm_experiments import compaction
from pathnorm_experiments.data import load_embedded
from pathnorm_experiments.settings import TrainConfig


def test_keras_measures_the_compacted_model() -> None:
    from pathnorm_experiments.tf_backend import build_model

    model = build_model(TrainConfig(hidden=(16,)))
    first, second = model.layers
    kernel_in, kernel_out = np.asarray(first.kernel).copy(), np.asarray(second.kernel).copy()
    kernel_out[[0, 1, 2]] = 0  # zero outgoing weights: removed
    kernel_in[:, [2, 3, 4, 5]] = 0  # zero incoming weights: folded (2: both)
    first.kernel.assign(kernel_in)
    second.kernel.assign(kernel_out)
    info = compaction.measure(model, load_embedded().x_test[:300], "tf", repeats=2)
    measured = ("ms_per_1000_before", "ms_per_1000_after", "speedup", "max_abs_output_diff")
    assert {k: v for k, v in info.items() if k not in measured} == {
        "pairs": ["dense_0 -> logits"],
        "hidden_before": 16,
        "hidden_after": 10,
        "hidden_alive": 10,
        "params_before": 784 * 16 + 16 + 16 * 10 + 10,
        "params_after": 784 * 10 + 10 + 10 * 10 + 10,
        "repeats": 2,
    }
    assert 0 <= info["max_abs_output_diff"] < 1e-5 and min(info[k] for k in measured[:3]) > 0
    assert np.array_equal(np.asarray(first.kernel), kernel_in)  # the input model is unchanged


def test_keras_measures_the_conv_network() -> None:
    from pathnorm_experiments.tf_backend import build_model

    model = build_model(TrainConfig(model="conv", hidden=(8,)))
    conv, dense = model.get_layer("conv"), model.get_layer("logits")
    kernel, rows = np.asarray(conv.kernel).copy(), np.asarray(dense.kernel).copy()
    kernel[..., 6:] = 0  # zero incoming: folded (a valid convolution, then a Flatten)
    rows[np.arange(len(rows)) % 8 < 2] = 0  # channels 0 and 1 (channels last): removed
    conv.kernel.assign(kernel)
    dense.kernel.assign(rows)
    info = compaction.measure(model, load_embedded().x_test[:300], "tf", repeats=2)
    assert info["pairs"] == ["conv -> logits"] and info["max_abs_output_diff"] < 1e-5
    units = [info[k] for k in ("hidden_before", "hidden_after", "hidden_alive")]
    conv_params = [c * 25 + c + c * 144 * 10 + 10 for c in (8, 4)]
    assert units == [8, 4, 4] and [info["params_before"], info["params_after"]] == conv_params
