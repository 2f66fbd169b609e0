"""What may stand between the two layers of a pair: a :class:`Role` per layer type
(:data:`BETWEEN`) and :func:`check_between`, which reads it. Part of the layer seam,
:mod:`pathnorm_tf.layers`, which re-exports these names.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras

from pathnorm_tf import layers as seam

__all__ = [
    "BETWEEN",
    "MIXING",
    "STEEP",
    "Between",
    "Role",
    "builtin_entrywise",
    "check_between",
    "max_slope",
    "role_of",
]


class Role(enum.Enum):
    """What a layer between the two layers of a pair does."""

    #: acts on each entry alone and holds no weights: activations, dropout, noise, identity
    POINTWISE = "pointwise"
    #: acts on each channel alone and keeps the channels: max and average pooling
    POOL = "pool"
    #: global pooling: one value per channel (with ``keepdims=False`` it also flattens)
    GLOBAL_POOL = "global_pool"
    #: ``Flatten``: between a convolution and a Dense layer
    FLATTEN = "flatten"


_L = keras.layers
#: The layer classes that may stand between two paired layers, by role (data the pairing
#: reads). Layers with weights (BatchNormalization, LayerNormalization, PReLU, ...) have none.
BETWEEN: dict[type, Role] = {
    **dict.fromkeys(
        (_L.Activation, _L.ReLU, _L.LeakyReLU, _L.ELU, _L.Dropout, _L.SpatialDropout1D,
         _L.SpatialDropout2D, _L.AlphaDropout, _L.GaussianDropout, _L.GaussianNoise,
         _L.Identity),
        Role.POINTWISE,
    ),
    **dict.fromkeys(
        (_L.MaxPooling1D, _L.MaxPooling2D, _L.AveragePooling1D, _L.AveragePooling2D), Role.POOL
    ),
    **dict.fromkeys(
        (_L.GlobalMaxPooling1D, _L.GlobalMaxPooling2D, _L.GlobalAveragePooling1D,
         _L.GlobalAveragePooling2D),
        Role.GLOBAL_POOL,
    ),
    _L.Flatten: Role.FLATTEN,
}  # fmt: skip
#: Keras activations (by function name) that normalise or split across the last axis, so mix
#: the units: an ``Activation`` of one has no role, and a first layer may not apply one.
MIXING = frozenset({"softmax", "log_softmax", "sparsemax", "glu"})


#: Keras activations (by function name) whose slope exceeds 1, with the sup of ``|f'|`` to 4
#: digits rounded up (held to autograd in the tests). The path-norm bounds the (l_inf, l_1)
#: Lipschitz constant for slopes at most 1; a steeper activation multiplies it by up to its slope.
STEEP = {
    "gelu": 1.129,
    "silu": 1.1,
    "mish": 1.089,
    "selu": 1.7582,
    "hard_silu": 1.5,
    "exponential": math.inf,
}


def _activation(layer: Any) -> str:
    """The name of a layer's ``activation`` function ("" where it has none)."""
    return getattr(getattr(layer, "activation", None), "__name__", "")


def max_slope(layer: Any) -> float:
    """The largest ``|f'|`` of a layer's activation (its ``activation`` attribute, or an
    ``ELU``/``LeakyReLU`` layer's parameter); 1.0 when it is at most 1, as for ReLU."""
    if isinstance(layer, _L.ELU):
        return max(1.0, abs(float(layer.alpha)))
    if isinstance(layer, _L.LeakyReLU):
        return max(1.0, abs(float(layer.negative_slope)))
    return STEEP.get(_activation(layer), 1.0)


def builtin_entrywise(fn: Any) -> bool:
    """Whether ``fn`` is a Keras built-in activation that acts on each entry alone (not one
    of :data:`MIXING`); a lambda or a user's function is not known to be."""
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or name in MIXING:
        return False
    try:
        return keras.activations.get(name) is fn
    except ValueError:
        return False


def _check_activation(where: str, layer: Any, strict: bool) -> None:
    """Warn (``strict``: raise ValueError) where ``layer`` applies an activation that is not a
    built-in entry-wise one: its units may be mixed, or its slope above 1."""
    fn = getattr(layer, "activation", None)
    if fn is None or builtin_entrywise(fn):
        return
    message = (
        f"{where}: the activation {getattr(fn, '__name__', fn)!r} of {type(layer).__name__} "
        f"{layer.name!r} is not a Keras built-in, so it is not known to act on each entry alone "
        "with a slope of at most 1 (as relu, elu, tanh, sigmoid); if it does not, the pair is "
        "not a shallow network and its path norm does not bound it"
    )
    if strict:
        raise ValueError(message)
    warnings.warn(
        f"{message}. The pair is proxed as if it did, and PathNormMetrics leaves out the "
        "bounds; a built-in activation (by name or keras.activations) removes this warning.",
        UserWarning,
        stacklevel=4,
    )


