"""Which kernels the optimizers regularize, resolved from the variables they train.

A Keras optimizer sees only variables, never the model, and a Keras 3 variable keeps no
reference to its layer, only a ``.path`` such as ``"sequential/dense_1/kernel"`` (the layer's
path, then the variable name). An optimizer given the model (``model=``, ``verify_pairs(model)``)
also maps each variable to its layer (:mod:`pathnorm_tf._graph`).

The layers are those of the layer seam (:mod:`pathnorm_tf.layers`: ``Dense``, ``Conv1D``,
``Conv2D``). A *layer kernel* is a trained variable named ``kernel``, not in a recurrent cell,
that is

* 2-D: a Dense kernel. Any layer holding a 2-D ``kernel`` (an ``EinsumDense`` such as
  ``"ab,bc->ac"``, a custom layer) looks the same, so it counts as Dense and the prox assumes
  ``y = x @ kernel``: pair such layers only if that is what they compute (passing the layer
  object itself is refused unless the seam has an entry for its class);
* 3-D or 4-D and owned by a ``Conv1D`` / ``Conv2D`` (``groups=1``). ``Conv2DTranspose`` and
  ``DepthwiseConv2D`` kernels have those ranks too, and a Flatten's channel order is not in the
  variables, so a convolution kernel is taken only where the optimizer saw the model; without
  it such a target is refused, with that advice.

A recurrent cell is a layer path that also holds a ``recurrent_kernel`` (the Keras convention:
``SimpleRNN``, ``LSTM``, ``GRU``, ``RNN``, ``StackedRNNCells``, ``Bidirectional``,
``ConvLSTM*``). ``"auto"`` skips cells and refuses a pair with a recurrent layer between (not a
shallow network); naming one is an error that says it is recurrent. ``Embedding`` and other
layers whose weight is not called ``kernel`` hold no layer kernel.

A layer is named by ``layer.name`` (``"dense_1"``), or by a longer suffix of its path
(``"enc/dense_1"``) when the name is ambiguous; layer objects are stored by name (configs stay
serializable). Paths are not stable: one holds an outer model's name only if the layer was built
inside that model (``"net/d1"`` in a ``Sequential`` given an ``Input`` or a subclassed model,
``"d1"`` in a functional one), and after ``load_model`` every path is the bare layer name.
Hence the naming rule:

* a name matches the layer kernels whose layer path ends with it, component by component;
* while it matches none, its leading component is dropped if no trained variable's path holds
  it (``"net/d1"`` is looked up as ``"d1"``); one that occurs is kept (``"enc/d3"`` matches
  nothing when ``enc`` has no ``d3``);
* a name that matches several layer kernels is an error listing them: nothing is guessed.

Resolved explicit names are *recorded* (:func:`record_of`, :mod:`pathnorm_tf._record`), so a
reloaded model keeps its pairs where its paths no longer tell the layers apart.

``pairs="auto"`` pairs consecutive layer kernels in variable (= layer) order, (K1, K2), (K3,
K4), ... as in the paper's multilayer extension, checking that the units chain (Dense -> Dense,
Conv -> Conv, Conv -> Flatten -> Dense; never Dense -> Conv) and, with the model, that the
layers between are ones the seam allows (:func:`~pathnorm_tf.layers.check_between`); an unpaired
last kernel is warned about. Each pair resolves to a :class:`Pair`: the two kernels' indices
and their :class:`~pathnorm_tf.layers.PairLayout`, all an optimizer needs for the prox.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import keras

from pathnorm_tf import _record
from pathnorm_tf import layers as seam
from pathnorm_tf._graph import (
    Owners,
    check_auto_pairs_in_model,
    layer_path,
    not_consecutive,
    owners_of,
    path_between,
)
from pathnorm_tf._record import Record, check_record

__all__ = [
    "Chain",
    "ModelNeeded",
    "Pair",
    "check_auto_pairs_in_model",
    "check_record",
    "kernel_chains",
    "layer_kernels",
    "layer_path",
    "normalize_layers",
    "normalize_pairs",
    "owners_of",
    "record_of",
    "resolve_layers",
    "resolve_pairs",
]

PairsSpec = str | list[tuple[str, str]]
LayersSpec = str | list[str]
#: The layer types the seam knows, for messages.
KINDS = "Dense/Conv1D/Conv2D"


def _has_entry(layer: Any) -> bool:
    return seam._by_class(seam.ENTRIES, layer) is not None


def _layer_name(layer: Any, what: str) -> str:
    if isinstance(layer, str):
        if not layer:
            raise ValueError(f"{what}: a layer name must not be empty")
        return layer
    if isinstance(layer, keras.layers.Layer):
        if not _has_entry(layer):
            raise ValueError(
                f"{what}: layer {layer.name!r} is a {type(layer).__name__}, not a {KINDS} "
                "layer; only the kernels of those can be regularized"
            )
        return str(layer.name)
    raise TypeError(f"{what}: expected a layer name (str) or a keras {KINDS} layer, got {layer!r}")


def normalize_pairs(pairs: Any) -> PairsSpec:
    """``"auto"`` or a list of ``(name_in, name_out)`` tuples (layers replaced by names)."""
    if isinstance(pairs, str):
        if pairs != "auto":
            raise ValueError(
                f'pairs must be "auto" or a list of (layer, layer) tuples, got {pairs!r}'
            )
        return "auto"
    if not isinstance(pairs, Sequence) or len(pairs) == 0:
        raise ValueError(
            f'pairs must be "auto" or a non-empty list of (layer, layer) tuples, got {pairs!r}'
        )
    out: list[tuple[str, str]] = []
    for pair in pairs:
        if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(
                f"pairs: each entry must be a (first_layer, second_layer) tuple, got {pair!r}"
            )
        out.append((_layer_name(pair[0], "pairs"), _layer_name(pair[1], "pairs")))
    return out


def normalize_layers(layers: Any) -> LayersSpec:
    """``"auto"`` or a list of layer names (layers replaced by names)."""
    if isinstance(layers, str):
        if layers != "auto":
            raise ValueError(f'layers must be "auto" or a list of layer names, got {layers!r}')
        return "auto"
    if not isinstance(layers, Sequence) or len(layers) == 0:
        raise ValueError(f'layers must be "auto" or a non-empty list of layers, got {layers!r}')
    return [_layer_name(layer, "layers") for layer in layers]


def _path(variable: Any) -> str:
    return str(getattr(variable, "path", variable.name))


# The cells Keras' recurrent layers create (named by Keras, then made unique: "lstm_cell_3").
_CELL_KINDS = {
    "simple_rnn_cell": "a SimpleRNN",
    "lstm_cell": "an LSTM",
    "gru_cell": "a GRU",
    "conv_lstm_cell": "a ConvLSTM",
}


class _Scan(NamedTuple):
    kernels: list[tuple[int, str]]  # (index, layer path) of each layer kernel, in variable order
    recurrent: list[tuple[int, str]]  # (index, cell path) of each recurrent cell's kernel


def _is_conv_kernel(variable: Any, owners: Owners | None) -> bool:
    """A 3-D/4-D kernel: a convolution's where the model shows its layer has a spatial seam
    entry; unknown (kept, refused when used: :func:`_entry`) without the model."""
    if owners is None:
        return True
    entry = seam._by_class(seam.ENTRIES, owners.get(id(variable)))
    return entry is not None and entry.spatial


def _scan(variables: Sequence[Any], owners: Owners | None = None) -> _Scan:
    """Sort the variables named ``kernel`` into layer kernels and recurrent-cell kernels."""
    paths = [_path(v).rpartition("/") for v in variables]  # (layer path, "/", variable name)
    cells = {layer for layer, _, name in paths if name == "recurrent_kernel"}
    kernels, recurrent = [], []
    for i, (layer, _, name) in enumerate(paths):
        if name != "kernel":
            continue
        rank = len(variables[i].shape)
        if layer in cells:
            recurrent.append((i, layer))
        elif rank == 2 or (rank in (3, 4) and _is_conv_kernel(variables[i], owners)):
            kernels.append((i, layer))
    return _Scan(kernels, recurrent)


def layer_kernels(variables: Sequence[Any], model: Any | None = None) -> list[int]:
    """Indices of the layer kernels among ``variables``, in variable order (``model``: the
    model that trains them, which tells convolutions from other layers)."""
    return [i for i, _ in _scan(variables, owners_of(model)).kernels]


def _matches(layer_path: str, name: str) -> bool:
    return layer_path == name or layer_path.endswith("/" + name)


def _within(layer_path: str, name: str) -> bool:
    """Whether the layer ``name`` (a path suffix) is ``layer_path`` or contains it."""
    return f"/{name}/" in f"/{layer_path}/"


def _recurrent_error(what: str, name: str, cells: list[str], known: list[str]) -> ValueError:
    kinds = {_CELL_KINDS.get(re.sub(r"_\d+$", "", cell.rpartition("/")[2])) for cell in cells}
    kind = next(iter(kinds)) if len(kinds) == 1 else None
    layer = f"{kind} (recurrent) layer" if kind else "a recurrent layer"
    holds = f"its cell {cells[0]!r} holds" if len(cells) == 1 else f"its cells {cells} hold"
    return ValueError(
        f"{what}: {name!r} is {layer}, not {KINDS}: {holds} a kernel and a recurrent_kernel, "
        f"and only {KINDS} kernels can be regularized. Name those layers only; the ones this "
        f"optimizer trains are {known}."
    )


def _lookup(kernels: list[tuple[int, str]], name: str, present: set[str]) -> tuple[list[int], str]:
    """The layer kernels ``name`` matches, and the suffix of ``name`` that matched.

    Leading components of ``name`` are dropped, one at a time, while nothing matches and the
    component is in no trained variable's path (an outer model name that Keras left out).
    """
    parts = name.split("/")
    k = 0
    while True:
        suffix = "/".join(parts[k:])
        hits = [i for i, layer in kernels if _matches(layer, suffix)]
        if hits or k == len(parts) - 1 or parts[k] in present:
            return hits, suffix
        k += 1


def _find(variables: Sequence[Any], name: str, what: str, scan: _Scan) -> int:
    kernels = scan.kernels
    present = {part for v in variables for part in layer_path(v).split("/")}
    hits, suffix = _lookup(kernels, name, present)
    dropped = "" if suffix == name else name[: -len(suffix) - 1]
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        why = (
            f"; {dropped!r} is in no trained variable's path (a reloaded model's paths lose "
            f"the outer model names), so it was looked up as {suffix!r}"
            if dropped
            else ""
        )
        listed = ", ".join(f"{_path(variables[i])!r} {tuple(variables[i].shape)}" for i in hits)
        raise ValueError(
            f"{what}: layer name {name!r} is ambiguous: it matches the layer kernels "
            f"[{listed}]{why}. Name the layer by a longer suffix of its "
            "path, or give the layers unique names."
        )
    known = [layer for _, layer in kernels]
    cells = [cell for _, cell in scan.recurrent if _within(cell, suffix)]
    if cells and not any(_within(layer, suffix) for layer in known):
        raise _recurrent_error(what, name, cells, known)
    others = [v for v in variables if _matches(layer_path(v), suffix)]
    if others:
        shapes = [(_path(v), tuple(v.shape)) for v in others]
        raise ValueError(
            f"{what}: layer {name!r} is not a {KINDS} layer (its trained variables are "
            f"{shapes}); only the kernels of those can be regularized"
        )
    raise ValueError(
        f"{what}: no trained {KINDS} layer named {name!r}; the ones this optimizer trains "
        f"are {known}. Use layer.name (or a path suffix); frozen layers cannot be regularized."
    )


def _skipped(scan: _Scan) -> str:
    if not scan.recurrent:
        return ""
    return f"; recurrent layers are skipped ({[cell for _, cell in scan.recurrent]})"


def _recurrent_between(scan: _Scan, i: int, j: int) -> str | None:
    """The path of a recurrent cell whose kernel lies between variables ``i`` and ``j``."""
    return next((cell for r, cell in scan.recurrent if min(i, j) < r < max(i, j)), None)


class ModelNeeded(ValueError):
    """A target that only the model can resolve (a convolution kernel), resolved without it."""


def _needs_model(variable: Any, what: str) -> ValueError:
    return ModelNeeded(
        f"{what}: {_path(variable)!r} {tuple(variable.shape)} is a {len(variable.shape)}-D "
        "kernel, which the trained variables alone cannot tell to be a Conv1D/Conv2D kernel "
        "(Conv2DTranspose and DepthwiseConv2D kernels have the same rank), nor how a Flatten "
        "after it orders the channels; the optimizer was built without seeing the model. "
        "Call optimizer.verify_pairs(model) before the first step, or pass model=model to the "
        "optimizer."
    )


def _entry(variable: Any, owners: Owners | None, what: str) -> seam.LayerEntry:
    """The seam entry of the layer that owns the kernel ``variable``: its layer's where the
    model shows it, :class:`~pathnorm_tf.layers.DenseEntry` for any other 2-D kernel."""
    owner = None if owners is None else owners.get(id(variable))
    if owner is not None and _has_entry(owner):
        try:
            return seam.entry_of(owner)
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from None
    if len(variable.shape) == 2:
        return _DENSE
    raise _needs_model(variable, what)


_DENSE = seam.DenseEntry()


class Pair(NamedTuple):
    """A resolved pair: the indices of its two kernels among the variables, and their layout
    (entries and the Flatten between)."""

    first: int
    second: int
    layout: seam.PairLayout


def _moves(layer: Any) -> bool:
    """Whether ``layer`` reorders its input's axes (a ``Permute``)."""
    return isinstance(layer, keras.layers.Permute)


