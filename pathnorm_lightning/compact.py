"""``compact``: remove the dead hidden units of every layer pair; a smaller network, same function.

The prox zeroes whole hidden units, but a zero unit still costs its row and column (or its
channels) in the dense layers. For a pair ``first -> ops -> second`` (as paired in training;
the ops pointwise, and after a convolution pooling and a Flatten), hidden unit ``i`` (a
feature, or a channel) is removed when

* its **outgoing** weights (the seam's ``out_view`` column) are all zero: it adds nothing to
  the output. Its incoming weights, bias entry and outgoing weights go (for a Linear layer
  after a Flatten, the ``P`` columns of that channel);
* its **incoming** weights (the seam's ``in_view`` row) are all zero but not its outgoing ones:
  it outputs the constant ``c_i = act(b_i)`` everywhere. ``c_i`` times its outgoing weights
  (summed over a convolution's taps or a Flatten's positions) is added to ``second``'s bias
  (created if missing) and the unit goes. Where that is not exact the unit is kept and counted
  in ``constant_kept``: a second convolution that reads zero padding (at the borders it reads
  the constant through fewer taps), or pooling that does not keep a constant channel constant
  (average pooling that counts its zero padding).

``c`` is computed by running ``first`` on a zero input and the pointwise ops on its output, in
eval mode (dropout is the identity), so the compacted model computes the same function at
inference, up to rounding. A pair whose units are all dead keeps one zero unit, so both layers
stay ordinary layers.

Exactness needs the hidden units to feed nothing but ``second``, one by one. This is checked on
the model's ``torch.fx`` traces in train and in eval mode: ``first`` and ``second`` each run
once, nothing else reads their parameters, and every value between them has one user, a
pointwise activation or dropout (module of an exact type, function or method), or after a
convolution a max/average pooling or a Flatten (module or function), in the order
:func:`~pathnorm_lightning.layers.check_between` allows. A model that cannot be traced is
accepted only where it is itself a plain ``nn.Sequential`` holding the pair once each, in order,
with only such modules between them (its forward reads the units nowhere else). Forward hooks
and pre-hooks on the pair's layers or a module between are refused; so is anything else.

Which weights are a unit's comes from the layer seam (:mod:`pathnorm_lightning.layers`); the
rest (a probe input, removing units, folding constants into the bias) is one class per layer
type in :data:`_UNIT_OPS`: ``nn.Linear`` and ``nn.Conv1d`` / ``nn.Conv2d``.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, fx, nn
from torch.nn import functional as F
from torch.nn.utils import parametrize, prune

from pathnorm_lightning import layers
from pathnorm_lightning.layers import Role, role_of
from pathnorm_lightning.pairing import LayerPair, PairsSpec, resolve_pairs
from shared_spec.compaction import CompactionReport, PairCompaction

__all__ = ["CompactionReport", "PairCompaction", "compact"]

Op = Callable[[Tensor], Tensor]
_Conv = nn.Conv1d | nn.Conv2d


# -- what compact does to each layer type --------------------------------------------------------


class _UnitOps(Protocol):
    """What ``compact`` asks of a layer type beyond the seam's views (meanings: see
    :class:`_LinearUnits`; ``positions``: of the Flatten before a Linear second layer, else 1)."""

    def probe(self, layer: Any) -> Tensor: ...
    def unit_values(self, output: Tensor) -> Tensor: ...
    def input_shift(self, layer: Any, constants: Tensor, positions: int) -> Tensor | None: ...
    def keep_out(self, layer: Any, keep: Tensor, zero: bool) -> None: ...
    def keep_in(
        self, layer: Any, keep: Tensor, zero: bool, shift: Tensor | None, positions: int
    ) -> None: ...


class _LinearUnits:
    """``nn.Linear``: hidden unit ``i`` is output feature ``i`` of the first layer (row ``i`` of
    its weight) and input feature ``i`` of the second (column ``i``; after a Flatten of ``P``
    positions per channel, columns ``i * P : (i + 1) * P``). Layers are changed in place (the
    caller owns them: a deep copy), so hooks and attributes stay."""

    @staticmethod
    def probe(layer: nn.Linear) -> Tensor:
        """Zeros: on them every unit outputs what it would with zero incoming weights."""
        return layer.weight.new_zeros(1, layer.in_features)

    @staticmethod
    def unit_values(output: Tensor) -> Tensor:
        """The per-unit values ``(n,)`` of an output of :meth:`probe` (after pointwise ops)."""
        return output[0]

    @staticmethod
    def input_shift(layer: nn.Linear, constants: Tensor, positions: int) -> Tensor | None:
        """The change to ``layer``'s output when input unit ``i`` is the constant
        ``constants[i]`` (at each of its positions) instead of zero: exactly a bias (None
        where a type cannot fold)."""
        weight = layer.weight
        per_unit = weight.reshape(weight.shape[0], -1, positions).sum(2)
        return per_unit @ constants.to(weight.dtype)

    @staticmethod
    def keep_out(layer: nn.Linear, keep: Tensor, zero: bool) -> None:
        """Keep only output units ``keep`` (index tensor); ``zero``: make them zero units."""
        _keep_outputs(layer, keep, zero)
        layer.out_features = len(keep)

    @staticmethod
    def keep_in(
        layer: nn.Linear, keep: Tensor, zero: bool, shift: Tensor | None, positions: int
    ) -> None:
        """Keep only input units ``keep`` (their ``positions`` columns each), zeroed if ``zero``;
        add ``shift`` to the bias (created where missing and the shift is nonzero)."""
        columns = (
            keep[:, None] * positions + torch.arange(positions, device=keep.device)
        ).flatten()
        _keep_inputs(layer, columns, zero, shift)
        layer.in_features = len(columns)


class _ConvUnits:
    """``nn.Conv1d`` / ``nn.Conv2d`` (``groups=1``): hidden unit ``c`` is output channel ``c``
    of the first layer (``weight[c]``) and input channel ``c`` of the second
    (``weight[:, c]``)."""

    @staticmethod
    def probe(layer: _Conv) -> Tensor:
        """Zeros of the fewest positions that give an output and take the padding (reflect
        padding needs more positions than it pads)."""
        pad = max(layer._reversed_padding_repeated_twice, default=0) + 1
        size = [
            max(d * (k - 1) + 1, pad)
            for k, d in zip(layer.kernel_size, layer.dilation, strict=True)
        ]
        return layer.weight.new_zeros(1, layer.in_channels, *size)

    @staticmethod
    def unit_values(output: Tensor) -> Tensor:
        return output[0].reshape(output.shape[1], -1)[:, 0]

    @staticmethod
    def input_shift(layer: _Conv, constants: Tensor, positions: int) -> Tensor | None:
        """A constant input channel shifts every output position by the same amount only where
        every tap reads a real position or a copy of one: None with zero padding."""
        if layer.padding_mode == "zeros" and any(layer._reversed_padding_repeated_twice):
            return None
        return layer.weight.flatten(2).sum(2) @ constants.to(layer.weight.dtype)

    @staticmethod
    def keep_out(layer: _Conv, keep: Tensor, zero: bool) -> None:
        _keep_outputs(layer, keep, zero)
        layer.out_channels = len(keep)

    @staticmethod
    def keep_in(
        layer: _Conv, keep: Tensor, zero: bool, shift: Tensor | None, positions: int
    ) -> None:
        _keep_inputs(layer, keep, zero, shift)
        layer.in_channels = len(keep)


def _keep_outputs(layer: Any, keep: Tensor, zero: bool) -> None:
    """Keep the output units ``keep`` of ``layer``'s weight (dim 0) and bias."""
    weight, bias = layer.weight.detach()[keep], layer.bias
    layer.weight = _like(layer.weight, weight.zero_() if zero else weight)
    if bias is not None:
        kept = bias.detach()[keep]
        layer.bias = _like(bias, kept.zero_() if zero else kept)


