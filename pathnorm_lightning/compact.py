"""``compact``: remove the dead hidden units of every layer pair; a smaller network, same function.

The 1-path-norm prox zeroes whole hidden units, but a zero unit still costs its row and column
in a dense layer. For a pair ``first -> pointwise ops -> second`` (as paired in training),
hidden unit ``i`` is removed when

* its **outgoing** weights are all zero (``second.weight[:, i] == 0``): it adds nothing to the
  output. Its incoming row, bias entry and outgoing column go;
* its **incoming** weights are all zero (``first.weight[i] == 0``) but not its outgoing ones:
  it outputs the constant ``c_i = act(b_i)`` for every input. ``c_i * second.weight[:, i]`` is
  added to ``second``'s bias (one is created if ``second`` has none) and the unit goes.

``c`` is computed by running ``first`` on a zero input and the operations between the two
layers on its output, in eval mode (dropout is the identity). So the compacted model computes
the same function at inference, up to floating-point rounding. A pair whose units are all dead
keeps one zero unit (zero weights and bias in, zero weights out), so both layers stay ordinary
layers with at least one unit.

Exactness needs the hidden units to feed nothing but ``second``, through entry-wise operations
only. This is checked on the model's ``torch.fx`` trace: ``first`` and ``second`` each run
once, and every value between them has one user, a pointwise activation or dropout (module,
function or method). A model that cannot be traced is accepted where the pair are neighbours in
one ``nn.Sequential`` with only such modules between them; anything else is refused.

Layer types enter through one seam: :data:`_UNIT_OPS` maps a layer type to the class holding
everything ``compact`` asks of it (unit count, which units have zero weights, removing output
units of the first layer or input units of the second, folding constants into the bias).
Only ``nn.Linear`` has an entry today; a convolution entry adds a class there.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, fx, nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

from pathnorm_lightning.layers import Role, role_of
from pathnorm_lightning.pairing import PairsSpec, resolve_pairs

__all__ = ["CompactionReport", "PairCompaction", "compact"]

Op = Callable[[Tensor], Tensor]


# -- the report ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairCompaction:
    """What ``compact`` did to one pair: hidden units and the pair's parameters, before/after.

    ``removed`` units had zero outgoing weights; ``folded`` ones zero incoming weights (their
    constant output went into ``second``'s bias). ``units_after`` is 1 where all were dead.
    """

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
    """Per-pair results and the whole model's parameter count before and after; ``str()`` is a
    table."""

    pairs: tuple[PairCompaction, ...]
    params_before: int
    params_after: int

    @property
    def units_before(self) -> int:
        """Hidden units of all pairs before compaction."""
        return sum(p.units_before for p in self.pairs)

    @property
    def units_after(self) -> int:
        """Hidden units of all pairs after compaction."""
        return sum(p.units_after for p in self.pairs)

    def __str__(self) -> str:
        head = ("pair", "units", "removed", "folded", "pair params")
        rows = [
            (
                f"{p.first} -> {p.second}",
                f"{p.units_before} -> {p.units_after}",
                str(p.removed),
                str(p.folded),
                f"{p.params_before:,} -> {p.params_after:,}",
            )
            for p in self.pairs
        ]
        widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]
        ]
        share = self.params_after / self.params_before if self.params_before else 1.0
        total = f"model parameters {self.params_before:,} -> {self.params_after:,} ({share:.1%})"
        return "\n".join([*lines, total])


# -- the layer seam: one entry per layer type ----------------------------------------------------


class _UnitOps(Protocol):
    """What ``compact`` asks of a layer type (see :class:`_LinearUnits` for the meanings)."""

    def units_out(self, layer: Any) -> int: ...
    def zero_incoming(self, layer: Any) -> Tensor: ...
    def zero_outgoing(self, layer: Any) -> Tensor: ...
    def probe(self, layer: Any) -> Tensor: ...
    def unit_values(self, output: Tensor) -> Tensor: ...
    def input_shift(self, layer: Any, constants: Tensor) -> Tensor | None: ...
    def keep_out(self, layer: Any, keep: Tensor, zero: bool) -> None: ...
    def keep_in(self, layer: Any, keep: Tensor, zero: bool, shift: Tensor | None) -> None: ...


class _LinearUnits:
    """``nn.Linear``: hidden unit ``i`` is output feature ``i`` of the first layer (row ``i`` of
    its weight) and input feature ``i`` of the second (column ``i``). Layers are changed in
    place (the caller owns them: a deep copy), so hooks and attributes stay."""

    @staticmethod
    def units_out(layer: nn.Linear) -> int:
        return layer.out_features

    @staticmethod
    def zero_incoming(layer: nn.Linear) -> Tensor:
        """Which output units of ``layer`` have all incoming weights zero, ``(n,)`` bool."""
        return (layer.weight == 0).all(dim=1)

    @staticmethod
    def zero_outgoing(layer: nn.Linear) -> Tensor:
        """Which input units of ``layer`` have all their weights zero, ``(n,)`` bool."""
        return (layer.weight == 0).all(dim=0)

    @staticmethod
    def probe(layer: nn.Linear) -> Tensor:
        """An input of zeros; on it every unit outputs what a unit with zero incoming weights
        always outputs (its bias)."""
        return layer.weight.new_zeros(1, layer.in_features)

    @staticmethod
    def unit_values(output: Tensor) -> Tensor:
        """The per-unit values ``(n,)`` of an output of :meth:`probe` (after pointwise ops)."""
        return output[0]

    @staticmethod
    def input_shift(layer: nn.Linear, constants: Tensor) -> Tensor | None:
        """The change to ``layer``'s output when input unit ``i`` is the constant
        ``constants[i]`` instead of zero: exactly a bias (None where a type cannot fold)."""
        return layer.weight @ constants.to(layer.weight.dtype)

    @staticmethod
    def keep_out(layer: nn.Linear, keep: Tensor, zero: bool) -> None:
        """Keep only output units ``keep`` (index tensor); ``zero``: make them zero units."""
        weight, bias = layer.weight.detach()[keep], layer.bias
        layer.weight = _like(layer.weight, weight.zero_() if zero else weight)
        if bias is not None:
            kept = bias.detach()[keep]
            layer.bias = _like(bias, kept.zero_() if zero else kept)
        layer.out_features = len(keep)

    @staticmethod
    def keep_in(layer: nn.Linear, keep: Tensor, zero: bool, shift: Tensor | None) -> None:
        """Keep only input units ``keep``, zeroing their weights if ``zero``; add ``shift`` to
        the bias (created where the layer has none and the shift is nonzero)."""
        weight = layer.weight.detach()[:, keep]
        layer.weight = _like(layer.weight, weight.zero_() if zero else weight)
        layer.in_features = len(keep)
        if shift is None or not bool((shift != 0).any()):
            return
        if layer.bias is None:
            layer.bias = nn.Parameter(shift.clone(), requires_grad=layer.weight.requires_grad)
        else:
            layer.bias = _like(layer.bias, layer.bias.detach() + shift)


def _like(old: Tensor, value: Tensor) -> nn.Parameter:
    return nn.Parameter(value.contiguous(), requires_grad=old.requires_grad)


#: The layer types ``compact`` can shrink (exact type), each with its seam entry.
_UNIT_OPS: dict[type[nn.Module], _UnitOps] = {nn.Linear: _LinearUnits}


def _ops(name: str, layer: nn.Module) -> _UnitOps:
    ops = _UNIT_OPS.get(type(layer))
    if ops is None:
        raise ValueError(
            f"compact: layer {name!r} is a {type(layer).__name__}; compact shrinks "
            f"{[t.__name__ for t in _UNIT_OPS]} layers only (exact types: a subclass may "
            "compute something else)."
        )
    if "weight" not in layer._parameters or parametrize.is_parametrized(layer):
        raise ValueError(
            f"compact: the weight of layer {name!r} is computed (torch.nn.utils.prune or a "
            "parametrization); make it a plain parameter first (prune.remove / "
            "parametrize.remove_parametrizations)."
        )
    return ops


# -- the data flow between the two layers of a pair ---------------------------------------------

# Entry-wise functions and tensor methods fx may record between a pair (modules: layers.BETWEEN).
_FUNCTIONS: frozenset[object] = frozenset(
    {F.relu, F.relu6, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish, F.leaky_relu, F.hardtanh,
     F.hardswish, F.hardsigmoid, F.softplus, F.softsign, F.tanhshrink, F.logsigmoid, F.tanh,
     F.sigmoid, torch.relu, torch.tanh, torch.sigmoid, torch.selu, torch.celu}
)  # fmt: skip
_DROPOUTS: frozenset[object] = frozenset({F.dropout, F.alpha_dropout, torch.dropout})
_METHODS = frozenset({"relu", "tanh", "sigmoid"})


def _pointwise_module(module: nn.Module) -> bool:
    """An entry-wise module of the seam's table, or a ``PReLU`` with one slope for all units
    (exact to compact across, though pairing does not take it for training)."""
    if isinstance(module, nn.PReLU):
        return module.weight.numel() == 1
    return role_of(module) is Role.POINTWISE


def _identity(x: Tensor) -> Tensor:
    return x


def _node_op(gm: fx.GraphModule, node: fx.Node, value: fx.Node) -> Op | None:
    """``node`` as an entry-wise operation of ``value`` alone (at inference), or None."""
    rest = [*node.args[1:], *node.kwargs.values()]
    if not node.args or node.args[0] is not value or any(isinstance(a, fx.Node) for a in rest):
        return None
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return module if _pointwise_module(module) and len(node.args) == 1 else None
    if node.op == "call_function" and node.target in _DROPOUTS:
        return _identity
    if node.op == "call_function" and node.target in _FUNCTIONS:
        return functools.partial(_apply, node.target, node.args[1:], node.kwargs)
    if node.op == "call_method" and node.target in _METHODS and len(node.args) == 1:
        return functools.partial(_apply, getattr(Tensor, str(node.target)), (), {})
    return None


def _apply(fn: Any, args: Sequence[object], kwargs: dict, x: Tensor) -> Tensor:
    return fn(x, *args, **kwargs)


def _describe(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module {node.target!r}"
    if node.op == "call_method":
        return f"the tensor method .{node.target}()"
    if node.op == "output":
        return "the model's output"
    return f"{getattr(node.target, '__name__', node.target)}()"


def _traced_between(gm: fx.GraphModule, first: str, second: str) -> list[Op]:
    """The operations from ``first``'s output to ``second``'s input in the fx graph."""
    calls = {
        name: [n for n in gm.graph.nodes if n.op == "call_module" and n.target == name]
        for name in (first, second)
    }
    for name, found in calls.items():
        if len(found) != 1:
            raise ValueError(
                f"compact: layer {name!r} runs {len(found)} times in forward() (as torch.fx "
                "traced it); a pair's layers must run once each (a reused layer's units serve "
                "several inputs, an unused one pairs nothing)."
            )
    (node,), (end,) = calls[first], calls[second]
    ops: list[Op] = []
    while True:
        users = list(node.users)
        if len(users) != 1:
            what = ", ".join(_describe(u) for u in users) if users else "nothing"
            raise ValueError(
                f"compact: the hidden units of ({first!r}, {second!r}) feed {what}, not "
                f"{second!r} alone: removing units would change the other consumers. Compact "
                "only pairs whose hidden units nothing else reads."
            )
        (user,) = users
        if user is end:
            if tuple(user.args) != (node,) or user.kwargs:
                raise ValueError(f"compact: {second!r} takes more than the pair's hidden units")
            return ops
        op = _node_op(gm, user, node)
        if op is None:
            raise ValueError(
                f"compact: {_describe(user)} stands between {first!r} and {second!r}, and "
                "it is not an entry-wise activation or dropout: the hidden units do not pass "
                "to the second layer one by one, so removing some would change the function."
            )
        ops.append(op)
        node = user


def _sequential_between(model: nn.Module, first: str, second: str) -> list[Op] | None:
    """The modules between ``first`` and ``second`` if they are in one plain ``nn.Sequential``
    with only pointwise modules between them, else None."""
    parent, _, a = first.rpartition(".")
    parent2, _, b = second.rpartition(".")
    container = model.get_submodule(parent)
    if parent != parent2 or type(container) is not nn.Sequential:
        return None
    names = list(container._modules)
    i, j = names.index(a), names.index(b)
    between = [container._modules[n] for n in names[i + 1 : j]]
    if i >= j or not all(m is not None and _pointwise_module(m) for m in between):
        return None
    return [m for m in between if m is not None]


def _between(model: nn.Module, gm: fx.GraphModule | str, first: str, second: str) -> list[Op]:
    """The entry-wise operations from ``first`` to ``second``; ``gm``: the model's fx trace, or
    why tracing failed. Raises ValueError where the flow cannot be shown to be a chain."""
    if isinstance(gm, fx.GraphModule):
        return _traced_between(gm, first, second)
    ops = _sequential_between(model, first, second)
    if ops is None:
        raise ValueError(
            f"compact: cannot show that the hidden units of ({first!r}, {second!r}) feed only "
            f"{second!r}: torch.fx could not trace {type(model).__name__} ({gm}), and the two "
            "are not neighbours in one nn.Sequential with only activations or dropout between "
            "them. Put the pair in an nn.Sequential, or compact the submodule that holds it."
        )
    return ops


def _trace(model: nn.Module) -> fx.GraphModule | str:
    try:
        return fx.symbolic_trace(model)
    except Exception as err:  # any failure to trace: fall back to the module tree
        return f"{type(err).__name__}: {err}"


# -- compact -------------------------------------------------------------------------------------


def _copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` without the Lightning trainer / Fabric it is attached to."""
    attached = (getattr(model, name, None) for name in ("_trainer", "_fabric"))
    memo: dict[int, object] = {id(obj): None for obj in attached if obj is not None}
    return copy.deepcopy(model, memo)


def _n_params(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


@torch.no_grad()
def _constants(first: nn.Module, ops: list[Op], unit_ops: _UnitOps) -> Tensor:
    """What each unit outputs, after the ops between the pair, when its inputs are all zero
    (every module run in eval mode, its mode restored after)."""
    modules = [first, *(op for op in ops if isinstance(op, nn.Module))]
    modes = [m.training for m in modules]
    try:
        for m in modules:
            m.eval()
        x = first(unit_ops.probe(first))
        for op in ops:
            x = op(x)
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.train(mode)
    return unit_ops.unit_values(x)


@torch.no_grad()
def _compact_pair(first_name: str, first: nn.Module, second_name: str, second: nn.Module,
                  ops: list[Op]) -> PairCompaction:  # fmt: skip
    ops_in, ops_out = _ops(first_name, first), _ops(second_name, second)
    before = _n_params(first, second)
    n = ops_in.units_out(first)
    removed = ops_out.zero_outgoing(second)
    constant = ops_in.zero_incoming(first) & ~removed
    shift = None
    if bool(constant.any()):
        c = _constants(first, ops, ops_in)
        if not bool(torch.isfinite(c[constant]).all()):
            raise ValueError(
                f"compact: units of {first_name!r} with zero incoming weights output NaN or inf "
                "(from their bias): the network's output is not finite; check the weights."
            )
        shift = ops_out.input_shift(second, torch.where(constant, c, torch.zeros_like(c)))
        if shift is None:  # the second layer's type cannot take the constants: keep the units
            constant = torch.zeros_like(constant)
    keep = torch.nonzero(~(removed | constant)).flatten()
    zero = len(keep) == 0
    if zero:  # all dead: one zero unit keeps both layers valid
        keep = keep.new_zeros(1)
    ops_in.keep_out(first, keep, zero)
    ops_out.keep_in(second, keep, zero, shift)
    return PairCompaction(
        first_name,
        second_name,
        units_before=n,
        units_after=len(keep),
        removed=int(removed.sum()),
        folded=int(constant.sum()),
        params_before=before,
        params_after=_n_params(first, second),
    )


def compact(model: nn.Module, pairs: PairsSpec = "auto") -> tuple[nn.Module, CompactionReport]:
    """A copy of ``model`` without the dead hidden units of its layer pairs, and a report.

    Args:
        model: the trained network (an ``nn.Module`` or ``LightningModule``); left unchanged.
        pairs: ``"auto"`` or ``[(first_name, second_name), ...]``, resolved as in training
            (:func:`~pathnorm_lightning.pairing.resolve_pairs`): pass what you trained with.

    Returns:
        ``(compacted, report)``: a deep copy of ``model`` (same classes; a Lightning trainer
        is not copied) whose paired layers are smaller, computing the same function at
        inference; and a :class:`CompactionReport` (``print`` it for a table).

    Raises:
        ValueError: pairs that do not resolve, a paired layer of another type than
            ``nn.Linear``, or a pair whose hidden units reach anything but the second layer,
            or reach it through anything but entry-wise activations and dropout.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compact: expected a torch nn.Module, got {type(model).__name__}")
    names = [(p.first_name, p.second_name) for p in resolve_pairs(model, pairs)]
    for name in (n for pair in names for n in pair):
        _ops(name, model.get_submodule(name))
    new = _copy(model)
    gm = _trace(new)
    flows = [_between(new, gm, first, second) for first, second in names]
    done = tuple(
        _compact_pair(first, new.get_submodule(first), second, new.get_submodule(second), ops)
        for (first, second), ops in zip(names, flows, strict=True)
    )
    return new, CompactionReport(done, _n_params(model), _n_params(new))
