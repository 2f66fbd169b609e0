"""Train, then ``compact``: the dead hidden units go, the function stays (Keras).

Trains the paper's 784-200-10 ELU network with ``PathNormSGD`` (proximal SGD on the 1-path-norm)
on the MNIST subset embedded in the package, then compacts it: every hidden unit the prox
killed is removed, in a new model built of smaller Dense layers. Prints the report, checks that
the compacted model gives the same outputs on the test images, and saves and reloads it.

    .venv/bin/python examples/compact_keras.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tempfile
from pathlib import Path

import keras
import numpy as np

import pathnorm_tf
from pathnorm_experiments.data import load_embedded


def main(epochs: int = 5, lam: float = 2e-3) -> dict[str, float]:
    keras.utils.set_random_seed(0)
    d = load_embedded()
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(200, activation="elu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=pathnorm_tf.PathNormSGD(learning_rate=0.1, lam=lam, model=model),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(d.x_train, d.y_train, batch_size=100, epochs=epochs, verbose=0)

    # --- the recipe: train (above), then compact --------------------------------------------
    small, report = pathnorm_tf.compact(model)
    print(report)
    # -----------------------------------------------------------------------------------------

    before, after = np.asarray(model(d.x_test)), np.asarray(small(d.x_test))
    diff = float(np.max(np.abs(after - before)))
    if diff > 1e-5 or not np.array_equal(before.argmax(1), after.argmax(1)):
        raise AssertionError(f"the compacted model differs from the trained one by {diff}")
    with tempfile.TemporaryDirectory() as tmp:
        small.save(Path(tmp) / "compact.keras")
        reloaded = keras.models.load_model(Path(tmp) / "compact.keras")
    assert np.array_equal(np.asarray(reloaded(d.x_test)), after)
    print(f"outputs within {diff:.0e} of the trained model's; the compacted one saves and reloads")
    return {
        "max_diff": diff,
        "test_accuracy": float(np.mean(after.argmax(1) == d.y_test)),
        "hidden_after": report.units_after,
    }


if __name__ == "__main__":
    main()