def _keep_inputs(layer: Any, index: Tensor, zero: bool, shift: Tensor | None) -> None:
    """Keep the inputs ``index`` of ``layer``'s weight (dim 1); add ``shift`` to its bias."""
    weight = layer.weight.detach()[:, index]
    layer.weight = _like(layer.weight, weight.zero_() if zero else weight)
    if shift is None or not bool((shift != 0).any()):
        return
    if layer.bias is None:
        layer.bias = nn.Parameter(shift.clone(), requires_grad=layer.weight.requires_grad)
    else:
        layer.bias = _like(layer.bias, layer.bias.detach() + shift)


def _like(old: Tensor, value: Tensor) -> nn.Parameter:
    return nn.Parameter(value.contiguous(), requires_grad=old.requires_grad)


#: The layer types ``compact`` can shrink (exact type), each with its entry.
_UNIT_OPS: dict[type[nn.Module], _UnitOps] = {
    nn.Linear: _LinearUnits,
    nn.Conv1d: _ConvUnits,
    nn.Conv2d: _ConvUnits,
}


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
# Pooling functions, as the module of the seam's table that computes the same (same arguments).
_POOLS: dict[object, type[nn.Module]] = {
    F.max_pool1d: nn.MaxPool1d, F.max_pool2d: nn.MaxPool2d, F.avg_pool1d: nn.AvgPool1d,
    F.avg_pool2d: nn.AvgPool2d, F.adaptive_max_pool1d: nn.AdaptiveMaxPool1d,
    F.adaptive_max_pool2d: nn.AdaptiveMaxPool2d, F.adaptive_avg_pool1d: nn.AdaptiveAvgPool1d,
    F.adaptive_avg_pool2d: nn.AdaptiveAvgPool2d,
}  # fmt: skip


