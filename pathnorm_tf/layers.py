"""The layer seam (Keras): what the prox needs to know about a layer type, one entry per type.

The prox is per hidden unit: unit ``i`` owns incoming weights ``y_i`` and outgoing weights
``x_i``, and the 1-path-norm is ``sum_i ||x_i||_1 ||y_i||_1``. A layer *pair* ``(first,
second)`` shares its hidden units: the first layer's outputs (units or channels) are the
second layer's inputs. An entry (:class:`LayerEntry`) maps one layer type to those units, in
the layout of :func:`~pathnorm_tf.functional.prox_path_norm` (the Keras layout, transposed from
the torch seam's): ``in_view`` ``(m', n)`` has ``y_i`` as column ``i`` (the functional's
``kernel_in``), ``out_view`` ``(n, p')`` has ``x_i`` as row ``i`` (its ``kernel_out``);
``in_native`` / ``out_native`` map such matrices back to the kernel's shape and ``write_in`` /
``write_out`` assign them (TensorFlow has no views: every view is a tensor of its own). It also
counts a layer's units, refuses configurations it does not cover (grouped convolutions, layers
not built yet), and gives ``reuse``: the factor ``s`` of the layer as the *second* of a pair
(how many times the unrolled network reads each outgoing weight at most, docs/conv_units.md),
so that the 1-path-norm of the unrolled network is at most ``s * path_norm``.

The entries (:data:`ENTRIES`): ``Dense`` (:class:`DenseEntry`) and ``Conv1D`` / ``Conv2D``
(:class:`ConvEntry`). Layouts (kernels do not depend on ``data_format``):

* ``Dense(n)`` kernel (m, n): ``y_i = kernel[:, i]``; as second layer ``Dense(p)`` kernel
  (n, p): ``x_i = kernel[i, :]``. Both views are the kernel itself.
* ``Conv`` kernel (*k, C_in, C): ``y_c = kernel[..., c]``, ``in_view = reshape(kernel, (-1,
  C))``; as second layer kernel (*k2, C, C_out): ``x_c = kernel[..., c, :]``, ``out_view`` =
  the kernel with ``C`` moved first, reshaped to ``(C, prod(k2) * C_out)``.
* Conv -> Flatten -> Dense: a Dense kernel (P * C, p) reads ``P`` positions per channel
  (:class:`Flat`). A ``Flatten`` of a channels-last tensor is position-major: row ``q * C + c``
  reads channel ``c`` at position ``q`` (``Flat(P, channels_last=True)``); ``out_view``
  reshapes to (P, C, p) and moves the channels first. A channels_first convolution read by a
  ``Flatten`` whose own ``data_format`` is ``"channels_last"`` is channel-major (row
  ``c * P + q``, ``channels_last=False``). :func:`flat_of` tells which from the layers. A
  global pooling layer (``keepdims=False``) in place of the Flatten leaves ``P = 1``.

Which layers may stand between the two layers of a pair is data (:data:`BETWEEN`, a role per
layer type, read by :func:`check_between`; both from :mod:`pathnorm_tf._between`).

:func:`prox_kernels` and :func:`prox_pair` run the exact prox on the views of two kernels or
layers. Pairing (:mod:`pathnorm_tf.pairing`) keeps per pair a :class:`PairLayout` (an
optimizer sees variables only); the optimizers, metrics and :mod:`pathnorm_tf.compact` read
units from its views.

A new Keras layer type is a :class:`LayerEntry` subclass given to :func:`register`, with tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import keras
import tensorflow as tf

from pathnorm_tf._between import BETWEEN, Between, Role, check_between, max_slope, role_of
from pathnorm_tf._common import Scalar
from pathnorm_tf.functional import prox_path_norm

__all__ = [
    "BETWEEN",
    "ENTRIES",
    "Between",
    "ConvEntry",
    "DenseEntry",
    "Flat",
    "LayerEntry",
    "PairLayout",
    "Role",
    "check_between",
    "entry_of",
    "flat_of",
    "layout_of",
    "max_slope",
    "prox_kernels",
    "prox_pair",
    "register",
    "role_of",
]


def _kernel(layer: Any) -> Any:
    """``layer.kernel``, or a clear error for a layer that has none yet."""
    kernel = getattr(layer, "kernel", None)
    if kernel is None or len(getattr(kernel, "shape", ())) < 2:
        raise ValueError(
            f"layer {getattr(layer, 'name', layer)!r} ({type(layer).__name__}) has no kernel yet: "
            "build the model first (call it on an example batch, or give it an Input)"
        )
    return kernel


Shape = Sequence[int]


@dataclass(frozen=True)
class Flat:
    """A flattening between a convolution and a Dense layer: ``positions`` per channel, read
    position-major (``channels_last``: Dense row ``q * C + c``) or channel-major (row
    ``c * P + q``)."""

    positions: int
    channels_last: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.positions, bool) or not isinstance(self.positions, int):
            raise ValueError(f"Flat.positions must be an int, got {self.positions!r}")
        if self.positions < 1:
            raise ValueError(f"Flat.positions must be >= 1, got {self.positions}")


class LayerEntry:
    """How the prox sees one layer type (subclass per type, then :func:`register` it).

    View methods take kernels (tensors or variables: an optimizer holds variables); counts,
    checks and the reuse factor take the layer (they need its configuration). ``flat`` is the
    :class:`Flat` between a convolution and this (second) layer, or None.
    """

    #: Whether the layer's outputs have spatial positions (pooling and Flatten may follow).
    spatial: ClassVar[bool] = False

    def check(self, layer: Any) -> None:
        """Raise ``ValueError`` when the seam cannot take ``layer`` as it is configured."""
        _kernel(layer)

    def units_out(self, layer: Any) -> int:
        """Hidden units of ``layer`` first in a pair: its kernel's last axis."""
        return self.kernel_units_out(tuple(_kernel(layer).shape))

    def units_in(self, layer: Any, flat: Flat | None = None) -> int:
        """Hidden units of ``layer`` second in a pair: the channels it reads."""
        return self.kernel_units_in(tuple(_kernel(layer).shape), flat, getattr(layer, "name", ""))

    def kernel_units_out(self, shape: Shape) -> int:
        """:meth:`units_out` from the kernel's shape alone (an optimizer sees variables)."""
        return int(shape[-1])

    def kernel_units_in(self, shape: Shape, flat: Flat | None = None, name: str = "") -> int:
        """:meth:`units_in` from the kernel's shape alone (``name``: the layer, for errors)."""
        raise NotImplementedError

    def in_view(self, kernel: Any) -> tf.Tensor:
        """``(m', n)``: column ``i`` is unit ``i``'s incoming weights."""
        raise NotImplementedError

    def in_native(self, matrix: tf.Tensor, shape: Shape) -> tf.Tensor:
        """The kernel of ``shape`` that :meth:`in_view` reads as ``matrix``."""
        return tf.reshape(matrix, list(shape))

    def out_view(self, kernel: Any, n_units: int, flat: Flat | None = None) -> tf.Tensor:
        """``(n, p')``: row ``i`` is unit ``i``'s outgoing weights."""
        raise NotImplementedError

    def out_native(self, matrix: tf.Tensor, shape: Shape, flat: Flat | None = None) -> tf.Tensor:
        """The kernel of ``shape`` that :meth:`out_view` reads as ``matrix``."""
        raise NotImplementedError

    def reuse(self, layer: Any, in_positions: Shape = ()) -> int:
        """The factor ``s`` of ``layer`` second in a pair, on an input grid of ``in_positions``
        (its spatial shape; empty for a Dense layer)."""
        raise NotImplementedError

    def in_positions(self, layer: Any) -> tuple[int, ...]:
        """The spatial shape of ``layer``'s input, for :meth:`reuse` (empty: no positions)."""
        return ()

    def write_in(self, variable: Any, matrix: tf.Tensor) -> None:
        """``variable.assign`` the kernel an :meth:`in_view`-shaped ``matrix`` stands for."""
        variable.assign(self.in_native(matrix, tuple(variable.shape)))

    def write_out(self, variable: Any, matrix: tf.Tensor, flat: Flat | None = None) -> None:
        """``variable.assign`` the kernel an :meth:`out_view`-shaped ``matrix`` stands for."""
        variable.assign(self.out_native(matrix, tuple(variable.shape), flat))


