"""Lightning callbacks that apply a prox (or projection) right after every real optimizer step.

``PathNormProx`` applies the exact 1-path-norm prox to pairs of ``nn.Linear`` layers;
``L1Prox`` and ``LayerwiseLinfProjection`` are the paper's layer-wise baselines. All three share
:class:`AfterOptimizerStep`, which decides *when* they run:

* a post-step hook (``torch.optim.Optimizer.register_step_post_hook``) on every optimizer of the
  fit, registered in ``on_fit_start`` and removed in ``on_fit_end`` / ``teardown`` /
  ``on_exception``, so the prox runs exactly once per real ``optimizer.step()``: automatic and
  manual optimization, raw torch optimizers stepped inside ``training_step``, several
  optimizers, ``accumulate_grad_batches > 1`` (one step per accumulation window), and repeated
  ``fit()`` calls with the same callback (no duplicated or leaked hooks);
* a step skipped by AMP's ``GradScaler`` (inf/NaN gradients) never calls ``optimizer.step()``,
  so the hook does not run and nothing is applied;
* the prox step is ``lam * lr`` with ``lr`` the current learning rate of the parameter group
  holding the weights, read at every step (LR schedulers and per-group rates are honoured).
"""

from __future__ import annotations

import numbers
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from pathnorm_lightning._common import NonFiniteWeightsError
from pathnorm_lightning._common import check_scalar as _check_scalar
from pathnorm_lightning._common import finite_flag as _finite_flag
from pathnorm_lightning.functional import (
    project_rows_l1_ball_,
    prox_l1_,
    prox_path_norm_,
)
from pathnorm_lightning.metrics import PathNormBound, ProductBound, Sparsity
from pathnorm_lightning.pairing import (
    LayersSpec,
    linear_chain,
    normalize_layers,
    normalize_pairs,
    resolve_layers,
    resolve_pairs,
)

__all__ = ["AfterOptimizerStep", "L1Prox", "LayerwiseLinfProjection", "PathNormProx", "StepTarget"]

_SHARDED_STRATEGIES = (
    "FSDPStrategy",
    "DeepSpeedStrategy",
    "ModelParallelStrategy",
    "XLAFSDPStrategy",
)


def _check_nonneg(value: Any, name: str, owner: str) -> float:
    """A finite number >= 0 as a plain float: Python, NumPy and 0-d tensor reals are accepted."""
    is_tensor_real = (
        isinstance(value, Tensor)
        and value.ndim == 0
        and not value.is_complex()
        and value.dtype != torch.bool
    )
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) or is_tensor_real):
        raise TypeError(
            f"{owner}: {name} must be a real number, got {value!r} ({type(value).__name__})"
        )
    return _prefixed(owner, lambda v: _check_scalar(v, name), value)


@dataclass
class StepTarget:
    """What one :meth:`AfterOptimizerStep.apply` call updates: a layer or a pair (its weights, in
    forward order) and a display name used in error messages."""

    name: str
    weights: tuple[Tensor, ...]


@dataclass
class _Planned:
    target: StepTarget
    groups: tuple[int, ...]  # param-group index of every weight, in the owning optimizer