def _warn_steep(where: str, layer: Any) -> None:
    slope = max_slope(layer)
    if slope > 1.0:
        warnings.warn(
            f"{where}: the activation of {type(layer).__name__} {layer.name!r} has a slope of up "
            f"to {slope:g} > 1, so the pair's path norm bounds its Lipschitz constant only up to "
            "that factor: the logged path_norm_bound and product_bound are not bounds of this "
            "network (activations of slope <= 1 keep them: relu, elu, tanh, sigmoid, softplus)",
            UserWarning,
            stacklevel=3,
        )


def role_of(layer: Any) -> Role | None:
    """The :class:`Role` of a Keras layer between two paired layers; None: not allowed there
    (it holds weights, mixes entries, or is unknown)."""
    mixing = _activation(layer) in MIXING
    if getattr(layer, "weights", None) or (isinstance(layer, _L.Activation) and mixing):
        return None
    return seam._by_class(BETWEEN, layer)


@dataclass(frozen=True)
class Between:
    """The layers :func:`check_between` found between a pair: the pooling layers (global ones
    included), and the layer that flattens (a ``Flatten`` or a global pool), if any."""

    pools: tuple[Any, ...]
    flatten: Any | None


def check_between(
    first: Any, second: Any, between: Sequence[Any], *, strict: bool = False
) -> Between:
    """Check the Keras layers between ``first`` and ``second`` (in the order they run).

    Allowed: an entry-wise activation of ``first`` itself (none of :data:`MIXING`); pointwise
    layers anywhere; pooling after a convolution, in the convolution's ``data_format``, before the
    flattening; exactly one ``Flatten`` or global pooling layer (``keepdims=False``) between a
    convolution and a Dense layer, which that pair needs. An activation that is not a Keras
    built-in (a lambda, a user's function) is warned about, or with ``strict`` (the metrics'
    bounds) refused.

    Raises:
        ValueError: naming the layer and why it breaks the pair.
    """
    spatial_in, spatial_out = seam.entry_of(first).spatial, seam.entry_of(second).spatial
    where = f"between {first.name!r} and {second.name!r}"
    pools: list[Any] = []
    flattening: Any | None = None
    _warn_steep(where, first)  # a Dense or conv layer applies its own activation first
    own = _activation(first)
    if own in MIXING:
        raise ValueError(
            f"{where}: {first.name!r} applies {own} to its outputs, which mixes its units; the "
            "pair would not be a shallow network and its path-norm would not bound it (pair "
            "other layers, or leave this pair out)"
        )
    _check_activation(where, first, strict)
    for layer in between:
        role, label = role_of(layer), f"{type(layer).__name__} {layer.name!r}"
        if role is Role.POINTWISE:
            _warn_steep(where, layer)
            _check_activation(where, layer, strict)
        if role is None:
            raise ValueError(
                f"{where}: {label} is neither pointwise, nor pooling, nor a Flatten; the pair "
                "would not be a shallow network and its path-norm would not bound it (pair "
                "other layers, or leave this pair out)"
            )
        if role in (Role.POOL, Role.GLOBAL_POOL):
            if not spatial_in or flattening is not None:
                raise ValueError(f"{where}: {label} pools positions, but there are none here")
            if layer.data_format != first.data_format:
                raise ValueError(
                    f"{where}: {label} pools in {layer.data_format} but {first.name!r} writes "
                    f"{first.data_format}: it would pool across channels"
                )
            pools.append(layer)
        if role is Role.FLATTEN or (role is Role.GLOBAL_POOL and not layer.keepdims):
            if not (spatial_in and not spatial_out) or flattening is not None:
                raise ValueError(f"{where}: {label} may stand only once, after a convolution")
            flattening = layer
    if spatial_in and not spatial_out and flattening is None:
        raise ValueError(
            f"{where}: the convolution's output needs a Flatten (or a global pooling layer) "
            "before the Dense layer, which would otherwise read each position separately"
        )
    if spatial_out and not spatial_in:
        raise ValueError(f"{where}: a convolution cannot read the units of a Dense layer")
    return Between(tuple(pools), flattening)
