"""``compact``: remove the dead hidden units of every Dense pair; a smaller model, same function.

The Keras twin of ``pathnorm_lightning.compact`` (same rules; see ``docs/compaction.md``). For a
pair ``first -> pointwise layers -> second`` (paired as the optimizers pair them), hidden unit
``i`` is removed when

* its **outgoing** weights are all zero (``second.kernel[i, :] == 0``): it adds nothing;
* its **incoming** weights are all zero (``first.kernel[:, i] == 0``) but not its outgoing ones:
  it outputs the constant ``c_i = act(b_i)`` (``first``'s activation, then the layers between,
  at inference); ``c_i * second.kernel[i, :]`` is added to ``second``'s bias (``use_bias`` is
  turned on where it was off) and the unit goes.

A pair whose units are all dead keeps one zero unit (``Dense(0)`` is not a valid layer).

The result is a new model of the same kind (``Sequential`` or functional) built by
``keras.models.clone_model``: the paired Dense layers are new, smaller ``Dense`` layers, every
other layer a clone holding the same weights; the input model is not changed. It is compiled
from the input's compile config when the input was compiled (a fresh optimizer state).

Exactness needs the hidden units to reach nothing but ``second``, entry by entry: both layers
sit in one ``Sequential`` with only pointwise layers between them, or in one functional model
whose graph takes ``first``'s output through single-consumer pointwise layers into ``second``
alone (each layer called once; no intermediate is a model output). ``first``'s activation must
be a built-in entry-wise one (not softmax). Anything else is refused with the reason.

Layer types enter through one seam, :data:`_UNIT_OPS` (layer class -> the class that counts,
reads and shrinks its units); only ``Dense`` has an entry today.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from pathnorm_tf import pairing
from pathnorm_tf.pairing import _MIXING, _pointwise

__all__ = ["CompactionReport", "PairCompaction", "compact"]


@dataclass(frozen=True)
class PairCompaction:
    """One pair's hidden units and parameters before/after: ``removed`` units had zero outgoing
    weights, ``folded`` ones zero incoming weights (their constant went into the bias)."""

    first: str
    second: str
    units_before: int
    units_after: int
    removed: int
    folded: int
    params_before: int
    params_after: int


@dataclass(frozen=True)
class CompactionReport:
    """Per-pair results and the model's parameter count before/after; ``str()`` is a table."""

    pairs: tuple[PairCompaction, ...]
    params_before: int
    params_after: int

    @property
    def units_before(self) -> int:
        return sum(p.units_before for p in self.pairs)

    @property
    def units_after(self) -> int:
        return sum(p.units_after for p in self.pairs)

    def __str__(self) -> str:
        rows = [("pair", "units", "removed", "folded", "pair params")] + [
            (f"{p.first} -> {p.second}", f"{p.units_before} -> {p.units_after}", f"{p.removed}",
             f"{p.folded}", f"{p.params_before:,} -> {p.params_after:,}")
            for p in self.pairs
        ]  # fmt: skip
        width = [max(map(len, column)) for column in zip(*rows, strict=True)]
        share = self.params_after / max(self.params_before, 1)
        return "\n".join(
            ["  ".join(cell.ljust(w) for cell, w in zip(row, width, strict=True)) for row in rows]
            + [f"model parameters {self.params_before:,} -> {self.params_after:,} ({share:.1%})"]
        )


# -- the layer seam: one entry per layer type ----------------------------------------------------