def _pointwise_module(module: nn.Module) -> bool:
    """An entry-wise module of the seam's table, or a ``PReLU`` with one slope for all units
    (exact to compact across, though pairing does not take it for training). Exact types:
    ``role_of`` matches subclasses, whose forward may mix the units."""
    if type(module) is nn.PReLU:
        return module.weight.numel() == 1
    return layers.BETWEEN.get(type(module)) is Role.POINTWISE


def _allowed_module(module: nn.Module) -> bool:
    """A module that may stand between a pair: pointwise, or pooling or a Flatten (where it
    stands is checked by :func:`_check_order`); exact types."""
    return _pointwise_module(module) or layers.BETWEEN.get(type(module)) in (
        Role.POOL,
        Role.FLATTEN,
    )


def _subclass_note(module: object) -> str:
    """Why ``module`` is refused where it subclasses an allowed type, else ``""``."""
    allowed = (*layers.BETWEEN, nn.PReLU)
    base = next((c for c in type(module).__mro__[1:] if c in allowed), None)
    if base is None or type(module) in allowed:
        return ""
    return (
        f" ({type(module).__name__} subclasses {base.__name__}: compact accepts exact types "
        "only, since a subclass may override forward() and mix the units)"
    )


def _node_op(gm: fx.GraphModule, node: fx.Node, value: fx.Node) -> Op | None:
    """``node`` as an operation of ``value`` alone that the seam allows between a pair (at
    inference; a pooling or flatten function as its module), or None."""
    rest = [*node.args[1:], *node.kwargs.values()]
    if not node.args or node.args[0] is not value or any(isinstance(a, fx.Node) for a in rest):
        return None
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return module if _allowed_module(module) and len(node.args) == 1 else None
    if node.op == "call_function" and node.target in _DROPOUTS:
        return nn.Identity()  # at inference
    if node.op == "call_function" and node.target in _FUNCTIONS:
        return functools.partial(_apply, node.target, node.args[1:], node.kwargs)
    if node.op == "call_function" and node.target in _POOLS:
        try:
            return _POOLS[node.target](*node.args[1:], **node.kwargs)
        except TypeError:  # arguments the module does not take
            return None
    if (node.op, node.target) in (("call_function", torch.flatten), ("call_method", "flatten")):
        return _flatten_module(node)
    if node.op == "call_method" and node.target in _METHODS and len(node.args) == 1:
        return functools.partial(_apply, getattr(Tensor, str(node.target)), (), {})
    return None