class DenseEntry(LayerEntry):
    """``Dense``: kernel (in, out); both views are the kernel itself, or, after a
    :class:`Flat`, the (C, P * p) regrouping of its rows by channel."""

    def kernel_units_in(self, shape: Shape, flat: Flat | None = None, name: str = "") -> int:
        rows, positions = int(shape[0]), 1 if flat is None else flat.positions
        if rows % positions:
            raise ValueError(
                f"Dense layer {name!r} takes {rows} inputs, not a whole number of "
                f"channels of {positions} positions each"
            )
        return rows // positions

    def in_view(self, kernel: Any) -> tf.Tensor:
        return tf.convert_to_tensor(kernel)

    def out_view(self, kernel: Any, n_units: int, flat: Flat | None = None) -> tf.Tensor:
        k = tf.convert_to_tensor(kernel)
        positions = 1 if flat is None else flat.positions
        if int(k.shape[0]) != n_units * positions:
            raise ValueError(
                f"a Dense kernel of shape {tuple(k.shape)} does not read {n_units} units of "
                f"{positions} position(s) each ({n_units * positions} inputs)"
            )
        if flat is None or not flat.channels_last:  # unit c's rows are adjacent
            return tf.reshape(k, [n_units, -1])
        by_position = tf.reshape(k, [positions, n_units, -1])  # row q * C + c
        return tf.reshape(tf.transpose(by_position, [1, 0, 2]), [n_units, -1])

    def out_native(self, matrix: tf.Tensor, shape: Shape, flat: Flat | None = None) -> tf.Tensor:
        if flat is None or not flat.channels_last:
            return tf.reshape(matrix, list(shape))
        by_unit = tf.reshape(matrix, [int(matrix.shape[0]), flat.positions, -1])
        return tf.reshape(tf.transpose(by_unit, [1, 0, 2]), list(shape))

    def reuse(self, layer: Any, in_positions: Shape = ()) -> int:
        return 1  # every input (a unit at one position) is read by its own row only