def _layout(
    variables: Sequence[Any],
    i: int,
    j: int,
    owners: Owners | None,
    what: str,
    names: tuple[str, str] | None = None,
    hint: str = "",
) -> seam.PairLayout:
    """The :class:`~pathnorm_tf.layers.PairLayout` of kernels ``i`` and ``j``, after checking
    that they chain (the first's outputs are the second's inputs); ``names``: the layers as the
    user named them (default: their paths), for the errors; ``hint``: what to do, appended to
    an error saying that they do not chain."""
    a, b = names or (layer_path(variables[i]), layer_path(variables[j]))
    first, second = _entry(variables[i], owners, what), _entry(variables[j], owners, what)
    where = f"{what}: layers {a!r} -> {b!r} do not chain"
    if second.spatial and not first.spatial:
        raise ValueError(f"{where}: a convolution cannot read the units of a Dense layer{hint}")
    flat = None
    if first.spatial and not second.spatial:  # a convolution's owner is known (_entry)
        assert owners is not None
        conv, dense = owners[id(variables[i])], owners.get(id(variables[j]))
        if dense is None:
            raise _needs_model(variables[j], what)
        between = path_between(conv, dense)
        flatten = None
        moved = [x.name for x in path_between(conv, dense, any_layer=True) or () if _moves(x)]
        if moved:  # the Dense rows would be matched to channels by the conv's layout: wrong
            raise ValueError(
                f"{where}: {moved[0]!r} between them moves the entries the Dense layer reads, "
                f"so its rows cannot be matched to the channels of {conv.name!r} (pair other "
                f"layers, or leave this pair out){hint}"
            )
        if between is not None:
            try:
                flatten = seam.check_between(conv, dense, between).flatten
            except ValueError:
                pass  # explicit pairs are the user's choice; "auto" checks this itself
        try:
            flat = seam.flat_of(conv, dense, flatten)
        except ValueError as err:
            why = str(err)
            if between is None and conv.data_format != "channels_last":
                why = (
                    f"{conv.name!r} is channels_first and the model's graph does not show a "
                    "Flatten before the Dense layer (a subclassed model has no graph; a Reshape "
                    "is no Flatten), so the order the Dense layer reads its channels in cannot "
                    "be told: put a Flatten between them in a Sequential or functional model, "
                    "or use channels_last"
                )
            raise ValueError(f"{where}: {why}{hint}") from None
    layout = seam.PairLayout(first, second, flat)
    shape_i, shape_j = tuple(variables[i].shape), tuple(variables[j].shape)
    units = first.kernel_units_out(shape_i)
    inputs = second.kernel_units_in(shape_j, flat, b)
    if units != inputs:
        raise ValueError(
            f"{where}: {a!r} has {units} units but {b!r} takes {inputs} inputs (kernels "
            f"{shape_i} and {shape_j}){hint}"
        )
    return layout


