"""Which layers a callback regularizes: layer pairs (path-norm) or single layers. Torch only.

A *pair* ``(first, second)`` is two layers of the layer seam (:mod:`pathnorm_lightning.layers`)
whose hidden units (the first's outputs, the second's inputs) the 1-path-norm prox couples:
``Linear -> act -> Linear``, ``Conv -> act (-> pool) -> Conv`` or ``Conv -> act (-> pool) ->
Flatten -> Linear``. The seam says which weights are a unit's, how many units a layer has and
what may stand between the two; this module never names a layer type. ``pairs="auto"`` pairs
the seam's layers in module order, (L1, L2), (L3, L4), ..., as in the paper's multilayer
extension; a pair the module tree does not show to be a shallow network is checked against the
first training forward pass (:class:`ForwardCheck`).
"""

from __future__ import annotations

import collections
import difflib
import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.nn.utils import parametrize, prune

from pathnorm_lightning import layers
from pathnorm_lightning._common import rank_zero_warn, shares_memory
from pathnorm_lightning._forward import (
    ForwardCheck,
    compiled_links,
    compiled_message,
    output_module,
    unwrap,
)

__all__ = [
    "ForwardCheck",
    "LayerPair",
    "LayersSpec",
    "PairsSpec",
    "chain_check",
    "chains",
    "compiled_chain_links",
    "layer_chain",
    "normalize_layers",
    "normalize_pairs",
    "resolve_layers",
    "resolve_pairs",
    "weight_parameter",
]

PairsSpec = str | Sequence[tuple[str, str]] | Sequence[Sequence[str]]
LayersSpec = str | Sequence[str]


@dataclass(frozen=True)
class LayerPair:
    """Two chained layers, named as in ``model.named_modules()``.

    ``verified`` is False for an ``"auto"`` pair whose data flow the module tree does not show
    (not neighbours in one ``nn.Sequential`` with only the seam's allowed modules between
    them), for a :class:`ForwardCheck`. ``flatten``: for a convolution followed by a Linear
    layer, the positions per channel of the Flatten between them; else None.
    """

    first_name: str
    second_name: str
    first: nn.Module
    second: nn.Module
    verified: bool = True
    flatten: int | None = None


def _has_entry(module: nn.Module) -> bool:
    """Whether the layer seam has an entry for ``module``'s type (its configuration unchecked)."""
    return any(cls in layers.ENTRIES for cls in type(module).__mro__)


def _seam_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, mod) for name, mod in model.named_modules() if _has_entry(mod)]


def _types() -> str:
    return ", ".join(sorted(f"nn.{t.__name__}" for t in layers.ENTRIES))


def _lookup(model: nn.Module, name: str, what: str) -> nn.Module:
    """The seam layer called ``name`` in ``model``, with a helpful error otherwise."""
    if not isinstance(name, str):
        raise TypeError(
            f"{what}: layer names must be strings, got {name!r} ({type(name).__name__})"
        )
    modules = dict(model.named_modules())
    if name not in modules:
        seam_names = [n for n, _ in _seam_layers(model)]
        close = difflib.get_close_matches(name, list(modules), n=3)
        hint = f" Did you mean {close}?" if close else ""
        raise ValueError(
            f"{what}: {type(model).__name__} has no submodule named {name!r}.{hint} "
            f"Its {_types()} layers are {seam_names} (names as in model.named_modules())."
        )
    module = modules[name]
    if not _has_entry(module):
        raise ValueError(
            f"{what}: module {name!r} is a {type(module).__name__}, but only {_types()} layers "
            "are supported (the prox needs layers whose outputs are hidden units)."
        )
    return module


