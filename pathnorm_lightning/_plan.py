"""The plan of the hook of :mod:`pathnorm_lightning.hook`: per target, where its weights sit in
the optimizer (:class:`Planned`), the guard that tells at every step, in O(groups + targets),
whether the plan still holds (:class:`Guard`), and the plan's refusals that need no step
(:func:`check_lr`, :func:`check_once_per_step`)."""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pathnorm_lightning._checks import FiniteCheck
from pathnorm_lightning._common import shares_memory
from pathnorm_lightning._target import StepTarget, UnitViews
from pathnorm_lightning.pairing import weight_parameter


@dataclass
class Planned:
    """One target as planned after one optimizer's steps."""

    target: StepTarget
    groups: tuple[int, ...]  # param-group index of every weight, in the owning optimizer
    lr_group: int | None = None  # the one group of all the weights (None: several)
    check: FiniteCheck | None = None  # the finiteness check, chosen at plan time


#: A plan: per optimizer (by id), its targets.
Plan = dict[int, list[Planned]]


@dataclass(frozen=True)
class Guard:
    """What a plan's validity is checked against at every step, in O(groups + targets): each
    optimizer's ``param_groups`` and each group's ``params`` with their lengths (the lists held,
    so that their ids are never reused), every planned weight's position in its list, and every
    target's weights (:func:`followed`)."""

    groups: tuple[tuple[list[Any], int, tuple[tuple[list[Any], int], ...]], ...]
    placed: tuple[tuple[list[Any], int, Tensor], ...]
    weights: tuple[tuple[nn.Module | None, Tensor | None, int, bool, Any], ...]
    modules: tuple[tuple[tuple[str, ...], nn.Module], ...]  # (path in the root, module)

    @classmethod
    def of(
        cls,
        optimizers: Sequence[torch.optim.Optimizer],
        plan: Plan,
        targets: Sequence[StepTarget],
        root: nn.Module | None = None,
    ) -> Guard:
        """The guard of ``plan``, made from the optimizers and targets now (and, with
        ``root``, the module each target's layer name finds in it)."""
        groups = tuple(
            (
                o.param_groups,
                len(o.param_groups),
                tuple((g["params"], len(g["params"])) for g in o.param_groups),
            )
            for o in optimizers
        )
        placed = []
        for optimizer in optimizers:
            for item in plan.get(id(optimizer), []):
                for weight, g in zip(item.target.weights, item.groups, strict=True):
                    params = optimizer.param_groups[g]["params"]
                    index = next(i for i, p in enumerate(params) if p is weight)
                    placed.append((params, index, weight))
        modules = tuple(
            (path_of(name), module)
            for target in targets
            for name, module in target.layers
            if root is not None
        )
        return cls(groups, tuple(placed), followed(targets), modules)

    def holds(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        targets: Sequence[StepTarget],
        root: nn.Module | None = None,
    ) -> bool:
        """Whether the optimizers and targets are still as planned."""
        for optimizer, (param_groups, n_groups, lists) in zip(optimizers, self.groups, strict=True):
            now = optimizer.param_groups
            if now is not param_groups or len(now) != n_groups:
                return False
            for group, (params, n_params) in zip(now, lists, strict=True):
                found = group["params"]
                if found is not params or len(found) != n_params:
                    return False
        for params, index, weight in self.placed:
            if params[index] is not weight:
                return False
        for module, planned, pointer, trainable, layout in self.weights:
            w = planned if module is None else module._parameters.get("weight")
            if w is not planned:
                return False
            if w is not None and (
                w.data_ptr() != pointer
                or w.requires_grad != trainable
                or (w.shape, w.stride()) != layout
            ):
                return False  # new storage, trainability, or the same storage re-strided
        return root is None or all(submodule(root, path) is m for path, m in self.modules)


def path_of(name: str) -> tuple[str, ...]:
    """A module's dotted name split into its parts (the root's name ``""``: ``()``)."""
    return tuple(name.split(".")) if name else ()


def submodule(root: nn.Module, path: tuple[str, ...]) -> nn.Module | None:
    """The module at ``path`` (a dotted name, split) in ``root`` now, or None."""
    module: nn.Module | None = root
    for part in path:
        if module is None:
            return None
        module = module._modules.get(part)
    return module


def followed(
    targets: Sequence[StepTarget],
) -> tuple[tuple[nn.Module | None, Tensor | None, int, bool, Any], ...]:
    """Per target weight: ``(module, weight, storage, trainability, (shape, strides))``, the weight read
    from its module now (``module`` None for a weight taken as given)."""
    found: list[tuple[nn.Module | None, Tensor | None, int, bool, Any]] = []
    for target in targets:
        pairs: list[tuple[nn.Module | None, Tensor | None]] = (
            [(module, module._parameters.get("weight")) for _, module in target.layers]
            if target.layers
            else [(None, w) for w in target.weights]
        )
        for module, w in pairs:
            if isinstance(w, Tensor):
                found.append((module, w, w.data_ptr(), w.requires_grad, (w.shape, w.stride())))
            else:
                found.append((module, None, 0, False, None))
    return tuple(found)


