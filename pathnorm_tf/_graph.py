"""The model side of the pairing: a Keras model's layers, the owner of each weight, and its
graph. :mod:`pathnorm_tf.pairing` resolves pairs from the trained variables; what only the model
shows (a frozen or shared layer, the layers between a pair, a convolution's Flatten) is read
here, when the optimizer has the model (``model=``, ``verify_pairs(model)``), and by
:mod:`pathnorm_tf.compact` and :mod:`pathnorm_tf.metrics`, which always have it.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Sequence
from typing import Any

from pathnorm_tf import layers as seam

__all__ = [
    "Owners",
    "check_auto_pairs_in_model",
    "check_shared",
    "graph_calls",
    "graph_nodes",
    "graphs",
    "layer_path",
    "leaves",
    "not_consecutive",
    "owners_of",
    "path_between",
]


def layer_path(variable: Any) -> str:
    """The path of the layer that owns ``variable`` (``"net/dense_1"``)."""
    return str(getattr(variable, "path", variable.name)).rpartition("/")[0]


def leaves(model: Any) -> list[Any]:
    """The layers of ``model`` (nested models included) that hold no layers themselves."""
    return [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if not list(layer._flatten_layers(include_self=False))
    ]


#: ``id(variable) -> layer`` for every weight of a model (:func:`owners_of`).
Owners = dict[int, Any]


def owners_of(model: Any | None) -> Owners | None:
    """The layer that owns each weight of ``model``, by the weight's ``id`` (None: no model)."""
    if model is None:
        return None
    return {id(w): layer for layer in leaves(model) for w in layer.weights}


def not_consecutive(a: str, b: str, what: str) -> ValueError:
    return ValueError(
        f'pairs="auto": layers {a!r} -> {b!r} are not consecutive: the {what} lies '
        "between them (a recurrent, frozen, normalization or other layer with weights), so "
        "they are no shallow network and their path-norm bounds nothing. Pass pairs=[...] to "
        "choose the pairs explicitly"
    )


def check_auto_pairs_in_model(
    model: Any, variables: Sequence[Any], pairs: Sequence[Sequence[Any]]
) -> None:
    """Refuse an auto pair that ``model`` shows is no shallow network: a layer with weights
    between its two layers in the layer order (frozen ones included: the optimizer's variables
    cannot show a layer whose weights are all frozen), a shared layer (:func:`check_shared`), or
    layers between them in the graph that the seam does not allow there
    (:func:`~pathnorm_tf.layers.check_between`). Warn about pairs that the graph does not
    confirm (the second layer fed by the first through layers the seam knows only).

    Args:
        model: the Keras model that trains ``variables``.
        variables: its trainable variables, as the optimizer holds them.
        pairs: what ``resolve_pairs(variables, "auto")`` returned (or index pairs).
    """
    layers = leaves(model)
    position = {id(w): k for k, layer in enumerate(layers) for w in layer.weights}
    calls = graph_calls(model)
    unverified = []
    for i, j, *_ in pairs:
        a, b = position.get(id(variables[i])), position.get(id(variables[j]))
        if a is None or b is None:
            unverified.append((layer_path(variables[i]), layer_path(variables[j])))
            continue
        for layer in layers[a + 1 : b]:
            if layer.weights:
                state = "frozen " if not any(w.trainable for w in layer.weights) else ""
                what = f"{state}{type(layer).__name__} {layer.name!r}"
                raise not_consecutive(layers[a].name, layers[b].name, what)
        check_shared(calls, layers[a], layers[b])
        between = path_between(layers[a], layers[b])
        if between is None:
            unverified.append((layers[a].name, layers[b].name))
            continue
        try:
            seam.check_between(layers[a], layers[b], between)
        except ValueError as err:
            raise ValueError(
                f'pairs="auto": {err}. Pass pairs=[...] to choose the pairs explicitly'
            ) from None
    if unverified:
        warnings.warn(
            f'pairs="auto" paired {unverified} from the order of the model\'s layers, which need '
            "not be the order call() runs them in; the model's graph does not confirm them (the "
            "second layer's input does not come from the first through activations, dropout, "
            "pooling or a Flatten only). Pass pairs=[(first, second), ...] explicitly to confirm "
            "them.",
            stacklevel=4,
        )


def graph_calls(model: Any) -> collections.Counter[str]:
    """How many times the graphs of ``model`` and of the models inside it call each layer, by
    ``id`` (Keras names a graph's nodes ``"<id(layer)>_ib-<k>"``; a layer's own list of calls
    also holds calls from outside these graphs, e.g. the ones ``load_model`` makes while it
    rebuilds a model). Empty without a graph (a subclassed model)."""
    keys = {key for _, graph in graphs(model) for key in graph._nodes}
    return collections.Counter(key.partition("_ib-")[0] for key in keys)


def graphs(model: Any) -> list[tuple[Any, Any]]:
    """``(model, its graph)`` for ``model`` and each model inside it that has a graph (a
    Sequential's is its ``_functional``); none for a subclassed model."""
    found = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        graph = getattr(layer, "_functional", None) or layer
        if getattr(graph, "_nodes_by_depth", None):
            found.append((layer, graph))
    return found


def graph_nodes(model: Any) -> list[Any]:
    """The nodes (layer calls) of the graphs of ``model`` and of the models inside it, each
    once. Empty without a graph (a subclassed model)."""
    nodes: dict[int, Any] = {}
    for _, graph in graphs(model):
        for level in graph._nodes_by_depth.values():
            nodes.update((id(node), node) for node in level)
    return list(nodes.values())


def check_shared(calls: collections.Counter[str], first: Any, second: Any) -> None:
    """Refuse an auto pair whose layers the model's graph calls a different number of times:
    a shared layer (``s1 -> s2 -> s1``) is also somewhere else in the network, so the pair is
    no shallow network. (A pair called together several times, as in a Siamese network, is.)"""
    n_first, n_second = calls[str(id(first))], calls[str(id(second))]
    if n_first != n_second:
        shared = first if n_first > n_second else second
        raise ValueError(
            f'pairs="auto": the layer {shared.name!r} is shared (the model calls '
            f"{first.name!r} {n_first} times and {second.name!r} {n_second} times), so "
            f"({first.name!r}, {second.name!r}) is not one shallow network and its path-norm "
            "prox would also act on the other uses of the layer. Give each call its own layer, "
            "or pass pairs=[...] to choose the pairs explicitly."
        )


def path_between(first: Any, second: Any, *, any_layer: bool = False) -> list[Any] | None:
    """The layers through which, in the model's graph, every call of ``second`` takes the
    output of ``first``, in the order they run: layers the seam gives a role between a pair
    (:func:`~pathnorm_tf.layers.role_of`; with ``any_layer``, any single-input layer), the
    same ones for every call. None where the graph does not show that (another layer, a merge,
    no graph: a subclassed model)."""
    found: list[list[Any]] = []
    for node in getattr(second, "_inbound_nodes", ()):
        between: list[Any] = []
        while True:
            parents = node.parent_nodes
            if len(parents) != 1:
                return None
            node = parents[0]
            if node.operation is first:
                break
            if not any_layer and seam.role_of(node.operation) is None:
                return None
            between.append(node.operation)
        found.append(between[::-1])
    if not found or any([id(x) for x in f] != [id(x) for x in found[0]] for f in found):
        return None
    return found[0]
