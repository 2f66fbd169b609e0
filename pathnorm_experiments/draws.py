"""The draws both backends share, so that they train the same network: the initial weights
and the minibatch order of every epoch, from NumPy generators seeded by the run's seed."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["initial_layer_weights", "initial_weights", "shuffle_orders"]


def initial_weights(widths: Sequence[int], seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Initial ``(weight (out, in), bias (out,))`` per layer of ``widths`` (input to output),
    float64, the same in both backends.

    PyTorch's default ``nn.Linear`` distribution (Kaiming-uniform with ``a = sqrt(5)``): weights
    and biases uniform in ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]``, drawn layer by layer (weight,
    then bias) from one NumPy generator seeded with ``(seed, 0)``.
    """
    return initial_layer_weights(
        [(fan_out, fan_in) for fan_in, fan_out in itertools.pairwise(widths)], seed
    )


def initial_layer_weights(
    shapes: Sequence[Sequence[int]], seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Initial ``(weight, bias (out,))`` per layer of the given torch-layout weight shapes.

    The draw of :func:`initial_weights` for any layer: ``(out, in)`` for ``nn.Linear``,
    ``(out, in, *kernel)`` for a convolution, whose PyTorch default is the same distribution
    with ``fan_in = in * prod(kernel)``. ``TrainConfig.weight_shapes`` gives the shapes.
    """
    rng = np.random.default_rng((seed, 0))
    layers = []
    for shape in shapes:
        bound = 1.0 / math.sqrt(math.prod(shape[1:]))
        w = rng.uniform(-bound, bound, tuple(shape))
        b = rng.uniform(-bound, bound, shape[0])
        layers.append((w, b))
    return layers


def shuffle_orders(n: int, epochs: int, seed: int) -> np.ndarray:
    """The training order of every epoch, (epochs, n) int64, the same in both backends.

    One permutation of ``range(n)`` per epoch, from a NumPy generator seeded with ``(seed, 1)``
    (a stream apart from :func:`initial_weights`').
    """
    rng = np.random.default_rng((seed, 1))
    return np.stack([rng.permutation(n) for _ in range(epochs)])
