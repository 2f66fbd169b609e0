"""Which weight of a convolutional layer pair belongs to which hidden unit, in NumPy.

A hidden unit of a convolutional pair is a channel ``c`` of the first layer's output. The
neutral layout of the spec (``X`` (n, p') outgoing, ``Y`` (n, m') incoming) holds, for the
networks of :data:`NETWORKS`, in torch's order within a unit:

* ``Y[c]`` = ``first[c]`` flattened: the torch weight of the first convolution is
  (C, C_in, *k), so the order is (C_in, *k);
* conv -> conv: ``X[c]`` = ``second[:, c]`` flattened, the second weight being (C_out, C, *k2):
  order (C_out, *k2);
* conv -> Flatten -> linear: ``torch.nn.Flatten`` is channels first, so of the Linear weight
  (p, C * P) (``P`` positions per channel) channel ``c`` owns the columns
  ``c * P : (c + 1) * P``: ``X[c]`` = ``second[:, c * P : (c + 1) * P]`` flattened, order (p, P).

The same networks in Keras have the kernels :func:`keras_kernels` gives: a convolution kernel is
(*k, C_in, C_out), and the Dense kernel (P * C, p) after a channels-last ``Flatten`` reads
channel ``c`` at position ``q`` in its row ``q * C + c``.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]

#: network name -> (spatial dimensions, whether a Flatten and a linear layer come second)
NETWORKS: dict[str, tuple[int, bool]] = {
    "conv1d-conv1d": (1, False),
    "conv2d-conv2d": (2, False),
    "conv1d-flatten-linear": (1, True),
    "conv2d-flatten-linear": (2, True),
}


def check_shapes(network: str, first_shape: tuple[int, ...], second_shape: tuple[int, ...]) -> int:
    """The hidden width ``C`` of a torch pair of ``network``, after checking the shapes.

    Raises:
        ValueError: an unknown network, or weight shapes that do not make one.
    """
    if network not in NETWORKS:
        raise ValueError(f"unknown network {network!r}: one of {sorted(NETWORKS)}")
    dims, flat = NETWORKS[network]
    if len(first_shape) != 2 + dims:
        raise ValueError(
            f"{network}: the first weight must have {2 + dims} axes, got {first_shape}"
        )
    channels = first_shape[0]
    if flat:
        if len(second_shape) != 2 or second_shape[1] % channels:
            raise ValueError(
                f"{network}: the linear weight must be (p, C * P) with C = {channels}, got "
                f"{second_shape}"
            )
    elif len(second_shape) != 2 + dims or second_shape[1] != channels:
        raise ValueError(
            f"{network}: the second weight must be (C_out, {channels}, *k) with {dims} kernel "
            f"axes, got {second_shape}"
        )
    return channels


def units(network: str, first: F64, second: F64) -> tuple[F64, F64]:
    """``(X, Y)``: the units of the torch weights ``first`` and ``second`` of ``network``."""
    first, second = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    channels = check_shapes(network, first.shape, second.shape)
    Y = first.reshape(channels, -1)
    if NETWORKS[network][1]:
        p = second.shape[0]
        X = second.reshape(p, channels, -1).transpose(1, 0, 2).reshape(channels, -1)
    else:
        X = np.moveaxis(second, 1, 0).reshape(channels, -1)
    return X, Y


def weights(
    network: str, X: F64, Y: F64, first_shape: tuple[int, ...], second_shape: tuple[int, ...]
) -> tuple[F64, F64]:
    """The inverse of :func:`units`: torch weights of the given shapes holding ``(X, Y)``."""
    channels = check_shapes(network, first_shape, second_shape)
    first = np.asarray(Y, dtype=np.float64).reshape(first_shape)
    X = np.asarray(X, dtype=np.float64)
    if NETWORKS[network][1]:
        p = second_shape[0]
        second = X.reshape(channels, p, -1).transpose(1, 0, 2).reshape(second_shape)
    else:
        moved = (channels, second_shape[0], *second_shape[2:])
        second = np.moveaxis(X.reshape(moved), 0, 1)
    return first, second


def _conv_to_keras(w: F64) -> F64:
    """torch (C_out, C_in, *k) -> Keras (*k, C_in, C_out)."""
    return np.transpose(w, (*range(2, w.ndim), 1, 0))


def _conv_to_torch(k: F64) -> F64:
    """Keras (*k, C_in, C_out) -> torch (C_out, C_in, *k)."""
    return np.transpose(k, (k.ndim - 1, k.ndim - 2, *range(k.ndim - 2)))


def keras_kernels(network: str, first: F64, second: F64) -> tuple[F64, F64]:
    """The Keras kernels of the torch pair ``(first, second)`` of ``network`` (the same function:
    the Keras network computes what the torch one does, on channels-last inputs)."""
    first, second = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    channels = check_shapes(network, first.shape, second.shape)
    if NETWORKS[network][1]:
        p = second.shape[0]
        dense = second.reshape(p, channels, -1).transpose(2, 1, 0).reshape(-1, p)
        return _conv_to_keras(first), dense
    return _conv_to_keras(first), _conv_to_keras(second)


def torch_weights(network: str, kernel_first: F64, kernel_second: F64) -> tuple[F64, F64]:
    """The inverse of :func:`keras_kernels`."""
    first = _conv_to_torch(np.asarray(kernel_first, dtype=np.float64))
    kernel_second = np.asarray(kernel_second, dtype=np.float64)
    if NETWORKS.get(network, (0, False))[1]:
        channels, p = first.shape[0], kernel_second.shape[-1]
        second = kernel_second.reshape(-1, channels, p).transpose(2, 1, 0).reshape(p, -1)
    else:
        second = _conv_to_torch(kernel_second)
    check_shapes(network, first.shape, second.shape)
    return first, second