def record_of(
    variables: Sequence[Any], spec: Sequence[Any], resolved: Sequence[Any], model: Any = None
) -> Record:
    """Which layer kernels the explicit ``spec`` resolved to, in a form that survives reload
    (:mod:`pathnorm_tf._record`). ``spec``: explicit pairs or layers; ``resolved``: what
    :func:`resolve_pairs` or :func:`resolve_layers` returned for it (or their indices);
    ``model``: as given to them."""
    scan = _scan(variables, owners_of(model))
    indices = [x for item in resolved for x in (item[:2] if isinstance(item, tuple) else (item,))]
    return _record.make(spec, variables, scan.kernels, indices)


def resolve_pairs(
    variables: Sequence[Any],
    pairs: PairsSpec,
    record: Record | None = None,
    model: Any | None = None,
) -> tuple[Pair, ...]:
    """The kernel pairs to regularize: :class:`Pair` s, indices into ``variables`` and layouts.

    ``record``: what :func:`record_of` wrote for these names before, used instead of them when
    ``variables`` hold the same layer kernels; ``model``: the model that trains ``variables``,
    if known (needed for convolutions).
    """
    owners = owners_of(model)
    scan = _scan(variables, owners)
    if pairs == "auto":
        kernels = scan.kernels
        if len(kernels) < 2:
            raise ValueError(
                f'pairs="auto" found fewer than two trained {KINDS} kernels '
                f"({[layer for _, layer in kernels]}{_skipped(scan)}); the path-norm prox "
                "needs a pair of layers (e.g. Dense -> Dense, or Conv -> Flatten -> Dense)"
            )
        out: list[Pair] = []
        for (i, a), (j, b) in zip(kernels[0::2], kernels[1::2], strict=False):
            cell = _recurrent_between(scan, i, j)
            if cell is not None:
                raise not_consecutive(a, b, f"recurrent layer {cell!r}")
            # a layer with trained variables between them (variable order is layer order)
            others = [v for v in variables[i + 1 : j] if layer_path(v) not in (a, b)]
            if others:
                layer = layer_path(others[0])
                trains = [_path(v) for v in others if layer_path(v) == layer]
                raise not_consecutive(a, b, f"layer {layer!r} (it trains {trains})")
            done = [(layer_path(variables[p.first]), layer_path(variables[p.second])) for p in out]
            hint = (
                '. pairs="auto" takes the layers two by two in the model\'s layer order'
                + (f" (it had paired {done} before)" if done else "")
                + ", which in a model with parallel branches is not the order they feed each "
                "other; pass pairs=[(first, second), ...] to name the pairs that chain explicitly"
            )
            out.append(Pair(i, j, _layout(variables, i, j, owners, 'pairs="auto"', hint=hint)))
        if len(kernels) % 2:
            warnings.warn(
                f'pairs="auto": the last layer {kernels[-1][1]!r} has no partner and is '
                "not regularized; pass pairs=[...] to choose the pairs explicitly",
                stacklevel=3,
            )
        return tuple(out)
    assert not isinstance(pairs, str)
    found = _record.lookup(record, _record.flat(pairs), variables, scan.kernels)
    seen: dict[int, str] = {}
    out = []
    for k, (a, b) in enumerate(pairs):
        i = found[2 * k] if found is not None else _find(variables, a, "pairs", scan)
        j = found[2 * k + 1] if found is not None else _find(variables, b, "pairs", scan)
        for name, idx in ((a, i), (b, j)):
            if idx in seen:
                raise ValueError(
                    f"pairs: layer {name!r} appears in two pairs ({seen[idx]} and {(a, b)}); "
                    "each layer can belong to one pair only"
                )
            seen[idx] = str((a, b))
        out.append(Pair(i, j, _layout(variables, i, j, owners, "pairs", (a, b))))
    return tuple(out)


