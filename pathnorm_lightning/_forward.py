"""The forward check of the pairs (and chain links) the module tree cannot verify: hooks on
the layers read the autograd graph of the training forward passes before the first optimizer
step (see :class:`ForwardCheck`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from pathnorm_lightning import layers
from pathnorm_lightning._common import rank_zero_warn

if TYPE_CHECKING:
    from pathnorm_lightning.pairing import LayerPair

__all__ = ["OUTPUT", "ForwardCheck"]

#: The name of the model's output in a link (no module name has "<")
OUTPUT = "<output>"


class ForwardCheck:
    """Checks the ``"auto"`` pairs that the module tree cannot verify against the training
    forward passes before the first optimizer step.

    A pair is verified when both layers ran equally often (at least once) and every input of
    the second layer comes from the first layer's latest output alone, through ops that act on
    each entry alone (activations, dropout, casts, reshapes; pooling after a convolution: no
    parameter, no skip connection, nothing that mixes or moves the units such as a softmax, a
    sum, an index or a flip), as read from the autograd graph. After a convolution a Linear
    second layer must read a channels-first flatten of ``(N, C, *S)`` with ``prod(S)`` the
    pair's ``flatten``. With ``tail`` (the model, and the name of its last layer and the
    layer), the model's output (a tensor with a batch dimension) must come from that layer's
    alone, as for a pair. Passes without gradients (validation, sanity checks) and code traced
    by ``torch.compile`` are not recorded. :meth:`finish` removes the forward hooks and warns
    about unverified pairs.
    """

    def __init__(
        self, pairs: Sequence[LayerPair], tail: tuple[nn.Module, str, nn.Module] | None = None
    ) -> None:
        self.pairs = [p for p in pairs if not p.verified]
        self._calls: dict[tuple[int, int], int] = {}  # (id(layer), 0 first / 1 second): runs
        self._last: Any = None  # the tail layer's latest output's grad_fn
        self._outputs: dict[int, Any] = {}  # id(first layer) -> its latest output's grad_fn
        self._broken: set[tuple[str, str]] = set()
        self._steep: dict[tuple[str, str], tuple[str, float]] = {}  # the steepest activation
        self._handles: list[RemovableHandle] = []
        for pair in self.pairs:
            self._calls[id(pair.first), 0] = self._calls[id(pair.second), 1] = 0
            self._handles.append(pair.first.register_forward_hook(self._first_ran))
            self._handles.append(
                pair.second.register_forward_hook(
                    lambda module, args, output, pair=pair: self._second_ran(pair, args)
                )
            )
        if tail is not None:
            model, name, last = tail
            self._handles.append(last.register_forward_hook(self._last_ran))
            self._handles.append(
                model.register_forward_hook(lambda m, a, output: self._model_ran(name, output))
            )

    def _recording(self) -> bool:
        return torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def _first_ran(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._recording():
            self._calls[id(module), 0] += 1
            self._outputs[id(module)] = getattr(output, "grad_fn", None)

    def _last_ran(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._recording():
            self._last = getattr(output, "grad_fn", None)

    def _model_ran(self, name: str, output: Any) -> None:
        if not self._recording() or not isinstance(output, torch.Tensor) or output.dim() == 0:
            return  # not the network's output (a loss, a structure)
        if self._last is None or _flows_from(output.grad_fn, self._last) is None:
            self._broken.add((name, OUTPUT))

    def _second_ran(self, pair: LayerPair, args: Any) -> None:
        if not self._recording():
            return
        self._calls[id(pair.second), 1] += 1
        source = self._outputs.get(id(pair.first))
        node = getattr(args[0], "grad_fn", None) if args else None
        seen = None if source is None else _flows_from(node, source)
        if seen is None or not _keeps_units(pair, seen):
            self._broken.add((pair.first_name, pair.second_name))
            return
        key = (pair.first_name, pair.second_name)
        for cls in filter(None, (layers.STEEP_OPS.get(layers.op_name(n)) for n in seen)):
            slope = layers.max_slope(cls())
            if slope > self._steep.get(key, ("", 1.0))[1]:
                self._steep[key] = (cls.__name__, slope)

    def remove(self) -> None:
        """Remove the forward hooks (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._outputs.clear()

    def finish(self, owner: str, warn: bool = True) -> list[tuple[str, str]]:
        """Remove the hooks; warn (``owner`` first, if ``warn``) about every pair not verified;
        return those the forward pass contradicted."""
        self.remove()
        unseen, contradicted = [], []
        for p in self.pairs:
            name, calls = (p.first_name, p.second_name), self._calls[id(p.first), 0]
            if calls == 0:
                unseen.append(name)
            elif name in self._broken or calls != self._calls[id(p.second), 1]:
                contradicted.append(name)
        contradicted += [link for link in self._broken if link[1] == OUTPUT]
        self.pairs = []
        if not warn:
            return contradicted
        for (first, second), (activation, slope) in self._steep.items():
            if (first, second) not in contradicted + unseen:
                what = f"{owner}: between {first!r} and {second!r}"
                rank_zero_warn(layers.steep_message(what, activation, slope))
        why = []
        if contradicted:
            why.append(
                f"the forward pass does not run {contradicted} as shallow pairs (the second "
                "layer must run once per first-layer call, on its output alone, through "
                "entrywise ops such as activations: no other input, no parameter, nothing that "
                "mixes or moves the units, such as a softmax, a sum, an index or a flip)"
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
        return contradicted


def _flows_from(node: Any, source: Any, budget: int = 256) -> list[Any] | None:
    """The autograd nodes on the paths back from ``node`` to ``source``, or None where a path
    reaches any other input first: a parameter, or (except as the factor of a product or
    quotient, e.g. a dropout mask) a tensor without gradient, such as a skip connection from
    the data."""
    stack, seen = [node], set()
    nodes = []
    while stack:
        current = stack.pop()
        if current is source:
            continue
        if current is None or type(current).__name__ == "AccumulateGrad":
            return None
        if id(current) in seen:
            continue
        seen.add(id(current))
        nodes.append(current)
        inputs = current.next_functions
        if not inputs or len(seen) > budget:
            return None
        for function, _ in inputs:
            if function is None and type(current).__name__ not in _SCALINGS:
                return None
            if function is not None:
                stack.append(function)
    return nodes


def _keeps_units(pair: LayerPair, nodes: list[Any]) -> bool:
    """Every node on the path is one of the seam's entrywise ops (or, after a convolution, of
    its pooling ops: an average that does not scale its sums, a mean over positions only, no
    power around it as in an Lp pooling), and (before a Linear layer after a convolution) a
    reshape of ``(N, C, *S)`` with ``prod(S)`` the pair's flatten positions, or (one position)
    a mean over every position."""
    spatial = layers.entry_of(pair.first).spatial
    allowed = layers.ENTRYWISE_OPS | layers.POOL_OPS if spatial else layers.ENTRYWISE_OPS
    names = [layers.op_name(n) for n in nodes]
    if any(name not in allowed for name in names):
        return False
    named = list(zip(nodes, names, strict=True))
    pooled = [n for n, name in named if name in layers.POOL_OPS]
    if pooled and "Pow" in names:
        return False  # an Lp pooling (a power, pooled, a factor, the root) sums, not averages
    if any(getattr(n, "_saved_divisor_override", None) is not None for n in pooled):
        return False  # scales the window sums
    means = [n for n, name in named if name == "Mean"]
    if any(_mean_axes(n) is None for n in means):
        return False  # a mean over the channels (or every axis) mixes the units
    if pair.flatten is None:
        return True
    channels = layers.entry_of(pair.first).units_out(pair.first)
    for node in nodes:
        sizes = getattr(node, "_saved_self_sym_sizes", None)
        if sizes is not None and len(sizes) >= 3:
            shape = [int(d) for d in sizes]
            if shape[1] == channels and math.prod(shape[2:]) == pair.flatten:
                return True
    # (N, C, *S) -> (N, C) by a mean over every position: one position
    return pair.flatten == 1 and any(
        not n._saved_keepdim and _mean_axes(n) == tuple(range(2, len(n._saved_self_sym_sizes)))
        for n in means
    )


def _mean_axes(node: Any) -> tuple[int, ...] | None:
    """The sorted axes a ``Mean`` node averages over, or None where they include the batch or
    channel axis (or every axis)."""
    dims = getattr(node, "_saved_dim", None)
    sizes = getattr(node, "_saved_self_sym_sizes", None)
    if dims is None or sizes is None:
        return None
    ndim = len(sizes)
    axes = tuple(sorted({(d - 2**64 if d >= 2**63 else d) % ndim for d in dims}))
    return axes if axes and axes[0] >= 2 else None


_SCALINGS = ("MulBackward0", "DivBackward0")  # a constant factor: dropout's mask, a scale
