"""Which ``nn.Linear`` layers a callback regularizes: layer pairs (path-norm) or single layers.

A *pair* ``(first, second)`` is two ``nn.Linear`` layers ``Linear(m, n) -> act -> Linear(n, p)``
whose hidden units (``first.weight[i, :]`` incoming, ``second.weight[:, i]`` outgoing) the
1-path-norm prox couples. ``pairs="auto"`` pairs the network's Linear layers in module order,
(L1, L2), (L3, L4), ..., as in the paper's multilayer extension; a pair the module tree does not
show to be a shallow network is checked against the first training forward pass
(:class:`ForwardCheck`). Needs torch only (no Lightning).
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize, prune
from torch.utils.hooks import RemovableHandle

from pathnorm_lightning._common import rank_zero_warn, shares_memory

__all__ = [
    "ForwardCheck",
    "LayerPair",
    "LayersSpec",
    "PairsSpec",
    "linear_chain",
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
    """Two chained ``nn.Linear`` layers, named as in ``model.named_modules()``.

    ``verified`` is False for an ``"auto"`` pair whose data flow the module tree does not show
    (not neighbours in one ``nn.Sequential`` with only activations between them): the hooks
    check it against the first training forward pass (:class:`ForwardCheck`).
    """

    first_name: str
    second_name: str
    first: nn.Linear
    second: nn.Linear
    verified: bool = True


def _linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]


def _lookup(model: nn.Module, name: str, what: str) -> nn.Linear:
    """The ``nn.Linear`` called ``name`` in ``model``, with a helpful error otherwise."""
    if not isinstance(name, str):
        raise TypeError(
            f"{what}: layer names must be strings, got {name!r} ({type(name).__name__})"
        )
    modules = dict(model.named_modules())
    if name not in modules:
        linear_names = [n for n, _ in _linear_layers(model)]
        close = difflib.get_close_matches(name, list(modules), n=3)
        hint = f" Did you mean {close}?" if close else ""
        raise ValueError(
            f"{what}: {type(model).__name__} has no submodule named {name!r}.{hint} "
            f"Its nn.Linear layers are {linear_names} (names as in model.named_modules())."
        )
    module = modules[name]
    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"{what}: module {name!r} is a {type(module).__name__}, but only nn.Linear layers are "
            "supported (the prox acts on 2-D weight matrices of fully connected layers)."
        )
    return module


def weight_parameter(name: str, layer: nn.Module) -> nn.Parameter:
    """The parameter ``layer.weight`` is, or a ``ValueError`` naming why it is computed instead
    (a parametrization, pruning, the older weight/spectral norm hooks): the prox would write to
    a tensor recomputed at every forward pass, not to the weights the optimizer trains."""
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
            undo = "torch.nn.utils.remove_weight_norm or remove_spectral_norm"
    raise ValueError(
        f"layer {name!r} is {cause}: its weight is computed from other tensors at every forward "
        "pass, not a parameter the optimizer updates, so the prox would write to a computed "
        "tensor (overwritten at the next forward) instead of the weights being trained. Remove "
        f"it before training with the prox ({undo}), or leave this layer out of the pairs. The "
        "prox itself zeroes weights exactly, so pruning on top of it is not needed for sparsity."
    )


def _check_materialized(name: str, layer: nn.Linear) -> None:
    weight_parameter(name, layer)
    if isinstance(layer.weight, nn.parameter.UninitializedParameter):
        raise ValueError(
            f"layer {name!r} is a {type(layer).__name__} whose weight is not materialized yet "
            "(its in_features are unknown). Run one forward pass on an example batch before "
            "fit, as torch requires before building the optimizers."
        )


def _check_chain(first_name: str, first: nn.Linear, second_name: str, second: nn.Linear) -> None:
    _check_materialized(first_name, first)
    _check_materialized(second_name, second)
    if first.out_features != second.in_features:
        raise ValueError(
            f"pairs: layers {first_name!r} (out_features={first.out_features}) and "
            f"{second_name!r} (in_features={second.in_features}) do not chain: the first layer's "
            "out_features must equal the second layer's in_features (they share the hidden units)."
        )
    if shares_memory(first.weight, second.weight):
        raise ValueError(
            f"pairs: layers {first_name!r} and {second_name!r} share one weight (tied weights); "
            "the prox of a pair needs two independent weight matrices (it would write one "
            "result over the other). Untie them or leave this pair out."
        )


def normalize_pairs(pairs: PairsSpec) -> str | list[tuple[str, str]]:
    """Check the *form* of a pairs spec (no model needed): ``"auto"`` or ``[(first, second), ...]``.

    Raises:
        ValueError / TypeError: anything else, an empty list, or an entry that is not two names.
    """
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
        raise ValueError("layers is empty: name at least one nn.Linear layer or use 'auto'")
    return list(layers)


def resolve_pairs(model: nn.Module, pairs: PairsSpec = "auto") -> list[LayerPair]:
    """Resolve ``pairs`` against ``model`` into a list of :class:`LayerPair`.

    Args:
        model: the network (usually the ``LightningModule``).
        pairs: ``"auto"`` pairs the ``nn.Linear`` layers in module order, (L1, L2), (L3, L4),
            ...; an unpaired last layer is left alone with a warning. A pair whose data flow the
            module tree does not show (not neighbours in one ``nn.Sequential`` with only
            activations between them) is returned with ``verified=False``, for a
            :class:`ForwardCheck` (``attach`` and the callbacks run one on the first training
            batch). Otherwise a sequence of ``(first_name, second_name)`` module names, taken as
            given.

    Raises:
        ValueError: unknown names, non-Linear modules, parametrized or pruned weights (computed,
            not parameters), dimensions that do not chain, tied weights, a layer in two pairs,
            no pair at all, or (``"auto"``) a module with parameters or buffers (Conv,
            BatchNorm, LayerNorm, PReLU, ...) between two paired layers.
    """
    spec = normalize_pairs(pairs)
    if spec == "auto":
        layers = _linear_layers(model)
        if len(layers) < 2:
            raise ValueError(
                f"pairs='auto' found {len(layers)} nn.Linear layer(s) in {type(model).__name__}; "
                "the path-norm prox needs at least two chained Linear layers "
                "(Linear(m, n) -> activation -> Linear(n, p))."
            )
        if len(layers) % 2 == 1:
            rank_zero_warn(
                f"pairs='auto': {len(layers)} nn.Linear layers, so the last one "
                f"({layers[-1][0]!r}) is not paired and is not regularized by the path-norm prox "
                "(pairs never share a layer). Pass pairs=[...] explicitly to choose the pairs.",
            )
        named = [(layers[i], layers[i + 1]) for i in range(0, len(layers) - 1, 2)]
        for name, layer in itertools.chain.from_iterable(named):
            _check_materialized(name, layer)
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
        _check_chain(n1, l1, n2, l2)
        result.append(LayerPair(n1, n2, l1, l2, verified=(n1, n2) not in unverified))
    return result


# Modules that act entry by entry and hold no state: between two Linear layers of one
# nn.Sequential they keep the pair a shallow network. (nn.PReLU is not one: it learns its slope.)
_POINTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus,
    nn.Softsign, nn.Tanhshrink, nn.LogSigmoid, nn.Identity, nn.Dropout, nn.AlphaDropout,
)  # fmt: skip


def _check_auto_pairs(
    model: nn.Module, named: list[tuple[tuple[str, nn.Linear], tuple[str, nn.Linear]]]
) -> set[tuple[str, str]]:
    """Refuse an auto pair with a module holding parameters or buffers (Conv, BatchNorm,
    LayerNorm, PReLU, ...) registered between its layers; return the pairs whose data flow
    cannot be read from the module tree (not neighbours in one ``nn.Sequential`` with only
    pointwise activations between them)."""
    order = list(model.named_modules())
    position = {name: index for index, (name, _) in enumerate(order)}
    unverified = set()
    for (n1, _), (n2, _) in named:
        between = order[position[n1] + 1 : position[n2]]
        for name, module in between:
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if own and not isinstance(module, nn.Linear):
                learned = (
                    " (nn.PReLU learns its slope, which may leave [0, 1], the slopes for which "
                    "the path-norm bounds the Lipschitz constant)"
                    if isinstance(module, nn.PReLU)
                    else ""
                )
                raise ValueError(
                    f"pairs='auto' would pair {n1!r} with {n2!r}, but {name!r} (a "
                    f"{type(module).__name__} with parameters or buffers) is registered between "
                    "them: such a pair is not a shallow network Linear -> activation -> Linear, "
                    f"and its path-norm would not bound that part of the network{learned}. Name "
                    "the pairs explicitly, e.g. pairs=[('encoder.0', 'encoder.2')]."
                )
        parent1, _, _ = n1.rpartition(".")
        parent2, _, _ = n2.rpartition(".")
        container = dict(order).get(parent1)
        direct = parent1 == parent2 and isinstance(container, nn.Sequential)
        if not direct or not all(isinstance(m, _POINTWISE) for _, m in between):
            unverified.add((n1, n2))
    return unverified


class ForwardCheck:
    """Checks ``"auto"`` pairs that the module tree cannot verify against the training forward
    passes before the first optimizer step.

    A pair is verified when both layers ran equally often (at least once) and every input of
    the second layer comes from the first layer's latest output alone (through activations,
    dropout, reshapes: no parameter, no skip connection), as read from the autograd graph. Passes without gradients (validation, sanity checks) and code being
    traced by ``torch.compile`` are not recorded. :meth:`finish` removes the forward hooks and
    warns about the pairs it could not verify.
    """

    def __init__(self, pairs: Sequence[LayerPair]) -> None:
        self.pairs = [p for p in pairs if not p.verified]
        self._calls: dict[int, int] = {}
        self._outputs: dict[int, Any] = {}  # id(first layer) -> its latest output's grad_fn
        self._broken: set[tuple[str, str]] = set()
        self._handles: list[RemovableHandle] = []
        for pair in self.pairs:
            for layer in (pair.first, pair.second):
                self._calls[id(layer)] = 0
            self._handles.append(pair.first.register_forward_hook(self._first_ran))
            self._handles.append(
                pair.second.register_forward_hook(
                    lambda module, args, output, pair=pair: self._second_ran(pair, args)
                )
            )

    def _recording(self) -> bool:
        return torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def _first_ran(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._recording():
            self._calls[id(module)] += 1
            self._outputs[id(module)] = getattr(output, "grad_fn", None)

    def _second_ran(self, pair: LayerPair, args: Any) -> None:
        if not self._recording():
            return
        self._calls[id(pair.second)] += 1
        source = self._outputs.get(id(pair.first))
        node = getattr(args[0], "grad_fn", None) if args else None
        if source is None or not _flows_from(node, source):
            self._broken.add((pair.first_name, pair.second_name))

    def remove(self) -> None:
        """Remove the forward hooks (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._outputs.clear()

    def finish(self, owner: str) -> None:
        """Remove the hooks; warn (``owner`` first) about every pair not verified."""
        self.remove()
        unseen, contradicted = [], []
        for p in self.pairs:
            name, calls = (p.first_name, p.second_name), self._calls[id(p.first)]
            if calls == 0:
                unseen.append(name)
            elif name in self._broken or calls != self._calls[id(p.second)]:
                contradicted.append(name)
        self.pairs = []
        why = []
        if contradicted:
            why.append(
                f"the forward pass does not run {contradicted} as shallow pairs (the second "
                "layer must run once per first-layer call, on its output alone, through "
                "activations: no other input, no parameter between)"
            )
        if unseen:
            why.append(
                f"no forward pass with gradients ran {unseen} before the first optimizer step "
                "(under torch.compile it is not seen)"
            )
        if why:
            rank_zero_warn(
                f"{owner}: pairs='auto' paired {contradicted + unseen} from the order the layers "
                f"were registered in, but {'; and '.join(why)}: the pairs could not be verified. "
                "Pass pairs=[(first, second), ...] explicitly to confirm them, or to choose "
                "others."
            )


def _flows_from(node: Any, source: Any, budget: int = 256) -> bool:
    """Whether every path back from autograd node ``node`` reaches ``source`` before reaching
    any other input: a parameter, or (except as the factor of a product or quotient, e.g. a
    dropout mask) a tensor without gradient, such as a skip connection from the data."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current is source:
            continue
        if current is None or type(current).__name__ == "AccumulateGrad":
            return False
        if id(current) in seen:
            continue
        seen.add(id(current))
        inputs = current.next_functions
        if not inputs or len(seen) > budget:
            return False
        for function, _ in inputs:
            if function is None and type(current).__name__ not in _SCALINGS:
                return False
            if function is not None:
                stack.append(function)
    return True


_SCALINGS = ("MulBackward0", "DivBackward0")  # a constant factor: dropout's mask, a scale


def resolve_layers(model: nn.Module, layers: LayersSpec = "auto") -> list[tuple[str, nn.Linear]]:
    """Resolve ``layers`` (``"auto"``: every ``nn.Linear``; or module names) to ``(name, layer)``.

    Raises:
        ValueError: unknown names, non-Linear modules, duplicates, or no layer at all.
    """
    spec = normalize_layers(layers)
    if spec == "auto":
        found = _linear_layers(model)
        if not found:
            raise ValueError(
                f"layers='auto' found no nn.Linear layer in {type(model).__name__}; "
                "only nn.Linear layers are supported."
            )
        for name, layer in found:
            _check_materialized(name, layer)
        return found
    seen: set[str] = set()
    result = []
    for index, name in enumerate(spec):
        layer = _lookup(model, name, f"layers[{index}]")
        if name in seen:
            raise ValueError(f"layers[{index}]: layer {name!r} is listed twice")
        _check_materialized(name, layer)
        seen.add(name)
        result.append((name, layer))
    return result


def linear_chain(model: nn.Module) -> list[nn.Linear] | None:
    """All ``nn.Linear`` layers of ``model`` in module order if their dimensions chain, else None.

    The network-level bounds (path-norm bound, product bound) are defined for such a chain:
    a feed-forward MLP ``W_L act(... act(W_1 x))``.
    """
    layers = [mod for _, mod in _linear_layers(model)]
    if not layers:
        return None
    for a, b in itertools.pairwise(layers):
        if a.out_features != b.in_features:
            return None
    return layers
