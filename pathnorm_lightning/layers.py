"""The layer seam: what the prox needs to know about a layer type, one entry per type.

The prox is per hidden unit: unit ``i`` owns incoming weights ``y_i`` and outgoing weights
``x_i``, and the 1-path-norm is ``sum_i ||x_i||_1 ||y_i||_1``. A layer *pair* ``(first,
second)`` shares its hidden units: the first layer's outputs (features or channels) are the
second layer's inputs. A :class:`LayerEntry` maps one layer type to those units: ``in_view``
``(weight) -> (n, m')`` (row ``i`` is ``y_i``: the ``w_in`` of
:func:`~pathnorm_lightning.functional.prox_path_norm`) and ``out_view`` ``(weight, n_units,
flatten) -> (p', n)`` (column ``i`` is ``x_i``: its ``w_out``), their inverses and in-place
writes, the unit counts, the configurations it refuses (``check``), and the factor ``s``
(``reuse``): how many times the unrolled network reads each outgoing weight of the second layer
at most (docs/conv_units.md), so that its 1-path-norm is at most ``s * path_norm``.

Layouts of the entries (:data:`ENTRIES`):

* ``Linear(m, n)`` weight (n, m): ``y_i = weight[i, :]``; as second layer ``Linear(n, p)``
  weight (p, n): ``x_i = weight[:, i]``. Both views are the weight itself.
* ``Conv1d`` / ``Conv2d`` weight (C, C_in, *k): ``in_view = weight.reshape(C, -1)`` (a view of
  a contiguous weight); as second layer weight (C_out, C, *k2): ``x_c = weight[:, c]``,
  ``out_view`` = the weight with ``C`` moved last, reshaped to ``(C_out * prod(k2), C)`` (a
  copy: no strided view has that shape).
* Conv -> Flatten -> Linear: ``nn.Flatten`` is channels first, so of a Linear weight
  (p, C * P) (``P`` positions per channel, the ``flatten`` argument) channel ``c`` owns the
  columns ``c * P : (c + 1) * P``; ``out_view`` is (p * P, C) (a copy).

Which modules may stand between the two layers of a pair is data (:data:`BETWEEN`, a role per
module type) that :func:`check_between` reads; a module with parameters or buffers (BatchNorm,
LayerNorm) has no role and is refused. :func:`prox_pair_` runs the exact prox on a pair's views.

The pairing, the hook, the metrics and ``compact`` ask the seam wherever they need a layer
(docs/conv_units.md). Adding a layer type is one :class:`LayerEntry` subclass,
:func:`register`, and its tests (``compact`` removes units per type, in ``compact._UNIT_OPS``).
"""

from __future__ import annotations

import enum
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import Tensor, nn

from pathnorm_lightning._common import shares_memory
from pathnorm_lightning.functional import Method, prox_path_norm_

__all__ = [
    "BETWEEN",
    "ENTRIES",
    "ENTRYWISE_OPS",
    "POOL_OPS",
    "STEEP_OPS",
    "Between",
    "ConvEntry",
    "LayerEntry",
    "LinearEntry",
    "Role",
    "check_between",
    "entry_of",
    "flatten_positions",
    "in_view",
    "max_slope",
    "op_name",
    "out_view",
    "prox_pair_",
    "register",
    "role_of",
    "steep_message",
    "write_in",
    "write_out",
]


