"""TensorFlow / Keras side of the main job: ``tf.data`` pipeline, the paper's MLP or its conv
twin, proximal SGD with the library's optimizers (``pathnorm_tf.PathNormSGD`` /
``ProxOptimizer``) and the evaluation (attacks: :mod:`~pathnorm_experiments.attacks_tf`).

The torch engine's configuration, step semantics and evaluation
(:mod:`~pathnorm_experiments.engine`), from the same initial weights and minibatch order
(:mod:`~pathnorm_experiments.draws`): both backends train the same network up to rounding. The
conv network is ``Reshape(28, 28, 1) -> Conv2D(C, k, stride, "valid") -> act -> Flatten ->
Dense(10)``, channels last, its kernels the torch draw in Keras layout (:func:`keras_kernel`).
Certificates and bounds take the kernels in torch layout.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import itertools
import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pathnorm_experiments.attacks_tf import robust_error
from pathnorm_experiments.certify import (
    ConvLayer,
    Layer,
    effective_nonzero_fraction,
    nonzero_fraction,
)
from pathnorm_experiments.data import Dataset
from pathnorm_experiments.draws import initial_layer_weights, shuffle_orders
from pathnorm_experiments.evaluation import build_result
from pathnorm_experiments.regularizers import REGULARIZERS, regularizer
from pathnorm_experiments.results import History
from pathnorm_experiments.settings import IMAGE_SHAPE, TrainConfig, float_key
from pathnorm_tf import PathNormSGD, ProxOptimizer
from pathnorm_tf.layers import ENTRIES

__all__ = [
    "RegularizedMLP",
    "build_model",
    "keras_kernel",
    "make_optimizer",
    "make_tf_dataset",
    "torch_weight",
    "torch_weights",
    "train_keras",
]


def make_tf_dataset(
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    orders: np.ndarray | None = None,
) -> tf.data.Dataset:
    """Batched, prefetched (images (N, 784), int32 labels) pipeline over the arrays.

    ``shuffle`` reshuffles every epoch with TF's shuffle seeded by ``seed``. ``orders`` (epochs,
    N) replaces it with the torch side's order
    (:func:`~pathnorm_experiments.draws.shuffle_orders`): every epoch batched on its own, the
    dataset ending after the last one.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if orders is not None:
        xs, ys = tf.constant(x), tf.constant(y.astype(np.int32))
        idx = tf.data.Dataset.from_tensor_slices(orders.astype(np.int64))
        batches = idx.flat_map(lambda o: tf.data.Dataset.from_tensor_slices(o).batch(batch_size))
        pairs = batches.map(lambda i: (tf.gather(xs, i), tf.gather(ys, i)))
        return pairs.prefetch(tf.data.AUTOTUNE)
    ds = tf.data.Dataset.from_tensor_slices((x, y.astype(np.int32)))
    if shuffle:
        ds = ds.shuffle(x.shape[0], seed=seed, reshuffle_each_iteration=True)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def _weight_layers(model: keras.Model) -> list[Any]:
    """The layers of the layer seam (``Dense``, ``Conv1D``, ``Conv2D``), in order."""
    return [layer for layer in model.layers if isinstance(layer, tuple(ENTRIES))]


def _kernels(model: keras.Model) -> list[Any]:
    return [layer.kernel for layer in _weight_layers(model)]


def _l1(kernels: list[Any]) -> tf.Tensor:
    return tf.add_n([tf.reduce_sum(tf.abs(k)) for k in kernels])


def _path(kernels: list[Any]) -> tf.Tensor:
    """Sum over layer pairs and hidden units (Dense units or channels) of ``||x_i||_1 ||y_i||_1``:
    ``y_i`` from ``k_in``'s output ``i``, ``x_i`` from rows ``[..., i, :]`` of ``k_out``'s
    ``(-1, n, out)`` reshape (a convolution's ``(*k, C, out)``; a Dense kernel after a
    channels-last Flatten: row ``q * C + c``)."""
    terms = []
    for k_in, k_out in zip(kernels[::2], kernels[1::2], strict=True):
        n = int(k_in.shape[-1])
        y = tf.reduce_sum(tf.reshape(tf.abs(k_in), (-1, n)), 0)
        x = tf.reduce_sum(tf.reshape(tf.abs(k_out), (-1, n, int(k_out.shape[-1]))), (0, 2))
        terms.append(tf.reduce_sum(x * y))
    return tf.add_n(terms)