def _flatten_module(node: fx.Node) -> nn.Flatten | None:
    """``torch.flatten(x, start, end)`` / ``x.flatten(start, end)`` as an ``nn.Flatten``."""
    names = ("start_dim", "end_dim")
    bound = dict(zip(names, node.args[1:], strict=False)) | dict(node.kwargs)
    if set(bound) - set(names):
        return None
    start, end = bound.get("start_dim", 0), bound.get("end_dim", -1)  # torch's defaults
    if not (isinstance(start, int) and isinstance(end, int)):
        return None
    return nn.Flatten(start, end)


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


def _check_order(model: nn.Module, first: str, second: str, ops: list[Op]) -> list[Op]:
    """``ops``, after checking with the seam (:func:`~pathnorm_lightning.layers.check_between`)
    that pooling and a Flatten stand where they keep the pair's units."""
    stand_ins = [op if isinstance(op, nn.Module) else nn.Identity() for op in ops]
    stand_ins = [nn.Identity() if isinstance(m, nn.PReLU) else m for m in stand_ins]
    try:
        layers.check_between(model.get_submodule(first), model.get_submodule(second), stand_ins)
    except ValueError as err:
        raise ValueError(f"compact: ({first!r}, {second!r}): {err}") from None
    return ops


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
    pair = [gm.get_submodule(first), gm.get_submodule(second)]
    owned = {id(t) for m in pair for t in (*m.parameters(), *m.buffers())}
    for read in (n for n in gm.graph.nodes if n.op == "get_attr"):
        if id(functools.reduce(getattr, str(read.target).split("."), gm)) in owned:
            raise ValueError(
                f"compact: forward() reads {read.target!r} outside the calls of {first!r} and "
                f"{second!r} (as torch.fx traced it): removing units would change what it "
                "reads. Compact only pairs whose weights nothing else reads."
            )
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
            return _check_order(gm, first, second, ops)
        op = _node_op(gm, user, node)
        if op is None:
            leaf = gm.get_submodule(str(user.target)) if user.op == "call_module" else None
            raise ValueError(
                f"compact: {_describe(user)} stands between {first!r} and {second!r}, and "
                "it is not an entry-wise activation or dropout (or, after a convolution, a "
                "pooling or a Flatten): the hidden units do not pass to the second layer one "
                f"by one, so removing some would change the function.{_subclass_note(leaf)}"
            )
        ops.append(op)
        node = user


def _sequential_between(model: nn.Module, why: str, first: str, second: str) -> list[Op]:
    """The modules between ``first`` and ``second`` where ``model`` is a plain ``nn.Sequential``
    holding both (so its forward reads the units nowhere else) with only modules the seam
    allows between them; ``why``: why torch.fx could not trace ``model``."""
    cannot = f"compact: torch.fx could not trace {type(model).__name__}.forward ({why}), "
    if type(model) is not nn.Sequential or not {first, second} <= set(model._modules):
        raise ValueError(
            f"{cannot}so compact cannot check that nothing else in it reads the hidden units of "
            f"({first!r}, {second!r}). Make forward traceable, or compact the nn.Sequential "
            "that holds the pair (and put the result back in its place)."
        )
    names = list(model._modules)
    i, j = names.index(first), names.index(second)
    every = list(model.modules(remove_duplicate=False))
    for name in (first, second):
        if sum(m is model._modules[name] for m in every) > 1:
            raise ValueError(
                f"{cannot}and layer {name!r} appears more than once in the nn.Sequential: a "
                "pair's layers must run once each (a reused layer's units serve several inputs)."
            )
    between = [model._modules[n] for n in names[i + 1 : j]]
    if i >= j or not all(m is not None and _allowed_module(m) for m in between):
        note = "".join(_subclass_note(m) for m in between)
        raise ValueError(
            f"{cannot}and in the nn.Sequential, {second!r} does not follow {first!r} with only "
            f"activations or dropout (and, after a convolution, pooling and a Flatten) between.{note}"
        )
    return _check_order(model, first, second, [m for m in between if m is not None])