class _DenseUnits:
    """``Dense``: hidden unit ``i`` is column ``i`` of the first layer's kernel ``(m, n)`` (and
    bias entry ``i``), and row ``i`` of the second layer's kernel ``(n, p)``. A shrunk layer is
    described as ``(config, weights)`` for a new layer of the same class."""

    @staticmethod
    def check(name: str, layer: Any) -> None:
        if layer.quantization_mode is not None or layer.lora_enabled:
            raise ValueError(
                f"compact: Dense layer {name!r} is quantized or has LoRA enabled; compact "
                "shrinks plain float Dense layers (compact before quantizing or adding LoRA)."
            )

    @staticmethod
    def units_out(layer: Any) -> int:
        return int(layer.units)

    @staticmethod
    def zero_incoming(layer: Any) -> np.ndarray:
        return np.all(np.asarray(layer.kernel) == 0, axis=0)

    @staticmethod
    def zero_outgoing(layer: Any) -> np.ndarray:
        return np.all(np.asarray(layer.kernel) == 0, axis=1)

    @staticmethod
    def probe(layer: Any) -> Any:
        """Zeros on which every unit outputs what one with zero incoming weights always does."""
        return keras.ops.zeros((1, layer.kernel.shape[0]), dtype=layer.compute_dtype)

    @staticmethod
    def unit_values(output: Any) -> np.ndarray:
        return np.asarray(output)[0]

    @staticmethod
    def input_shift(layer: Any, constants: np.ndarray) -> np.ndarray | None:
        """The change to the output when input unit ``i`` is ``constants[i]`` instead of zero:
        exactly a bias (None where a type cannot fold)."""
        kernel = np.asarray(layer.kernel)
        return constants.astype(kernel.dtype) @ kernel

    @staticmethod
    def keep_out(layer: Any, keep: np.ndarray, zero: bool) -> tuple[dict, list[np.ndarray]]:
        weights = [w[..., keep] * (not zero) for w in layer.get_weights()]  # kernel, bias
        return {**layer.get_config(), "units": len(keep)}, weights

    @staticmethod
    def keep_in(
        layer: Any, keep: np.ndarray, zero: bool, shift: np.ndarray | None
    ) -> tuple[dict, list[np.ndarray]]:
        config = layer.get_config()
        kernel, *bias = layer.get_weights()
        weights = [kernel[keep] * (not zero), *bias]
        if shift is not None and np.any(shift != 0):
            if bias:
                weights[1] = bias[0] + shift
            else:
                config["use_bias"] = True
                weights.append(shift)
        return config, weights


#: The layer classes ``compact`` can shrink (exact class), each with its seam entry.
_UNIT_OPS: dict[type, type[_DenseUnits]] = {keras.layers.Dense: _DenseUnits}


def _ops(layer: Any) -> type[_DenseUnits]:
    ops = _UNIT_OPS.get(type(layer))
    if ops is None:
        raise ValueError(
            f"compact: layer {layer.name!r} is a {type(layer).__name__}; compact shrinks "
            f"{[t.__name__ for t in _UNIT_OPS]} layers only (exact classes: a subclass may "
            "compute something else)."
        )
    ops.check(layer.name, layer)
    return ops


# -- which layers the pairs are, and the data flow between them ---------------------------------


def _leaves(model: Any) -> list[Any]:
    return [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if not list(layer._flatten_layers(include_self=False))
    ]


def _resolve(model: Any, pairs: Any) -> list[tuple[Any, Any]]:
    """The ``(first, second)`` layers of ``pairs``, resolved as the optimizers resolve them."""
    spec = pairing.normalize_pairs(pairs)
    variables = list(model.trainable_variables)
    indices = pairing.resolve_pairs(variables, spec)
    if spec == "auto":
        with warnings.catch_warnings():  # compact checks the data flow itself, more strictly
            warnings.filterwarnings("ignore", message='pairs="auto" paired')
            pairing.check_auto_pairs_in_model(model, variables, indices)
    owner = {id(w): layer for layer in _leaves(model) for w in layer.weights}
    return [(owner[id(variables[i])], owner[id(variables[j])]) for i, j in indices]


def _pointwise_activation(fn: Any) -> bool:
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or name in _MIXING:
        return False
    try:
        return keras.activations.get(name) is fn
    except ValueError:
        return False