class LayerEntry:
    """How the prox sees one layer type (subclass per type, then :func:`register` it).

    View and write methods take the weight tensor (a hook holds weights); counts, checks and
    the reuse factor take the module (they need its configuration).
    """

    #: Whether the layer's outputs have spatial positions (pooling and Flatten may follow).
    spatial: ClassVar[bool] = False

    def check(self, layer: nn.Module) -> None:
        """Raise ``ValueError`` when the seam cannot take ``layer`` as it is configured."""
        if isinstance(_weight(layer), nn.parameter.UninitializedParameter):
            raise ValueError(
                f"{type(layer).__name__} has a weight that is not materialized yet; run one "
                "forward pass on an example batch first"
            )

    def units_out(self, layer: nn.Module) -> int:
        """Hidden units of ``layer`` as the first layer of a pair (its outputs)."""
        raise NotImplementedError

    def units_in(self, layer: nn.Module, flatten: int | None = None) -> int:
        """Hidden units of ``layer`` as the second layer of a pair (its inputs); ``flatten``:
        the positions per channel when a Flatten stands before it."""
        raise NotImplementedError

    def in_view(self, weight: Tensor) -> Tensor:
        """``(n, m')``: row ``i`` is unit ``i``'s incoming weights."""
        raise NotImplementedError

    def in_native(self, matrix: Tensor, shape: torch.Size) -> Tensor:
        """The inverse of :meth:`in_view`: ``matrix`` in the weight's layout of ``shape``."""
        raise NotImplementedError

    def out_view(self, weight: Tensor, n_units: int, flatten: int | None = None) -> Tensor:
        """``(p', n)``: column ``i`` is unit ``i``'s outgoing weights."""
        raise NotImplementedError

    def out_native(self, matrix: Tensor, shape: torch.Size, flatten: int | None = None) -> Tensor:
        """The inverse of :meth:`out_view`: ``matrix`` in the weight's layout of ``shape``."""
        raise NotImplementedError

    def reuse(self, layer: nn.Module, in_positions: Sequence[int] = ()) -> int:
        """The factor ``s`` of ``layer`` as the second layer, reading a grid of
        ``in_positions`` (its input's spatial shape; empty for a Linear layer)."""
        raise NotImplementedError

    def write_in(self, weight: Tensor, matrix: Tensor) -> None:
        """Write an :meth:`in_view`-shaped ``matrix`` into ``weight``, in place."""
        _write(weight, self.in_native(matrix, weight.shape))

    def write_out(self, weight: Tensor, matrix: Tensor, flatten: int | None = None) -> None:
        """Write an :meth:`out_view`-shaped ``matrix`` into ``weight``, in place."""
        _write(weight, self.out_native(matrix, weight.shape, flatten))


def _weight(layer: nn.Module) -> Tensor:
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, Tensor):
        raise ValueError(f"{type(layer).__name__} has no weight tensor")
    return weight


def _write(weight: Tensor, native: Tensor) -> None:
    """``weight[...] = native``, skipped when ``native`` is ``weight``'s own memory (a view the
    prox wrote through)."""
    if (
        native.shape == weight.shape
        and native.data_ptr() == weight.data_ptr()
        and all(
            a == b or size == 1
            for size, a, b in zip(weight.shape, native.stride(), weight.stride(), strict=True)
        )
    ):
        return
    with torch.no_grad():
        weight.copy_(native.clone() if shares_memory(native, weight) else native)


def _check_flatten(flatten: int | None) -> int:
    if flatten is None:
        return 1
    if isinstance(flatten, bool) or not isinstance(flatten, int) or flatten < 1:
        raise ValueError(f"flatten must be None or a positive number of positions, got {flatten!r}")
    return flatten


class LinearEntry(LayerEntry):
    """``nn.Linear``: weight (out_features, in_features); both views are the weight itself, or,
    after a Flatten of ``P`` positions per channel, a (p * P, C) copy."""

    def units_out(self, layer: nn.Module) -> int:
        return int(_weight(layer).shape[0])

    def units_in(self, layer: nn.Module, flatten: int | None = None) -> int:
        width, positions = int(_weight(layer).shape[1]), _check_flatten(flatten)
        if width % positions:
            raise ValueError(
                f"{type(layer).__name__} takes {width} inputs, not a whole number of channels "
                f"of {positions} positions each"
            )
        return width // positions

    def in_view(self, weight: Tensor) -> Tensor:
        return weight

    def in_native(self, matrix: Tensor, shape: torch.Size) -> Tensor:
        return matrix.reshape(shape)

    def out_view(self, weight: Tensor, n_units: int, flatten: int | None = None) -> Tensor:
        positions = _check_flatten(flatten)
        p, width = weight.shape
        if width != n_units * positions:
            raise ValueError(
                f"a Linear weight of shape {tuple(weight.shape)} does not read {n_units} units "
                f"of {positions} position(s) each ({n_units * positions} inputs)"
            )
        if flatten is None:
            return weight
        # channels first: column c * P + q reads channel c at position q
        return weight.reshape(p, n_units, positions).transpose(1, 2).reshape(p * positions, n_units)

    def out_native(self, matrix: Tensor, shape: torch.Size, flatten: int | None = None) -> Tensor:
        positions = _check_flatten(flatten)
        if flatten is None:
            return matrix.reshape(shape)
        n_units = matrix.shape[1]
        return matrix.reshape(shape[0], positions, n_units).transpose(1, 2).reshape(shape)

    def reuse(self, layer: nn.Module, in_positions: Sequence[int] = ()) -> int:
        return 1  # every input (a unit at one position) is read by its own column only