def _check_hooks(model: nn.Module, first: str, second: str, ops: list[Op]) -> list[Op]:
    """``ops``, after refusing forward hooks and pre-hooks (but pruning's) on the pair's layers
    or a module between: compact's reasoning does not see what they change."""
    between = {id(op) for op in ops if isinstance(op, nn.Module)}
    for name, module in model.named_modules():
        if name not in (first, second) and id(module) not in between:
            continue
        pre, post = module._forward_pre_hooks.values(), module._forward_hooks.values()
        for kind, hooks in (("pre-hook", pre), ("hook", post)):
            if any(not isinstance(h, prune.BasePruningMethod) for h in hooks):
                raise ValueError(
                    f"compact: module {name!r} ({type(module).__name__}) has a forward {kind}: "
                    f"compact's check of the pair ({first!r}, {second!r}) cannot see what it "
                    "changes. Remove the hook (its handle's .remove()), or compact a model "
                    "without it."
                )
    return ops


def _flow(model: nn.Module, gm: fx.GraphModule | str, first: str, second: str) -> list[Op]:
    """The operations from ``first`` to ``second``; ``gm``: an fx trace, or why it failed."""
    if isinstance(gm, fx.GraphModule):
        return _check_hooks(model, first, second, _traced_between(gm, first, second))
    return _check_hooks(model, first, second, _sequential_between(model, gm, first, second))


def _between(model: nn.Module, traces: dict[str, fx.GraphModule | str], first: str,
             second: str) -> list[Op]:  # fmt: skip
    """The operations from ``first`` to ``second`` in eval mode (the last of ``traces``),
    after checking the flow in every mode's trace. Raises ValueError where it is not a chain."""
    ops: list[Op] = []
    failed: list[tuple[str, ValueError]] = []
    for mode, gm in traces.items():
        try:
            ops = _flow(model, gm, first, second)
        except ValueError as err:
            failed.append((mode, err))
    if len(failed) == len(traces):
        raise failed[-1][1]
    if failed:  # forward() branches on self.training
        raise ValueError(
            f"{failed[0][1]} (in {failed[0][0]} mode: compact checks forward() in train and "
            "eval mode, so that the compacted model is exact in both)"
        )
    return ops


def _trace(model: nn.Module) -> dict[str, fx.GraphModule | str]:
    """The fx trace of ``model`` (or why it failed) in train and in eval mode (``forward()`` may
    branch on ``self.training``); every module's mode is restored after."""
    modes = [(m, m.training) for m in model.modules()]
    traces: dict[str, fx.GraphModule | str] = {}
    try:
        for mode in ("train", "eval"):
            model.train(mode == "train")
            try:
                traces[mode] = fx.symbolic_trace(model)
            except Exception as err:  # any failure to trace: fall back to the module tree
                traces[mode] = f"{type(err).__name__}: {err}"
    finally:
        for m, training in modes:
            m.training = training
    return traces


# -- compact -------------------------------------------------------------------------------------


