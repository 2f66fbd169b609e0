"""The prox after every real optimizer step, without a Trainer: :func:`attach` and its hook.

Plain PyTorch and Lightning Fabric loops call :func:`attach` once; the Lightning callbacks in
:mod:`pathnorm_lightning.callbacks` are built on the same :class:`StepHook`. The hook is an
optimizer step post-hook (``torch.optim.Optimizer.register_step_post_hook``), so it runs
exactly once per real ``optimizer.step()``: a step that AMP's ``GradScaler`` skips never calls
``step()``, and gradient accumulation steps once per window. The prox step is ``lam * lr``
with ``lr`` read from the parameter group holding the weights at every step, so learning-rate
schedules and per-group rates are honoured.

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

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from pathnorm_lightning._common import NonFiniteWeightsError, check_scalar, finite_flag
from pathnorm_lightning.functional import prox_path_norm_
from pathnorm_lightning.metrics import PathNormBound, ProductBound, Sparsity
from pathnorm_lightning.pairing import PairsSpec, linear_chain, resolve_pairs

__all__ = ["DeferredCheck", "FiniteCheck", "StepHook", "StepTarget", "SyncCheck", "attach"]


@dataclass
class StepTarget:
    """What one update acts on: a layer or a pair (its weights, in forward order) and a display
    name used in error messages."""

    name: str
    weights: tuple[Tensor, ...]


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


class DeferredCheck(FiniteCheck):
    """Checks without stalling the GPU: an on-device flag per step is copied asynchronously
    into a pinned host slot and read when it has arrived (a few steps later at most; every
    pending flag is read by :meth:`collect` with ``keep=0``).

    Args:
        owner: the name errors start with.
        step: returns the number of the step being checked.
    """

    def __init__(self, owner: str, step: Callable[[], int]) -> None:
        self.owner = owner
        self.step = step
        self.pending: deque[tuple[int, str, int]] = deque()  # (step, target name, slot)
        self.flags: Tensor | None = None
        self.events: list[torch.cuda.Event] = []
        self.next_slot = 0

    def __call__(self, target: StepTarget) -> None:
        flag = finite_flag(target.weights)
        if flag is None:
            return
        if self.flags is None:  # allocated once: pinned slots, and an event per slot
            self.flags = torch.ones(_MAX_PENDING, dtype=torch.bool, pin_memory=True)
            self.events = [torch.cuda.Event() for _ in range(_MAX_PENDING)]
        self.collect(keep=_MAX_PENDING - 1)  # the slot must be free (rarely waits)
        slot = self.next_slot
        self.next_slot = (slot + 1) % _MAX_PENDING
        self.flags[slot].copy_(flag, non_blocking=True)
        self.events[slot].record(torch.cuda.current_stream(flag.device))
        self.pending.append((self.step(), target.name, slot))

    def collect(self, keep: int | None = None) -> None:
        """Read the flags that have arrived; with ``keep``, wait until at most ``keep`` remain."""
        while self.pending:
            step, name, slot = self.pending[0]
            if keep is None or len(self.pending) <= keep:
                if not self.events[slot].query():
                    return
            else:
                self.events[slot].synchronize()
            self.pending.popleft()
            assert self.flags is not None
            if not bool(self.flags[slot]):
                self.pending.clear()
                raise _non_finite(self.owner, name, step)


_MAX_PENDING = 64  # CUDA finiteness flags in flight before a step waits for the oldest

#: An update: ``(target, lr, check) -> None``, in place on ``target.weights``.
Update = Callable[[StepTarget, float, FiniteCheck], None]


@dataclass
class _Planned:
    target: StepTarget
    groups: tuple[int, ...]  # param-group index of every weight, in the owning optimizer


class StepHook:
    """Runs an update on each target right after every real step of the given optimizers.

    Args:
        optimizers: the optimizers whose steps trigger the update (a target's weights must sit
            in one of them, or be frozen).
        targets: the layers or pairs to update.
        update: ``(target, lr, check) -> None``, called with the learning rate of the target's
            parameter group and the finiteness check to use (see :class:`FiniteCheck`).
        check_finite: check the targets' weights after every step (raise
            :class:`NonFiniteWeightsError`); on CUDA without stalling the GPU.
        owner: the name error messages start with.
        sparsity_chains: weight chains (forward order) whose zeros and hidden units
            :meth:`metrics` counts.
        chain: every ``nn.Linear`` of the network in forward order, for the network bounds
            (None: not a chain, no bounds).
        num_steps: the step count to start from (a resumed run).
    """

    def __init__(
        self,
        optimizers: Iterable[torch.optim.Optimizer],
        targets: Sequence[StepTarget],
        update: Update,
        *,
        check_finite: bool = True,
        owner: str = "attach",
        sparsity_chains: Sequence[Sequence[Tensor]] = (),
        chain: Sequence[nn.Linear] | None = None,
        num_steps: int = 0,
    ) -> None:
        self.optimizers = [_unwrap(o) for o in optimizers]
        self.targets = list(targets)
        self.update = update
        self.owner = owner
        self.sparsity_chains = [list(c) for c in sparsity_chains]
        self.chain = list(chain) if chain is not None else None
        self.num_steps = num_steps  # real optimizer steps acted on
        self._checks = {
            "off": FiniteCheck(),
            "sync": SyncCheck(),
            "deferred": DeferredCheck(owner, lambda: self.num_steps + 1),
        }
        self.check_finite = check_finite
        self._warned_half_frozen: set[str] = set()
        self._plan = self._build_plan()
        # All optimizers: a later param group may hold a target.
        self._handles: list[RemovableHandle] = [
            o.register_step_post_hook(self._after_step) for o in self.optimizers
        ]
        self._metrics = (Sparsity(), PathNormBound(), ProductBound())

    def remove(self) -> None:
        """Remove the hooks (idempotent); checks still pending are dropped."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._checks["deferred"].pending.clear()  # type: ignore[attr-defined]

    def flush(self) -> None:
        """Wait for every pending finiteness check and raise on a failed one."""
        self._checks["deferred"].collect(keep=0)

    @torch.no_grad()
    def metrics(self) -> dict[str, Tensor]:
        """The current metric values as detached 0-d tensors: ``sparsity`` and ``alive_units``
        of the regularized weights, ``path_norm_bound`` and ``product_bound`` of the network
        (when its ``nn.Linear`` layers form a chain)."""
        sparsity, path_bound, product = self._metrics
        device = self.targets[0].weights[0].device if self.targets else torch.device("cpu")
        values: dict[str, Tensor] = {}
        sparsity = sparsity.to(device)
        sparsity.reset()
        for weights in self.sparsity_chains:
            sparsity.update(weights)
        counted = sparsity.compute()
        values["sparsity"] = counted["sparsity"]
        if not bool(torch.isnan(counted["alive_units"])):
            values["alive_units"] = counted["alive_units"]
        if self.chain is not None:
            weights = [layer.weight for layer in self.chain]
            for key, metric in (("path_norm_bound", path_bound), ("product_bound", product)):
                metric = metric.to(device)
                metric.reset()
                metric.update(weights)
                values[key] = metric.compute()
        return values

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _group_sizes(optimizer) != self._layout.get(id(optimizer)):
            self._plan = self._build_plan()  # param groups were added
        planned = self._plan.get(id(optimizer), [])
        if not planned:
            return
        self._checks["deferred"].collect()
        for item in planned:
            if not all(w.requires_grad for w in item.target.weights):
                self._skip_frozen(item.target)
                continue
            lr = self._step_size(optimizer, item)
            try:
                self.update(item.target, lr, self._check_for(item.target))
            except _StepError:  # already names its step (a deferred check that came back)
                raise
            except NonFiniteWeightsError:  # the update's own check: name the target
                raise _non_finite(self.owner, item.target.name) from None
        self.num_steps += 1

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

    def _skip_frozen(self, target: StepTarget) -> None:
        """A frozen weight stays as it is; a half-frozen pair is skipped, with a warning (its
        prox would change the frozen layer too)."""
        if (
            any(w.requires_grad for w in target.weights)
            and target.name not in self._warned_half_frozen
        ):
            self._warned_half_frozen.add(target.name)
            rank_zero_warn(
                f"{self.owner}: {target.name} is half frozen (requires_grad=False on one of its "
                "layers); the prox couples both layers, so it is skipped until both are "
                "trainable."
            )

    def _build_plan(self) -> dict[int, list[_Planned]]:
        owner_of: dict[int, tuple[int, int]] = {}  # id(param) -> (optimizer index, group index)
        for opt_index, optimizer in enumerate(self.optimizers):
            for group_index, group in enumerate(optimizer.param_groups):
                for param in group["params"]:
                    owner_of.setdefault(id(param), (opt_index, group_index))
        self._layout = {id(o): _group_sizes(o) for o in self.optimizers}
        plan: dict[int, list[_Planned]] = {}
        for target in self.targets:
            owners = []
            for weight in target.weights:
                if id(weight) not in owner_of:
                    if not weight.requires_grad:
                        break  # frozen and not optimized (yet: a schedule may add it later)
                    raise ValueError(
                        f"{self.owner}: the weight of {target.name} is not in any optimizer "
                        "(left out of configure_optimizers), so no optimizer step would "
                        "trigger its prox. Optimize it, freeze it (requires_grad=False), or "
                        "leave it out of the layers/pairs."
                    )
                owners.append(owner_of[id(weight)])
            if len(owners) < len(target.weights):
                continue
            opt_indices = sorted({o for o, _ in owners})
            if len(opt_indices) > 1:
                raise ValueError(
                    f"{self.owner}: the weights of {target.name} are held by different "
                    f"optimizers (indices {opt_indices}); the coupled prox needs one step after "
                    "one optimizer step. Put both layers in the same optimizer."
                )
            optimizer = self.optimizers[opt_indices[0]]
            plan.setdefault(id(optimizer), []).append(_Planned(target, tuple(g for _, g in owners)))
        return plan


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
        model: the network; its ``nn.Linear`` layers are paired as in :func:`resolve_pairs`.
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
        sparsity_chains=[list(t.weights) for t in targets],
        chain=linear_chain(model),
    )


def pair_target(
    first_name: str, second_name: str, first: nn.Linear, second: nn.Linear
) -> StepTarget:
    """The :class:`StepTarget` of a layer pair."""
    return StepTarget(f"pair ({first_name!r}, {second_name!r})", (first.weight, second.weight))


def prox_pair(target: StepTarget, step: float, check: FiniteCheck) -> None:
    """The path-norm prox of a pair target in place, with the finiteness ``check``: the prox's
    own (free in the CPU kernel) when a synchronous check is wanted, else ``check``."""
    if not check.synchronous:
        check(target)
    w_in, w_out = target.weights
    prox_path_norm_(w_in, w_out, step, check_finite=check.synchronous)


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


def _group_sizes(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    return tuple(len(group["params"]) for group in optimizer.param_groups)


def _as_float(lr: Any) -> float:
    return float(lr.item()) if isinstance(lr, Tensor) else float(lr)
