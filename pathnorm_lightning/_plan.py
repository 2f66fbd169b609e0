"""The plan of the hook of :mod:`pathnorm_lightning.hook`: per target, where its weights sit in
the optimizer (:class:`Planned`), and the guard that tells at every step, in O(groups +
targets), whether the plan still holds (:class:`Guard`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pathnorm_lightning._checks import FiniteCheck
from pathnorm_lightning._common import shares_memory
from pathnorm_lightning._target import StepTarget


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


def no_grad(weights: tuple[Tensor, ...]) -> bool:
    """Whether no gradient reached any of ``weights`` (a layer's one or a pair's two)."""
    if len(weights) == 2:
        return weights[0].grad is None and weights[1].grad is None
    return all(w.grad is None for w in weights)


def overlap(a: StepTarget, b: StepTarget) -> bool:
    """Whether two targets share a weight (one tensor or storage)."""
    return any(shares_memory(x, y) for x in a.weights for y in b.weights)
