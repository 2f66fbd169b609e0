"""The plan of the hook of :mod:`pathnorm_lightning.hook`: per target, where its weights sit in
the optimizer (:class:`Planned`), and the guard that tells at every step, in O(groups +
targets), whether the plan still holds (:class:`Guard`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

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
    """What a plan's validity is checked against at every step, in O(groups + targets): per
    optimizer its ``param_groups`` list, its length and each group's ``params`` list and length
    (held, so that their ids are never reused), the position of every planned weight in its
    group's list, and every target's weights (identity, storage, trainability)."""

    groups: tuple[tuple[list[Any], int, tuple[tuple[list[Any], int], ...]], ...]
    placed: tuple[tuple[list[Any], int, Tensor], ...]
    states: tuple[tuple[Any, ...], ...]

    @classmethod
    def of(
        cls,
        optimizers: Sequence[torch.optim.Optimizer],
        plan: Plan,
        targets: Sequence[StepTarget],
    ) -> Guard:
        """The guard of ``plan``, made from the optimizers and targets now."""
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
        return cls(groups, tuple(placed), tuple(weight_state(t) for t in targets))

    def holds(
        self, optimizers: Sequence[torch.optim.Optimizer], targets: Sequence[StepTarget]
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
        return all(weight_state(t) == s for t, s in zip(targets, self.states, strict=True))


def weight_state(target: StepTarget) -> tuple[Any, ...]:
    """What a plan depends on in ``target``: its weights' identity, storage and trainability
    (for a followed target, read from its modules now)."""
    weights: list[Tensor | None] = (
        [module._parameters.get("weight") for _, module in target.layers]
        if target.layers
        else list(target.weights)
    )
    return tuple(
        (id(w), w.data_ptr(), w.requires_grad) if isinstance(w, Tensor) else None for w in weights
    )


def no_grad(weights: tuple[Tensor, ...]) -> bool:
    """Whether no gradient reached any of ``weights`` (a layer's one or a pair's two)."""
    if len(weights) == 2:
        return weights[0].grad is None and weights[1].grad is None
    return all(w.grad is None for w in weights)


def overlap(a: StepTarget, b: StepTarget) -> bool:
    """Whether two targets share a weight (one tensor or storage)."""
    return any(shares_memory(x, y) for x in a.weights for y in b.weights)