class ConvEntry(LayerEntry):
    """``Conv1D`` / ``Conv2D`` (``groups=1``): kernel (*k, C_in, C_out); a unit is an output
    channel (first layer) or an input channel (second layer)."""

    spatial = True

    def check(self, layer: Any) -> None:
        super().check(layer)
        groups = getattr(layer, "groups", 1)
        if groups != 1:
            what = f"{type(layer).__name__} {layer.name!r} has groups={groups}"
            raise ValueError(
                f"{what}: a grouped convolution splits a channel's weights between groups, which "
                "the seam does not cover (use groups=1, or leave the layer out of the pairs)"
            )

    def kernel_units_in(self, shape: Shape, flat: Flat | None = None, name: str = "") -> int:
        if flat is not None:
            raise ValueError(f"a Flatten cannot stand before the convolution {name!r}")
        return int(shape[-2])

    def in_positions(self, layer: Any) -> tuple[int, ...]:
        """The spatial shape ``layer`` was built on, for :meth:`reuse`; ``ValueError`` for a
        layer not built yet, or built on an unknown spatial size."""
        shape = (getattr(layer, "_build_shapes_dict", None) or {}).get("input_shape")
        rank = len(layer.kernel_size)
        if shape is None or len(shape) != rank + 2:
            raise ValueError(
                f"{type(layer).__name__} {layer.name!r} has no known input shape: build it on "
                "an input of fixed spatial size (give the model an Input)"
            )
        spatial = shape[1:-1] if layer.data_format == "channels_last" else shape[2:]
        if any(d is None for d in spatial):
            raise ValueError(
                f"{type(layer).__name__} {layer.name!r} was built on inputs of unknown spatial "
                f"size {tuple(shape)}: its factor s depends on it; give the Input a fixed size"
            )
        return tuple(int(d) for d in spatial)

    def in_view(self, kernel: Any) -> tf.Tensor:
        k = tf.convert_to_tensor(kernel)
        return tf.reshape(k, [-1, int(k.shape[-1])])

    def out_view(self, kernel: Any, n_units: int, flat: Flat | None = None) -> tf.Tensor:
        k = tf.convert_to_tensor(kernel)
        rank = len(k.shape)
        if flat is not None or rank < 3 or int(k.shape[-2]) != n_units:
            raise ValueError(
                f"a convolution kernel of shape {tuple(k.shape)} does not read {n_units} input "
                f"channels{' (and no Flatten stands before a convolution)' if flat else ''}"
            )
        channels_first = tf.transpose(k, [rank - 2, *range(rank - 2), rank - 1])  # (C, *k, C_out)
        return tf.reshape(channels_first, [n_units, -1])

    def out_native(self, matrix: tf.Tensor, shape: Shape, flat: Flat | None = None) -> tf.Tensor:
        *kernel, n_units, c_out = (int(d) for d in shape)
        rank = len(shape)
        channels_first = tf.reshape(matrix, [n_units, *kernel, c_out])
        return tf.transpose(channels_first, [*range(1, rank - 1), 0, rank - 1])

    def reuse(self, layer: Any, in_positions: Shape = ()) -> int:
        kernel, strides, dilation = layer.kernel_size, layer.strides, layer.dilation_rate
        if len(in_positions) != len(kernel):
            raise ValueError(
                f"{type(layer).__name__} {layer.name!r} reads a grid of {len(kernel)} spatial "
                f"dimensions, got in_positions={tuple(in_positions)}"
            )
        factor = 1
        for size, k, st, d in zip(in_positions, kernel, strides, dilation, strict=True):
            span = d * (k - 1)
            if layer.padding == "valid":
                outputs, left = (size - span - 1) // st + 1, 0
            elif layer.padding == "causal":
                outputs, left = (size - 1) // st + 1, span
            else:  # "same": TensorFlow pads the extra position at the end
                outputs = (size + st - 1) // st
                left = max((outputs - 1) * st + span + 1 - size, 0) // 2
            factor *= max(
                sum(0 <= r * st + t * d - left < size for r in range(outputs)) for t in range(k)
            )
        return factor


