"""Metrics of the regularized network: sparsity and the Lipschitz bounds, and a Keras callback
that adds them to ``logs``.

Keys (the same names and definitions as ``pathnorm_lightning``'s logged metrics):

* ``pathnorm/sparsity``: fraction of exactly-zero entries of the regularized kernels;
* ``pathnorm/alive_units``: fraction of hidden units (Dense features, convolution channels) of
  the regularized pairs whose incoming weights (column ``j`` of the layer seam's in-view,
  ``K_in[:, j]`` for Dense) and outgoing weights (row ``j`` of its out-view, ``K_out[j, :]``)
  both have a nonzero entry;
* ``pathnorm/path_norm_bound``: ``s * 1^T |K_1| |K_2| ... |K_L| 1`` over the model's chain of
  Dense/Conv1D/Conv2D layers, each ``|K_l|`` summed over a unit's taps or positions: for an MLP
  the 1-path-norm of the whole network, in general an upper bound on the path norm of the
  unrolled network and on its (l_inf, l_1) Lipschitz constant; ``s`` is the factor of the last
  layer (1 for a Dense layer; for a convolution, from the spatial size it was built on;
  docs/conv_units.md);
* ``pathnorm/product_bound``: ``s * sum|K_L| * prod_{l<L} max_j ||K_l[:, j]||_1`` (``K_l``'s
  in-view for a convolution), the layer-wise bound (never below the path-norm bound).

The regularized kernels are those of the model's :class:`~pathnorm_tf.PathNormSGD` or
:class:`~pathnorm_tf.ProxOptimizer` (also inside a ``LossScaleOptimizer``): its pairs, or for
the l1/l_inf baselines its kernels (alive units over runs of adjacent ones whose units chain).
With another optimizer, or explicit ``pairs`` other than the optimizer's, the pairs are
resolved over the model's *trainable* variables as the optimizer would resolve them (frozen
layers and recurrent cells skipped, :mod:`pathnorm_tf.pairing`). The bounds cover every built
Dense/Conv1D/Conv2D layer, frozen ones included, and are reported only where the model's
graph confirms that they form a chain (:func:`_chain_of`: no skip connection, branch, shared
layer, nor a subclassed model, whose graph is unknown; a Dense layer after a convolution reads
it through a Flatten or global pooling) and, where the last is a convolution, its input size is
known; otherwise they are left out with a warning (once per callback) saying why. Values are
Python floats computed in float64 from the current weights. A regularized pair left with no alive
hidden unit is warned about once per pair (with the model's path-norm optimizer, whose own
check at the end of ``fit`` shares the record). An optimizer with ``use_ema=True`` makes ``fit``
end by writing the weights' moving average (no prox output) into the model: the callback then
warns, once, with the values of the model ``fit`` returns where they differ from the last logged.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import keras
import tensorflow as tf

from pathnorm_tf import layers as seam
from pathnorm_tf import pairing
from pathnorm_tf._graph import graph_calls, graph_nodes, graphs, path_between
from pathnorm_tf._units import alive_units, links, warn_dead_pairs
from pathnorm_tf.optimizers import PathNormSGD, ProxOptimizer

__all__ = ["PathNormMetrics", "metric_values"]


def _seam_layers(model: keras.Model) -> list[Any]:
    """The built layers of ``model`` the layer seam has an entry for, in layer order."""
    return [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if pairing._has_entry(layer) and layer.built
    ]


def _abs64(kernel: Any) -> tf.Tensor:
    return tf.abs(tf.cast(tf.convert_to_tensor(kernel), tf.float64))


def path_norm_bound(kernels: list[Any], layouts: list[seam.PairLayout], reuse: int) -> float:
    """``reuse * 1^T |K_1| ... |K_L| 1`` for a chain of kernels in forward order and the
    ``layouts`` between them: each ``|K_l|`` summed over a unit's taps or positions (the seam's
    views), ``reuse`` the factor ``s`` of the last layer."""
    first = layouts[0].first if layouts else seam.DenseEntry()
    v = tf.reduce_sum(_abs64(first.in_view(kernels[0])), 0)  # per unit: ||y_i||_1
    for kernel, layout in zip(kernels[1:], layouts, strict=True):
        n_units = int(v.shape[0])
        rows = _abs64(layout.second.out_view(kernel, n_units, layout.flat))
        per_unit = tf.reduce_sum(tf.reshape(rows, [n_units, -1, int(kernel.shape[-1])]), 1)
        v = tf.linalg.matvec(per_unit, v, transpose_a=True)
    return float(tf.reduce_sum(v)) * reuse


def product_bound(kernels: list[Any], layouts: list[seam.PairLayout], reuse: int) -> float:
    """``reuse * sum|K_L| * prod_{l<L} ||K_l||_{inf->inf}`` (largest column l1 norm of the
    seam's in-view: of a Dense kernel, of a convolution's kernel per output channel; 0 for a
    kernel with no column)."""
    value = tf.reduce_sum(_abs64(kernels[-1])) * reuse
    for k, layout in zip(kernels[:-1], layouts, strict=True):
        sums = tf.reduce_sum(_abs64(layout.first.in_view(k)), 0)
        value = value * tf.reduce_max(tf.concat([sums, [0.0]], 0))
    return float(value)


class _Graph:
    """The model's graph as the chain check reads it: how many times it calls each layer, the
    node of each layer it calls, the nodes that read each node, and its outputs (the model's
    and those of the models inside it, each with its model)."""

    def __init__(self, model: keras.Model) -> None:
        nodes = graph_nodes(model)
        if not nodes:
            raise ValueError(
                "the model has no graph (a subclassed model), which alone would show the order "
                "its call() runs the layers in"
            )
        self.model = model
        self.calls = graph_calls(model)
        self.node_of = {id(node.operation): node for node in nodes}
        self.readers: dict[int, list[Any]] = {}
        for node in nodes:
            for parent in node.parent_nodes:
                self.readers.setdefault(id(parent), []).append(node)
        self.output_of: dict[int, Any] = {}
        for layer, graph in graphs(model):
            for history in (t._keras_history for t in graph.outputs):
                node = history.operation._inbound_nodes[history.node_index]
                self.output_of[id(node)] = layer

    def check_called_once(self, layer: Any) -> None:
        n = self.calls[str(id(layer))]
        if n == 0:
            raise ValueError(f"the model's graph does not call {layer.name!r}")
        if n > 1:
            raise ValueError(f"the model calls {layer.name!r} {n} times (a shared layer)")

    def check_read_on(self, layer: Any, stop: Any | None) -> None:
        """Check that the output of ``layer`` is read by one line of layers that read nothing
        else, up to the layer ``stop`` (None: up to the model's output)."""
        node = self.node_of[id(layer)]
        while node.operation is not stop:
            name, after = node.operation.name, self.readers.get(id(node), [])
            owner = self.output_of.get(id(node))
            if owner is not None and after:
                readers = [n.operation.name for n in after]
                raise ValueError(
                    f"the output of {name!r} is an output of {owner.name!r} and also read by "
                    f"{readers}"
                )
            if owner is not None and owner is not self.model:  # on in the graph around it
                self.check_called_once(owner)
                node = self.node_of[id(owner)]
            elif not after:
                if stop is None:
                    return
                raise ValueError(f"the output of {name!r} does not reach {stop.name!r}")
            elif len(after) > 1:
                readers = [n.operation.name for n in after]
                raise ValueError(
                    f"the output of {name!r} is read by {len(after)} layers {readers} (a branch "
                    "or a skip connection)"
                )
            elif len(after[0].parent_nodes) > 1:
                raise ValueError(
                    f"{after[0].operation.name!r} after {layer.name!r} also reads another input "
                    "(a merge or a skip connection)"
                )
            else:
                node = after[0]


#: The kernels of a chain, the layouts between them and the factor ``s`` of the last one.
_Network = tuple[list[Any], list[seam.PairLayout], int]


def _chain_of(model: keras.Model) -> tuple[_Network | None, str]:
    """The kernels of the model's seam layers, the layouts between them and the factor ``s``
    of the last one; or None and why not. The model's graph must confirm that the layers are
    the network's chain: it calls each once, each reads exactly the outputs of the one before
    it, through layers the pairing allows between a pair only (the graph does not show the
    order of a subclassed model's layers), and nothing else reads these (nor the last one's,
    up to the model's output). The last convolution's input size must be known."""
    found = _seam_layers(model)
    if not found:
        return None, ""
    try:
        graph = _Graph(model)
        for layer in found:
            graph.check_called_once(layer)
        layouts = []
        for a, b in itertools.pairwise(found):
            between = path_between(a, b)
            if between is None:
                raise ValueError(
                    f"the graph does not show {b.name!r} reading exactly the outputs of "
                    f"{a.name!r} through activations, dropout, pooling or a Flatten only: a "
                    "skip connection, a merge of branches or another layer lies between"
                )
            layouts.append(
                seam.layout_of(a, b, seam.check_between(a, b, between, strict=True).flatten)
            )
        for a, b in itertools.zip_longest(found, found[1:]):
            graph.check_read_on(a, b)
        last = seam.entry_of(found[-1])
        reuse = last.reuse(found[-1], last.in_positions(found[-1]))
    except ValueError as err:
        return None, str(err)
    return ([layer.kernel for layer in found], layouts, reuse), ""


def _regularizing_optimizer(model: keras.Model) -> Any:
    """The model's PathNormSGD/ProxOptimizer (unwrapping a LossScaleOptimizer; in a
    ``MultiOptimizer``, its one built such optimizer), or None."""
    opt = getattr(model, "optimizer", None)
    while isinstance(opt, keras.optimizers.LossScaleOptimizer):
        opt = opt.inner_optimizer
    if isinstance(opt, getattr(keras.optimizers, "MultiOptimizer", ())):  # Keras >= 3.15
        inner = getattr(opt, "optimizers", [])
        found = [o for o in inner if isinstance(o, (PathNormSGD, ProxOptimizer))]
        opt = found[0] if len(found) == 1 and found[0].built else None
    return opt if isinstance(opt, (PathNormSGD, ProxOptimizer)) else None


def _regularized_chains(model: keras.Model, spec: pairing.PairsSpec) -> list[list[Any]]:
    opt = _regularizing_optimizer(model)
    variables = list(model.trainable_variables)
    if opt is not None and (
        spec == "auto" or (opt._regularizer, opt._pairs_spec) == ("path", spec)
    ):
        # Exactly what the optimizer acts on (for its own names: as it resolved them, which
        # its config records, so also where a reloaded model's paths no longer tell them apart).
        return list(opt.regularized_chains(variables, model))
    if spec == "auto":
        found = pairing.layer_kernels(variables, model)
        if len(found) < 2:  # nothing to pair: the one kernel's sparsity, if there is one
            return [[variables[i]] for i in found]
    return [
        pairing.Chain([variables[p.first], variables[p.second]], [p.layout])
        for p in pairing.resolve_pairs(variables, spec, model=model)
    ]


def metric_values(model: keras.Model, pairs: Any = "auto") -> dict[str, float]:
    """The ``pathnorm/...`` values of ``model`` now (see the module docstring), as Python
    floats. Warns about a pair with no alive hidden unit (once per pair with the model's
    ``PathNormSGD``/``ProxOptimizer``).

    Args:
        model: a built Keras model.
        pairs: ``"auto"``: the kernels the model's path-norm optimizer regularizes, or with
            another optimizer (or none) the pairs ``PathNormSGD(pairs="auto")`` would take;
            or ``(first, second)`` layer names (trained Dense layers), as for the optimizer.
    """
    return _metric_values(model, pairing.normalize_pairs(pairs), set(), set())


def _metric_values(
    model: keras.Model,
    spec: pairing.PairsSpec,
    warned: set[tuple[str, str]],
    no_chain: set[str],
) -> dict[str, float]:
    """:func:`metric_values`, warning about a dead pair once per the regularizing optimizer's
    record, or per ``warned`` without one, and about bounds left out once per ``no_chain``
    (the reasons warned about)."""
    chains = _regularized_chains(model, spec)
    if not _seam_layers(model) and not chains:
        raise ValueError(
            f"PathNormMetrics: the model has no built {pairing.KINDS} layer to report on"
        )
    zeros = total = alive = units = 0
    dead: list[tuple[str, str]] = []
    for chain in chains:
        for k in chain:
            t = tf.convert_to_tensor(k)
            zeros += int(tf.reduce_sum(tf.cast(tf.equal(t, 0), tf.int64)))
            total += int(tf.size(t))
        for k_in, k_out, layout in links(chain):
            live = int(tf.reduce_sum(tf.cast(alive_units(k_in, k_out, layout), tf.int64)))
            alive += live
            units += int(k_in.shape[-1])
            if live == 0 and int(k_in.shape[-1]) > 0:
                dead.append((pairing.layer_path(k_in), pairing.layer_path(k_out)))
    values = {}
    if total:
        values["pathnorm/sparsity"] = zeros / total
    if units:
        values["pathnorm/alive_units"] = alive / units
    network, why = _chain_of(model)
    if network is not None:
        values["pathnorm/path_norm_bound"] = path_norm_bound(*network)
        values["pathnorm/product_bound"] = product_bound(*network)
    elif why and why not in no_chain:
        no_chain.add(why)
        warnings.warn(
            f"PathNormMetrics: the {pairing.KINDS} layers of {model.name!r} do not form a chain "
            f"({why}), so the network bounds pathnorm/path_norm_bound and "
            "pathnorm/product_bound are not reported (they hold for a chain only; skip "
            "connections, branches, shared layers and subclassed models have none); "
            "pathnorm/sparsity and pathnorm/alive_units are.",
            UserWarning,
            stacklevel=3,
        )
    opt = _regularizing_optimizer(model)
    warn_dead_pairs(dead, opt, opt._warned_dead if opt is not None else warned)
    return values


class PathNormMetrics(keras.callbacks.Callback):
    """Add the ``pathnorm/...`` metrics to the epoch ``logs`` (History, CSVLogger, TensorBoard).

    Put it *before* ``CSVLogger``/``TensorBoard`` in ``callbacks=[...]``: Keras hands the same
    ``logs`` dict to the callbacks in list order (``History`` always comes last).

    With ``use_ema=True`` (``PathNormSGD(..., use_ema=True)``), ``fit`` ends by writing the
    moving average of the weights into the model, after the last epoch's values were logged;
    where that changes the values, the callback warns (once) at the end of ``fit`` and names the
    returned model's values, which :func:`metric_values` gives.

    Args:
        pairs: ``"auto"`` (default): sparsity and alive units over what the model's
            ``PathNormSGD``/``ProxOptimizer`` regularizes (with another optimizer: the pairs
            ``pairs="auto"`` would take); or explicit ``(first, second)`` layer names.
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
        self._warned: set[tuple[str, str]] = set()  # dead pairs (with another optimizer)
        self._no_chain: set[str] = set()  # why the bounds were left out, as warned
        self._logged: dict[str, float] | None = None  # this fit's last epoch values
        self._warned_ema = False

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.every_n_batches and logs is not None and (batch + 1) % self.every_n_batches == 0:
            logs.update(_metric_values(self.model, self.pairs, self._warned, self._no_chain))

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._logged = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            self._logged = _metric_values(self.model, self.pairs, self._warned, self._no_chain)
            logs.update(self._logged)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        # fit() calls the optimizer's finalize_variable_values, which writes the moving average
        # of an optimizer with use_ema=True into the model, after the last on_epoch_end and
        # before on_train_end: only here can the callback see what fit() returns.
        if self._warned_ema or self._logged is None or not _averages(self.model.optimizer):
            return
        final = _metric_values(self.model, self.pairs, self._warned, self._no_chain)
        if final == self._logged:  # e.g. SwapEMAWeights(swap_on_epoch=True) logged the average
            return
        self._warned_ema = True
        warnings.warn(
            "PathNormMetrics: the optimizer has use_ema=True, so fit() ended by writing the "
            "moving average of the weights into the model (Keras's finalize_variable_values), "
            "after the last epoch's values were logged. The History's pathnorm/... values "
            "describe the weights at the end of each epoch (a path-norm optimizer's proxed "
            "iterates), not this average, which no prox produced: it keeps only the zeros that "
            "all the averaged weights share, and the logged bounds do not hold for it. The "
            "model fit() returns has "
            f"{_listed(final)} (the History's last entry: {_listed(self._logged)}); "
            "metric_values(model) gives these values. To keep the proxed weights, train without "
            "use_ema (or save them at each epoch's end: ModelCheckpoint(..., "
            "save_weights_only=True)); to log the average's values instead, put "
            "keras.callbacks.SwapEMAWeights(swap_on_epoch=True) before PathNormMetrics.",
            UserWarning,
            stacklevel=2,
        )


def _averages(optimizer: Any) -> bool:
    """Whether ``optimizer``, or one inside it (a ``LossScaleOptimizer``'s or
    ``ProxOptimizer``'s inner optimizer, a ``MultiOptimizer``'s), has ``use_ema=True``: then
    ``fit`` ends by writing the moving average of the weights it updates into the model."""
    inner = [getattr(optimizer, "inner_optimizer", None), *getattr(optimizer, "optimizers", [])]
    return bool(getattr(optimizer, "use_ema", False)) or any(
        _averages(o) for o in inner if o is not None
    )


def _listed(values: dict[str, float]) -> str:
    return ", ".join(f"{key}={value:.6g}" for key, value in values.items())
