"""Keras quick start: proximal SGD on the 1-path-norm, with the metrics in the History.

Runs anywhere in 13-19 s on 2 CPU cores, most of it TensorFlow's import and XLA compilation
(synthetic data, no download):

    .venv/bin/python examples/keras_quickstart.py

It trains the paper's kind of network (Dense -> ELU -> Dense) four ways -- plain SGD,
``PathNormSGD`` (exact path-norm prox after every step), Adam wrapped in ``ProxOptimizer``, and
SGD with the layer-wise l_inf baseline (``ProxOptimizer(..., regularizer="linf")``) -- then
prints accuracy, sparsity and the Lipschitz bounds, saves the model and reloads it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tempfile
from pathlib import Path

import keras
import numpy as np

from pathnorm_tf import PathNormMetrics, PathNormSGD, ProxOptimizer


def make_data(n: int = 2000, dim: int = 64, classes: int = 10, seed: int = 0):
    """A linearly separable-ish problem where only the first 16 inputs matter."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype("float32")
    w = np.zeros((dim, classes), dtype="float32")
    w[:16] = rng.standard_normal((16, classes))
    y = np.argmax(x @ w + 0.1 * rng.standard_normal((n, classes)), axis=1)
    return x, y


def make_model(dim: int = 64, hidden: int = 100, classes: int = 10) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((dim,)),
            keras.layers.Dense(hidden, activation="elu"),
            keras.layers.Dense(classes),
        ]
    )


def train(name: str, make_optimizer, x, y) -> keras.Model:
    """Train a fresh model with ``make_optimizer(model)`` (the prox optimizers are shown it)."""
    model = make_model()
    model.compile(
        optimizer=make_optimizer(model),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        x, y, batch_size=100, epochs=5, verbose=0, callbacks=[PathNormMetrics()]
    ).history
    print(
        f"{name:>26}: accuracy {history['accuracy'][-1]:.3f}, "
        f"zero weights {100 * history['pathnorm/sparsity'][-1]:5.1f}%, "
        f"alive units {100 * history['pathnorm/alive_units'][-1]:5.1f}%, "
        f"path-norm bound {history['pathnorm/path_norm_bound'][-1]:8.2f}, "
        f"product bound {history['pathnorm/product_bound'][-1]:9.2f}"
    )
    return model


def main() -> None:
    x, y = make_data()
    train("SGD", lambda m: keras.optimizers.SGD(0.1), x, y)
    model = train(
        "PathNormSGD(lam=2e-3)", lambda m: PathNormSGD(learning_rate=0.1, lam=2e-3, model=m), x, y
    )
    train(
        "Adam + path-norm prox",
        lambda m: ProxOptimizer(keras.optimizers.Adam(1e-2), lam=2e-2, model=m),
        x,
        y,
    )
    train(
        "SGD + layer-wise l_inf",
        lambda m: ProxOptimizer(keras.optimizers.SGD(0.1), regularizer="linf", radius=2.0, model=m),
        x,
        y,
    )

    # The optimizer (and its lam, pairs, momentum slots) is saved with the model.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.keras"
        model.save(path)
        restored = keras.models.load_model(path)
    restored.optimizer.verify_pairs(restored)  # show the reloaded optimizer its model
    assert isinstance(restored.optimizer, PathNormSGD)
    print(
        f"reloaded: {type(restored.optimizer).__name__}(lam={restored.optimizer.lam}), "
        f"pairs {restored.optimizer.regularized_pairs}"
    )


if __name__ == "__main__":
    main()
