"""A Keras callback that reports sparsity and the Lipschitz bounds in ``logs``.

Keys (the same names and definitions as ``pathnorm_lightning``'s logged metrics):

* ``pathnorm/sparsity``: fraction of exactly-zero entries of the regularized kernels;
* ``pathnorm/alive_units``: fraction of hidden units of the regularized pairs whose incoming
  column ``K_in[:, j]`` and outgoing row ``K_out[j, :]`` both have a nonzero entry;
* ``pathnorm/path_norm_bound``: ``1^T |K_1| |K_2| ... |K_L| 1`` over the model's Dense chain
  (the 1-path-norm of the whole MLP, an upper bound on its (l_inf, l_1) Lipschitz constant);
* ``pathnorm/product_bound``: ``sum|K_L| * prod_{l<L} max_j ||K_l[:, j]||_1``, the layer-wise
  bound (never below the path-norm bound).

The two bounds are reported when all Dense layers of the model chain (a feed-forward MLP).
Values are Python floats computed in float64 from the current weights.
"""

from __future__ import annotations

import itertools
from typing import Any

import keras
import tensorflow as tf

from pathnorm_tf import pairing

__all__ = ["PathNormMetrics", "metric_values"]


def _dense_layers(model: keras.Model) -> list[keras.layers.Dense]:
    layers = [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, keras.layers.Dense) and layer.built
    ]
    return layers


def _abs64(kernel: Any) -> tf.Tensor:
    return tf.abs(tf.cast(tf.convert_to_tensor(kernel), tf.float64))


def path_norm_bound(kernels: list[Any]) -> float:
    """``1^T |K_1| ... |K_L| 1`` for a chain of Dense kernels (in, out) in forward order."""
    v = tf.reduce_sum(_abs64(kernels[0]), 0)  # 1^T |K_1|
    for k in kernels[1:]:
        v = tf.linalg.matvec(_abs64(k), v, transpose_a=True)
    return float(tf.reduce_sum(v))


def product_bound(kernels: list[Any]) -> float:
    """``sum|K_L| * prod_{l<L} ||K_l||_{inf->inf}`` (largest column l1 norm of a Dense kernel)."""
    value = tf.reduce_sum(_abs64(kernels[-1]))
    for k in kernels[:-1]:
        value = value * tf.reduce_max(tf.reduce_sum(_abs64(k), 0))
    return float(value)


def metric_values(model: keras.Model, pairs: Any = "auto") -> dict[str, float]:
    """The ``pathnorm/...`` values of ``model`` now (see the module docstring).

    Args:
        model: a built Keras model.
        pairs: the regularized pairs, as for :class:`~pathnorm_tf.PathNormSGD`: ``"auto"``
            (consecutive Dense layers (1, 2), (3, 4), ...) or ``(first, second)`` layer names.
    """
    dense = _dense_layers(model)
    if not dense:
        raise ValueError("PathNormMetrics: the model has no built Dense layer to report on")
    kernels = [layer.kernel for layer in dense]
    spec = pairing.normalize_pairs(pairs)
    if spec == "auto" and len(kernels) < 2:
        chains = [[kernels[0]]]
    else:
        chains = [[kernels[i], kernels[j]] for i, j in pairing.resolve_pairs(kernels, spec)]
    zeros = total = alive = units = 0
    for chain in chains:
        for k in chain:
            t = tf.convert_to_tensor(k)
            zeros += int(tf.reduce_sum(tf.cast(tf.equal(t, 0), tf.int64)))
            total += int(tf.size(t))
        for k_in, k_out in itertools.pairwise(chain):
            live = tf.reduce_any(tf.not_equal(k_in, 0), 0) & tf.reduce_any(
                tf.not_equal(k_out, 0), 1
            )
            alive += int(tf.reduce_sum(tf.cast(live, tf.int64)))
            units += int(live.shape[0])
    values = {"pathnorm/sparsity": zeros / max(total, 1)}
    if units:
        values["pathnorm/alive_units"] = alive / units
    if all(a.shape[1] == b.shape[0] for a, b in itertools.pairwise(kernels)):
        values["pathnorm/path_norm_bound"] = path_norm_bound(kernels)
        values["pathnorm/product_bound"] = product_bound(kernels)
    return values


class PathNormMetrics(keras.callbacks.Callback):
    """Add the ``pathnorm/...`` metrics to the epoch ``logs`` (History, CSVLogger, TensorBoard).

    Put it *before* ``CSVLogger``/``TensorBoard`` in ``callbacks=[...]``: Keras hands the same
    ``logs`` dict to the callbacks in list order (``History`` always comes last).

    Args:
        pairs: the regularized pairs (``"auto"`` or explicit layer-name tuples), as given to
            the optimizer; sparsity and alive units are taken over these kernels.
        every_n_batches: also add the values to the batch ``logs`` every ``n`` batches (they
            then show in the progress bar); ``None`` for epochs only.
    """

    def __init__(self, pairs: Any = "auto", every_n_batches: int | None = None) -> None:
        super().__init__()
        self.pairs = pairing.normalize_pairs(pairs)
        if every_n_batches is not None and (
            isinstance(every_n_batches, bool)
            or not isinstance(every_n_batches, int)
            or every_n_batches < 1
        ):
            raise ValueError(
                f"every_n_batches must be None or an int >= 1, got {every_n_batches!r}"
            )
        self.every_n_batches = every_n_batches

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.every_n_batches and logs is not None and (batch + 1) % self.every_n_batches == 0:
            logs.update(metric_values(self.model, self.pairs))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs.update(metric_values(self.model, self.pairs))
