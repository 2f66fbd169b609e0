"""``compact``: remove the dead hidden units of every layer pair; a smaller model, same function.

The Keras twin of ``pathnorm_lightning.compact`` (same rules; see ``docs/compaction.md``). For a
pair ``first -> layers between -> second`` (paired as the optimizers pair them), hidden unit
``i`` (a feature, or a channel) is removed when

* its **outgoing** weights are all zero (row ``i`` of the layer seam's out-view: a Dense
  ``second.kernel[i, :]``, a convolution's ``kernel[..., i, :]``, or after a Flatten every row
  of channel ``i``): it adds nothing;
* its **incoming** weights are all zero (column ``i`` of the seam's in-view) but not its
  outgoing ones: it outputs the constant ``c_i = act(b_i)`` at every position (``first``'s
  activation, then the pointwise layers between, at inference); ``c_i`` times its outgoing
  weights (summed over a convolution's taps or a Flatten's positions) is added to ``second``'s
  bias (``use_bias`` is turned on where it was off) and the unit goes. Where that is not exact
  the unit is kept and counted in ``constant_kept``: a second convolution with zero padding
  (``"same"``, ``"causal"``: at the borders it reads the constant through fewer taps), or a
  pooling layer that does not keep a constant channel constant.

A pair whose units are all dead keeps one zero unit (``Dense(0)`` is not a valid layer). The
result is a new model of the same kind (``Sequential`` or functional) built by
``keras.models.clone_model``: the paired layers are new, smaller layers of the same classes,
every other layer a clone holding the same weights; the input model is not changed. It is
compiled from the input's compile config when the input was compiled (a fresh optimizer state).

Exactness needs the hidden units to reach nothing but ``second``, unit by unit: both layers
sit in one ``Sequential`` with only allowed layers between them (pointwise layers; after a
convolution, pooling and a Flatten or global pooling, in the order
:func:`~pathnorm_tf.layers.check_between` checks), or in one functional model whose graph takes
``first``'s output through such single-consumer layers into ``second`` alone (each layer called
once; no intermediate is a model output). ``first``'s activation must be a built-in entry-wise
one (not one of :data:`~pathnorm_tf._between.MIXING`: softmax, log_softmax, sparsemax, glu).
Anything else is refused with the reason.

Which weights are a unit's comes from the layer seam (:mod:`pathnorm_tf.layers`); what
``compact`` does beyond that (a probe input, shrinking a layer's outputs or inputs, folding
constants into the bias) is one class per layer type in :data:`_UNIT_OPS`: ``Dense``,
``Conv1D`` and ``Conv2D``.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
import numpy as np

from pathnorm_tf import layers as seam
from pathnorm_tf import pairing
from pathnorm_tf._between import BETWEEN, builtin_entrywise
from shared_spec.compaction import CompactionReport, PairCompaction

__all__ = ["CompactionReport", "PairCompaction", "compact"]


# -- what compact does to a layer type, beyond the seam's views -------------------------------


def _with_shift(
    config: dict, weights: list[np.ndarray], bias: list[np.ndarray], shift: np.ndarray | None
) -> tuple[dict, list[np.ndarray]]:
    """``weights`` (the kernel) and the bias plus ``shift`` (a bias turned on if needed)."""
    if shift is not None and np.any(shift != 0):
        if bias:
            return config, [*weights, bias[0] + shift]
        return {**config, "use_bias": True}, [*weights, shift]
    return config, [*weights, *bias]


class _DenseUnits:
    """``Dense``: hidden unit ``i`` is column ``i`` of the first layer's kernel ``(m, n)`` (and
    bias entry ``i``), and row ``i`` of the second layer's kernel ``(n, p)``, or after a
    :class:`~pathnorm_tf.layers.Flat` the ``P`` rows of channel ``i``. A shrunk layer is
    described as ``(config, weights)`` for a new layer of the same class."""

    #: the config key of the first layer's unit count
    size_key = "units"

    @staticmethod
    def check(name: str, layer: Any) -> None:
        if getattr(layer, "quantization_mode", None) is not None or getattr(
            layer, "lora_enabled", False
        ):
            raise ValueError(
                f"compact: layer {name!r} is quantized or has LoRA enabled; compact shrinks "
                "plain float layers (compact before quantizing or adding LoRA)."
            )

    @staticmethod
    def probe(layer: Any) -> Any:
        """Zeros on which every unit outputs what one with zero incoming weights always does."""
        return keras.ops.zeros((1, layer.kernel.shape[0]), dtype=layer.compute_dtype)

    @staticmethod
    def unit_values(layer: Any, output: Any) -> np.ndarray:
        return np.asarray(output)[0]

    @staticmethod
    def input_shift(layer: Any, constants: np.ndarray, flat: seam.Flat | None) -> np.ndarray | None:
        """The change to the output when input unit ``i`` is ``constants[i]`` (at each of its
        positions or taps) instead of zero: exactly a bias (None where it is not one)."""
        kernel = np.asarray(layer.kernel)
        rows = np.asarray(seam.entry_of(layer).out_view(kernel, len(constants), flat))
        per_unit = rows.reshape(len(constants), -1, kernel.shape[-1]).sum(1)
        return constants.astype(kernel.dtype) @ per_unit

    @classmethod
    def keep_out(cls, layer: Any, keep: np.ndarray, zero: bool) -> tuple[dict, list[np.ndarray]]:
        """The first layer with only its output units ``keep`` (kernel's last axis, bias);
        ``zero``: their weights zeroed."""
        weights = [w[..., keep] * (not zero) for w in layer.get_weights()]  # kernel, bias
        return {**layer.get_config(), cls.size_key: len(keep)}, weights

    @staticmethod
    def keep_in(
        layer: Any, keep: np.ndarray, zero: bool, shift: np.ndarray | None, flat: seam.Flat | None
    ) -> tuple[dict, list[np.ndarray]]:
        kernel, *bias = layer.get_weights()
        positions = 1 if flat is None else flat.positions
        n_units = kernel.shape[0] // positions
        if flat is not None and flat.channels_last:  # row q * C + c
            rows = (np.arange(positions)[:, None] * n_units + keep[None, :]).ravel()
        else:  # row c * P + q
            rows = (keep[:, None] * positions + np.arange(positions)[None, :]).ravel()
        return _with_shift(layer.get_config(), [kernel[rows] * (not zero)], bias, shift)


class _ConvUnits(_DenseUnits):
    """``Conv1D`` / ``Conv2D`` (``groups=1``): hidden unit ``c`` is output channel ``c`` of the
    first layer (``kernel[..., c]``, bias entry ``c``) and input channel ``c`` of the second
    (``kernel[..., c, :]``)."""

    size_key = "filters"

    @staticmethod
    def probe(layer: Any) -> Any:
        """Zeros with the fewest positions that give an output: a unit with zero incoming
        weights outputs its bias there (and everywhere)."""
        size = [
            d * (k - 1) + 1 for k, d in zip(layer.kernel_size, layer.dilation_rate, strict=True)
        ]
        channels = int(layer.kernel.shape[-2])
        shape = (
            [1, *size, channels] if layer.data_format == "channels_last" else [1, channels, *size]
        )
        return keras.ops.zeros(shape, dtype=layer.compute_dtype)

    @staticmethod
    def unit_values(layer: Any, output: Any) -> np.ndarray:
        out = np.asarray(output)[0]
        if layer.data_format == "channels_last":
            return out.reshape(-1, out.shape[-1])[0]
        return out.reshape(out.shape[0], -1)[:, 0]

    @staticmethod
    def input_shift(layer: Any, constants: np.ndarray, flat: seam.Flat | None) -> np.ndarray | None:
        """A constant input channel shifts every output position by the same amount only where
        every tap reads a real position: None where zero padding (``"same"``, ``"causal"``)
        pads some axis, one whose kernel spans more than one position (``dilation * (k - 1)``
        > 0); a kernel of one tap per axis pads nothing."""
        spans = zip(layer.kernel_size, layer.dilation_rate, strict=True)
        if layer.padding != "valid" and any(d * (k - 1) > 0 for k, d in spans):
            return None
        return _DenseUnits.input_shift(layer, constants, flat)

    @staticmethod
    def keep_in(
        layer: Any, keep: np.ndarray, zero: bool, shift: np.ndarray | None, flat: seam.Flat | None
    ) -> tuple[dict, list[np.ndarray]]:
        kernel, *bias = layer.get_weights()
        return _with_shift(layer.get_config(), [kernel[..., keep, :] * (not zero)], bias, shift)


_UnitOps = type[_DenseUnits]
#: The layer classes ``compact`` can shrink (exact class), each with its entry.
_UNIT_OPS: dict[type, _UnitOps] = {
    keras.layers.Dense: _DenseUnits,
    keras.layers.Conv1D: _ConvUnits,
    keras.layers.Conv2D: _ConvUnits,
}


def _ops(layer: Any) -> _UnitOps:
    ops = _UNIT_OPS.get(type(layer))
    if ops is None:
        raise ValueError(
            f"compact: layer {layer.name!r} is a {type(layer).__name__}; compact shrinks "
            f"{[t.__name__ for t in _UNIT_OPS]} layers only (exact classes: a subclass may "
            "compute something else)."
        )
    ops.check(layer.name, layer)
    try:
        seam.entry_of(layer)
    except ValueError as err:
        raise ValueError(f"compact: {err}") from None
    return ops


# -- which layers the pairs are, and the data flow between them ---------------------------------


def _resolve(model: Any, pairs: Any) -> list[tuple[Any, Any]]:
    """The ``(first, second)`` layers of ``pairs``, resolved as the optimizers resolve them."""
    spec = pairing.normalize_pairs(pairs)
    variables = list(model.trainable_variables)
    resolved = pairing.resolve_pairs(variables, spec, model=model)
    if spec == "auto":
        with warnings.catch_warnings():  # compact checks the data flow itself, more strictly
            warnings.filterwarnings("ignore", message='pairs="auto" paired')
            pairing.check_auto_pairs_in_model(model, variables, resolved)
    owner = pairing.owners_of(model)
    assert owner is not None
    return [(owner[id(variables[p.first])], owner[id(variables[p.second])]) for p in resolved]


def _check_between(layer: Any, first: Any, second: Any) -> None:
    """Refuse a layer that may not stand between a pair: one the seam gives no role there, or a
    pointwise one whose activation is not a built-in entry-wise one."""
    role, activation = seam.role_of(layer), getattr(layer, "activation", None)
    if role is not None and type(layer) not in BETWEEN:
        allowed = next(cls for cls in type(layer).__mro__ if cls in BETWEEN)
        raise ValueError(
            f"compact: {type(layer).__name__} {layer.name!r} between {first.name!r} and "
            f"{second.name!r} is a subclass of {allowed.__name__}; compact takes only the exact "
            "allowed classes between a pair (a subclass may override call and mix or move the "
            "hidden units)."
        )
    pointwise = role is seam.Role.POINTWISE and (
        activation is None or builtin_entrywise(activation)
    )
    if not pointwise and role in (None, seam.Role.POINTWISE):
        raise ValueError(
            f"compact: {type(layer).__name__} {layer.name!r} stands between {first.name!r} and "
            f"{second.name!r}; only entry-wise layers (built-in activations, dropout, noise) "
            "and, after a convolution, pooling and a Flatten may, else the hidden units do not "
            "reach the second layer one by one."
        )


def _check_called_once(calls: list[Any], holder: Any, first: Any, second: Any) -> None:
    """Refuse a pair whose layer appears other than once in ``calls`` (the layers ``holder``
    calls, in order): a reused layer's units serve several inputs."""
    for layer in (first, second):
        count = sum(x is layer for x in calls)
        if count != 1:
            raise ValueError(
                f"compact: layer {layer.name!r} is called {count} times in {holder.name!r}; a "
                "pair's layers must be called once each."
            )


def _graph_between(graph: Any, first: Any, second: Any) -> list[Any]:
    """The layers from ``first``'s output to ``second``'s input in a functional model's graph."""
    nodes = [node for depth in graph._nodes_by_depth.values() for node in depth]
    _check_called_once([node.operation for node in nodes], graph, first, second)
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


def _between(model: Any, first: Any, second: Any) -> tuple[list[Any], seam.Flat | None]:
    """The layers from ``first`` to ``second``, and the pair's :class:`~pathnorm_tf.layers.Flat`;
    ValueError where the flow is not a chain of allowed ones (see the module docstring), or
    pooling and flattening do not stand where they keep the pair's units (the seam's check)."""
    if not builtin_entrywise(first.activation):
        raise ValueError(
            f"compact: {type(first).__name__} {first.name!r} has the activation "
            f"{first.activation!r}, not a built-in entry-wise one: its units are not "
            "independent (softmax, sparsemax, glu) or not known to be."
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
        _check_called_once(holder.layers, holder, first, second)
        i = next(k for k, x in enumerate(holder.layers) if x is first)
        j = next(k for k, x in enumerate(holder.layers) if x is second)
        if i > j:
            raise ValueError(f"compact: {second.name!r} comes before {first.name!r}")
        between = list(holder.layers[i + 1 : j])
        for layer in between:
            _check_between(layer, first, second)
    elif not hasattr(holder, "_nodes_by_depth"):
        raise ValueError(
            f"compact: {first.name!r} and {second.name!r} are in the subclassed model "
            f"{holder.name!r}, whose data flow is hidden in call(); compact works on Sequential "
            "and functional models."
        )
    else:
        between = _graph_between(holder, first, second)
    try:
        found = seam.check_between(first, second, between)
        return between, seam.flat_of(first, second, found.flatten)
    except ValueError as err:
        raise ValueError(f"compact: ({first.name!r}, {second.name!r}): {err}") from None


# -- compact -------------------------------------------------------------------------------------


def _keeps_constants(pool: Any, like: Any) -> bool:
    """Whether ``pool`` maps a constant channel to a constant, tried on ones of 16 positions
    per spatial axis in its ``data_format`` (``like``: the tensor it pools, for rank and dtype)."""
    spatial = [16] * (len(like.shape) - 2)
    shape = [1, *spatial, 1] if pool.data_format == "channels_last" else [1, 1, *spatial]
    try:
        out = np.asarray(pool(keras.ops.ones(shape, dtype=like.dtype), training=False))
    except Exception:  # the probe does not run (a window larger than it): not shown to keep them
        return False
    return out.size > 0 and bool(np.all(out == 1))


def _constants(first: Any, between: list[Any], ops: _UnitOps) -> np.ndarray | None:
    """What each unit outputs, after the pointwise layers between the pair, when its inputs are
    all zero; None where a pooling between does not keep constant channels constant (a Flatten
    keeps them)."""
    with keras.StatelessScope():  # the probe leaves no activity-regularizer loss on a layer
        x = first(ops.probe(first), training=False)
        for layer in between:
            role = seam.role_of(layer)
            if role is seam.Role.POINTWISE:
                x = layer(x, training=False)
            elif role in (seam.Role.POOL, seam.Role.GLOBAL_POOL) and not _keeps_constants(layer, x):
                return None
    return ops.unit_values(first, x)


def _plan_pair(
    first: Any, second: Any, between: list[Any], flat: seam.Flat | None
) -> tuple[PairCompaction, dict]:
    """The pair's report and, per layer id, the ``(config, weights)`` of its smaller layer."""
    ops_in, ops_out = _ops(first), _ops(second)
    layout = seam.PairLayout(seam.entry_of(first), seam.entry_of(second), flat)
    kernel_in, kernel_out = (np.asarray(m) for m in layout.views(first.kernel, second.kernel))
    removed = np.all(kernel_out == 0, axis=1)
    zero_in = np.all(kernel_in == 0, axis=0) & ~removed
    constant = zero_in.copy()
    shift = None
    if constant.any():
        c = _constants(first, between, ops_in)
        if c is not None:
            if not np.all(np.isfinite(c[constant])):
                raise ValueError(
                    f"compact: units of {first.name!r} with zero incoming weights output NaN or "
                    "inf (from their bias): the network's output is not finite; check the weights."
                )
            shift = ops_out.input_shift(second, np.where(constant, c, 0), flat)
        if shift is None:  # the constants cannot be folded exactly here: keep the units
            constant[:] = False
    keep = np.flatnonzero(~(removed | constant))
    zero = keep.size == 0
    if zero:  # all dead: one zero unit keeps both layers valid
        keep = np.zeros(1, dtype=np.int64)
    plans = {
        id(first): ops_in.keep_out(first, keep, zero),
        id(second): ops_out.keep_in(second, keep, zero, shift, flat),
    }
    after = sum(w.size for _, weights in plans.values() for w in weights)
    report = PairCompaction(
        first.name,
        second.name,
        units_before=len(removed),
        units_after=len(keep),
        removed=int(removed.sum()),
        folded=int(constant.sum()),
        params_before=first.count_params() + second.count_params(),
        params_after=int(after),
        constant_kept=int((zero_in & ~constant).sum()),
    )
    return report, plans


def compact(model: keras.Model, pairs: Any = "auto") -> tuple[keras.Model, CompactionReport]:
    """A copy of ``model`` without the dead hidden units of its layer pairs, and a report.

    Args:
        model: a built ``Sequential`` or functional Keras model; left unchanged.
        pairs: ``"auto"`` or ``[(first, second), ...]`` layer names or layers, resolved
            over the trainable variables as the optimizers resolve them: pass what you trained
            with.

    Returns:
        ``(compacted, report)``: a new model of the same kind computing the same function at
        inference, and a :class:`CompactionReport` (``print`` it for a table).

    Raises:
        ValueError: an unbuilt or subclassed model, pairs that do not resolve, a paired layer
            that is not a plain ``Dense``, ``Conv1D`` or ``Conv2D``, or a pair whose data flow
            the module docstring does not allow.
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
    with warnings.catch_warnings():  # a steep activation loosens the bounds, not compaction
        warnings.filterwarnings("ignore", message=".* has a slope of up to")
        for first, second in _resolve(model, pairs):
            report, plan = _plan_pair(first, second, *_between(model, first, second))
            reports.append(report)
            plans.update(plan)
    clones: list[tuple[Any, Any]] = []

    def clone(layer: Any) -> Any:
        """A new layer (the smaller one for a paired layer); an operation that is not a layer
        (a ``keras.ops`` call in a functional graph, a mask's ``NotEqual``) holds no weights."""
        config, _ = plans.get(id(layer), (layer.get_config(), None))
        new = type(layer).from_config(config)
        if isinstance(layer, keras.layers.Layer):
            clones.append((layer, new))
        return new

    new_model = keras.models.clone_model(model, clone_function=clone, recursive=True)
    if not new_model.built:
        new_model.build(model.input_shape)
    for old, new in clones:
        new.set_weights(plans[id(old)][1] if id(old) in plans else old.get_weights())
    if model.compiled and not new_model.compiled:
        new_model.compile_from_config(model.get_compile_config())
    _check_same_function(model, new_model)
    result = CompactionReport(tuple(reports), model.count_params(), new_model.count_params())
    return new_model, result


#: Machine epsilon of the float dtypes a Keras layer computes in (by name).
_EPS = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-23, "float64": 2.0**-52}


def _probe_inputs(model: Any) -> list[np.ndarray] | None:
    """A random batch of 2 for ``model``'s inputs: normal floats, integers in {0, 1} (a valid
    index, 0 also a masked one), 16 positions on an axis of unknown length; None where an
    input is of another dtype."""
    rng, batch = np.random.default_rng(0), []
    for t in keras.tree.flatten(model.inputs or []):
        shape = (2, *(16 if d is None else d for d in t.shape[1:]))
        try:
            dtype = np.dtype(t.dtype)
        except TypeError:  # bfloat16, string: not a NumPy dtype name
            return None
        if np.issubdtype(dtype, np.floating):
            batch.append(rng.standard_normal(shape).astype(dtype))
        elif np.issubdtype(dtype, np.integer):
            batch.append(rng.integers(0, 2, shape).astype(dtype))
        else:
            return None
    return batch or None


def _check_same_function(model: Any, new_model: Any) -> None:
    """Refuse a compacted model whose outputs differ from the model's on a random batch beyond
    rounding: 1,000 ulps of each output's dtype, or 16 ulps of the lowest-precision dtype a
    layer computes in (``mixed_float16``, ``mixed_bfloat16``), whichever is larger, times the
    largest output (at least 1). Where the model does not run on the batch (an input it cannot
    take), there is nothing to compare. What it catches: a layer that computes something else
    at its new size, such as a channels_first convolution whose bias Keras 3.15 adds along the
    last axis when that axis is as long as the bias (``keras.ops.add``'s ``bias_add`` path)."""
    x = _probe_inputs(model)
    if x is None:
        return
    run = x if len(x) > 1 else x[0]
    with keras.StatelessScope():  # no activity-regularizer loss left on the model
        try:
            a = keras.tree.flatten(model(run, training=False))
        except Exception:  # the probe batch does not suit the model: no check
            return
        b = keras.tree.flatten(new_model(run, training=False))
    layers = list(model._flatten_layers(include_self=True, recursive=True))
    low = max((_EPS.get(str(layer.compute_dtype), 0.0) for layer in layers), default=0.0)
    for y, z in zip(a, b, strict=True):
        eps = max(1e3 * _EPS.get(keras.backend.standardize_dtype(y.dtype), 0.0), 16 * low)
        y, z = np.asarray(y, np.float64), np.asarray(z, np.float64)
        same = (y == z) | (np.isnan(y) & np.isnan(z))  # a NaN (an all-masked mean) in both
        diff = float(np.where(same, 0.0, np.abs(y - z)).max(initial=0.0))
        tol = eps * max(1.0, float(np.abs(y[np.isfinite(y)]).max(initial=0.0)))
        if not diff <= tol:
            raise ValueError(_differ_message(diff, tol, layers, low))


def _differ_message(diff: float, tol: float, layers: list[Any], low: float) -> str:
    """Why :func:`_check_same_function` refuses: the difference, the tolerance, likely causes."""
    causes = ["a layer computes something else at its new size (report it with the model)"]
    if any(
        getattr(x, "data_format", "") == "channels_first" and hasattr(x, "filters") for x in layers
    ):
        causes.insert(
            0,
            "Keras adds a channels_first convolution's bias along the wrong axis when its last "
            "axis is as long as the bias (compact the model in channels_last)",
        )
    if low > _EPS["float32"]:
        causes.append(
            "rounding in a low-precision compute dtype beyond the tolerance (compact a float32 "
            "copy of the model, then set the dtype policy)"
        )
    return (
        f"compact: the compacted model's outputs differ from the model's by up to {diff:.3g} "
        f"on a random batch (tolerance {tol:.3g}), so it is not returned. Likely causes: "
        + "; or ".join(causes)
        + "."
    )