def weight_parameter(name: str, layer: nn.Module) -> nn.Parameter:
    """The parameter ``layer.weight`` is, or a ``ValueError`` naming why it is computed instead
    (a parametrization, pruning, the older weight/spectral norm hooks)."""
    weight = layer._parameters.get("weight")
    if isinstance(weight, nn.Parameter):
        return weight
    if parametrize.is_parametrized(layer, "weight"):
        parametrizations: Any = layer.parametrizations
        kinds = ", ".join(type(p).__name__ for p in parametrizations["weight"])
        cause = (
            f"parametrized ({kinds}) with torch.nn.utils.parametrize (as parametrizations."
            "weight_norm and spectral_norm do)"
        )
        undo = "torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight')"
    else:
        hooks = [type(h) for h in layer._forward_pre_hooks.values()]
        if any(issubclass(h, prune.BasePruningMethod) for h in hooks):
            cause = (
                "pruned (torch.nn.utils.prune, e.g. Lightning's ModelPruning: weight = "
                "weight_orig * weight_mask)"
            )
            undo = "torch.nn.utils.prune.remove(layer, 'weight') (or prune after training)"
        else:
            known = {
                "WeightNorm": "torch.nn.utils.weight_norm",
                "SpectralNorm": "torch.nn.utils.spectral_norm",
            }
            found = [known[h.__name__] for h in hooks if h.__name__ in known]
            cause = f"wrapped by {found[0]}" if found else "computed by a forward pre-hook"
            if not hooks:
                own = dict(layer.named_buffers(recurse=False))
                kind = "a buffer" if "weight" in own else "a plain tensor"
                raise ValueError(
                    f"layer {name!r} holds its weight as {kind}, not an nn.Parameter, so no "
                    "optimizer updates it and the prox has nothing to follow. Register it as "
                    "an nn.Parameter (requires_grad=False freezes it: a frozen pair is left "
                    "alone), or leave this layer out of the pairs."
                )
            undo = "torch.nn.utils.remove_weight_norm or remove_spectral_norm"
    raise ValueError(
        f"layer {name!r} is {cause}: its weight is computed from other tensors at every forward "
        "pass, not a parameter the optimizer updates, so the prox would write to a computed "
        "tensor (overwritten at the next forward) instead of the weights being trained. Remove "
        f"it before training with the prox ({undo}), or leave this layer out of the pairs. The "
        "prox itself zeroes weights exactly, so pruning on top of it is not needed for sparsity."
    )


def _check_layer(name: str, layer: nn.Module) -> layers.LayerEntry:
    """The seam entry of ``layer``, after checking that its weight is a materialized parameter
    and that the seam takes its configuration."""
    weight_parameter(name, layer)
    if isinstance(layer.weight, nn.parameter.UninitializedParameter):
        raise ValueError(
            f"layer {name!r} is a {type(layer).__name__} whose weight is not materialized yet "
            "(its input size is unknown). Run one forward pass on an example batch before "
            "fit, as torch requires before building the optimizers."
        )
    try:
        return layers.entry_of(layer)
    except ValueError as err:
        raise ValueError(f"layer {name!r}: {err}") from None


def _check_chain(
    first_name: str, first: nn.Module, second_name: str, second: nn.Module
) -> int | None:
    """Check that the two layers pair (the seam's unit counts, tied weights); return the
    positions per channel of the Flatten between a convolution and a Linear layer (else None)."""
    entry_first = _check_layer(first_name, first)
    entry_second = _check_layer(second_name, second)
    what = f"pairs: layers {first_name!r} and {second_name!r}"
    if shares_memory(weight_parameter(first_name, first), weight_parameter(second_name, second)):
        raise ValueError(
            f"{what} share one weight (tied weights); "
            "the prox of a pair needs two independent weight matrices (it would write one "
            "result over the other). Untie them or leave this pair out."
        )
    if entry_second.spatial and not entry_first.spatial:
        raise ValueError(
            f"{what} do not chain: a {type(second).__name__} cannot read the units of a "
            f"{type(first).__name__} (a convolution reads channels, a Linear layer has none)"
        )
    try:
        flatten = layers.flatten_positions(first, second)
    except ValueError as err:
        raise ValueError(
            f"{what} do not chain: {err}; the Linear layer must read every channel at the "
            "same number of positions"
        ) from None
    outputs = entry_first.units_out(first)
    inputs = entry_second.units_in(second, flatten)
    if outputs != inputs:
        raise ValueError(
            f"pairs: layers {first_name!r} ({outputs} outputs) and {second_name!r} ({inputs} "
            "inputs) do not chain: the first layer's outputs (features or channels) must be the "
            "second layer's inputs (they share the hidden units)."
        )
    return flatten


def normalize_pairs(pairs: PairsSpec) -> str | list[tuple[str, str]]:
    """Check the *form* of a pairs spec (no model needed): ``"auto"`` or ``[(first, second), ...]``
    (ValueError / TypeError for anything else, an empty list, or an entry not two names)."""
    if isinstance(pairs, str):
        if pairs != "auto":
            raise ValueError(
                f"pairs must be 'auto' or a list of (first, second) module names, got {pairs!r}"
            )
        return "auto"
    if not isinstance(pairs, Sequence):
        raise TypeError(
            "pairs must be 'auto' or a list of (first, second) module names, "
            f"got {type(pairs).__name__}"
        )
    if len(pairs) == 0:
        raise ValueError("pairs is empty: give at least one (first, second) pair or use 'auto'")
    clean = []
    for index, pair in enumerate(pairs):
        if (
            isinstance(pair, str)
            or not isinstance(pair, Sequence)
            or len(pair) != 2
            or not all(isinstance(name, str) for name in pair)
        ):
            raise ValueError(
                f"pairs[{index}] must be a (first, second) pair of module names, got {pair!r}"
            )
        clean.append((pair[0], pair[1]))
    return clean