def _check_between(layer: Any, first: Any, second: Any) -> None:
    activation = getattr(layer, "activation", None)
    if not _pointwise(layer) or (activation is not None and not _pointwise_activation(activation)):
        raise ValueError(
            f"compact: {type(layer).__name__} {layer.name!r} stands between {first.name!r} and "
            f"{second.name!r}; only entry-wise layers (built-in activations, dropout, noise) may, "
            "else the hidden units do not reach the second layer one by one."
        )


def _graph_between(graph: Any, first: Any, second: Any) -> list[Any]:
    """The layers from ``first``'s output to ``second``'s input in a functional model's graph."""
    nodes = [node for depth in graph._nodes_by_depth.values() for node in depth]
    for layer in (first, second):
        count = sum(node.operation is layer for node in nodes)
        if count != 1:
            raise ValueError(
                f"compact: layer {layer.name!r} is called {count} times in {graph.name!r}; a "
                "pair's layers must be called once each."
            )
    outputs = [id(t) for t in keras.tree.flatten(graph.outputs)]
    node = next(n for n in nodes if n.operation is first)
    between: list[Any] = []
    while True:
        (tensor,) = node.output_tensors
        users = [n for n in nodes if any(t is tensor for t in n.input_tensors)]
        if id(tensor) in outputs or len(users) != 1:
            what = [n.operation.name for n in users]
            what += ["the model output"] * (id(tensor) in outputs)
            raise ValueError(
                f"compact: the hidden units of ({first.name!r}, {second.name!r}) reach {what}, "
                f"not {second.name!r} alone: removing units would change the other consumers."
            )
        (node,) = users
        if node.operation is second:
            if len(node.input_tensors) != 1:
                raise ValueError(f"compact: {second.name!r} takes more than the hidden units")
            return between
        if len(node.input_tensors) != 1:
            raise ValueError(
                f"compact: {type(node.operation).__name__} {node.operation.name!r} between "
                f"{first.name!r} and {second.name!r} takes other inputs too (a residual or a "
                "concatenation): the hidden units do not reach the second layer one by one."
            )
        _check_between(node.operation, first, second)
        between.append(node.operation)


def _between(model: Any, first: Any, second: Any) -> list[Any]:
    """The pointwise layers from ``first`` to ``second``; ValueError where the flow is not a
    chain of them (see the module docstring)."""
    if not _pointwise_activation(first.activation):
        raise ValueError(
            f"compact: Dense {first.name!r} has the activation {first.activation!r}, not a "
            "built-in entry-wise one: its units are not independent (softmax) or not known to be."
        )
    nested = model._flatten_layers(include_self=False, recursive=True)
    containers = [model, *(m for m in nested if isinstance(m, keras.Model))]
    holder = next((c for c in containers if any(x is first for x in c.layers)), None)
    if holder is None or not any(x is second for x in holder.layers):
        raise ValueError(
            f"compact: {first.name!r} and {second.name!r} are not layers of one model (a "
            "nested model holds one of them); compact pairs within one Sequential or "
            "functional model."
        )
    if isinstance(holder, keras.Sequential):
        i = next(k for k, x in enumerate(holder.layers) if x is first)
        j = next(k for k, x in enumerate(holder.layers) if x is second)
        if i > j:
            raise ValueError(f"compact: {second.name!r} comes before {first.name!r}")
        for layer in holder.layers[i + 1 : j]:
            _check_between(layer, first, second)
        return list(holder.layers[i + 1 : j])
    if not hasattr(holder, "_nodes_by_depth"):
        raise ValueError(
            f"compact: {first.name!r} and {second.name!r} are in the subclassed model "
            f"{holder.name!r}, whose data flow is hidden in call(); compact works on Sequential "
            "and functional models."
        )
    return _graph_between(holder, first, second)


# -- compact -------------------------------------------------------------------------------------


