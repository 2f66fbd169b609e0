"""The forward check of the pairs (and chain links) the module tree cannot verify: hooks on
the layers read the autograd graph of the training forward passes before the first optimizer
step (see :class:`ForwardCheck`)."""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from pathnorm_lightning import layers
from pathnorm_lightning._common import rank_zero_warn

if TYPE_CHECKING:
    from pathnorm_lightning.pairing import LayerPair

__all__ = [
    "OUTPUT",
    "ForwardCheck",
    "compiled_links",
    "compiled_message",
    "output_module",
    "unwrap",
]

#: The name of the model's output in a link (no module name has "<")
OUTPUT = "<output>"

#: What a hook that ran under ``torch.compile`` leaves instead of an output's ``grad_fn``
_HIDDEN = object()


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
    alone, as for a pair (the layer's output, or that of a module whose output is the
    layer's). Passes without gradients (validation, sanity checks) and code traced by
    ``torch.compile`` are not recorded: a pair (or the output) with a layer run under
    ``torch.compile`` is not seen, never contradicted. :meth:`finish` removes the forward hooks
    and warns about unverified pairs.
    """

    def __init__(
        self, pairs: Sequence[LayerPair], tail: tuple[nn.Module, str, nn.Module] | None = None
    ) -> None:
        self.pairs = [p for p in pairs if not p.verified]
        self._calls: dict[tuple[int, int], int] = {}  # (id(layer), 0 first / 1 second): runs
        self._last: Any = None  # the tail layer's latest output's grad_fn
        self._outputs: dict[int, Any] = {}  # id(first layer) -> its latest output's grad_fn
        self._broken: set[tuple[str, str]] = set()
        self._hidden: dict[tuple[str, str], bool] = {}  # links a layer ran under compile in
        self._steep: dict[tuple[str, str], tuple[str, float]] = {}  # the steepest activation
        self._handles: list[RemovableHandle] = []
        for pair in self.pairs:
            key = id(pair.first)  # (no id() in hooks that torch.compile may trace)
            self._calls[key, 0] = self._calls[id(pair.second), 1] = 0
            self._handles.append(
                pair.first.register_forward_hook(
                    lambda module, args, output, key=key: self._first_ran(key, output)
                )
            )
            self._handles.append(
                pair.second.register_forward_hook(
                    lambda module, args, output, pair=pair: self._second_ran(pair, args)
                )
            )
        if tail is not None:
            model, name, last = tail
            self._handles.append(last.register_forward_hook(self._last_ran))
            self._handles.append(model.register_forward_pre_hook(self._model_starts))
            self._handles.append(
                model.register_forward_hook(lambda m, a, output: self._model_ran(name, output))
            )

    # The hooks run eagerly, or traced by torch.compile (where they only leave _HIDDEN: the
    # compiled code replays such attribute and dict writes, and no graph breaks for them).
    def _recording(self) -> bool:
        return torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def _hiding(self) -> bool:
        return torch.is_grad_enabled() and torch.compiler.is_compiling()

    def _first_ran(self, key: int, output: Any) -> None:
        if self._recording():
            self._calls[key, 0] += 1
            self._outputs[key] = getattr(output, "grad_fn", None)
        elif self._hiding():
            self._outputs[key] = _HIDDEN

    def _last_ran(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._recording():
            self._last = getattr(output, "grad_fn", None)
        elif self._hiding():
            self._last = _HIDDEN

    def _model_starts(self, module: nn.Module, args: Any) -> None:
        if self._recording():
            self._last = None  # the last layer's output of this call, not of an earlier one

    def _model_ran(self, name: str, output: Any) -> None:
        if not self._recording() or not isinstance(output, torch.Tensor) or output.dim() == 0:
            return  # not the network's output (a loss, a structure)
        if self._last is _HIDDEN:
            self._hidden[name, OUTPUT] = True
        elif self._last is None or _flows_from(output.grad_fn, self._last) is None:
            self._broken.add((name, OUTPUT))

    def _second_ran(self, pair: LayerPair, args: Any) -> None:
        key = (pair.first_name, pair.second_name)
        if not self._recording():
            if self._hiding():
                self._hidden[key] = True
            return
        self._calls[id(pair.second), 1] += 1
        source = self._outputs.get(id(pair.first))
        if source is _HIDDEN:
            self._hidden[key] = True
            return
        node = getattr(args[0], "grad_fn", None) if args else None
        seen = None if source is None else _flows_from(node, source)
        if seen is None or not _keeps_units(pair, seen):
            self._broken.add(key)
            return
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
            if calls == 0 or (name in self._hidden and name not in self._broken):
                unseen.append(name)  # a layer ran under torch.compile: not seen
            elif name in self._broken or calls != self._calls[id(p.second), 1]:
                contradicted.append(name)
        contradicted += [link for link in self._broken if link[1] == OUTPUT]
        unseen += [link for link in self._hidden if link[1] == OUTPUT and link not in contradicted]
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


def unwrap(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wrapper (an ``OptimizedModule``, which registers
    it as ``_orig_mod``) holds, else ``module`` itself."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # torch.compile imports it
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    if wrapper is not None and isinstance(module, wrapper):
        return unwrap(module._orig_mod)
    return module


def _compiled_scopes(model: nn.Module) -> list[str]:
    """The names of the modules of ``model`` whose forward runs under ``torch.compile`` (a
    ``torch.compile(module)`` wrapper, a module compiled in place by ``module.compile()``, or a
    LightningModule that ``trainer.fit(torch.compile(model))`` compiled): their submodules run
    in code the hooks do not see."""
    return [
        name
        for name, module in model.named_modules()
        if unwrap(module) is not module
        or module._compiled_call_impl is not None
        or getattr(module, "_compiler_ctx", None) is not None
    ]


def _inside(name: str, scopes: list[str]) -> bool:
    return any(s == "" or name == s or name.startswith(s + ".") for s in scopes)


def compiled_links(model: nn.Module, links: Sequence[LayerPair]) -> list[tuple[str, str]]:
    """The ``links`` (that the module tree does not verify) with a layer that runs under
    ``torch.compile`` in ``model``: no forward check can see them."""
    scopes = _compiled_scopes(model)
    return [
        (p.first_name, p.second_name)
        for p in links
        if _inside(p.first_name, scopes) or _inside(p.second_name, scopes)
    ]


def compiled_message(model: nn.Module, hidden: Sequence[tuple[str, str]]) -> str:
    """Why the network bounds of ``model`` are left out: its ``hidden`` links run compiled."""
    scopes = [repr(s) if s else "the model itself" for s in _compiled_scopes(model)]
    return (
        f"{type(unwrap(model)).__name__}: the network bounds path_norm_bound and product_bound "
        f"are not computed: the links {list(hidden)} between its Linear and convolution layers "
        f"run under torch.compile (compiled: {', '.join(scopes)}), where the forward pass that "
        "would verify them is not seen, and the module tree does not show them (the two layers "
        "are not neighbours in one nn.Sequential). The prox and the sparsity and alive_units "
        "metrics are not affected. To keep the bounds, compile an nn.Sequential that holds the "
        "layers instead (e.g. self.net = torch.compile(nn.Sequential(...)): its module tree "
        "shows the chain), or train uncompiled."
    )


def output_module(model: nn.Module, name: str, last: nn.Module) -> nn.Module:
    """The module whose output the output check of ``model``'s chain reads as the last layer's
    (``name``): the layer, or, where the layer ends an ``nn.Sequential`` that
    ``torch.compile(sequential)`` wraps (no parameter or buffer after it there), the wrapper,
    whose hooks run outside the compiled code (the layer's run inside it)."""
    parent, _, child = name.rpartition(".")
    wrapper_name, _, attribute = parent.rpartition(".")
    modules = dict(model.named_modules())
    holder, wrapper = modules.get(parent), modules.get(wrapper_name)
    if attribute != "_orig_mod" or not isinstance(holder, nn.Sequential) or wrapper is None:
        return last
    if unwrap(wrapper) is not holder:
        return last
    children = list(holder.named_children())
    index = next((i for i, (n, _) in enumerate(children) if n == child), None)
    if index is None or any(_holds_any(m) for _, m in children[index + 1 :]):
        return last
    return wrapper


def _holds_any(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule has a parameter or a buffer."""
    return next(itertools.chain(module.parameters(), module.buffers()), None) is not None