def normalize_layers(layers: LayersSpec) -> str | list[str]:
    """Check the *form* of a layers spec: ``"auto"`` or a non-empty list of module names."""
    if isinstance(layers, str):
        if layers != "auto":
            raise ValueError(f"layers must be 'auto' or a list of module names, got {layers!r}")
        return "auto"
    if not isinstance(layers, Sequence) or not all(isinstance(name, str) for name in layers):
        raise TypeError(f"layers must be 'auto' or a list of module names, got {layers!r}")
    if len(layers) == 0:
        raise ValueError("layers is empty: name at least one layer or use 'auto'")
    return list(layers)


def resolve_pairs(model: nn.Module, pairs: PairsSpec = "auto") -> list[LayerPair]:
    """Resolve ``pairs`` against ``model`` into a list of :class:`LayerPair`.

    Args:
        model: the network (usually the ``LightningModule``).
        pairs: ``"auto"`` pairs the seam's layers (``nn.Linear``, ``nn.Conv1d``,
            ``nn.Conv2d``) in module order, (L1, L2), (L3, L4), ... (an unpaired last layer is
            left alone with a warning); a pair whose data flow the module tree does not show is
            returned with ``verified=False``, for a :class:`ForwardCheck` (``attach`` and the
            callbacks run one on the first training batch). Otherwise a sequence of
            ``(first_name, second_name)`` module names, taken as given.

    Raises:
        ValueError: unknown names, modules (or configurations, e.g. grouped convolutions) the
            seam does not take, parametrized or pruned weights, units that do not chain, tied
            weights, a layer in two pairs, no pair at all, or (``"auto"``) a module with
            parameters or buffers (BatchNorm, LayerNorm, PReLU, ...) between two paired layers,
            a module in an ``nn.Sequential`` the seam does not allow where it stands, or a
            convolution after a Linear layer.
    """
    spec = normalize_pairs(pairs)
    if spec == "auto":
        found = _seam_layers(model)
        if len(found) < 2:
            raise ValueError(
                f"pairs='auto' found {len(found)} layer(s) of the types {_types()} in "
                f"{type(model).__name__}; the path-norm prox needs at least two chained layers "
                "(e.g. Linear(m, n) -> activation -> Linear(n, p), or Conv2d -> activation -> "
                "Flatten -> Linear)."
            )
        if len(found) % 2 == 1:
            rank_zero_warn(
                f"pairs='auto': {len(found)} chained layers "
                f"({', '.join(sorted({type(layer).__name__ for _, layer in found}))}), so the last one "
                f"({found[-1][0]!r}) is not paired and is not regularized by the path-norm prox "
                "(pairs never share a layer). Pass pairs=[...] explicitly to choose the pairs.",
            )
        named = [(found[i], found[i + 1]) for i in range(0, len(found) - 1, 2)]
        for name, layer in itertools.chain.from_iterable(named):
            _check_layer(name, layer)
        unverified = _check_auto_pairs(model, named)
    else:
        used: dict[str, int] = {}
        named = []
        for index, (n1, n2) in enumerate(spec):
            l1 = _lookup(model, n1, f"pairs[{index}]")
            l2 = _lookup(model, n2, f"pairs[{index}]")
            if n1 == n2:
                raise ValueError(f"pairs[{index}]: a layer cannot pair with itself ({n1!r})")
            for name in (n1, n2):
                if name in used:
                    raise ValueError(
                        f"pairs[{index}]: layer {name!r} is already in pairs[{used[name]}]; each "
                        "layer may belong to at most one pair (the prox of overlapping pairs is "
                        "not defined)."
                    )
                used[name] = index
            named.append(((n1, l1), (n2, l2)))
        unverified = set()
    result = []
    for (n1, l1), (n2, l2) in named:
        flatten = _check_chain(n1, l1, n2, l2)
        verified = (n1, n2) not in unverified
        result.append(LayerPair(n1, n2, l1, l2, verified=verified, flatten=flatten))
    return result