def _constants(first: Any, between: list[Any], ops: type[_DenseUnits]) -> np.ndarray:
    x = first(ops.probe(first), training=False)
    for layer in between:
        x = layer(x, training=False)
    return ops.unit_values(x)


def _plan_pair(first: Any, second: Any, between: list[Any]) -> tuple[PairCompaction, dict]:
    """The pair's report and, per layer id, the ``(config, weights)`` of its smaller layer."""
    ops_in, ops_out = _ops(first), _ops(second)
    removed = ops_out.zero_outgoing(second)
    constant = ops_in.zero_incoming(first) & ~removed
    shift = None
    if constant.any():
        c = _constants(first, between, ops_in)
        if not np.all(np.isfinite(c[constant])):
            raise ValueError(
                f"compact: units of {first.name!r} with zero incoming weights output NaN or inf "
                "(from their bias): the network's output is not finite; check the weights."
            )
        shift = ops_out.input_shift(second, np.where(constant, c, 0))
        if shift is None:  # the second layer's type cannot take the constants: keep the units
            constant[:] = False
    keep = np.flatnonzero(~(removed | constant))
    zero = keep.size == 0
    if zero:  # all dead: one zero unit keeps both layers valid
        keep = np.zeros(1, dtype=np.int64)
    plans = {
        id(first): ops_in.keep_out(first, keep, zero),
        id(second): ops_out.keep_in(second, keep, zero, shift),
    }
    after = sum(w.size for _, weights in plans.values() for w in weights)
    report = PairCompaction(
        first.name,
        second.name,
        units_before=ops_in.units_out(first),
        units_after=len(keep),
        removed=int(removed.sum()),
        folded=int(constant.sum()),
        params_before=first.count_params() + second.count_params(),
        params_after=int(after),
    )
    return report, plans


def compact(model: keras.Model, pairs: Any = "auto") -> tuple[keras.Model, CompactionReport]:
    """A copy of ``model`` without the dead hidden units of its Dense pairs, and a report.

    Args:
        model: a built ``Sequential`` or functional Keras model; left unchanged.
        pairs: ``"auto"`` or ``[(first, second), ...]`` layer names or Dense layers, resolved
            over the trainable variables as the optimizers resolve them: pass what you trained
            with.

    Returns:
        ``(compacted, report)``: a new model of the same kind computing the same function at
        inference, and a :class:`CompactionReport` (``print`` it for a table).

    Raises:
        ValueError: an unbuilt or subclassed model, pairs that do not resolve, a paired layer
            that is not a plain ``Dense``, or a pair whose hidden units reach anything but the
            second layer, or reach it through anything but entry-wise layers.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"compact: expected a keras.Model, got {type(model).__name__}")
    if not model.built or not model.weights:
        raise ValueError("compact: the model is not built; call it on a batch or give it an Input")
    if not isinstance(model, keras.Sequential) and not hasattr(model, "_nodes_by_depth"):
        raise ValueError(
            f"compact: {type(model).__name__} is a subclassed model; its data flow is hidden in "
            "call(). compact works on Sequential and functional models."
        )
    reports, plans = [], {}
    for first, second in _resolve(model, pairs):
        report, plan = _plan_pair(first, second, _between(model, first, second))
        reports.append(report)
        plans.update(plan)
    clones: list[tuple[Any, Any]] = []

    def clone(layer: Any) -> Any:
        config, _ = plans.get(id(layer), (layer.get_config(), None))
        new = type(layer).from_config(config)
        clones.append((layer, new))
        return new

    new_model = keras.models.clone_model(model, clone_function=clone, recursive=True)
    if not new_model.built:
        new_model.build(model.input_shape)
    for old, new in clones:
        new.set_weights(plans[id(old)][1] if id(old) in plans else old.get_weights())
    if model.compiled and not new_model.compiled:
        new_model.compile_from_config(model.get_compile_config())
    result = CompactionReport(tuple(reports), model.count_params(), new_model.count_params())
    return new_model, result