class AfterOptimizerStep(Callback):
    """Base class: run :meth:`apply` on each target right after every real optimizer step.

    Subclasses define :meth:`resolve_targets` (which weights), :meth:`apply` (what to do with
    them given the learning rate) and :meth:`sparsity_chains` (which weights the sparsity
    metric covers). The step mechanics, logging and checkpoint state live here.

    Args:
        log_every_n_steps: log the metrics every this many optimizer steps; ``None`` follows the
            trainer's ``log_every_n_steps`` (at the steps where Lightning flushes its logs).
        log_metrics: log ``pathnorm/sparsity``, ``pathnorm/alive_units``,
            ``pathnorm/path_norm_bound`` and ``pathnorm/product_bound``.
        prog_bar: also show the metrics in the progress bar.
        log_prefix: the metrics' name prefix (``"pathnorm"``: ``pathnorm/sparsity``, ...). The
            baselines log under the same names, so runs with different regularizers compare
            directly; two such callbacks in one ``Trainer`` need different prefixes (checked at
            fit start).
        check_finite: raise a ``ValueError`` when a regularized weight is NaN/inf after an
            optimizer step. On CPU at that step (free in the compiled prox). On CUDA without
            stalling the GPU: the flag is copied to the host asynchronously and read when it has
            arrived, so the error comes at a later step (a few at most, and at the latest at
            the end of the epoch or before a checkpoint is saved). Elsewhere one device sync
            per step. With ``False`` non-finite weights propagate silently.
    """

    # Whether :meth:`apply` itself raises NonFiniteWeightsError on NaN/inf weights (else the
    # base class checks them before calling it). Such an ``apply`` checks when
    # ``self.check_in_apply`` is set: the base class sets it before each call (off on CUDA,
    # where it has queued the check itself).
    apply_checks_finite = False

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        log_metrics: bool = True,
        prog_bar: bool = False,
        check_finite: bool = True,
        log_prefix: str = "pathnorm",
    ) -> None:
        owner = type(self).__name__
        if not isinstance(log_prefix, str) or not log_prefix or log_prefix.endswith("/"):
            raise ValueError(
                f"{owner}: log_prefix must be a non-empty string without a trailing '/', "
                f"got {log_prefix!r}"
            )
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool)
            or not isinstance(log_every_n_steps, int)
            or log_every_n_steps < 1
        ):
            raise ValueError(
                f"{owner}: log_every_n_steps must be a positive int or None (follow the trainer), "
                f"got {log_every_n_steps!r}"
            )
        for flag_name, flag in (
            ("log_metrics", log_metrics),
            ("prog_bar", prog_bar),
            ("check_finite", check_finite),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{owner}: {flag_name} must be a bool, got {flag!r}")
        self.log_every_n_steps = log_every_n_steps
        self.log_metrics = log_metrics
        self.prog_bar = prog_bar
        self.check_finite = check_finite
        self.check_in_apply = check_finite
        self.log_prefix = log_prefix

        self.num_steps = 0  # real optimizer steps this callback has acted on (all fits)
        self._handles: list[RemovableHandle] = []
        self._targets: list[StepTarget] = []
        self._plan: dict[int, list[_Planned]] = {}  # id(optimizer) -> its targets
        self._optimizers: list[torch.optim.Optimizer] = []
        # Per optimizer, the sizes of its param groups when the plan was made (a fine-tuning
        # schedule that adds a group, or params, triggers a new plan at its next step).
        self._layout: dict[int, tuple[int, ...]] = {}
        self._warned_half_frozen: set[str] = set()
        self._chain: list[nn.Linear] | None = None
        self._last_logged_step = -1
        # CUDA finiteness checks on their way: (step, target, slot of self._flags / _events).
        self._pending: deque[tuple[int, StepTarget, int]] = deque()
        self._flags: Tensor | None = None
        self._events: list[torch.cuda.Event] = []
        self._next_slot = 0
        self._sparsity = Sparsity()
        self._path_norm_bound = PathNormBound()
        self._product_bound = ProductBound()

    # --- to be defined by subclasses -------------------------------------------------------
    def resolve_targets(self, pl_module: pl.LightningModule) -> list[StepTarget]:
        """The layers or pairs to act on (called at fit start, after ``configure_model``)."""
        raise NotImplementedError

    def apply(self, target: StepTarget, lr: float) -> None:
        """Update ``target.weights`` in place after an optimizer step with learning rate ``lr``."""
        raise NotImplementedError

    def sparsity_chains(self) -> list[list[Tensor]]:
        """Weight chains (forward order) whose zeros and hidden units the sparsity metric counts."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """Constructor arguments, stored in checkpoints."""
        return {
            "log_every_n_steps": self.log_every_n_steps,
            "log_metrics": self.log_metrics,
            "prog_bar": self.prog_bar,
            "check_finite": self.check_finite,
            "log_prefix": self.log_prefix,
        }

    @property
    @override
    def state_key(self) -> str:
        # Several instances of one class (e.g. a different lam per pair) keep their own state:
        # the key names the layers acted on when they are explicit (the default keeps the
        # class name, as in checkpoints of earlier versions).
        spec = getattr(self, "pairs", getattr(self, "layers", "auto"))
        if spec == "auto":
            return type(self).__qualname__
        return self._generate_state_key(targets=_normalize(spec))

    # --- hooks --------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = type(trainer.strategy)
        if any(cls.__name__ in _SHARDED_STRATEGIES for cls in strategy.__mro__):
            raise ValueError(
                f"{type(self).__name__} does not support the sharded strategy "
                f"{strategy.__name__}: the prox couples whole weight matrices, which are split "
                "across processes there. Use a data-parallel strategy (e.g. strategy='ddp') instead."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()  # idempotent: a previous fit that died without cleanup
        if self.log_metrics:
            self._check_unique_prefix(trainer)
        self._targets = self.resolve_targets(pl_module)
        self._optimizers = list(trainer.optimizers)
        self._plan = self._build_plan(self._optimizers)
        for optimizer in self._optimizers:  # all: a later param group may hold a target
            self._handles.append(optimizer.register_step_post_hook(self._after_step))
        self._chain = linear_chain(pl_module)
        if self.log_metrics and self._chain is None:
            rank_zero_warn(
                f"{type(self).__name__}: the nn.Linear layers of {type(pl_module).__name__} do "
                "not form a chain (consecutive out/in features differ), so the network bounds "
                "pathnorm/path_norm_bound and pathnorm/product_bound are not logged."
            )
        self._last_logged_step = -1

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()
        self._collect_checks(keep=0)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._collect_checks(keep=0)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._collect_checks(keep=0)  # never save weights a pending check would reject

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()
        self._pending.clear()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._remove_hooks()
        self._pending.clear()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if (
            not self.log_metrics or not self._targets or trainer.log_every_n_steps == 0  # type: ignore[attr-defined]
        ):
            return
        if pl_module.automatic_optimization and trainer.fit_loop._should_accumulate():
            return  # no step on this batch (as Lightning's own step logging)
        step = trainer.global_step
        if step == self._last_logged_step:
            return
        if self.log_every_n_steps is None:
            # The trainer's own flush condition, as Lightning's LearningRateMonitor uses it.
            due = trainer._logger_connector.should_update_logs
        else:
            due = step % self.log_every_n_steps == 0
        if due:
            self._last_logged_step = step
            self.log_metric_values(trainer, pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config(), "num_steps": self.num_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.num_steps = int(state_dict.get("num_steps", 0))
        saved = state_dict.get("config", {})
        current = self.config()
        changed = {
            key: (saved[key], current[key])
            for key in saved
            if key in current and _normalize(saved[key]) != _normalize(current[key])
        }
        if changed:
            diff = ", ".join(
                f"{k}: checkpoint {old!r} -> now {new!r}" for k, (old, new) in changed.items()
            )
            rank_zero_warn(
                f"{type(self).__name__}: resuming with a configuration that differs from the "
                f"checkpoint ({diff}); the current constructor arguments are used."
            )

    # --- metrics -----------------------------------------------------------------------
    @torch.no_grad()
    def metric_values(self) -> dict[str, Tensor]:
        """Current metric values (detached 0-d tensors), keyed by their logged names."""
        values: dict[str, Tensor] = {}
        device = self._targets[0].weights[0].device if self._targets else torch.device("cpu")
        if self._sparsity.device != device:
            self._sparsity = self._sparsity.to(device)
        self._sparsity.reset()
        for chain in self.sparsity_chains():
            self._sparsity.update(chain)
        sparsity = self._sparsity.compute()
        values[f"{self.log_prefix}/sparsity"] = sparsity["sparsity"]
        if not bool(torch.isnan(sparsity["alive_units"])):
            values[f"{self.log_prefix}/alive_units"] = sparsity["alive_units"]
        if self._chain is not None:
            weights = [layer.weight for layer in self._chain]
            for key, metric in (
                ("path_norm_bound", self._path_norm_bound),
                ("product_bound", self._product_bound),
            ):
                if metric.device != device:
                    metric = metric.to(device)
                metric.reset()
                metric.update(weights)
                values[f"{self.log_prefix}/{key}"] = metric.compute()
        return values

    def log_metric_values(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log :meth:`metric_values` (identical on every rank: the weights are replicated, so no
        ``sync_dist`` reduction is needed).

        As Lightning's own monitoring callbacks (``LearningRateMonitor``, ``DeviceStatsMonitor``)
        do, the values are written to every logger directly, at Lightning's step (its loggers
        write on rank zero only), and put in ``trainer.callback_metrics`` (where ``ModelCheckpoint``
        and ``EarlyStopping`` can monitor them). ``pl_module.log`` costs about 0.3 ms per value
        on CPU; it is used only with ``prog_bar=True``, for the progress bar.
        """
        values = {name: value.float() for name, value in self.metric_values().items()}
        if self.prog_bar:
            for name, value in values.items():
                pl_module.log(
                    name, value, on_step=True, on_epoch=False, prog_bar=True, logger=False,
                    batch_size=1,
                )  # fmt: skip
        trainer.callback_metrics.update(values)
        if trainer.loggers:
            # The step axis Lightning's own step-level logging uses.
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            scalars = {name: float(value) for name, value in values.items()}
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=step)

    # --- mechanics ---------------------------------------------------------------------
    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _check_unique_prefix(self, trainer: pl.Trainer) -> None:
        for other in trainer.callbacks:  # type: ignore[attr-defined]
            if other is self:
                return  # the first of a clashing pair raises
            if (
                isinstance(other, AfterOptimizerStep)
                and other.log_metrics
                and other.log_prefix == self.log_prefix
            ):
                raise ValueError(
                    f"{type(other).__name__} and {type(self).__name__} both log their metrics as "
                    f"'{self.log_prefix}/...', so each would overwrite the other's values. Give "
                    f"one a log_prefix of its own (e.g. log_prefix='{self.log_prefix}_2') or "
                    "log_metrics=False."
                )

    def _build_plan(self, optimizers: Sequence[torch.optim.Optimizer]) -> dict[int, list[_Planned]]:
        owner_of: dict[int, tuple[int, int]] = {}  # id(param) -> (optimizer index, group index)
        for opt_index, optimizer in enumerate(optimizers):
            for group_index, group in enumerate(optimizer.param_groups):
                for param in group["params"]:
                    owner_of.setdefault(id(param), (opt_index, group_index))
        self._layout = {id(o): _group_sizes(o) for o in optimizers}
        plan: dict[int, list[_Planned]] = {}
        name = type(self).__name__
        for target in self._targets:
            owners = []
            for weight in target.weights:
                if id(weight) not in owner_of:
                    if not weight.requires_grad:
                        break  # frozen and not optimized (yet: a schedule may add it later)
                    raise ValueError(
                        f"{name}: the weight of {target.name} is not in any optimizer of this fit "
                        "(left out of configure_optimizers), so no optimizer step would trigger "
                        "its prox. Optimize it, freeze it (requires_grad=False), or leave it out "
                        "of the callback's layers/pairs."
                    )
                owners.append(owner_of[id(weight)])
            if len(owners) < len(target.weights):
                continue
            opt_indices = {o for o, _ in owners}
            if len(opt_indices) > 1:
                raise ValueError(
                    f"{name}: the weights of {target.name} are held by different optimizers "
                    f"(indices {sorted(opt_indices)}); the coupled prox needs one step after one "
                    "optimizer step. Put both layers in the same optimizer."
                )
            optimizer = optimizers[owners[0][0]]
            plan.setdefault(id(optimizer), []).append(_Planned(target, tuple(g for _, g in owners)))
        return plan

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _group_sizes(optimizer) != self._layout.get(id(optimizer)):
            self._plan = self._build_plan(self._optimizers)  # param groups were added
        planned = self._plan.get(id(optimizer))
        if not planned:
            return
        self._collect_checks()
        for item in planned:
            if not all(w.requires_grad for w in item.target.weights):
                self._skip_frozen(item.target)
                continue
            lrs = [_as_float(optimizer.param_groups[g]["lr"]) for g in item.groups]
            if any(lr != lrs[0] for lr in lrs[1:]):
                raise ValueError(
                    f"{type(self).__name__}: the weights of {item.target.name} are in parameter "
                    f"groups with different learning rates {lrs}; the coupled prox needs a single "
                    "step size lam * lr. Give both layers the same learning rate (one group)."
                )
            self.check_in_apply = False
            if self.check_finite:
                if item.target.weights[0].device.type == "cuda":
                    self._defer_check(item.target)
                elif self.apply_checks_finite:
                    self.check_in_apply = True
                elif not _all_finite(item.target.weights):
                    raise self._non_finite(item.target)
            try:
                self.apply(item.target, lrs[0])
            except NonFiniteWeightsError:
                raise self._non_finite(item.target) from None
        self.num_steps += 1

    def _skip_frozen(self, target: StepTarget) -> None:
        """A frozen weight stays as it is; a half-frozen pair is skipped, with a warning (its
        prox would change the frozen layer too)."""
        if (
            any(w.requires_grad for w in target.weights)
            and target.name not in self._warned_half_frozen
        ):
            self._warned_half_frozen.add(target.name)
            rank_zero_warn(
                f"{type(self).__name__}: {target.name} is half frozen (requires_grad=False on "
                "one of its layers); the prox couples both layers, so it is skipped until both "
                "are trainable."
            )

    def _non_finite(self, target: StepTarget, step: int | None = None) -> ValueError:
        when = "the optimizer step" if step is None else f"optimizer step {step}"
        late = (
            ""
            if step is None
            else " (on CUDA the check reads its flag when it has reached the host, without "
            "stalling the GPU, so training may have gone on for a few steps)"
        )
        return ValueError(
            f"{type(self).__name__}: the weights of {target.name} contain NaN or inf "
            f"after {when}{late}; check the learning rate and the loss for divergence. The "
            "prox of non-finite weights is undefined."
        )

    def _defer_check(self, target: StepTarget) -> None:
        """Queue an on-device finiteness flag of ``target``'s weights, copied asynchronously
        into a pinned host slot (no host sync), for :meth:`_collect_checks`."""
        flag = _finite_flag(target.weights)
        if flag is None:
            return
        if self._flags is None:  # allocated once: pinned slots, and an event per slot
            self._flags = torch.ones(_MAX_PENDING, dtype=torch.bool, pin_memory=True)
            self._events = [torch.cuda.Event() for _ in range(_MAX_PENDING)]
        self._collect_checks(keep=_MAX_PENDING - 1)  # the slot must be free (rarely waits)
        slot = self._next_slot
        self._next_slot = (slot + 1) % _MAX_PENDING
        self._flags[slot].copy_(flag, non_blocking=True)
        self._events[slot].record(torch.cuda.current_stream(flag.device))
        self._pending.append((self.num_steps + 1, target, slot))

    def _collect_checks(self, keep: int | None = None) -> None:
        """Read the queued flags that have arrived; with ``keep``, wait until at most ``keep``
        remain. Raise on the first non-finite one."""
        while self._pending:
            step, target, slot = self._pending[0]
            ready = self._events[slot]
            if keep is None or len(self._pending) <= keep:
                if not ready.query():
                    return
            else:
                ready.synchronize()
            self._pending.popleft()
            assert self._flags is not None
            if not bool(self._flags[slot]):
                self._pending.clear()
                raise self._non_finite(target, step)


