"""l_inf PGD on a Keras classifier, the paper's attack and the CW-margin one, and the robust
error it measures. The torch twin is :mod:`~pathnorm_experiments.attacks_torch`."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

__all__ = ["pgd_attack", "robust_error"]


def pgd_attack(
    model: keras.Model,
    x: tf.Tensor,
    y: tf.Tensor,
    eps: float,
    *,
    steps: int = 40,
    step_size: float | None = None,
    random_start: bool = True,
    loss: str = "ce",
    seed: int = 0,
) -> tf.Tensor:
    """l_inf PGD (step ``eps / 20``, random start, clipped to [0, 1]) on ``loss``: ``"ce"``
    (cross-entropy, the paper's attack) or ``"margin"`` (CW margin ``max_{j != y} z_j - z_y``)."""
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if loss not in ("ce", "margin"):
        raise ValueError(f"loss must be 'ce' or 'margin', got {loss!r}")
    step = eps / 20 if step_size is None else step_size
    x = tf.convert_to_tensor(x)
    if not x.dtype.is_floating:
        x = tf.cast(x, tf.float32)
    y = tf.convert_to_tensor(y, tf.int32)
    lo, hi = tf.maximum(x - eps, 0.0), tf.minimum(x + eps, 1.0)
    if random_start:
        noise = tf.random.stateless_uniform(
            tf.shape(x), seed=[seed, 0], minval=-eps, maxval=eps, dtype=x.dtype
        )
        x_adv = tf.clip_by_value(x + noise, lo, hi)
    else:
        x_adv = x
    ce = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum", dtype=x.dtype.name
    )
    onehot = tf.one_hot(y, model.output_shape[-1]) > 0

    def objective(z: tf.Tensor) -> tf.Tensor:
        if loss == "ce":
            return ce(y, z)
        neg_inf = tf.constant(-np.inf, z.dtype)  # a bare -np.inf would be float32
        zy = tf.reduce_max(tf.where(onehot, z, neg_inf), 1)
        other = tf.reduce_max(tf.where(onehot, neg_inf, z), 1)
        return tf.reduce_sum(other - zy)

    @tf.function
    def one_step(xa: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            tape.watch(xa)
            obj = objective(model(xa, training=False))
        grad = tape.gradient(obj, xa)
        return tf.clip_by_value(xa + step * tf.sign(grad), lo, hi)

    for _ in range(steps):
        x_adv = one_step(x_adv)
    return x_adv


def robust_error(
    model: keras.Model,
    x: np.ndarray,
    y: np.ndarray,
    eps: float,
    *,
    steps: int = 40,
    seed: int = 0,
    losses: tuple[str, ...] = ("ce",),
) -> float:
    """Fraction misclassified at ``x`` or at the PGD point of any loss in ``losses``."""
    logits = model(x, training=False)
    wrong = np.argmax(logits, 1) != y
    if eps > 0:
        for i, loss in enumerate(losses):
            xa = pgd_attack(model, x, y, eps, steps=steps, seed=seed + i, loss=loss)
            wrong |= np.argmax(model(xa, training=False), 1) != y
    return float(wrong.mean())