#: The registry: layer class -> entry. A subclass of a registered class uses its entry;
#: ``Conv2DTranspose``, ``DepthwiseConv2D`` and ``SeparableConv2D`` are not subclasses.
ENTRIES: dict[type, LayerEntry] = {
    keras.layers.Dense: DenseEntry(),
    keras.layers.Conv1D: ConvEntry(),
    keras.layers.Conv2D: ConvEntry(),
}


def register(layer_type: type, entry: LayerEntry) -> None:
    """Use ``entry`` for Keras layers of class ``layer_type`` and its subclasses."""
    if not (isinstance(layer_type, type) and issubclass(layer_type, keras.layers.Layer)):
        raise TypeError(f"layer_type must be a keras.layers.Layer subclass, got {layer_type!r}")
    if not isinstance(entry, LayerEntry):
        raise TypeError(f"entry must be a LayerEntry, got {type(entry).__name__}")
    ENTRIES[layer_type] = entry


def _by_class(table: dict[type, Any], layer: Any) -> Any:
    """``table``'s value for the nearest class of ``layer`` (its own, then its bases)."""
    return next((table[cls] for cls in type(layer).__mro__ if cls in table), None)


def entry_of(layer: Any) -> LayerEntry:
    """The :class:`LayerEntry` of a Keras layer, which has checked that it can take it.

    Raises:
        ValueError: a layer class without an entry (the message lists those with one), a layer
            not built yet, or a configuration the entry refuses (:meth:`LayerEntry.check`).
    """
    entry = _by_class(ENTRIES, layer)
    if entry is None:
        known = ", ".join(sorted(cls.__name__ for cls in ENTRIES))
        raise ValueError(
            f"{type(layer).__name__} {getattr(layer, 'name', '')!r} has no hidden units the "
            f"path-norm prox knows; the seam has entries for {known}"
        )
    entry.check(layer)
    return entry


def flat_of(first: Any, second: Any, flatten: Any | None = None) -> Flat | None:
    """The :class:`Flat` between a convolution ``first`` and a Dense ``second`` (None for any
    other pair): the positions per channel from the shapes, the order from ``flatten`` (the
    layer that flattens, when known) and ``first``'s ``data_format``. A ``Flatten`` moves the
    channels of a channels_first input last only when its own ``data_format`` is
    ``"channels_first"``, so after a channels_first convolution ``flatten`` must be given.

    Raises:
        ValueError: shapes that do not divide, an order that cannot be told, or a Flatten that
            would interleave positions and channels.
    """
    if not (entry_of(first).spatial and not entry_of(second).spatial):
        return None
    rows, channels = int(_kernel(second).shape[0]), entry_of(first).units_out(first)
    positions, rest = divmod(rows, channels)
    if rest:
        message = f"{rows} inputs are not a whole number of positions of {channels} channels"
        raise ValueError(f"Dense layer {second.name!r} cannot read {first.name!r}: {message}")
    fmt = first.data_format
    if not isinstance(flatten, keras.layers.Flatten) or flatten.data_format == fmt:
        if flatten is None and fmt != "channels_last":
            raise ValueError(
                f"{first.name!r} is channels_first: the order the Dense layer reads depends on "
                "the Flatten's data_format; pass the Flatten layer"
            )
        return Flat(positions, True)
    if fmt == "channels_last":
        raise ValueError(
            f"Flatten {flatten.name!r} (data_format='channels_first') after the channels_last "
            f"{first.name!r} would interleave positions and channels; give the Flatten "
            "data_format='channels_last'"
        )
    return Flat(positions, False)  # a channels_first tensor flattened as it is


