"""Every private name of Keras and TensorFlow that ``pathnorm_tf`` uses: where, why, and a
probe that resolves it on small real objects of the installed versions.

``check()`` raises :class:`~shared_spec.private_api.PrivateAPIError` naming each name that has
moved, the installed version, the call site and the fix; ``tests/test_tf_private_api.py`` runs
it and scans the sources so that a new private name cannot go unlisted (the rule:
:mod:`shared_spec.private_api`). Upper bounds in ``pyproject.toml`` (``keras<4``,
``tensorflow<3``) keep installs on major versions with these names.
"""

from __future__ import annotations

import functools
from typing import Any

from shared_spec.private_api import PrivateName
from shared_spec.private_api import check as _check

__all__ = ["ENTRIES", "TESTED", "check"]

# The versions these entries were last checked with (the probes pass there).
TESTED = {"keras": "3.15.1", "tensorflow": "2.21.0"}


def check() -> None:
    """Raise ``PrivateAPIError`` if a listed name does not resolve on the installed Keras or
    TensorFlow (each message: the name, the version, the call site, what to do)."""
    _check(ENTRIES, TESTED)


@functools.cache
def _models() -> tuple[Any, Any, Any]:
    """A functional Conv2D -> Flatten -> Dense model, its layers, and a Sequential."""
    import keras

    inputs = keras.Input((4, 4, 1))
    conv, flatten, dense = keras.layers.Conv2D(2, 3), keras.layers.Flatten(), keras.layers.Dense(3)
    functional = keras.Model(inputs, dense(flatten(conv(inputs))))
    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    return functional, (conv, flatten, dense), sequential


def _flatten_layers() -> bool:
    functional, layers, _ = _models()
    found = list(functional._flatten_layers(include_self=False, recursive=True))
    return all(any(x is layer for x in found) for layer in layers)


def _nodes_by_depth() -> bool:
    import keras

    class Subclassed(keras.Model):
        def call(self, x: Any) -> Any:
            return x

    functional, layers, _ = _models()
    nodes = [node for depth in functional._nodes_by_depth.values() for node in depth]
    ops = [node.operation for node in nodes]
    return all(any(op is layer for op in ops) for layer in layers) and not hasattr(
        Subclassed(), "_nodes_by_depth"
    )


def _graph_nodes() -> bool:
    functional, layers, sequential = _models()
    keys = set(functional._nodes) | set(sequential._functional._nodes)
    calls = {key.partition("_ib-")[0] for key in keys}
    return {str(id(layer)) for layer in (*layers, sequential.layers[0])} <= calls


def _inbound_nodes() -> bool:
    _, (_, flatten, dense), _ = _models()
    (node,) = dense._inbound_nodes
    return node.operation is dense and [p.operation for p in node.parent_nodes] == [flatten]


def _keras_history() -> bool:
    functional, (_, _, dense), _ = _models()
    (history,) = (t._keras_history for t in functional.outputs)
    node = history.operation._inbound_nodes[history.node_index]
    return history.operation is dense and node.operation is dense


def _build_shapes() -> bool:
    _, (conv, _, _), _ = _models()
    return tuple(conv._build_shapes_dict["input_shape"]) == (None, 4, 4, 1)


def _optimizer_state() -> bool:
    import keras

    _, _, sequential = _models()
    variables = sequential.trainable_variables
    optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    optimizer.build(variables)
    built = optimizer._trainable_variables
    keys = {optimizer._var_key(v) for v in built}
    return (
        len(built) == len(variables)
        and all(a is b for a, b in zip(built, variables, strict=True))
        and len(keys) == len(variables)
        and any(v is optimizer._iterations for v in optimizer._variables)
        and int(optimizer._iterations) == 0
    )


def _backend_update_step() -> bool:
    import keras

    calls: list[int] = []

    class Probe(keras.optimizers.SGD):
        def _backend_update_step(self, grads: Any, variables: Any, learning_rate: Any) -> None:
            calls.append(len(variables))
            super()._backend_update_step(grads, variables, learning_rate)

    weight = keras.Variable([1.0, 2.0])
    Probe(0.5).apply([keras.ops.ones((2,))], [weight])
    return calls == [1] and weight.numpy().tolist() == [0.5, 1.5]


def _merge_call() -> bool:
    import tensorflow as tf

    merge = tf.__internal__.distribute.interim.maybe_merge_call
    return merge(lambda strategy, a: a + 1, tf.distribute.get_strategy(), 1) == 2