class ConvEntry(LayerEntry):
    """``nn.Conv1d`` / ``nn.Conv2d`` (``groups=1``): weight (C_out, C_in, *k); a unit is an
    output channel (first layer) or an input channel (second layer)."""

    spatial = True

    def check(self, layer: nn.Module) -> None:
        super().check(layer)
        if getattr(layer, "groups", 1) != 1:
            raise ValueError(
                f"{type(layer).__name__} with groups={layer.groups}: grouped and depthwise "
                "convolutions are not supported (a channel's weights are split between groups); "
                "use groups=1 or leave the layer out of the pairs"
            )

    def units_out(self, layer: nn.Module) -> int:
        return int(_weight(layer).shape[0])

    def units_in(self, layer: nn.Module, flatten: int | None = None) -> int:
        if flatten is not None:
            raise ValueError(f"a Flatten cannot stand before a {type(layer).__name__}")
        return int(_weight(layer).shape[1])

    def in_view(self, weight: Tensor) -> Tensor:
        return weight.reshape(weight.shape[0], -1)

    def in_native(self, matrix: Tensor, shape: torch.Size) -> Tensor:
        return matrix.reshape(shape)

    def out_view(self, weight: Tensor, n_units: int, flatten: int | None = None) -> Tensor:
        if flatten is not None:
            raise ValueError("a Flatten cannot stand before a convolution")
        if weight.dim() < 3 or weight.shape[1] != n_units:
            raise ValueError(
                f"a convolution weight of shape {tuple(weight.shape)} does not read {n_units} "
                "input channels"
            )
        return weight.movedim(1, -1).reshape(-1, n_units)

    def out_native(self, matrix: Tensor, shape: torch.Size, flatten: int | None = None) -> Tensor:
        c_out, n_units, *kernel = shape
        return matrix.reshape(c_out, *kernel, n_units).movedim(-1, 1)

    def reuse(self, layer: nn.Module, in_positions: Sequence[int] = ()) -> int:
        conv = cast("nn.modules.conv._ConvNd", layer)
        kernel, stride, dilation = conv.kernel_size, conv.stride, conv.dilation
        if len(in_positions) != len(kernel):
            raise ValueError(
                f"{type(layer).__name__} reads a grid of {len(kernel)} spatial dimensions, got "
                f"in_positions={tuple(in_positions)}"
            )
        if conv.padding == "same":
            pads = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
            lefts = [t // 2 for t in pads]
        elif conv.padding == "valid":
            pads, lefts = [0] * len(kernel), [0] * len(kernel)
        else:
            lefts = list(cast(tuple[int, ...], conv.padding))
            pads = [2 * q for q in lefts]
        factor = 1
        for size, k, st, d, total, left in zip(
            in_positions, kernel, stride, dilation, pads, lefts, strict=True
        ):
            outputs = (size + total - d * (k - 1) - 1) // st + 1
            if conv.padding_mode == "zeros":  # taps on the zero padding read nothing
                factor *= max(_tap_reads(size, outputs, st, d, left, t) for t in range(k))
            else:  # every tap reads a real position
                factor *= outputs
        return factor


def _tap_reads(size: int, outputs: int, stride: int, dilation: int, left: int, tap: int) -> int:
    """In one spatial dimension of a zero-padded convolution: how many of the ``outputs``
    positions read an input position (of ``size``) through kernel tap ``tap``."""
    return sum(0 <= r * stride + tap * dilation - left < size for r in range(outputs))


#: The registry: module type -> entry. A subclass of a registered type uses its entry
#: (``nn.LazyLinear`` once materialized); ``nn.ConvTranspose*`` are not subclasses of ``Conv*``.
ENTRIES: dict[type[nn.Module], LayerEntry] = {
    nn.Linear: LinearEntry(),
    nn.Conv1d: ConvEntry(),
    nn.Conv2d: ConvEntry(),
}


def register(module_type: type[nn.Module], entry: LayerEntry) -> None:
    """Make ``entry`` the seam's entry of ``module_type`` (and of its subclasses)."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")
    if not isinstance(entry, LayerEntry):
        raise TypeError(f"entry must be a LayerEntry, got {type(entry).__name__}")
    ENTRIES[module_type] = entry


def entry_of(layer: nn.Module) -> LayerEntry:
    """The entry of ``layer``'s type, after checking that the entry can take ``layer``.

    Raises:
        ValueError: no entry for the type (the message lists the supported types), or the
            layer's configuration is not supported (see :meth:`LayerEntry.check`).
    """
    for cls in type(layer).__mro__:
        entry = ENTRIES.get(cls)
        if entry is not None:
            entry.check(layer)
            return entry
    names = ", ".join(sorted(t.__name__ for t in ENTRIES))
    raise ValueError(
        f"a {type(layer).__name__} has no hidden units the path-norm prox knows; the supported "
        f"layer types are {names}"
    )


class Role(enum.Enum):
    """What a module between the two layers of a pair does."""

    #: acts on each entry alone and holds no weights: activations, dropout, identity
    POINTWISE = "pointwise"
    #: acts on each channel alone and keeps the channels: max and average pooling
    POOL = "pool"
    #: ``(N, C, *S) -> (N, C * prod(S))``, channels first: between a convolution and a Linear
    FLATTEN = "flatten"


#: The module types that may stand between two paired layers, by role (data the pairing
#: reads). Modules with weights (BatchNorm, LayerNorm, PReLU, ...) have no role.
BETWEEN: dict[type[nn.Module], Role] = {
    **dict.fromkeys(
        (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
         nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus,
         nn.Softsign, nn.Tanhshrink, nn.LogSigmoid, nn.Identity, nn.Dropout, nn.Dropout1d,
         nn.Dropout2d, nn.AlphaDropout, nn.FeatureAlphaDropout),
        Role.POINTWISE,
    ),
    **dict.fromkeys(
        (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveMaxPool1d,
         nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d),
        Role.POOL,
    ),
    nn.Flatten: Role.FLATTEN,
}  # fmt: skip


#: The same roles in the forward pass, where the module tree does not show what stands
#: between two paired layers (``pairing.ForwardCheck`` reads the autograd graph): the ops,
#: named as autograd nodes without their ``Backward<k>`` suffix (:func:`op_name`), that act on
#: each entry alone (activations, dropout, arithmetic, casts, views). Anything else (softmax,
#: sums, indexing, flips, pads, permutes) may mix or move the units.
ENTRYWISE_OPS = frozenset(
    "Relu Threshold Hardtanh LeakyRelu Elu Celu Gelu Silu Mish Tanh Sigmoid LogSigmoid "
    "Hardswish Hardsigmoid Softplus Softshrink Hardshrink NativeDropout Abs Neg Exp Expm1 Log "
    "Log1P Sqrt Rsqrt Pow Sin Cos Atan Sinh Cosh Asinh Erf Sign Sgn Clamp ClampMin ClampMax "
    "Maximum Minimum Where Add Sub Rsub Mul Div Reciprocal ToCopy Clone View UnsafeView "
    "ReshapeAlias Alias Squeeze Unsqueeze".split()
)
#: Pooling ops, after a convolution: each channel alone, its positions combined (``Mean``: an
#: adaptive average pooling to one position).
POOL_OPS = frozenset(
    "MaxPool2DWithIndices AvgPool2D AdaptiveMaxPool2D AdaptiveAvgPool2D Mean".split()
)
#: Entrywise ops of a fixed slope above 1, by the module they stand for (ELU and LeakyReLU keep
#: their parameters where only private autograd attributes show them: not read).
STEEP_OPS: dict[str, type[nn.Module]] = {
    "Gelu": nn.GELU,
    "Silu": nn.SiLU,
    "Mish": nn.Mish,
    "Hardswish": nn.Hardswish,
}


def op_name(node: object) -> str:
    """An autograd node's op, without its ``Backward<k>`` suffix (``ReluBackward0``: Relu)."""
    return re.sub(r"Backward\d*$", "", type(node).__name__)


#: The pointwise types whose slope can exceed 1, with their largest |slope| (of the default
#: arguments, or read from the module). The path-norm bounds the (l_inf, l_1) Lipschitz constant
#: for activations of slope at most 1; a steeper one multiplies it by up to its slope per pair.
#: The constants are the sup of |f'| to 4 digits, rounded up (held to autograd in the tests).
STEEP: dict[type[nn.Module], object] = {
    nn.GELU: 1.129,
    nn.SiLU: 1.1,
    nn.Mish: 1.089,
    nn.SELU: 1.7582,
    nn.Hardswish: 1.5,
    nn.ELU: "alpha",
    nn.CELU: None,  # slope exp(x / alpha) <= 1 for every alpha
    nn.LeakyReLU: "negative_slope",
}


def max_slope(module: nn.Module) -> float:
    """The largest ``|f'|`` of a pointwise module (1.0 when it is at most 1, as for ReLU)."""
    value = next((STEEP[cls] for cls in type(module).__mro__ if cls in STEEP), None)
    if isinstance(value, str):
        return max(1.0, abs(float(getattr(module, value))))
    return 1.0 if value is None else float(cast(float, value))


def steep_message(what: str, name: str, slope: float) -> str:
    """The warning for an activation ``name`` of slope up to ``slope`` > 1 ``what`` (between
    the two layers of a pair)."""
    return (
        f"{what}: {name} has a slope of up to {slope:g} > 1, so the pair's path norm bounds its "
        "Lipschitz constant only up to that factor: the logged path_norm_bound and "
        "product_bound are not bounds of this network (activations of slope <= 1 keep them: "
        "ReLU, ELU (alpha <= 1), Tanh, Sigmoid, Softplus)"
    )


def role_of(module: nn.Module) -> Role | None:
    """The :class:`Role` of ``module`` between two paired layers, or None (not allowed)."""
    return next((BETWEEN[cls] for cls in type(module).__mro__ if cls in BETWEEN), None)


@dataclass(frozen=True)
class Between:
    """What stands between two paired layers, as :func:`check_between` found it."""

    pools: tuple[nn.Module, ...]
    flatten: nn.Module | None


def check_between(first: nn.Module, second: nn.Module, modules: Sequence[nn.Module]) -> Between:
    """Check the modules between ``first`` and ``second`` (in forward order).

    Allowed: pointwise modules anywhere; pooling after a convolution, before any Flatten
    (``AvgPool`` without ``divisor_override``, which would scale the sums); exactly one
    ``nn.Flatten(1, -1)`` between a convolution and a Linear layer, which that pair needs.

    Raises:
        ValueError: naming the module and why it breaks the pair.
    """
    spatial_in, spatial_out = entry_of(first).spatial, entry_of(second).spatial
    what = f"between a {type(first).__name__} and a {type(second).__name__}"
    pools: list[nn.Module] = []
    flatten: nn.Module | None = None
    for module in modules:
        role, name = role_of(module), type(module).__name__
        if role is None:
            raise ValueError(
                f"{what}: a {name} is neither pointwise, nor pooling, nor a Flatten; the pair "
                "would not be a shallow network and its path-norm would not bound it (pair "
                "other layers, or leave this pair out)"
            )
        if role is Role.POINTWISE and max_slope(module) > 1.0:
            warnings.warn(steep_message(what, name, max_slope(module)), UserWarning, stacklevel=3)
        if role is Role.POOL:
            if not spatial_in or flatten is not None:
                raise ValueError(f"{what}: a {name} pools positions, but there are none here")
            if getattr(module, "divisor_override", None) is not None:
                raise ValueError(
                    f"{what}: {name}(divisor_override={module.divisor_override}) scales the "
                    "window sums; only plain averages (and maxima) keep the factor s"
                )
            pools.append(module)
        elif role is Role.FLATTEN:
            if not (spatial_in and not spatial_out) or flatten is not None:
                raise ValueError(f"{what}: a Flatten may stand only once, after a convolution")
            if (module.start_dim, module.end_dim) != (1, -1):
                raise ValueError(
                    f"{what}: Flatten(start_dim={module.start_dim}, end_dim={module.end_dim}) "
                    "must flatten every non-batch dimension (Flatten(1, -1))"
                )
            flatten = module
    if spatial_in and not spatial_out and flatten is None:
        raise ValueError(f"{what}: the convolution's output needs an nn.Flatten before it")
    if spatial_out and not spatial_in:
        raise ValueError(f"{what}: a convolution cannot read the units of a Linear layer")
    return Between(tuple(pools), flatten)


def flatten_positions(first: nn.Module, second: nn.Module) -> int | None:
    """Positions per channel of the Flatten between a convolution ``first`` and a Linear
    ``second`` (``second``'s inputs over ``first``'s channels); None for any other pair."""
    entry_first, entry_second = entry_of(first), entry_of(second)
    if not entry_first.spatial or entry_second.spatial:
        return None
    channels, width = entry_first.units_out(first), int(_weight(second).shape[1])
    if width % channels:
        raise ValueError(
            f"a {type(second).__name__} with {width} inputs cannot read the {channels} channels "
            f"of a {type(first).__name__} through a Flatten ({width} is not a multiple of "
            f"{channels})"
        )
    return width // channels


def in_view(layer: nn.Module) -> Tensor:
    """``layer``'s incoming weights as (n, m'), row ``i`` = unit ``i`` (see the module doc)."""
    return entry_of(layer).in_view(_weight(layer))


def out_view(layer: nn.Module, n_units: int, flatten: int | None = None) -> Tensor:
    """``layer``'s outgoing weights as (p', n), column ``i`` = unit ``i``."""
    return entry_of(layer).out_view(_weight(layer), n_units, flatten)


def write_in(layer: nn.Module, matrix: Tensor) -> None:
    """Write an :func:`in_view`-shaped ``matrix`` into ``layer.weight`` in place."""
    entry_of(layer).write_in(_weight(layer), matrix)


def write_out(layer: nn.Module, matrix: Tensor, flatten: int | None = None) -> None:
    """Write an :func:`out_view`-shaped ``matrix`` into ``layer.weight`` in place."""
    entry_of(layer).write_out(_weight(layer), matrix, flatten)


def _pair(first: nn.Module, second: nn.Module) -> tuple[LayerEntry, LayerEntry, int, int | None]:
    """The entries, the hidden width and the flatten positions of a pair, checked."""
    if first is second:
        raise ValueError("a layer cannot pair with itself")
    entry_first, entry_second = entry_of(first), entry_of(second)
    if entry_second.spatial and not entry_first.spatial:
        raise ValueError(
            f"a {type(second).__name__} cannot read the units of a {type(first).__name__}"
        )
    flatten = flatten_positions(first, second)
    n_units = entry_first.units_out(first)
    width = entry_second.units_in(second, flatten)
    if width != n_units:
        raise ValueError(
            f"a {type(first).__name__} with {n_units} outputs and a {type(second).__name__} "
            f"with {width} inputs do not pair (they must share the hidden units)"
        )
    return entry_first, entry_second, n_units, flatten


def prox_pair_(
    first: nn.Module,
    second: nn.Module,
    lam: float | Tensor,
    *,
    method: Method = "auto",
    check_finite: bool = True,
) -> tuple[Tensor, Tensor]:
    """The exact path-norm prox of a layer pair, in place on both weights; returns
    ``(first.weight, second.weight)``.

    Runs :func:`~pathnorm_lightning.functional.prox_path_norm_` on the entries' views and
    writes back what a view could not hold. A convolution followed by a Linear layer reads a
    Flatten in between (channels first), its positions per channel taken from the shapes.

    Raises:
        ValueError: unsupported layers or a pair whose units do not match, and whatever
            :func:`~pathnorm_lightning.functional.prox_path_norm_` raises (nothing written).
    """
    entry_first, entry_second, n_units, flatten = _pair(first, second)
    w_first, w_second = _weight(first), _weight(second)
    w_in = entry_first.in_view(w_first.detach())
    w_out = entry_second.out_view(w_second.detach(), n_units, flatten)
    prox_path_norm_(w_in, w_out, lam, method=method, check_finite=check_finite)
    entry_first.write_in(w_first, w_in)
    entry_second.write_out(w_second, w_out, flatten)
    return w_first, w_second