@dataclass(frozen=True)
class PairLayout:
    """A pair as code that sees kernels only (an optimizer holds variables) needs it: the two
    layers' entries and the :class:`Flat` between them (:func:`layout_of` makes it from the
    layers)."""

    first: LayerEntry
    second: LayerEntry
    flat: Flat | None = None

    def units(
        self, shape_first: Shape, shape_second: Shape, names: Sequence[str] = ("", "")
    ) -> int:
        """The hidden units that kernels of these shapes share; ``ValueError`` where they do
        not chain (naming the layers ``names``)."""
        if self.second.spatial and not self.first.spatial:
            raise ValueError(
                f"the convolution {names[1]!r} cannot read the units of the Dense layer "
                f"{names[0]!r}"
            )
        n_units = self.first.kernel_units_out(shape_first)
        width = self.second.kernel_units_in(shape_second, self.flat, names[1])
        if width != n_units:
            raise ValueError(
                f"{names[0]!r} with {n_units} outputs and {names[1]!r} with {width} inputs do "
                "not pair (they must share the hidden units)"
            )
        return n_units

    def views(self, kernel_first: Any, kernel_second: Any) -> tuple[tf.Tensor, tf.Tensor]:
        """``(kernel_in (m', n), kernel_out (n, p'))``: the units of the two kernels."""
        kernel_in = self.first.in_view(kernel_first)
        return kernel_in, self.second.out_view(kernel_second, int(kernel_in.shape[1]), self.flat)

    def natives(
        self, kernel_in: tf.Tensor, kernel_out: tf.Tensor, shape_first: Shape, shape_second: Shape
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """The kernels of the given shapes that :meth:`views` reads as these matrices."""
        return (
            self.first.in_native(kernel_in, shape_first),
            self.second.out_native(kernel_out, shape_second, self.flat),
        )


def layout_of(first: Any, second: Any, flatten: Any | None = None) -> PairLayout:
    """The :class:`PairLayout` of two built Keras layers (``flatten``: the layer that flattens
    between them, see :func:`flat_of`), after checking that they share their hidden units.

    Raises:
        ValueError: a layer the seam does not take, or layers that do not pair.
    """
    if first is second:
        raise ValueError(f"layer {first.name!r} cannot pair with itself")
    entry_first, entry_second = entry_of(first), entry_of(second)
    if entry_second.spatial and not entry_first.spatial:
        raise ValueError(f"{second.name!r} (a convolution) cannot read the units of {first.name!r}")
    layout = PairLayout(entry_first, entry_second, flat_of(first, second, flatten))
    layout.units(
        tuple(_kernel(first).shape), tuple(_kernel(second).shape), (first.name, second.name)
    )
    return layout


def prox_kernels(
    kernel_first: Any,
    kernel_second: Any,
    lam: Scalar,
    *,
    first: LayerEntry,
    second: LayerEntry,
    flat: Flat | None = None,
    method: str = "auto",
    check_finite: bool = True,
) -> tuple[tf.Tensor, tf.Tensor]:
    """The exact path-norm prox of two kernels (tensors or variables) whose layers' entries
    are ``first`` and ``second``, with ``flat`` between them: new kernels, in the kernels'
    shapes and dtype. The views go through :func:`~pathnorm_tf.functional.prox_path_norm`
    (``method`` and ``check_finite`` as there); tf ops only, for eager, graph and XLA use.
    """
    k1, k2 = tf.convert_to_tensor(kernel_first), tf.convert_to_tensor(kernel_second)
    layout = PairLayout(first, second, flat)
    kernel_in, kernel_out = layout.views(k1, k2)
    new_in, new_out = prox_path_norm(
        kernel_in, kernel_out, lam, method=method, check_finite=check_finite
    )
    return layout.natives(new_in, new_out, tuple(k1.shape), tuple(k2.shape))


def prox_pair(
    first: Any,
    second: Any,
    lam: Scalar,
    *,
    flatten: Any = None,
    assign: bool = False,
    **options: Any,
) -> tuple[tf.Tensor, tf.Tensor]:
    """The exact path-norm prox of two Keras layers: their new kernels, assigned to them too
    with ``assign``; ``options`` (``method``, ``check_finite``) go to :func:`prox_kernels`;
    ``flatten``: the Flatten between a convolution and a Dense layer (:func:`flat_of`; needed
    after a channels_first convolution).

    Raises:
        ValueError: unsupported layers, a pair whose units do not match, and whatever
            :func:`~pathnorm_tf.functional.prox_path_norm` raises (nothing assigned).
    """
    layout = layout_of(first, second, flatten)
    k1, k2 = _kernel(first), _kernel(second)
    new = prox_kernels(
        k1, k2, lam, first=layout.first, second=layout.second, flat=layout.flat, **options
    )
    if assign:
        k1.assign(new[0])
        k2.assign(new[1])
    return new