def _copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` without the Lightning trainer / Fabric it is attached to."""
    attached = (getattr(model, name, None) for name in ("_trainer", "_fabric"))
    memo: dict[int, object] = {id(obj): None for obj in attached if obj is not None}
    return copy.deepcopy(model, memo)


def _n_params(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def _keeps_constants(pool: nn.Module, dims: int, like: Tensor) -> bool:
    """Whether ``pool`` maps a constant channel to a constant (max pooling, averages that do
    not count zero padding), tried on ones of 16 positions per dimension."""
    ones = like.new_ones(1, 1, *([16] * dims))
    try:
        out = pool(ones)
    except RuntimeError:  # a window larger than the probe: not shown to keep constants
        return False
    return bool((out == 1).all())


@torch.no_grad()
def _constants(first: nn.Module, ops: list[Op], unit_ops: _UnitOps) -> Tensor | None:
    """What each unit outputs, after the pointwise ops between the pair, when its inputs are
    all zero (every module run in eval mode, its mode restored after); None where a pooling
    between does not keep constant channels constant (a Flatten keeps them)."""
    modules = [first, *(op for op in ops if isinstance(op, nn.Module))]
    modes = [m.training for m in modules]
    try:
        for m in modules:
            m.eval()
        x = first(unit_ops.probe(first))
        for op in ops:
            if not isinstance(op, nn.Module) or _pointwise_module(op):
                x = op(x)
            elif role_of(op) is Role.POOL and not _keeps_constants(op, x.dim() - 2, x):
                return None
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.train(mode)
    return unit_ops.unit_values(x)


@torch.no_grad()
def _compact_pair(pair: LayerPair, first: nn.Module, second: nn.Module,
                  ops: list[Op]) -> PairCompaction:  # fmt: skip
    first_name, second_name = pair.first_name, pair.second_name
    ops_in, ops_out = _ops(first_name, first), _ops(second_name, second)
    before = _n_params(first, second)
    n = layers.entry_of(first).units_out(first)
    positions = pair.flatten or 1
    removed = (layers.out_view(second, n, pair.flatten) == 0).all(0)
    zero_in = (layers.in_view(first) == 0).all(1) & ~removed
    constant = zero_in
    shift = None
    if bool(constant.any()):
        c = _constants(first, ops, ops_in)
        if c is not None and not bool(torch.isfinite(c[constant]).all()):
            raise ValueError(
                f"compact: units of {first_name!r} with zero incoming weights output NaN or inf "
                "(from their bias): the network's output is not finite; check the weights."
            )
        if c is not None:
            folded = torch.where(constant, c, torch.zeros_like(c))
            shift = ops_out.input_shift(second, folded, positions)
        if shift is None:  # the constants cannot be folded exactly here: keep the units
            constant = torch.zeros_like(constant)
    keep = torch.nonzero(~(removed | constant)).flatten()
    zero = len(keep) == 0
    if zero:  # all dead: one zero unit keeps both layers valid
        keep = keep.new_zeros(1)
    ops_in.keep_out(first, keep, zero)
    ops_out.keep_in(second, keep, zero, shift, positions)
    return PairCompaction(
        first_name,
        second_name,
        units_before=n,
        units_after=len(keep),
        removed=int(removed.sum()),
        folded=int(constant.sum()),
        params_before=before,
        params_after=_n_params(first, second),
        constant_kept=int((zero_in & ~constant).sum()),
    )


def compact(model: nn.Module, pairs: PairsSpec = "auto") -> tuple[nn.Module, CompactionReport]:
    """A copy of ``model`` without the dead hidden units of its layer pairs, and a report.

    Args:
        model: the trained network (an ``nn.Module`` or ``LightningModule``); left unchanged.
        pairs: ``"auto"`` or ``[(first_name, second_name), ...]``, resolved as in training
            (:func:`~pathnorm_lightning.pairing.resolve_pairs`): pass what you trained with.

    Returns:
        ``(compacted, report)``: a deep copy of ``model`` (same classes; a Lightning trainer
        is not copied) whose paired layers are smaller (fewer features or channels),
        computing the same function at inference; and a :class:`CompactionReport` (``print``
        it for a table).

    Raises:
        ValueError: pairs that do not resolve, a paired layer of another type than
            ``nn.Linear``, ``nn.Conv1d`` or ``nn.Conv2d``, or a pair whose hidden units reach
            anything but the second layer, or reach it through anything but entry-wise
            activations and dropout (and, after a convolution, pooling and a Flatten).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compact: expected a torch nn.Module, got {type(model).__name__}")
    with warnings.catch_warnings():  # a steep activation loosens the bounds, not compaction
        warnings.filterwarnings("ignore", message=".* has a slope of up to")
        resolved = resolve_pairs(model, pairs)
        for name in (n for p in resolved for n in (p.first_name, p.second_name)):
            _ops(name, model.get_submodule(name))
        new = _copy(model)
        traces = _trace(new)
        flows = [_between(new, traces, p.first_name, p.second_name) for p in resolved]
    done = tuple(
        _compact_pair(p, new.get_submodule(p.first_name), new.get_submodule(p.second_name), ops)
        for p, ops in zip(resolved, flows, strict=True)
    )
    return new, CompactionReport(done, _n_params(model), _n_params(new))