def current(owner: str, root: nn.Module | None, target: StepTarget) -> StepTarget:
    """``target`` with the weights its modules hold now (a clear error for a computed one, or,
    with ``root``, for a layer no longer at its name there); ``owner`` starts the messages."""
    if not target.layers:
        return target
    for name, module in target.layers:
        if root is not None and submodule(root, path_of(name)) is not module:
            raise ValueError(
                f"{owner}: {target.name}: the model's {name!r} is no longer the layer it was "
                "when the pairs were resolved (a module replaced or removed after that), so the "
                "prox would couple a layer that is not in the network. Resolve the pairs again: "
                "handle.remove() and attach() again (a Lightning callback resolves them at each "
                "fit's start)."
            )
    try:
        weights = tuple(weight_parameter(name, module) for name, module in target.layers)
    except ValueError as err:
        raise ValueError(f"{owner}: {err}") from None
    views = None
    if target.unit_views:
        try:
            views = UnitViews.plan([m for _, m in target.layers], weights)
        except ValueError as err:  # a layer changed shape or configuration since
            raise ValueError(f"{owner}: {target.name}: {err}") from None
    return dataclasses.replace(target, weights=weights, views=views)


def no_grad(weights: tuple[Tensor, ...]) -> bool:
    """Whether no gradient reached any of ``weights`` (a layer's one or a pair's two)."""
    if len(weights) == 2:
        return weights[0].grad is None and weights[1].grad is None
    return all(w.grad is None for w in weights)


def overlap(a: StepTarget, b: StepTarget) -> bool:
    """Whether two targets share a weight (one tensor or storage)."""
    return any(shares_memory(x, y) for x in a.weights for y in b.weights)


def check_lr(
    owner: str, name: str, optimizer: torch.optim.Optimizer, groups: Iterable[int]
) -> None:
    """Refuse a parameter group (of ``groups``) whose ``"lr"`` is not a number (a real or a
    one-element tensor): the prox step of target ``name`` is ``lam * group["lr"]``."""
    for g in sorted(set(groups)):
        group = optimizer.param_groups[g]
        lr = group.get("lr")
        if isinstance(lr, numbers.Real) or (isinstance(lr, Tensor) and lr.numel() == 1):
            continue
        has = f"lr={lr!r}" if "lr" in group else "no 'lr' key"
        raise ValueError(
            f"{owner}: {name}: parameter group {g} of its optimizer ({type(optimizer).__name__}) "
            f"has {has}, but the prox step is lam * group['lr'], so the group needs a learning "
            "rate (a real number or a one-element tensor). Give the group an lr; an optimizer "
            "with relative step sizes and no lr (e.g. Adafactor(relative_step=True)) cannot "
            "drive the prox: give it an explicit lr (Adafactor(lr=..., relative_step=False))."
        )


#: Another live hook as :func:`check_once_per_step` sees it: its owner, optimizers and plan.
Other = tuple[str, Sequence[torch.optim.Optimizer], Plan]


def check_once_per_step(
    owner: str, optimizers: Sequence[torch.optim.Optimizer], plan: Plan, others: Iterable[Other]
) -> None:
    """Refuse a weight that two targets of ``plan`` share (tied, by storage) or that another
    live hook with the same penalty (``others``) regularizes after the same optimizer's steps."""
    mine = [item.target for items in plan.values() for item in items]
    for a, b in itertools.combinations(mine, 2):
        if overlap(a, b):
            raise ValueError(
                f"{owner}: {a.name} and {b.name} share a weight (tied weights: one tensor or "
                "storage in both), so its prox would run twice per step. Untie them, or leave "
                "one of them out of the pairs."
            )
    for other, their_optimizers, their_plan in others:
        for optimizer in optimizers:
            if not any(o is optimizer for o in their_optimizers):
                continue  # an id in their plan may be a dead optimizer's, reused
            theirs = [i.target for i in their_plan.get(id(optimizer), [])]
            for a in (i.target for i in plan.get(id(optimizer), [])):
                for b in theirs:
                    if overlap(a, b):
                        raise ValueError(
                            f"{owner}: {a.name} is already regularized after every step of "
                            f"this optimizer by another hook ({other}, {b.name}), so a prox "
                            "would run twice per step. Remove the other hook first (its "
                            ".remove() for attach), or give the two hooks disjoint pairs."
                        )