class Single(NamedTuple):
    """A resolved layer of a baseline: its kernel's index among the variables and its entry."""

    kernel: int
    entry: seam.LayerEntry


def resolve_layers(
    variables: Sequence[Any],
    layers: LayersSpec,
    record: Record | None = None,
    model: Any | None = None,
) -> tuple[Single, ...]:
    """The kernels to regularize (baselines), as :class:`Single` s.

    ``record``, ``model``: see :func:`resolve_pairs`.
    """
    owners = owners_of(model)
    scan = _scan(variables, owners)
    what = "layers"
    if layers == "auto":
        if not scan.kernels:
            raise ValueError(
                f'layers="auto" found no trained {KINDS} kernel to regularize{_skipped(scan)}'
            )
        indices = [i for i, _ in scan.kernels]
        what = 'layers="auto"'
    else:
        found = _record.lookup(record, _record.flat(layers), variables, scan.kernels)
        indices = []
        for k, name in enumerate(layers):
            i = found[k] if found is not None else _find(variables, name, what, scan)
            if i in indices:
                raise ValueError(f"layers: layer {name!r} is listed twice")
            indices.append(i)
    return tuple(Single(i, _entry(variables[i], owners, what)) for i in indices)


class Chain(list[Any]):
    """Kernels in forward order (a list) and, in :attr:`layouts`, the
    :class:`~pathnorm_tf.layers.PairLayout` of each two consecutive ones."""

    def __init__(self, kernels: Sequence[Any], layouts: Sequence[seam.PairLayout]) -> None:
        super().__init__(kernels)
        if len(layouts) != max(len(kernels) - 1, 0):
            raise ValueError(f"a chain of {len(kernels)} kernels has {len(kernels) - 1} links")
        self.layouts = list(layouts)


def kernel_chains(
    variables: Sequence[Any], singles: Sequence[Single], model: Any | None = None
) -> list[Chain]:
    """Split the kernels of ``singles`` into maximal forward chains of indices (for the
    metrics): in variable order, two kernels share a chain when no other layer kernel or
    recurrent kernel lies between them and their units chain."""
    owners = owners_of(model)
    scan = _scan(variables, owners)
    position = {i: p for p, (i, _) in enumerate(scan.kernels)}
    chains: list[Chain] = []
    for i in sorted(s.kernel for s in singles):
        if chains:
            prev = chains[-1][-1]
            layout = None
            if position[i] == position[prev] + 1 and _recurrent_between(scan, prev, i) is None:
                try:
                    layout = _layout(variables, prev, i, owners, "layers")
                except ValueError:
                    pass  # their units do not chain: a new chain
            if layout is not None:
                chains[-1].append(i)
                chains[-1].layouts.append(layout)
                continue
        chains.append(Chain([i], []))
    return chains