def _check_auto_pairs(
    model: nn.Module, named: list[tuple[tuple[str, nn.Module], tuple[str, nn.Module]]]
) -> set[tuple[str, str]]:
    """Refuse an auto pair with a module holding parameters or buffers registered between its
    layers, a convolution after a Linear layer, or (in one ``nn.Sequential``) modules between
    that :func:`~pathnorm_lightning.layers.check_between` refuses; return the pairs whose data
    flow the module tree does not show (see :class:`LayerPair`)."""
    order, position, registered = _tree(model)
    unverified = set()
    for (n1, l1), (n2, l2) in named:
        refuse = f"pairs='auto' would pair {n1!r} with {n2!r}, but"
        advice = "Name the pairs explicitly, e.g. pairs=[('encoder.0', 'encoder.2')]."
        for name, module in _registered_between(order, position, n1, n2):
            if _holds_state(module) and not _has_entry(module):
                learned = (
                    " (nn.PReLU learns its slope, which may leave [0, 1], the slopes for which "
                    "the path-norm bounds the Lipschitz constant)"
                    if isinstance(module, nn.PReLU)
                    else ""
                )
                raise ValueError(
                    f"{refuse} {name!r} (a {type(module).__name__} with parameters or buffers) "
                    "is registered between them: such a pair is not a shallow network "
                    "(layer -> activation -> layer), and its path-norm would not bound that "
                    f"part of the network{learned}. {advice}"
                )
        if layers.entry_of(l2).spatial and not layers.entry_of(l1).spatial:
            raise ValueError(
                f"{refuse} a {type(l2).__name__} cannot read the units of a "
                f"{type(l1).__name__}: the layers the seam knows do not alternate in pairs "
                f"here. {advice}"
            )
        children = _neighbours(order, registered, (n1, l1), (n2, l2))
        if children is None:
            unverified.add((n1, n2))
            continue
        try:
            layers.check_between(l1, l2, children)
        except ValueError as err:
            raise ValueError(f"{refuse} {err}. {advice}") from None
    return unverified


def _tree(
    model: nn.Module,
) -> tuple[list[tuple[str, nn.Module]], dict[str, int], collections.Counter[int]]:
    """The modules in registration order, each name's position there, and how many times each
    module is registered (a module used twice is registered twice)."""
    order = list(model.named_modules())
    position = {name: index for index, (name, _) in enumerate(order)}
    return order, position, collections.Counter(map(id, model.modules(remove_duplicate=False)))


def _registered_between(
    order: list[tuple[str, nn.Module]], position: dict[str, int], n1: str, n2: str
) -> list[tuple[str, nn.Module]]:
    """The modules registered after layer ``n1`` and before layer ``n2``, less ``n1``'s own
    submodules (a parametrization of its bias, a Linear subclass's children)."""
    inside = n1 + "."
    return [(n, m) for n, m in order[position[n1] + 1 : position[n2]] if not n.startswith(inside)]


def _holds_state(module: nn.Module) -> bool:
    """Whether ``module`` has parameters or buffers of its own (a BatchNorm, a PReLU)."""
    own = itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
    return next(own, None) is not None


def _neighbours(
    order: list[tuple[str, nn.Module]],
    registered: collections.Counter[int],
    first: tuple[str, nn.Module],
    second: tuple[str, nn.Module],
) -> list[nn.Module] | None:
    """The modules between two layers that are neighbours in one ``nn.Sequential`` (each
    registered once) with only modules of a known role between them, else None: the module
    tree then shows the data flow."""
    (n1, l1), (n2, l2) = first, second
    parent1, _, a = n1.rpartition(".")
    parent2, _, b = n2.rpartition(".")
    container = dict(order).get(parent1)
    direct = parent1 == parent2 and isinstance(container, nn.Sequential)
    direct = direct and all(registered[id(m)] == 1 for m in (l1, l2))  # not used twice
    children = _children_between(container, a, b) if direct else None
    if children is None or any(layers.role_of(m) is None for m in children):
        return None
    return children


def _children_between(container: Any, first: str, second: str) -> list[nn.Module] | None:
    """The direct children of ``container`` registered between ``first`` and ``second``, or
    None where the second is not after the first."""
    names = list(container._modules)
    i, j = names.index(first), names.index(second)
    if i >= j:
        return None
    return [m for m in (container._modules[n] for n in names[i + 1 : j]) if m is not None]