def _xla_context() -> bool:
    import tensorflow as tf
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext

    seen: list[bool] = []

    def record(x: Any) -> Any:
        seen.append(GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
        return x

    spec = tf.TensorSpec([], tf.float32)
    tf.function(record, jit_compile=True).get_concrete_function(spec)
    tf.function(record).get_concrete_function(spec)
    return seen == [True, False]


_OPT = "pathnorm_tf/optimizers.py"
_REG = f"{_OPT}:_KernelRegularizer"
_UPD = "pathnorm_tf/_update.py:StepUpdate"
ENTRIES: tuple[PrivateName, ...] = (
    PrivateName(
        "keras",
        "_flatten_layers",
        "Layer._flatten_layers(include_self=..., recursive=True)",
        (
            "pathnorm_tf/compact.py:_between",
            "pathnorm_tf/metrics.py:_seam_layers",
            "pathnorm_tf/_graph.py:leaves",
            "pathnorm_tf/_graph.py:graph_calls",
        ),
        "every layer of a model, nested models included, in order (model.layers is one level)",
        _flatten_layers,
    ),
    PrivateName(
        "keras",
        "_nodes_by_depth",
        "Functional._nodes_by_depth",
        (
            "pathnorm_tf/compact.py:_graph_between",
            "pathnorm_tf/compact.py:_between",
            "pathnorm_tf/compact.py:compact",
            "pathnorm_tf/_graph.py:graphs",
            "pathnorm_tf/_graph.py:graph_nodes",
        ),
        "a functional model's graph, to find the layers between a pair; its absence marks a "
        "subclassed model, whose data flow compact refuses",
        _nodes_by_depth,
    ),
    *(
        PrivateName(
            "keras",
            name,
            'Functional._nodes (keys "<id(layer)>_ib-<k>"), Sequential._functional',
            ("pathnorm_tf/_graph.py:graph_calls", *more),
            "how many times the model's graphs call each layer, to refuse a shared layer in a "
            'pairs="auto" pair (and, for the metrics, in the network chain)',
            _graph_nodes,
        )
        for name, more in (
            ("_nodes", ()),
            ("_functional", ("pathnorm_tf/_graph.py:graphs",)),
        )
    ),
    PrivateName(
        "keras",
        "_inbound_nodes",
        "Layer._inbound_nodes (nodes with .parent_nodes, .operation)",
        ("pathnorm_tf/_graph.py:path_between", "pathnorm_tf/metrics.py:_Graph"),
        "the layers through which every call of a pair's second layer reads the first's output",
        _inbound_nodes,
    ),
    PrivateName(
        "keras",
        "_keras_history",
        "KerasTensor._keras_history (operation, node_index)",
        ("pathnorm_tf/metrics.py:_Graph",),
        "the node that produced each output of a model's graph: the metrics' chain must end "
        "in the model's output, read by nothing else",
        _keras_history,
    ),
    PrivateName(
        "keras",
        "_build_shapes_dict",
        'Layer._build_shapes_dict["input_shape"]',
        ("pathnorm_tf/layers.py:ConvEntry.in_positions",),
        "the spatial size a Conv layer was built on (a layer keeps no public input shape)",
        _build_shapes,
    ),
    PrivateName(
        "keras",
        "_trainable_variables",
        "Optimizer._trainable_variables (after build)",
        (
            f"{_REG}.regularized_pairs",
            f"{_REG}.regularized_kernels",
            f"{_REG}.verify_pairs",
            f"{_REG}.regularized_chains",
            f"{_UPD}._apply_regularizer",
            f"{_UPD}._warn_half_frozen",
            f"{_UPD}._distributed_regularize",
            f"{_OPT}:PathNormSGD.build",
            f"{_OPT}:ProxOptimizer.build",
            f"{_OPT}:ProxOptimizer.apply",
        ),
        "the variables the optimizer was built on, in build order: the pairs are indices "
        "into this list",
        _optimizer_state,
    ),
    PrivateName(
        "keras",
        "_var_key",
        "Optimizer._var_key(variable)",
        (f"{_UPD}._apply_regularizer",),
        "Keras's identity of a variable, to tell which kernels this step updated",
        _optimizer_state,
    ),
    PrivateName(
        "keras",
        "_variables",
        "Optimizer._variables",
        (f"{_OPT}:ProxOptimizer.variables",),
        "the wrapper's own state (iterations), joined with the inner optimizer's variables",
        _optimizer_state,
    ),
    PrivateName(
        "keras",
        "_iterations",
        "Optimizer._iterations",
        (f"{_OPT}:ProxOptimizer.apply",),
        "the inner optimizer's raw step count under gradient accumulation (a real update "
        "every gradient_accumulation_steps)",
        _optimizer_state,
    ),
    PrivateName(
        "keras",
        "_backend_update_step",
        "Optimizer._backend_update_step(grads, variables, learning_rate) (overridden)",
        (f"{_OPT}:PathNormSGD._backend_update_step",),
        "the one place Keras runs once per real update, after clipping, weight decay and "
        "accumulation: the prox follows the SGD step there",
        _backend_update_step,
    ),
    PrivateName(
        "tensorflow",
        "__internal__",
        "tf.__internal__.distribute.interim.maybe_merge_call",
        (f"{_UPD}._apply_regularizer",),
        "the prox runs once per update under a distribution strategy (in the cross-replica "
        "context), as Keras's own optimizers apply their updates",
        _merge_call,
    ),
    PrivateName(
        "tensorflow",
        "tensorflow.python.ops.control_flow_util",
        "tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext",
        ("pathnorm_tf/_common.py:<module>",),
        "whether a function is traced for XLA, to pick the XLA-friendly formulations there "
        "(gone: they are used everywhere, same values, slower)",
        _xla_context,
    ),
)