def _prefixed(owner: str, check: Callable[[Any], Any], value: Any) -> Any:
    """Run a spec check, prefixing its error message with the callback's name."""
    try:
        return check(value)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{owner}: {err}") from None


_MAX_PENDING = 64  # CUDA finiteness flags in flight before a step waits for the oldest


def _all_finite(weights: Sequence[Tensor]) -> bool:
    """Whether every entry is finite (one host sync)."""
    flag = _finite_flag(weights)
    return flag is None or bool(flag)


def _group_sizes(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    return tuple(len(group["params"]) for group in optimizer.param_groups)


def _as_float(lr: Any) -> float:
    return float(lr.item()) if isinstance(lr, Tensor) else float(lr)


def _normalize(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    return value


def _consecutive_chains(layers: list[nn.Linear]) -> list[list[Tensor]]:
    """Split layers (in the given order) into maximal runs whose dimensions chain."""
    chains: list[list[Tensor]] = []
    previous: nn.Linear | None = None
    for layer in layers:
        if previous is not None and previous.out_features == layer.in_features:
            chains[-1].append(layer.weight)
        else:
            chains.append([layer.weight])
        previous = layer
    return chains


class PathNormProx(AfterOptimizerStep):
    """Proximal SGD on the 1-path-norm: after every real optimizer step, apply the exact prox
    of ``lam * lr * sum_pairs path_norm(first.weight, second.weight)`` to every pair.

    Biases are untouched. A pair's two weights must sit in the same optimizer; if they are in
    different parameter groups, the groups must have equal learning rates at each step (the prox
    couples both layers, so it needs one step size), else a ``ValueError`` is raised.

    Example::

        trainer = Trainer(callbacks=[PathNormProx(lam=1e-3)])

    Args:
        lam: regularization strength lambda (finite, >= 0); the prox step is ``lam * lr``.
        pairs: ``"auto"`` pairs the ``nn.Linear`` layers in module order, (L1, L2), (L3, L4), ...;
            or explicit ``[("encoder.0", "encoder.2"), ...]`` module names.
        log_every_n_steps, log_metrics, prog_bar, check_finite, log_prefix: see
            :class:`AfterOptimizerStep`.
    """

    def __init__(
        self,
        lam: float,
        pairs: str | list[tuple[str, str]] = "auto",
        log_every_n_steps: int | None = None,
        log_metrics: bool = True,
        prog_bar: bool = False,
        check_finite: bool = True,
        log_prefix: str = "pathnorm",
    ) -> None:
        super().__init__(log_every_n_steps, log_metrics, prog_bar, check_finite, log_prefix)
        self.lam = _check_nonneg(lam, "lam", "PathNormProx")
        self.pairs = _prefixed("PathNormProx", normalize_pairs, pairs)
        self._layer_pairs: list[tuple[nn.Linear, nn.Linear]] = []

    @override
    def config(self) -> dict[str, Any]:
        return {"lam": self.lam, "pairs": self.pairs, **super().config()}

    @override
    def resolve_targets(self, pl_module: pl.LightningModule) -> list[StepTarget]:
        pairs = resolve_pairs(pl_module, self.pairs)
        self._layer_pairs = [(p.first, p.second) for p in pairs]
        return [
            StepTarget(
                f"pair ({p.first_name!r}, {p.second_name!r})", (p.first.weight, p.second.weight)
            )
            for p in pairs
        ]

    # The prox checks finiteness itself, for free in the compiled kernel's first pass.
    apply_checks_finite = True

    @override
    def apply(self, target: StepTarget, lr: float) -> None:
        w_in, w_out = target.weights
        prox_path_norm_(w_in, w_out, self.lam * lr, check_finite=self.check_in_apply)

    @override
    def sparsity_chains(self) -> list[list[Tensor]]:
        return [[first.weight, second.weight] for first, second in self._layer_pairs]


class _LayerwiseBase(AfterOptimizerStep):
    def __init__(
        self,
        layers: str | list[str],
        log_every_n_steps: int | None,
        log_metrics: bool,
        prog_bar: bool,
        check_finite: bool,
        log_prefix: str,
    ) -> None:
        super().__init__(log_every_n_steps, log_metrics, prog_bar, check_finite, log_prefix)
        self.layers = _prefixed(type(self).__name__, normalize_layers, layers)
        self._linear_layers: list[nn.Linear] = []

    @override
    def config(self) -> dict[str, Any]:
        return {"layers": self.layers, **super().config()}

    @override
    def resolve_targets(self, pl_module: pl.LightningModule) -> list[StepTarget]:
        spec: LayersSpec = self.layers
        found = resolve_layers(pl_module, spec)
        self._linear_layers = [layer for _, layer in found]
        return [StepTarget(f"layer {name!r}", (layer.weight,)) for name, layer in found]

    @override
    def sparsity_chains(self) -> list[list[Tensor]]:
        return _consecutive_chains(self._linear_layers)


class L1Prox(_LayerwiseBase):
    """Proximal SGD on the l1 norm of the chosen layers' weights: soft-thresholding by
    ``lam * lr`` after every real optimizer step (the paper's sparsity baseline).

    Args:
        lam: regularization strength (finite, >= 0); the threshold is ``lam * lr``.
        layers: ``"auto"`` (every ``nn.Linear``) or module names.
        log_every_n_steps, log_metrics, prog_bar, check_finite, log_prefix: see
            :class:`AfterOptimizerStep`.
    """

    def __init__(
        self,
        lam: float,
        layers: str | list[str] = "auto",
        log_every_n_steps: int | None = None,
        log_metrics: bool = True,
        prog_bar: bool = False,
        check_finite: bool = True,
        log_prefix: str = "pathnorm",
    ) -> None:
        super().__init__(layers, log_every_n_steps, log_metrics, prog_bar, check_finite, log_prefix)
        self.lam = _check_nonneg(lam, "lam", "L1Prox")

    @override
    def config(self) -> dict[str, Any]:
        return {"lam": self.lam, **super().config()}

    @override
    def apply(self, target: StepTarget, lr: float) -> None:
        prox_l1_(target.weights[0], self.lam * lr)


class LayerwiseLinfProjection(_LayerwiseBase):
    """Projected SGD with ``||W||_inf <= radius`` per chosen layer: after every real optimizer
    step each row of ``W`` is projected onto the l1 ball of that radius (the paper's layer-wise
    Lipschitz baseline; the product of the radii bounds the network's Lipschitz constant).

    Args:
        radius: the l1 radius of every row (finite, >= 0); independent of the learning rate.
        layers: ``"auto"`` (every ``nn.Linear``) or module names.
        log_every_n_steps, log_metrics, prog_bar, check_finite, log_prefix: see
            :class:`AfterOptimizerStep`.
    """

    def __init__(
        self,
        radius: float,
        layers: str | list[str] = "auto",
        log_every_n_steps: int | None = None,
        log_metrics: bool = True,
        prog_bar: bool = False,
        check_finite: bool = True,
        log_prefix: str = "pathnorm",
    ) -> None:
        super().__init__(layers, log_every_n_steps, log_metrics, prog_bar, check_finite, log_prefix)
        self.radius = _check_nonneg(radius, "radius", "LayerwiseLinfProjection")

    @override
    def config(self) -> dict[str, Any]:
        return {"radius": self.radius, **super().config()}

    @override
    def apply(self, target: StepTarget, lr: float) -> None:
        project_rows_l1_ball_(target.weights[0], self.radius)
