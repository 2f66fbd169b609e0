"""The prox after every real optimizer step, without a Trainer: :func:`attach` and its hook.

Plain PyTorch and Lightning Fabric loops call :func:`attach` once; the Lightning callbacks in
:mod:`pathnorm_lightning.callbacks` are built on the same :class:`StepHook`, which holds the
invariant: **the prox runs exactly once per real update, on exactly the weights that update
changed** (see :class:`StepHook`). The hook is an optimizer step post-hook
(``torch.optim.Optimizer.register_step_post_hook``): a step that AMP's ``GradScaler`` skips
either never calls ``step()`` or (fused optimizers) is recognised by the scaler's ``found_inf``,
and gradient accumulation steps once per window. The prox step is ``lam * lr`` with ``lr`` read
from the parameter group holding the weights at every step, so learning-rate schedules and
per-group rates are honoured. Needs torch only (and numba for the CPU kernel): no Lightning.

Example::

    handle = pathnorm_lightning.attach(optimizer, model, lam=1e-3)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()  # the prox runs right after
    print(handle.metrics())
    handle.remove()
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from pathnorm_lightning import layers as seam
from pathnorm_lightning._chain import acc_dtype, alive_units, check_chain, counts
from pathnorm_lightning._chain import path_norm_bound as _path_norm_bound
from pathnorm_lightning._chain import product_bound as _product_bound
from pathnorm_lightning._common import (
    NonFiniteWeightsError,
    check_scalar,
    finite_flag,
    rank_zero_warn,
    shares_memory,
)
from pathnorm_lightning.functional import planned_prox, prox_path_norm_
from pathnorm_lightning.pairing import (
    ForwardCheck,
    LayerPair,
    PairsSpec,
    layer_chain,
    resolve_pairs,
    weight_parameter,
)

__all__ = [
    "DeferredCheck",
    "FiniteCheck",
    "StepHook",
    "StepTarget",
    "SyncCheck",
    "UnitViews",
    "attach",
]


@dataclass(frozen=True)
class UnitViews:
    """A target's weights as the layer seam's unit matrices (:mod:`pathnorm_lightning.layers`),
    built when the hook plans, not at every step.

    For a pair, ``(in_view, out_view)``: ``(n, m')``, row ``i`` unit ``i``'s incoming weights,
    and ``(p', n)``, column ``i`` its outgoing weights; for one layer, ``(in_view,)``. Where a
    matrix is a view of the weight (a Linear weight, a contiguous convolution's incoming
    weights) it is kept in :attr:`cached` and the prox writes through it; where the layout
    needs a copy (a convolution's outgoing weights, a Linear layer after a Flatten, a
    channels-last weight) :attr:`cached` holds None, and :meth:`matrices` copies the weight at
    each step and :meth:`write_back` writes the result into it.
    """

    entries: tuple[seam.LayerEntry, ...]
    n_units: int
    flatten: int | None
    cached: tuple[Tensor | None, ...] = dataclasses.field(repr=False)
    #: For a pair whose matrices are both views: the planned in-place prox of them
    #: (:func:`pathnorm_lightning.functional.planned_prox`), checked once, here.
    prox: Callable[[float, bool], bool] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    @classmethod
    def plan(cls, modules: Sequence[nn.Module], weights: Sequence[Tensor]) -> UnitViews:
        """The views of one layer (``modules`` of one) or of a pair, from their weights now."""
        entries = tuple(seam.entry_of(m) for m in modules)
        n_units = entries[0].units_out(modules[0])
        flatten = seam.flatten_positions(*modules) if len(modules) == 2 else None
        views = cls(entries, n_units, flatten, (None,) * len(modules))
        fresh = views.matrices(weights)
        cached = tuple(m if _is_view(m, w) else None for m, w in zip(fresh, weights, strict=True))
        prox = None
        if len(cached) == 2 and cached[0] is not None and cached[1] is not None:
            prox = planned_prox(cached[0], cached[1])
        return cls(entries, n_units, flatten, cached, prox)

    def matrices(self, weights: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """The unit matrices of ``weights``: the cached views, or copies made now."""
        made = []
        for index, (cached, weight) in enumerate(zip(self.cached, weights, strict=True)):
            if cached is not None:
                made.append(cached)
            elif index == 0:
                made.append(self.entries[0].in_view(weight.detach()))
            else:
                made.append(self.entries[1].out_view(weight.detach(), self.n_units, self.flatten))
        return tuple(made)

    def write_back(self, weights: Sequence[Tensor], matrices: Sequence[Tensor]) -> None:
        """Write the matrices that are copies into their weights, in place."""
        for index, (cached, weight, matrix) in enumerate(
            zip(self.cached, weights, matrices, strict=True)
        ):
            if cached is not None:
                continue  # written through the view
            if index == 0:
                self.entries[0].write_in(weight, matrix)
            else:
                self.entries[1].write_out(weight, matrix, self.flatten)


def _is_view(matrix: Tensor, weight: Tensor) -> bool:
    """Whether ``matrix`` is ``weight``'s memory (writes to it are writes to the weight)."""
    return matrix.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()


@dataclass
class StepTarget:
    """What one update acts on: a layer or a pair (its weights, in forward order) and a display
    name used in error messages.

    ``layers`` names the modules the weights belong to, as ``(name, module)``: the hook then
    follows them, reading each module's ``weight`` parameter at every step (a weight replaced
    or parametrized during training is seen at the next step); without ``layers`` the
    ``weights`` are taken as given. With ``unit_views`` (and ``layers``) the hook also plans
    the seam's :class:`UnitViews` of the layers into ``views``, whenever it re-plans.
    """

    name: str
    weights: tuple[Tensor, ...]
    layers: tuple[tuple[str, nn.Module], ...] = ()
    unit_views: bool = False
    views: UnitViews | None = None


class FiniteCheck:
    """How an update checks that its weights are finite; this base class checks nothing.

    An update calls the check on its target (:meth:`__call__`) unless it checks by itself
    when :attr:`synchronous` is set (the prox's own ``check_finite``, free in the CPU kernel).
    """

    #: Whether a check at this step, waiting for the device, is wanted.
    synchronous = False

    def __call__(self, target: StepTarget) -> None:
        """Check ``target``'s weights (or queue a check of them)."""

    def collect(self, keep: int | None = None) -> None:
        """Raise on a failed check that has completed (deferred checks only)."""


class SyncCheck(FiniteCheck):
    """Checks at this step, with one host sync (CPU, where that costs nothing)."""

    synchronous = True

    def __call__(self, target: StepTarget) -> None:
        flag = finite_flag(target.weights)
        if flag is not None and not bool(flag):
            raise NonFiniteWeightsError(target.name)


#: What to do when a deferred flag turns out False: ``(step, target name) -> None``.
OnFalse = Callable[[int, str], None]


class DeferredCheck(FiniteCheck):
    """Checks without stalling the GPU: an on-device flag per step is copied asynchronously
    into a pinned host slot and read when it has arrived (a few steps later at most; every
    pending flag is read by :meth:`collect` with ``keep=0``). The same queue carries other
    on-device flags (:meth:`push`), e.g. whether a pair has a hidden unit left.

    Args:
        owner: the name errors start with.
        step: returns the number of the step being checked.
    """

    def __init__(self, owner: str, step: Callable[[], int]) -> None:
        self.owner = owner
        self.step = step
        self.pending: deque[tuple[int, str, int, OnFalse]] = deque()  # (step, name, slot, ...)
        self.flags: Tensor | None = None
        self.events: list[torch.cuda.Event] = []
        self.next_slot = 0

    def __call__(self, target: StepTarget) -> None:
        flag = finite_flag(target.weights)
        if flag is not None:
            self.push(flag, target.name, self._non_finite)

    def push(self, flag: Tensor, name: str, on_false: OnFalse) -> None:
        """Queue the on-device 0-d bool ``flag``; ``on_false(step, name)`` runs if it is False."""
        if self.flags is None:  # allocated once: pinned slots, and an event per slot
            self.flags = torch.ones(_MAX_PENDING, dtype=torch.bool, pin_memory=True)
            self.events = [torch.cuda.Event() for _ in range(_MAX_PENDING)]
        self.collect(keep=_MAX_PENDING - 1)  # the slot must be free (rarely waits)
        slot = self.next_slot
        self.next_slot = (slot + 1) % _MAX_PENDING
        self.flags[slot].copy_(flag, non_blocking=True)
        self.events[slot].record(torch.cuda.current_stream(flag.device))
        self.pending.append((self.step(), name, slot, on_false))

    def collect(self, keep: int | None = None) -> None:
        """Read the flags that have arrived; with ``keep``, wait until at most ``keep`` remain."""
        while self.pending:
            step, name, slot, on_false = self.pending[0]
            if keep is None or len(self.pending) <= keep:
                if not self.events[slot].query():
                    return
            else:
                self.events[slot].synchronize()
            self.pending.popleft()
            assert self.flags is not None
            if not bool(self.flags[slot]):
                on_false(step, name)

    def _non_finite(self, step: int, name: str) -> None:
        self.pending.clear()
        raise _non_finite(self.owner, name, step)


_MAX_PENDING = 64  # CUDA flags in flight before a step waits for the oldest

#: An update: ``(target, lr, check) -> None``, in place on ``target.weights``.
Update = Callable[[StepTarget, float, FiniteCheck], None]


@dataclass
class _Planned:
    target: StepTarget
    groups: tuple[int, ...]  # param-group index of every weight, in the owning optimizer
    lr_group: int | None = None  # the one group of all the weights (None: several)
    check: FiniteCheck | None = None  # the finiteness check, chosen at plan time


#: What the plan's validity is checked against at every step, in O(groups + targets): per
#: optimizer its ``param_groups`` list, its length and each group's ``params`` list and length
#: (held, so that their ids are never reused), the position of every planned weight in its
#: group's list, and every target's weights (identity, storage, trainability).
_Guard = tuple[
    tuple[tuple[list[Any], int, tuple[tuple[list[Any], int], ...]], ...],
    tuple[tuple[list[Any], int, Tensor], ...],
    tuple[tuple[Any, ...], ...],
]


#: Every hook registered on an optimizer (for the check that no weight is regularized twice
#: per step by two hooks).
_LIVE: weakref.WeakSet[StepHook] = weakref.WeakSet()


class StepHook:
    """Runs an update on each target right after every real step of the given optimizers.

    The invariant, checked here and nowhere else: **the update runs exactly once per real
    update, on exactly the weights that update changed.** At every step the hook reads what
    the optimizer updates now (its parameter groups, compared by tensor identity) and what the
    targets' modules hold now (their ``weight`` parameters), and re-plans when either changed
    (a cheap identity key decides; the plan is cached otherwise). So:

    * a step that did not update (a fused optimizer's step that ``GradScaler`` skipped on
      inf/NaN gradients; a target none of whose weights got a gradient) updates nothing and is
      not counted;
    * an optimizer given twice is hooked once, and a weight that another live hook already
      regularizes after the same optimizer's steps, or that two targets share (tied weights,
      compared by storage), is refused with a ``ValueError`` before anything is written (the
      same penalty twice; see ``penalty``);
    * a frozen target is left alone; a half-frozen one is skipped with a warning, whether or
      not its frozen weight is in an optimizer; a trainable weight no optimizer holds, or a
      target split across two optimizers, is refused;
    * a weight that became computed (pruning, a parametrization) is refused at the next step,
      before the update writes anything, with its cause.

    Args:
        optimizers: the optimizers whose steps trigger the update (a target's weights must sit
            in one of them, or be frozen); one listed twice is hooked once.
        targets: the layers or pairs to update.
        update: ``(target, lr, check) -> None``, called with the learning rate of the target's
            parameter group and the finiteness check to use (see :class:`FiniteCheck`).
        check_finite: check the targets' weights after every step (raise
            :class:`NonFiniteWeightsError`); on CUDA without stalling the GPU.
        owner: the name error messages start with.
        sparsity_chains: chains (forward order) of weights or of modules (their ``weight`` is
            read when the metrics are computed) whose zeros and hidden units :meth:`metrics`
            counts.
        chain: every layer of the seam's types (``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d``)
            in forward order, for the network bounds (None: not a chain, no bounds). When the
            last one is a convolution, its bounds depend on the positions it reads: a forward
            pre-hook records them at each forward pass (no bounds before the first).
        num_steps: the step count to start from (a resumed run).
        penalty: what the update regularizes (``"path-norm"``, ``"l1"``, ...; default: the
            owner's name): two live hooks with the same penalty may not share a weight after one
            optimizer's steps. Different penalties may (each update runs once per step, one
            after the other: a composition of two proxes, not the prox of their sum).
        watch_units: warn (once per target) when an update leaves a pair target no hidden
            unit, checked at the hook's steps 1, 2, 4, ..., 32 and every 64th after (on CUDA
            through the deferred flags, without stalling the GPU).
        forward_check: verifies ``"auto"`` pairs against the forward passes before the first
            step; finished (and its hooks removed) at that step, before any update.
    """

    def __init__(
        self,
        optimizers: Iterable[torch.optim.Optimizer],
        targets: Sequence[StepTarget],
        update: Update,
        *,
        check_finite: bool = True,
        owner: str = "attach",
        sparsity_chains: Sequence[Sequence[Tensor | nn.Module]] = (),
        chain: Sequence[nn.Module] | None = None,
        num_steps: int = 0,
        penalty: str | None = None,
        watch_units: bool = False,
        forward_check: ForwardCheck | None = None,
    ) -> None:
        self.optimizers = list(dict.fromkeys(_unwrap(o) for o in optimizers))
        self.targets = list(targets)
        self.update = update
        self.owner = owner
        self.penalty = owner if penalty is None else penalty
        self.sparsity_chains = [list(c) for c in sparsity_chains]
        self.chain = list(chain) if chain is not None else None
        self._positions: tuple[int, ...] | None = None  # what a convolution last in chain read
        self._chain_handle: RemovableHandle | None = None
        self.num_steps = num_steps  # real optimizer steps acted on
        self._checks = {
            "off": FiniteCheck(),
            "sync": SyncCheck(),
            "deferred": DeferredCheck(owner, lambda: self.num_steps + 1),
        }
        self._guard: _Guard | None = None
        self._check_finite = check_finite
        self.watch_units = watch_units
        self._steps_here = 0  # steps acted on by this hook (the unit-watch schedule)
        self._warned: set[tuple[str, str]] = set()  # (what, target name): warned once
        self._forward_check = forward_check
        self._plan: dict[int, list[_Planned]] = {}
        try:
            self._replan()  # every refusal comes before a hook is registered
        except BaseException:
            self._drop_forward_check()
            raise
        self._handles: list[RemovableHandle] = [
            o.register_step_post_hook(self._after_step) for o in self.optimizers
        ]
        if self.chain and seam.entry_of(self.chain[-1]).spatial:
            self._chain_handle = self.chain[-1].register_forward_pre_hook(self._record_positions)
        _LIVE.add(self)

    @property
    def check_finite(self) -> bool:
        """Whether the targets' weights are checked after every step (set: re-planned)."""
        return self._check_finite

    @check_finite.setter
    def check_finite(self, value: bool) -> None:
        self._check_finite = value
        self._guard = None  # the plan holds each target's check

    def remove(self) -> None:
        """Remove the hooks (idempotent); checks still pending are dropped."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._chain_handle is not None:
            self._chain_handle.remove()
            self._chain_handle = None
        _LIVE.discard(self)
        self._drop_forward_check()
        self._checks["deferred"].pending.clear()  # type: ignore[attr-defined]

    def flush(self) -> None:
        """Wait for every pending flag (finiteness, units left) and raise on a failed check."""
        self._checks["deferred"].collect(keep=0)

    @torch.no_grad()
    def metrics(self) -> dict[str, float]:
        """The current metric values as Python floats: ``sparsity`` and ``alive_units`` of the
        regularized weights, ``path_norm_bound`` and ``product_bound`` of the network (when its
        layers form a chain; a network ending in a convolution, once a forward pass showed the
        positions that convolution reads). Read from the weights now (a host sync on CUDA)."""
        zeros = entries = alive = units = 0
        for chain in self.sparsity_chains:
            z, n, a, u = counts(check_chain([_weight_of(w) for w in chain], "metrics"))
            zeros, entries, alive, units = zeros + int(z), entries + n, alive + int(a), units + u
        values = {"sparsity": zeros / max(entries, 1)}
        if units:
            values["alive_units"] = alive / units
        reuse = self.reuse()
        if self.chain is not None and reuse is not None:
            weights = check_chain([_weight_of(layer) for layer in self.chain], "metrics")
            dtype = acc_dtype(weights[0])
            values["path_norm_bound"] = float(_path_norm_bound(weights, dtype, reuse))
            values["product_bound"] = float(_product_bound(weights, dtype, reuse))
        return values

    def reuse(self) -> int | None:
        """The factor ``s`` of the chain's last layer (docs/conv_units.md): 1 for a Linear
        layer; for a convolution, from the positions it read in the latest forward pass (None
        before any, or without a chain)."""
        if not self.chain:
            return None
        last = self.chain[-1]
        entry = seam.entry_of(last)
        if not entry.spatial:
            return entry.reuse(last)
        return None if self._positions is None else entry.reuse(last, self._positions)

    def _record_positions(self, module: nn.Module, args: Any) -> None:
        if args and isinstance(args[0], Tensor):
            self._positions = tuple(args[0].shape[2:])

    # --- the step ------------------------------------------------------------------------
    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _skipped_by_scaler(optimizer):
            return  # a fused step GradScaler ran on inf/NaN gradients: no update happened
        self._replan()
        if self._forward_check is not None:
            check, self._forward_check = self._forward_check, None
            check.finish(self.owner)
        planned = self._plan.get(id(optimizer))
        if not planned:
            return
        deferred = self._checks["deferred"]
        deferred.collect()
        watch = self.watch_units and _watch_due(self._steps_here + 1)
        acted = False
        for item in planned:
            target = item.target
            if _no_grad(target.weights):
                continue  # no gradient reached these weights: this step did not change them
            lr = (
                _as_float(optimizer.param_groups[item.lr_group]["lr"])
                if item.lr_group is not None
                else self._step_size(optimizer, item)
            )
            finite = item.check if item.check is not None else self._check_for(target)
            try:
                self.update(target, lr, finite)
            except _StepError:  # already names its step (a deferred check that came back)
                raise
            except NonFiniteWeightsError:  # the update's own check: name the target
                raise _non_finite(self.owner, target.name) from None
            acted = True
            if watch and len(target.weights) == 2:
                self._watch_units(target, deferred)  # type: ignore[arg-type]
        if acted:
            self.num_steps += 1
            self._steps_here += 1

    def _check_for(self, target: StepTarget) -> FiniteCheck:
        if not self.check_finite:
            return self._checks["off"]
        cuda = target.weights[0].device.type == "cuda"
        return self._checks["deferred" if cuda else "sync"]

    def _step_size(self, optimizer: torch.optim.Optimizer, item: _Planned) -> float:
        lrs = [_as_float(optimizer.param_groups[g]["lr"]) for g in item.groups]
        if any(lr != lrs[0] for lr in lrs[1:]):
            raise ValueError(
                f"{self.owner}: the weights of {item.target.name} are in parameter groups with "
                f"different learning rates {lrs}; the coupled prox needs a single step size "
                "lam * lr. Give both layers the same learning rate (one group)."
            )
        return lrs[0]

    def _watch_units(self, target: StepTarget, deferred: DeferredCheck) -> None:
        """Warn once if ``target`` (a pair) has no hidden unit left; on CUDA via ``deferred``."""
        w_in, w_out = (w.detach() for w in target.weights)
        left = alive_units(w_in, w_out).any()
        if w_in.device.type == "cuda":
            deferred.push(left, target.name, self._warn_dead)
        elif not bool(left):
            self._warn_dead(self.num_steps + 1, target.name)

    def _warn_dead(self, step: int, name: str) -> None:
        self._warn_once(
            "dead",
            name,
            f"{self.owner}: {name} has no hidden unit left after the prox of step {step} (each "
            "unit's incoming row or outgoing column is zero), so nothing passes through it any "
            "more: lam is too large for these layers. The prox shrinks a unit by about "
            "lr * lam times the l1 norm of its other side, which falls as layers widen; try a "
            "3-10x smaller lam and watch alive_units in the metrics.",
        )

    def _warn_once(self, what: str, name: str, message: str) -> None:
        if (what, name) not in self._warned:
            self._warned.add((what, name))
            rank_zero_warn(message, stacklevel=4)

    def _drop_forward_check(self) -> None:
        if self._forward_check is not None:
            self._forward_check.remove()
            self._forward_check = None

    # --- the plan: what the optimizers update now ------------------------------------------
    def _replan(self) -> None:
        """Rebuild the plan when the optimizers' parameter groups or the targets' weights
        changed (identity, storage, requires_grad); a cached plan otherwise. The test costs
        O(groups + targets), whatever the number of parameters (see :data:`_Guard`)."""
        if self._guard is None or not self._guard_holds(self._guard):
            self._guard = None
            self._plan = self._build_plan()
            self._guard = self._make_guard()

    def _make_guard(self) -> _Guard:
        groups = tuple(
            (
                o.param_groups,
                len(o.param_groups),
                tuple((g["params"], len(g["params"])) for g in o.param_groups),
            )
            for o in self.optimizers
        )
        placed = []
        for optimizer in self.optimizers:
            for item in self._plan.get(id(optimizer), []):
                for weight, g in zip(item.target.weights, item.groups, strict=True):
                    params = optimizer.param_groups[g]["params"]
                    index = next(i for i, p in enumerate(params) if p is weight)
                    placed.append((params, index, weight))
        return groups, tuple(placed), tuple(_weight_state(t) for t in self.targets)

    def _guard_holds(self, guard: _Guard) -> bool:
        groups, placed, states = guard
        for optimizer, (param_groups, n_groups, lists) in zip(self.optimizers, groups, strict=True):
            now = optimizer.param_groups
            if now is not param_groups or len(now) != n_groups:
                return False
            for group, (params, n_params) in zip(now, lists, strict=True):
                found = group["params"]
                if found is not params or len(found) != n_params:
                    return False
        for params, index, weight in placed:
            if params[index] is not weight:
                return False
        return all(_weight_state(t) == state for t, state in zip(self.targets, states, strict=True))

    def _current(self, target: StepTarget) -> StepTarget:
        """``target`` with the weights its modules hold now (a clear error for a computed one)."""
        if not target.layers:
            return target
        try:
            weights = tuple(weight_parameter(name, module) for name, module in target.layers)
        except ValueError as err:
            raise ValueError(f"{self.owner}: {err}") from None
        views = None
        if target.unit_views:
            try:
                views = UnitViews.plan([m for _, m in target.layers], weights)
            except ValueError as err:  # a layer changed shape or configuration since
                raise ValueError(f"{self.owner}: {target.name}: {err}") from None
        return dataclasses.replace(target, weights=weights, views=views)

    def _build_plan(self) -> dict[int, list[_Planned]]:
        owner_of: dict[int, tuple[int, int]] = {}  # id(param) -> (optimizer index, group index)
        for opt_index, optimizer in enumerate(self.optimizers):
            for group_index, group in enumerate(optimizer.param_groups):
                for param in group["params"]:
                    owner_of.setdefault(id(param), (opt_index, group_index))
        plan: dict[int, list[_Planned]] = {}
        for target in map(self._current, self.targets):
            owners = [owner_of.get(id(w)) for w in target.weights]
            if any(
                o is None and w.requires_grad for o, w in zip(owners, target.weights, strict=True)
            ):
                raise ValueError(
                    f"{self.owner}: the weight of {target.name} is not in any optimizer "
                    "(left out of configure_optimizers), so no optimizer step would "
                    "trigger its prox. Optimize it, freeze it (requires_grad=False), or "
                    "leave it out of the layers/pairs."
                )
            trainable = [w.requires_grad for w in target.weights]
            if not any(trainable):
                continue  # frozen: left as the optimizer leaves it
            if not all(trainable):
                self._warn_once(
                    "half frozen",
                    target.name,
                    f"{self.owner}: {target.name} is half frozen (requires_grad=False on one of "
                    "its layers); the prox couples both layers, so it is skipped until both "
                    "are trainable and optimized.",
                )
                continue
            opt_indices = sorted({o for o, _ in owners})  # type: ignore[misc]
            if len(opt_indices) > 1:
                raise ValueError(
                    f"{self.owner}: the weights of {target.name} are held by different "
                    f"optimizers (indices {opt_indices}); the coupled prox needs one step after "
                    "one optimizer step. Put both layers in the same optimizer."
                )
            groups = tuple(g for _, g in owners)  # type: ignore[misc]
            optimizer = self.optimizers[opt_indices[0]]
            lr_group = groups[0] if all(g == groups[0] for g in groups) else None
            planned = _Planned(target, groups, lr_group, self._check_for(target))
            plan.setdefault(id(optimizer), []).append(planned)
        self._check_once_per_step(plan)
        return plan

    def _check_once_per_step(self, plan: dict[int, list[_Planned]]) -> None:
        """Refuse a weight that two targets share (tied, by storage) or that another live hook
        with the same penalty regularizes after the same optimizer's steps."""
        mine = [item.target for items in plan.values() for item in items]
        for index, a in enumerate(mine):
            for b in mine[index + 1 :]:
                if _overlap(a, b):
                    raise ValueError(
                        f"{self.owner}: {a.name} and {b.name} share a weight (tied weights: one "
                        "tensor or storage in both), so its prox would run twice per step. "
                        "Untie them, or leave one of them out of the pairs."
                    )
        for other in list(_LIVE):
            if other is self or other.penalty != self.penalty:
                continue
            for optimizer in self.optimizers:
                theirs = [i.target for i in other._plan.get(id(optimizer), [])]
                if not any(o is optimizer for o in other.optimizers):
                    continue
                for a in (i.target for i in plan.get(id(optimizer), [])):
                    for b in theirs:
                        if _overlap(a, b):
                            raise ValueError(
                                f"{self.owner}: {a.name} is already regularized after every "
                                f"step of this optimizer by another hook ({other.owner}, "
                                f"{b.name}), so a prox would run twice per step. Remove the "
                                "other hook first (its .remove() for attach), or give the two "
                                "hooks disjoint pairs."
                            )


def _weight_state(target: StepTarget) -> tuple[Any, ...]:
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


def _no_grad(weights: tuple[Tensor, ...]) -> bool:
    """Whether no gradient reached any of ``weights`` (a layer's one or a pair's two)."""
    if len(weights) == 2:
        return weights[0].grad is None and weights[1].grad is None
    return all(w.grad is None for w in weights)


def _overlap(a: StepTarget, b: StepTarget) -> bool:
    return any(shares_memory(x, y) for x in a.weights for y in b.weights)


def _watch_due(step: int) -> bool:
    """Steps 1, 2, 4, ..., 32, then every 64th: about 1/64 of a pass over the weights per step."""
    return (step <= 32 and step & (step - 1) == 0) or step % 64 == 0


def _skipped_by_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this step is one that ``GradScaler`` ran on inf/NaN gradients and the optimizer
    skipped by itself: for optimizers that handle the scaling (``fused=True``), the scaler
    calls ``step()`` with ``optimizer.found_inf`` set and the fused kernel updates nothing
    (read at every step a fused optimizer takes under the scaler: one host sync on CUDA)."""
    found_inf = getattr(optimizer, "found_inf", None)
    return isinstance(found_inf, Tensor) and bool(found_inf)


def _weight_of(item: Tensor | nn.Module) -> Tensor:
    return item.weight if isinstance(item, nn.Module) else item  # type: ignore[return-value]


def attach(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    model: nn.Module,
    lam: float,
    pairs: PairsSpec = "auto",
    *,
    check_finite: bool = True,
) -> StepHook:
    """Apply the exact 1-path-norm prox with step ``lam * lr`` after every real step of
    ``optimizer``: Proximal SGD in a plain PyTorch or Lightning Fabric loop.

    Args:
        optimizer: the optimizer (or several) that trains ``model``; a Fabric or Lightning
            wrapper is unwrapped.
        model: the network; its ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` layers are paired
            as in :func:`resolve_pairs`.
        lam: regularization strength lambda (finite, >= 0).
        pairs: ``"auto"`` or explicit ``[(first_name, second_name), ...]`` module names.
        check_finite: raise :class:`NonFiniteWeightsError` when a regularized weight is NaN or
            inf after a step (on CUDA a few steps later at most, without stalling the GPU; call
            :meth:`StepHook.flush` to wait for every check).

    Returns:
        The :class:`StepHook`: ``.remove()`` detaches it, ``.metrics()`` gives the sparsity and
        the network's path-norm and product bounds, ``.num_steps`` counts the steps acted on.
    """
    lam = _prefixed("attach", lambda v: check_scalar(v, "lam"), lam)
    if not isinstance(check_finite, bool):
        raise TypeError(f"attach: check_finite must be a bool, got {check_finite!r}")
    optimizers: list[Any] = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    layer_pairs = resolve_pairs(model, pairs)
    targets = [pair_target(p.first_name, p.second_name, p.first, p.second) for p in layer_pairs]

    def update(target: StepTarget, lr: float, check: FiniteCheck) -> None:
        prox_pair(target, lam * lr, check)

    return StepHook(
        optimizers,
        targets,
        update,
        check_finite=check_finite,
        sparsity_chains=[[p.first, p.second] for p in layer_pairs],
        chain=layer_chain(model),
        penalty="path-norm",
        watch_units=True,
        forward_check=forward_check(layer_pairs),
    )


def forward_check(pairs: Sequence[LayerPair]) -> ForwardCheck | None:
    """A :class:`ForwardCheck` of the pairs the module tree could not verify (None if none)."""
    return ForwardCheck(pairs) if any(not p.verified for p in pairs) else None


def pair_target(
    first_name: str, second_name: str, first: nn.Module, second: nn.Module
) -> StepTarget:
    """The :class:`StepTarget` of a layer pair (followed: its modules' weights at each step,
    seen through the seam's :class:`UnitViews`)."""
    return StepTarget(
        f"pair ({first_name!r}, {second_name!r})",
        (weight_parameter(first_name, first), weight_parameter(second_name, second)),
        ((first_name, first), (second_name, second)),
        unit_views=True,
    )


def prox_pair(target: StepTarget, step: float, check: FiniteCheck) -> None:
    """The path-norm prox of a pair target in place, with the finiteness ``check``: the prox's
    own (free in the CPU kernel) when a synchronous check is wanted, else ``check``. Runs on
    the target's planned unit views (writing back those that are copies), or on its weights
    as given (2-D matrices) when it has none."""
    if not check.synchronous:
        check(target)
    views = target.views
    if views is not None and views.prox is not None and views.prox(step, check.synchronous):
        return  # the planned prox (checked when planned) on the views of the weights
    if views is None:
        w_in, w_out = target.weights
        prox_path_norm_(w_in, w_out, step, check_finite=check.synchronous)
        return
    w_in, w_out = views.matrices(target.weights)
    prox_path_norm_(w_in, w_out, step, check_finite=check.synchronous)
    views.write_back(target.weights, (w_in, w_out))


class _StepError(NonFiniteWeightsError):
    """Non-finite weights, reported by the hook with the target and the step."""


def _non_finite(owner: str, name: str, step: int | None = None) -> NonFiniteWeightsError:
    when = "the optimizer step" if step is None else f"optimizer step {step}"
    late = (
        ""
        if step is None
        else " (on CUDA the check reads its flag when it has reached the host, without "
        "stalling the GPU, so training may have gone on for a few steps)"
    )
    return _StepError(
        f"{owner}: the weights of {name} contain NaN or inf after {when}{late}; check the "
        "learning rate and the loss for divergence. The prox of non-finite weights is undefined."
    )


def _prefixed(owner: str, check: Callable[[Any], Any], value: Any) -> Any:
    """Run a spec check, prefixing its error message with the owner's name."""
    try:
        return check(value)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{owner}: {err}") from None


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a Fabric or Lightning wrapper (or ``optimizer`` itself). The
    wrappers subclass the optimizer's class but step the inner one, whose hooks run."""
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        if inner.optimizer is inner:
            break
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return inner


def _as_float(lr: Any) -> float:
    return float(lr.item()) if isinstance(lr, Tensor) else float(lr)
