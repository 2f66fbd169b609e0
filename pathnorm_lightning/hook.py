"""The prox after every real optimizer step, without a Trainer: :func:`attach` and its hook.

Plain PyTorch and Lightning Fabric loops call :func:`attach` once; the Lightning callbacks in
:mod:`pathnorm_lightning.callbacks` are built on the same :class:`StepHook`, an optimizer step
post-hook (``register_step_post_hook``): a step that AMP's ``GradScaler`` skips either never
calls ``step()`` or (fused optimizers) is recognised by the scaler's ``found_inf``, and gradient
accumulation steps once per window. The prox step is ``lam * lr``, ``lr`` read from the
weights' parameter group at every step (schedules and per-group rates are honoured). Needs
torch only (and numba for the CPU kernel): no Lightning.

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

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from pathnorm_lightning import layers as seam
from pathnorm_lightning._chain import alive_units, metric_values
from pathnorm_lightning._checks import (
    DeferredCheck,
    FiniteCheck,
    StepError,
    SyncCheck,
    non_finite,
)
from pathnorm_lightning._common import NonFiniteWeightsError, check_scalar, rank_zero_warn
from pathnorm_lightning._plan import (
    Guard,
    Plan,
    Planned,
    check_lr,
    check_once_per_step,
    current,
    no_grad,
    submodule,
)
from pathnorm_lightning._target import StepTarget, UnitViews, pair_target
from pathnorm_lightning.functional import prox_path_norm_
from pathnorm_lightning.pairing import (
    ForwardCheck,
    LayerPair,
    PairsSpec,
    chain_check,
    layer_chain,
    resolve_pairs,
)

__all__ = [
    "DeferredCheck",
    "FiniteCheck",
    "StepHook",
    "StepTarget",
    "SyncCheck",
    "UnitViews",
    "attach",
    "forward_check",
    "pair_target",
    "prox_pair",
]

#: An update: ``(target, lr, check) -> None``, in place on ``target.weights``.
Update = Callable[[StepTarget, float, FiniteCheck], None]

#: Every live hook (no weight may be regularized twice per step by two hooks).
_LIVE: weakref.WeakSet[StepHook] = weakref.WeakSet()


class StepHook:
    """Runs an update on each target right after every real step of the given optimizers.

    The invariant, checked here and nowhere else: **the update runs exactly once per real
    update, on exactly the weights that update changed.** At every step the hook re-plans when
    the optimizers' parameter groups or the targets' modules' ``weight`` parameters changed
    (compared by identity; the plan is cached otherwise). So:

    * a step that did not update (a fused optimizer's step that ``GradScaler`` skipped on
      inf/NaN gradients; a target none of whose weights got a gradient) updates nothing and is
      not counted;
    * a weight that two targets share (tied, by storage), or that another live hook with the
      same ``penalty`` regularizes after the same optimizer's steps, is refused with a
      ``ValueError`` before anything is written;
    * a frozen target is left alone; a half-frozen one is skipped with a warning, whether or
      not its frozen weight is in an optimizer; a trainable weight no optimizer holds, or a
      target split across two optimizers, is refused;
    * a weight that became computed (pruning, a parametrization) is refused at the next step,
      before the update writes anything, with its cause.

    Args:
        optimizers: the optimizers whose steps trigger the update (a target's weights must sit
            in one of them, or be frozen); one listed twice is hooked once. Optimizers created
            later (a reset between stages) are followed after :meth:`follow`.
        targets: the layers or pairs to update.
        update: ``(target, lr, check) -> None``, called with the learning rate of the target's
            parameter group and the finiteness check to use (see :class:`FiniteCheck`).
        check_finite: check the targets' weights after every step (raise
            :class:`NonFiniteWeightsError`); on CUDA without stalling the GPU.
        owner: the name error messages start with.
        sparsity_chains: chains (forward order) of weights or of modules (``weight`` read at
            each call) whose zeros and hidden units :meth:`metrics` counts.
        chain: every layer of the seam's types in forward order, for the network bounds (None:
            no bounds). A last convolution's bounds depend on the positions it reads, recorded
            by a forward pre-hook (no bounds before the first forward pass).
        num_steps: the step count to start from (a resumed run).
        penalty: what the update regularizes (``"path-norm"``, ``"l1"``, ...; default: the
            owner's name): two live hooks with the same penalty may not share a weight after one
            optimizer's steps; different ones may (a composition of two proxes, not the prox of
            their sum).
        watch_units: warn (once per target) when an update leaves a pair target no hidden
            unit (checked at the steps of :func:`_watch_due`; on CUDA through deferred flags).
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
        chain_check: ForwardCheck | None = None,
        root: nn.Module | None = None,
    ) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []  # set by follow()
        self.targets = list(targets)
        # The model the targets' layer names were found in: a layer replaced there is refused.
        found = root is not None and all(
            submodule(root, tuple(name.split("."))) is m
            for t in self.targets
            for name, m in t.layers
        )
        self.root = root if found else None
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
        self._guard: Guard | None = None
        self._check_finite = check_finite
        self.watch_units = watch_units
        self._steps_here = 0  # steps acted on by this hook (the unit-watch schedule)
        self._warned: set[tuple[str, str]] = set()  # (what, target name): warned once
        self._forward_check = forward_check
        self._chain_check = chain_check
        self._plan: Plan = {}
        self._handles: list[RemovableHandle] = []
        try:
            self.follow(optimizers)  # every refusal comes before a hook is registered
        except BaseException:
            self._drop_forward_check()
            raise
        if self.chain and seam.entry_of(self.chain[-1]).spatial:
            self._chain_handle = self.chain[-1].register_forward_pre_hook(self._record_positions)

    def follow(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Follow the steps of ``optimizers`` from now on, instead of the ones followed so far
        (e.g. optimizers re-created between training stages). Planned now: a refusal raises
        here and leaves the hook as it was; the step count, pending checks and warnings stay."""
        new = list(dict.fromkeys(_unwrap(o) for o in optimizers))
        kept = self.optimizers, self._guard
        self.optimizers, self._guard = new, None
        try:
            self._replan()
        except BaseException:
            self.optimizers, self._guard = kept
            raise
        for handle in self._handles:
            handle.remove()
        self._handles = [o.register_step_post_hook(self._after_step) for o in new]
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
        """``sparsity`` and ``alive_units`` of the regularized weights, and ``path_norm_bound``
        and ``product_bound`` of the network when its layers form a chain (see ``chain``), read
        from the weights now (one host sync on CUDA)."""
        reuse = self.reuse()
        network = None if reuse is None else [_weight_of(layer) for layer in self.chain or ()]
        chains = [[_weight_of(w) for w in chain] for chain in self.sparsity_chains]
        return metric_values(chains, network, reuse or 1)

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
        if self._chain_check is not None:
            self._finish_chain_check()
        planned = self._plan.get(id(optimizer))
        if not planned:
            return
        deferred = self._checks["deferred"]
        deferred.collect()
        watch = self.watch_units and _watch_due(self._steps_here + 1)
        acted = False
        for item in planned:
            target = item.target
            if no_grad(target.weights):
                continue  # no gradient reached these weights: this step did not change them
            try:
                lr = (
                    _as_float(optimizer.param_groups[item.lr_group]["lr"])
                    if item.lr_group is not None
                    else self._step_size(optimizer, item)
                )
            except (TypeError, ValueError, KeyError, RuntimeError):  # e.g. an lr set to None
                check_lr(self.owner, target.name, optimizer, item.groups)  # says so, if it is
                raise
            if not 0.0 <= lr < math.inf:
                raise ValueError(
                    f"{self.owner}: {target.name}: the learning rate of its parameter group is "
                    f"{lr!r}, so the prox step lam * lr is not a finite number >= 0; use a finite "
                    "learning rate >= 0"
                )
            finite = item.check if item.check is not None else self._check_for(target)
            try:
                self.update(target, lr, finite)
            except StepError:  # already names its step (a deferred check that came back)
                raise
            except NonFiniteWeightsError:  # the update's own check: name the target
                raise non_finite(self.owner, target.name) from None
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

    def _step_size(self, optimizer: torch.optim.Optimizer, item: Planned) -> float:
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
            f"{self.owner}: {name} has no hidden unit left after the prox of step {step} (steps "
            "as num_steps counts them: those the prox acted on, not the trainer's global_step). "
            "Each unit's incoming row or outgoing column is zero, so nothing passes through it "
            "any more: lam is too large for these layers. The prox shrinks a unit by about "
            "lr * lam times the l1 norm of its other side, which falls as layers widen; try a "
            "3-10x smaller lam and watch alive_units in the metrics.",
        )

    def _warn_once(self, what: str, name: str, message: str) -> None:
        if (what, name) not in self._warned:
            self._warned.add((what, name))
            rank_zero_warn(message, stacklevel=4)

    def _drop_forward_check(self) -> None:
        for check in (self._forward_check, self._chain_check):
            if check is not None:
                check.remove()
        self._forward_check = self._chain_check = None

    def _finish_chain_check(self) -> None:
        check, self._chain_check = self._chain_check, None
        broken = check.finish(self.owner, warn=False) if check is not None else []
        if broken and self.chain is not None:
            self.chain = None
            rank_zero_warn(
                f"{self.owner}: in the forward pass, the input of the second of {broken} (the "
                "model's output for '<output>') does not come from the first's output alone "
                "(a skip connection, a branch, a layer run twice, an op that mixes the units), "
                "so the layers do not form a chain and the network bounds path_norm_bound and "
                "product_bound are not computed."
            )

    # --- the plan: what the optimizers update now ------------------------------------------
    def _replan(self) -> None:
        """Rebuild the plan unless its :class:`~pathnorm_lightning._plan.Guard` holds (checked
        in O(groups + targets), whatever the number of parameters)."""
        if self._guard is None or not self._guard.holds(self.optimizers, self.targets, self.root):
            self._guard = None
            self._plan = self._build_plan()
            self._guard = Guard.of(self.optimizers, self._plan, self.targets, self.root)

    def _build_plan(self) -> Plan:
        owner_of: dict[int, tuple[int, int]] = {}  # id(param) -> (optimizer index, group index)
        for opt_index, optimizer in enumerate(self.optimizers):
            for group_index, group in enumerate(optimizer.param_groups):
                for param in group["params"]:
                    owner_of.setdefault(id(param), (opt_index, group_index))
        plan: Plan = {}
        for target in (current(self.owner, self.root, t) for t in self.targets):
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
            a, b = target.weights[0], target.weights[-1]  # a pair's two (a layer's one)
            if a.dtype != b.dtype or a.device != b.device:
                raise ValueError(
                    f"{self.owner}: {target.name}: its layers' weights are {a.dtype} on "
                    f"{a.device} and {b.dtype} on {b.device}; the coupled prox needs both in "
                    "one dtype on one device: cast or move one layer (e.g. model.to(dtype))"
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
            check_lr(self.owner, target.name, optimizer, groups)
            planned = Planned(target, groups, lr_group, self._check_for(target))
            plan.setdefault(id(optimizer), []).append(planned)
        others = [
            (o.owner, o.optimizers, o._plan)
            for o in list(_LIVE)
            if o is not self and o.penalty == self.penalty
        ]
        check_once_per_step(self.owner, self.optimizers, plan, others)
        return plan


def _watch_due(step: int) -> bool:
    """Steps 1, 2, 4, ..., 32, then every 64th: about 1/64 of a pass over the weights per step."""
    return (step <= 32 and step & (step - 1) == 0) or step % 64 == 0


def _skipped_by_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a fused optimizer (``fused=True``) skipped this step by itself: ``GradScaler``
    calls its ``step()`` with ``optimizer.found_inf`` set on inf/NaN gradients (one host sync
    on CUDA, at every step such an optimizer takes under the scaler)."""
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
        optimizer: the optimizer (or several) that trains ``model``; a Lightning, Fabric or
            Accelerate wrapper is unwrapped, any other (a Lookahead) is followed itself.
        model: the network; its ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` layers are paired
            as in :func:`resolve_pairs`.
        lam: regularization strength lambda (finite, >= 0).
        pairs: ``"auto"`` or explicit ``[(first_name, second_name), ...]`` module names.
        check_finite: raise :class:`NonFiniteWeightsError` when a regularized weight is NaN or
            inf after a step (on CUDA a few steps later at most, without stalling the GPU; call
            :meth:`StepHook.flush` to wait for every check).

    Returns:
        The :class:`StepHook` (``.remove()``, ``.metrics()``, ``.num_steps``).
    """
    lam = _prefixed("attach", lambda v: check_scalar(v, "lam"), lam)
    if not isinstance(check_finite, bool):
        raise TypeError(f"attach: check_finite must be a bool, got {check_finite!r}")
    optimizers: list[Any] = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    layer_pairs = _prefixed("attach", lambda m: resolve_pairs(m, pairs), model)
    targets = [_prefixed("attach", pair_target, p) for p in layer_pairs]

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
        chain_check=chain_check(model),
        root=model,
    )


def forward_check(pairs: Sequence[LayerPair]) -> ForwardCheck | None:
    """A :class:`ForwardCheck` of the pairs the module tree could not verify (None if none)."""
    return ForwardCheck(pairs) if any(not p.verified for p in pairs) else None


def prox_pair(target: StepTarget, step: float, check: FiniteCheck) -> None:
    """The path-norm prox of a pair target in place, on its planned unit views (copies written
    back after) or its weights as given; a synchronous ``check`` is the prox's own (free in the
    CPU kernel, before anything is written)."""
    if not check.synchronous:
        check(target)
    views = target.views
    if views is None:
        w_in, w_out = target.weights
        prox_path_norm_(w_in, w_out, step, check_finite=check.synchronous)
        return
    if step == 0.0 and not check.synchronous:
        return  # the identity (lam or lr 0) on views checked when planned: nothing to do
    if not views.copies and views.prox is not None and views.prox(step, check.synchronous):
        return  # the planned prox (checked when planned) wrote through the views
    w_in, w_out = views.matrices(target.weights)  # the weights copied into the buffers
    # the planned prox on the buffers (a non-finite weight raises before any write-back)
    planned = views.copies and views.prox is not None and views.prox(step, check.synchronous)
    if not planned:
        prox_path_norm_(w_in, w_out, step, check_finite=check.synchronous)
    views.write_back(target.weights, (w_in, w_out))


def _prefixed(owner: str, check: Callable[[Any], Any], value: Any) -> Any:
    """Run a spec check, prefixing its error message with the owner's name."""
    try:
        return check(value)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{owner}: {err}") from None


#: Wrappers that step the optimizer inside them and change no weight after it (their classes):
#: the prox follows the inner optimizer's step, whose hooks run.
_PASS_THROUGH = {
    "lightning.pytorch.core.optimizer.LightningOptimizer",
    "pytorch_lightning.core.optimizer.LightningOptimizer",
    "lightning.fabric.wrappers._FabricOptimizer",
    "lightning_fabric.wrappers._FabricOptimizer",
    "accelerate.optimizer.AcceleratedOptimizer",
}


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer whose every step the prox follows: the one inside a Lightning, Fabric or
    Accelerate wrapper (they step it and change nothing after), else ``optimizer`` itself. Any
    other wrapper (a Lookahead) may change the weights after its inner step, so its own step is
    followed, and it must run torch's step hooks."""
    inner = optimizer
    while any(f"{c.__module__}.{c.__qualname__}" in _PASS_THROUGH for c in type(inner).__mro__):
        if not isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            break
        inner = inner.optimizer
    name = type(inner).__name__
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"expected a torch.optim.Optimizer, got {name}: attach to the optimizer that "
            "updates the weights (a wrapper that only steps an optimizer: to that optimizer)"
        )
    hooks = getattr(type(inner).step, "hooked", False) and hasattr(
        inner, "_optimizer_step_post_hooks"
    )
    if not hooks:  # both set by Optimizer.__init__
        raise TypeError(
            f"{name}.step does not run torch's optimizer step hooks ({name}.__init__ does not "
            "call torch.optim.Optimizer.__init__), so the prox cannot follow its steps: call "
            f"prox_path_norm_ after each {name}.step() yourself, or attach to the optimizer "
            f"inside it if {name} changes no weight after stepping it"
        )
    return inner


def _as_float(lr: Any) -> float:
    return float(lr.item()) if isinstance(lr, Tensor) else float(lr)