def _l1_optimizer(cfg: TrainConfig) -> keras.optimizers.Optimizer:
    return ProxOptimizer(keras.optimizers.SGD(cfg.lr), lam=cfg.lam, regularizer="l1")


def _path_optimizer(cfg: TrainConfig) -> keras.optimizers.Optimizer:
    return PathNormSGD(learning_rate=cfg.lr, lam=cfg.lam)


def _linf_optimizer(cfg: TrainConfig) -> keras.optimizers.Optimizer:
    return ProxOptimizer(keras.optimizers.SGD(cfg.lr), regularizer="linf", radius=1.0 / cfg.lam)


#: each regularizer's Keras parts: the differentiable ``g`` on the kernels (None: ``g = 0``) and
#: the library optimizer of its proximal step (None: plain SGD)
KERAS: dict[str, tuple[Callable[[list[Any]], tf.Tensor] | None, Callable[..., Any] | None]] = {
    "none": (None, None),
    "l1": (_l1, _l1_optimizer),
    "path": (_path, _path_optimizer),
    "linf": (None, _linf_optimizer),
}
if tuple(KERAS) != REGULARIZERS:  # a new row of the table needs its Keras parts here
    raise ImportError(f"tf_backend.KERAS covers {tuple(KERAS)}, the table has {REGULARIZERS}")


def penalty(kernels: list[Any], name: str) -> tf.Tensor:
    """Differentiable ``g`` on Keras kernels (0 for none and for a constraint)."""
    g = KERAS[regularizer(name).name][0]
    return tf.zeros((), kernels[0].dtype) if g is None else g(kernels)