def resolve_layers(model: nn.Module, layers: LayersSpec = "auto") -> list[tuple[str, nn.Module]]:
    """Resolve ``layers`` (``"auto"``: every ``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d``; or
    module names) to ``(name, layer)``.

    Raises:
        ValueError: unknown names, modules (or configurations) the seam does not take,
            duplicates, or no layer at all.
    """
    spec = normalize_layers(layers)
    if spec == "auto":
        found = _seam_layers(model)
        if not found:
            raise ValueError(
                f"layers='auto' found no layer of the types {_types()} in "
                f"{type(model).__name__}; only those are supported."
            )
        for name, layer in found:
            _check_layer(name, layer)
        return found
    result = []
    for index, name in enumerate(spec):
        layer = _lookup(model, name, f"layers[{index}]")
        if name in spec[:index]:
            raise ValueError(f"layers[{index}]: layer {name!r} is listed twice")
        _check_layer(name, layer)
        result.append((name, layer))
    return result


def chains(first: nn.Module, second: nn.Module) -> bool:
    """Whether ``second`` reads exactly the units ``first`` outputs, as the seam counts them (a
    Linear layer after a convolution through a Flatten of a whole number of positions)."""
    try:
        layers._pair(first, second)
    except ValueError:
        return False
    return True


def layer_chain(model: nn.Module) -> list[nn.Module] | None:
    """All layers of the seam's types in ``model``, in module order, if their units chain (see
    :func:`chains`) and the module tree allows a chain between each two (see
    :func:`chain_check`), else None: the network ``W_L act(... act(W_1 x))`` (pooling and a
    Flatten allowed after convolutions) for which the network-level bounds are defined. None
    also where a link only the forward pass could show runs under ``torch.compile``."""
    chain = _chain(model)
    if chain is None or compiled_links(model, chain[1]):
        return None
    return [layer for _, layer in chain[0]]


def compiled_chain_links(model: nn.Module) -> list[tuple[str, str]]:
    """The links of ``model``'s chain that only the forward pass could show and that run under
    ``torch.compile``, which hides them (empty: none, or no chain)."""
    chain = _chain(model)
    return [] if chain is None else compiled_links(model, chain[1])


def chain_check(model: nn.Module, warn: bool = True) -> ForwardCheck | None:
    """A :class:`ForwardCheck` of the links of :func:`layer_chain` (two consecutive layers, as a
    pair) whose data flow the module tree does not show, and of the model's output, which must
    come from the last layer's alone (None: no chain, or an ``nn.Sequential``, compiled or not,
    that shows it all): a skip connection, a branch or a layer run twice means no chain. Returns
    None where such a link runs under ``torch.compile``, which hides it (with ``warn``: says
    so)."""
    chain = _chain(model)
    if chain is None:
        return None
    found, links = chain
    hidden = compiled_links(model, links)
    if hidden:
        if warn:
            rank_zero_warn(compiled_message(model, hidden))
        return None
    if not links and isinstance(unwrap(model), nn.Sequential):
        return None
    name, last = found[-1]
    return ForwardCheck(links, tail=(model, name, output_module(model, name, last)))


def _chain(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[LayerPair]] | None:
    """The seam's layers of ``model`` in module order and the links between them that the
    module tree does not verify (:func:`_links`); None where they do not form a chain."""
    found = _seam_layers(model)
    try:
        for _, layer in found:
            layers.entry_of(layer)
    except ValueError:
        return None
    if not found or not all(chains(a, b) for (_, a), (_, b) in itertools.pairwise(found)):
        return None
    links = _links(model, found)
    return None if links is None else (found, links)


def _links(model: nn.Module, found: list[tuple[str, nn.Module]]) -> list[LayerPair] | None:
    """The unverified links of a chain of ``found`` layers, or None where the module tree rules
    the chain out: a module with parameters or buffers (a BatchNorm) registered between two of
    its layers, or modules between neighbours in one ``nn.Sequential`` that
    :func:`~pathnorm_lightning.layers.check_between` refuses."""
    order, position, registered = _tree(model)
    links = []
    for (n1, l1), (n2, l2) in itertools.pairwise(found):
        if any(_holds_state(m) for _, m in _registered_between(order, position, n1, n2)):
            return None
        children = _neighbours(order, registered, (n1, l1), (n2, l2))
        if children is None:
            links.append(LayerPair(n1, n2, l1, l2, False, _check_chain(n1, l1, n2, l2)))
            continue
        try:
            with warnings.catch_warnings():  # a steep activation: the pairs warn about it
                warnings.simplefilter("ignore")
                layers.check_between(l1, l2, children)
        except ValueError:
            return None
    return links