def keras_kernel(weight: np.ndarray, channels_before: int | None = None) -> np.ndarray:
    """A torch-layout weight, (out, in) or (C, C_in, *k), as the Keras kernel, (in, out) or
    (*k, C_in, C). ``channels_before``: for a Linear layer reading a convolution of that many
    channels through a Flatten, the rows are permuted (torch reads channel by channel, column
    ``c * P + q``; Keras position by position, row ``q * C + c``)."""
    if weight.ndim > 2:
        return np.moveaxis(weight, (0, 1), (-1, -2))
    if channels_before is None:
        return weight.T
    p, width = weight.shape
    return (
        weight.reshape(p, channels_before, width // channels_before)
        .transpose(2, 1, 0)
        .reshape(width, p)
    )


def torch_weight(kernel: np.ndarray, channels_before: int | None = None) -> np.ndarray:
    """The inverse of :func:`keras_kernel`."""
    if kernel.ndim > 2:
        return np.moveaxis(kernel, (-1, -2), (0, 1))
    if channels_before is None:
        return kernel.T
    width, p = kernel.shape
    return (
        kernel.reshape(width // channels_before, channels_before, p)
        .transpose(2, 1, 0)
        .reshape(p, width)
    )


def _channels_before(model: keras.Model) -> list[int | None]:
    """Per weight layer: the channels of the convolution it reads through a Flatten, or None."""
    return [None] + [
        int(prev.shape[-1]) if len(prev.shape) > 2 and len(k.shape) == 2 else None
        for prev, k in itertools.pairwise(_kernels(model))
    ]


def torch_weights(model: keras.Model) -> list[np.ndarray]:
    """The model's kernels in torch layout (see :func:`torch_weight`), copies."""
    return [
        torch_weight(np.asarray(k), c).copy()
        for k, c in zip(_kernels(model), _channels_before(model), strict=True)
    ]


class RegularizedMLP(keras.Sequential):
    """``keras.Sequential`` whose training loss is ``CE + lam * g`` when ``penalty_lam > 0``."""

    def __init__(
        self, layers: list[Any], regularizer: str = "none", penalty_lam: float = 0.0, **kw: Any
    ) -> None:
        super().__init__(layers, **kw)
        self.regularizer = regularizer
        self.penalty_lam = float(penalty_lam)

    def compute_loss(
        self,
        x: Any = None,
        y: Any = None,
        y_pred: Any = None,
        sample_weight: Any = None,
        training: bool = True,
    ) -> Any:
        loss = super().compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
        )
        if self.penalty_lam:
            loss = loss + self.penalty_lam * penalty(_kernels(self), self.regularizer)
        return loss


def build_model(cfg: TrainConfig) -> RegularizedMLP:
    """``cfg``'s MLP or conv network in ``cfg.dtype`` on flat 784-pixel inputs, initialised
    with the torch side's draw in Keras layout; with the penalty for ``method="penalty"``."""
    layers: list[Any] = [keras.Input((cfg.widths[0],), dtype=cfg.dtype)]
    if cfg.model == "conv":
        c_in, height, width = IMAGE_SHAPE
        layers += [
            keras.layers.Reshape((height, width, c_in), dtype=cfg.dtype),
            keras.layers.Conv2D(
                cfg.hidden[0],
                cfg.kernel_size,
                strides=cfg.stride,
                padding="valid",
                activation=cfg.activation,
                name="conv",
                dtype=cfg.dtype,
            ),
            keras.layers.Flatten(dtype=cfg.dtype),
        ]
    else:
        for i, h in enumerate(cfg.hidden):
            layers.append(
                keras.layers.Dense(h, activation=cfg.activation, name=f"dense_{i}", dtype=cfg.dtype)
            )
    layers.append(keras.layers.Dense(cfg.widths[-1], name="logits", dtype=cfg.dtype))
    lam = cfg.lam if cfg.method == "penalty" else 0.0
    model = RegularizedMLP(layers, regularizer=cfg.regularizer, penalty_lam=lam)
    draw = initial_layer_weights(cfg.weight_shapes, cfg.seed)
    for layer, (w, b), c in zip(_weight_layers(model), draw, _channels_before(model), strict=True):
        layer.kernel.assign(keras_kernel(w, c).astype(cfg.dtype))
        layer.bias.assign(b.astype(cfg.dtype))
    return model


def make_optimizer(cfg: TrainConfig) -> keras.optimizers.Optimizer:
    """The library optimizer for ``method="prox"``; plain SGD otherwise."""
    make = KERAS[cfg.regularizer][1]
    if cfg.method != "prox" or make is None or cfg.lam == 0:
        return keras.optimizers.SGD(cfg.lr)
    return make(cfg)


class _History(keras.callbacks.Callback):
    def __init__(self, cfg: TrainConfig, x_eval: np.ndarray, y_eval: np.ndarray) -> None:
        super().__init__()
        self.cfg = cfg
        self.hist = History()
        self.step = 0
        self.x_eval, self.y_eval = x_eval, y_eval

    def _g(self) -> float:
        return float(penalty(_kernels(self.model), self.cfg.regularizer))

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.step += 1
        if self.step % self.cfg.log_every == 0 and logs is not None:
            ws = torch_weights(self.model)
            extra = self.cfg.lam * self._g() if self.cfg.method == "prox" else 0.0
            self.hist.iteration.append(self.step)
            # Keras reports the epoch's running mean loss (with the penalty for "penalty")
            self.hist.batch_objective.append(float(logs["loss"]) + extra)
            self.hist.nonzero_pct.append(100.0 * nonzero_fraction(ws))
            self.hist.effective_nonzero_pct.append(100.0 * effective_nonzero_fraction(ws))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.hist.epoch_objective.append(
            _mean_ce(self.model, self.x_eval, self.y_eval) + self.cfg.lam * self._g()
        )


def _mean_ce(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    total = 0.0
    for s in range(0, x.shape[0], 10000):
        z = model(x[s : s + 10000], training=False)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y[s : s + 10000], logits=z)
        total += float(tf.reduce_sum(ce))
    return total / x.shape[0]


def _compiled_model(cfg: TrainConfig) -> RegularizedMLP:
    """Seed Keras, build the network, compile it with the library optimizer and the CE loss."""
    keras.utils.set_random_seed(cfg.seed)
    model = build_model(cfg)
    floatx = keras.config.floatx()
    # The optimizer's lr variable and compile's loss take floatx: in float32 they would round
    # the float64 run's lr and loss.
    keras.config.set_floatx(cfg.dtype)
    try:
        optimizer = make_optimizer(cfg)
        if isinstance(optimizer, (PathNormSGD, ProxOptimizer)):
            optimizer.verify_pairs(model)  # shows it the model (the conv network needs it)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    finally:
        keras.config.set_floatx(floatx)
    return model


def _certify_layers(model: keras.Model, ws: list[np.ndarray]) -> list[Layer]:
    """The torch-layout weights as :mod:`~pathnorm_experiments.certify` layers: a Conv2D
    (valid padding, channels last, as :func:`build_model` makes it) as a ``ConvLayer``."""
    out: list[Layer] = []
    for layer, w in zip(_weight_layers(model), ws, strict=True):
        if w.ndim == 4:
            height, width, c_in = layer.input.shape[1:]
            out.append(ConvLayer(w, (c_in, height, width), tuple(layer.strides)))
        else:
            out.append(w)
    return out


def _evaluate_keras(
    model: keras.Model,
    cfg: TrainConfig,
    data: Dataset,
    cb: _History,
    ws: list[np.ndarray],
    bs: list[np.ndarray],
    timings: dict[str, float],
) -> dict[str, Any]:
    """Clean and PGD-robust test error, train CE, certificates and bounds: the result dict of
    :func:`~pathnorm_experiments.evaluation.build_result` (``ws`` in torch layout; adds
    ``eval_s`` to ``timings``)."""
    x_test = data.x_test.astype(cfg.dtype)
    t1 = time.perf_counter()
    y_te = data.y_test.astype(np.int32)
    wrong_clean = np.argmax(model.predict(x_test, batch_size=2000, verbose=0), 1) != y_te
    n_adv = x_test.shape[0] if cfg.pgd_samples is None else min(cfg.pgd_samples, x_test.shape[0])
    losses = ("ce", "margin") if cfg.attack == "ce+margin" else ("ce",)
    attack = partial(robust_error, model, x_test[:n_adv], y_te[:n_adv], steps=cfg.pgd_steps)
    robust = {float_key(e): attack(e, seed=cfg.seed, losses=losses) for e in cfg.eps}
    ce = _mean_ce(model, cb.x_eval, cb.y_eval)  # the history's training subset
    timings["eval_s"] = time.perf_counter() - t1
    return build_result(
        cfg,
        data,
        _certify_layers(model, ws),
        bs,
        clean_error=float(wrong_clean.mean()),
        clean_error_attacked=float(wrong_clean[:n_adv].mean()),
        robust_error=robust,
        train_ce=ce,
        n_adv=n_adv,
        history=cb.hist,
        timings=timings,
        backend="tf",
    )


def train_keras(
    cfg: TrainConfig,
    data: Dataset,
    *,
    progress: bool = True,
    threads: int | None = None,
    evaluate_model: bool = True,
) -> tuple[keras.Model, dict[str, Any]]:
    """Train with ``model.fit`` and the library optimizer, then evaluate; returns (model,
    result dict).

    Args:
        progress: show Keras' progress bar.
        threads: TF's intra- and inter-op threads (None: TF's default).
        evaluate_model: attack, certify and measure after training; otherwise the result
            holds only ``history``, ``timings`` and the final ``weights`` and ``biases``.

    Raises:
        FloatingPointError: training diverged (non-finite weights).
    """
    if threads:
        # TF already initialised in this process (RuntimeError): it keeps its setting
        with contextlib.suppress(RuntimeError):
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
    model = _compiled_model(cfg)
    x_train = data.x_train.astype(cfg.dtype)
    n, n_eval = x_train.shape[0], cfg.eval_train_samples
    cb = _History(cfg, x_train[:n_eval], data.y_train[:n_eval].astype(np.int32))
    orders = shuffle_orders(n, cfg.epochs, cfg.seed)  # the torch side's minibatch order
    t0 = time.perf_counter()
    model.fit(
        make_tf_dataset(x_train, data.y_train, cfg.batch_size, orders=orders),
        epochs=cfg.epochs,
        # with steps_per_epoch, Keras continues one iterator across the epochs
        steps_per_epoch=math.ceil(n / cfg.batch_size),
        verbose=1 if progress else 0,
        callbacks=[cb],
        shuffle=False,
    )
    timings = {"train_s": time.perf_counter() - t0, "iterations": float(cb.step)}
    ws = torch_weights(model)
    if not all(np.isfinite(w).all() for w in ws):
        raise FloatingPointError("training diverged (NaN/inf weights); lower --lr or --lam")
    bs = [np.asarray(layer.bias).copy() for layer in _weight_layers(model)]
    if not evaluate_model:
        return model, {"history": cb.hist, "timings": timings, "weights": ws, "biases": bs}
    return model, _evaluate_keras(model, cfg, data, cb, ws, bs, timings)
