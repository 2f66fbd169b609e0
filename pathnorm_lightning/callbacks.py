"""Lightning callbacks that apply a prox (or projection) right after every real optimizer step.

``PathNormProx`` applies the exact 1-path-norm prox to layer pairs (``nn.Linear``,
``nn.Conv1d``, ``nn.Conv2d``: the layer seam of :mod:`pathnorm_lightning.layers`); ``L1Prox``
and ``LayerwiseLinfProjection`` are the paper's layer-wise baselines. All three run through the
step post-hook of :mod:`pathnorm_lightning.hook` (the one :func:`~pathnorm_lightning.attach`
gives plain PyTorch and Fabric loops), so each runs exactly once per real ``optimizer.step()``:
automatic and manual optimization, raw torch optimizers stepped in ``training_step``, several
optimizers, gradient accumulation (one step per window), steps skipped by AMP's ``GradScaler``
(no step, no prox), optimizers re-created during a fit (followed from the next batch), and
repeated ``fit()`` calls (no duplicated or leaked hooks). The prox step is ``lam * lr``, ``lr``
read at every step from the parameter group holding the weights.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from pathnorm_lightning._common import check_scalar
from pathnorm_lightning.functional import project_rows_l1_ball_, prox_l1_
from pathnorm_lightning.hook import (
    FiniteCheck,
    StepHook,
    StepTarget,
    _prefixed,
    forward_check,
    pair_target,
    prox_pair,
)
from pathnorm_lightning.pairing import (
    ForwardCheck,
    LayerPair,
    chain_check,
    chains,
    compiled_chain_links,
    layer_chain,
    normalize_layers,
    normalize_pairs,
    resolve_layers,
    resolve_pairs,
    weight_parameter,
)

__all__ = [
    "AfterOptimizerStep",
    "FiniteCheck",
    "L1Prox",
    "LayerwiseLinfProjection",
    "PathNormProx",
    "StepTarget",
]

_SHARDED_STRATEGIES = (
    "FSDPStrategy",
    "DeepSpeedStrategy",
    "ModelParallelStrategy",
    "XLAFSDPStrategy",
)


def _check_nonneg(value: Any, name: str, owner: str) -> float:
    """A finite number >= 0 as a plain float (Python, NumPy and 0-d tensor reals)."""
    return _prefixed(owner, lambda v: check_scalar(v, name), value)


class AfterOptimizerStep(Callback):
    """Base class: run :meth:`apply` on each target right after every real optimizer step.

    Subclasses define :meth:`resolve_targets` (which weights), :meth:`apply` (what to do with
    them given the learning rate) and :meth:`sparsity_chains` (which weights the sparsity
    metric covers), and may define :meth:`forward_check`. The step mechanics are a
    :class:`~pathnorm_lightning.hook.StepHook`, registered in ``on_fit_start`` (moved to the
    trainer's new optimizers before the next batch when they are re-created) and removed in
    ``on_fit_end`` / ``teardown`` / ``on_exception``; logging and checkpoint state live here.

    Args:
        log_every_n_steps: log the metrics every this many optimizer steps; ``None`` follows the
            trainer's ``log_every_n_steps`` (at the steps where Lightning flushes its logs).
        log_metrics: log ``pathnorm/sparsity``, ``pathnorm/alive_units``,
            ``pathnorm/path_norm_bound`` and ``pathnorm/product_bound``.
        prog_bar: also show the metrics in the progress bar.
        check_finite: raise :class:`~pathnorm_lightning.NonFiniteWeightsError` (a
            ``ValueError``) when a regularized weight is NaN/inf after an optimizer step: on CPU
            at that step (free in the compiled prox); on CUDA a few steps later at most, without
            stalling the GPU (the flag reaches the host asynchronously; read at the latest at
            the epoch's end or before a checkpoint is saved). ``False``: not checked.
        log_prefix: the metrics' name prefix (``"pathnorm"``: ``pathnorm/sparsity``, ...). The
            baselines log under the same names, so runs compare directly; two such callbacks in
            one ``Trainer`` need different prefixes (checked at fit start).
        targets: the subclass's layer spec (``"auto"`` or names); it names the callback's
            checkpoint state when explicit, so several instances keep their own.
    """

    #: Warn when an update leaves a pair no hidden unit (see :class:`StepHook`).
    watch_units = False
    #: What the update regularizes: two callbacks (or an ``attach``) with the same penalty may
    #: not act on one weight after the same optimizer's steps (see :class:`StepHook`).
    penalty = "update"

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        log_metrics: bool = True,
        prog_bar: bool = False,
        check_finite: bool = True,
        log_prefix: str = "pathnorm",
        targets: Any = "auto",
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
        self.log_prefix = log_prefix
        self.targets_spec = targets
        self._hook: StepHook | None = None
        self._last_hook: StepHook | None = None  # the latest fit's hook, for metrics after it
        self._followed: list[Any] = []  # the trainer's optimizers the hook follows
        self._num_steps = 0  # real optimizer steps acted on (all fits), while no hook runs
        self._last_logged_step = -1

    # --- to be defined by subclasses -------------------------------------------------------
    def resolve_targets(self, pl_module: pl.LightningModule) -> list[StepTarget]:
        """The layers or pairs to act on (called at fit start, after ``configure_model``)."""
        raise NotImplementedError

    def apply(self, target: StepTarget, lr: float, check: FiniteCheck) -> None:
        """Update ``target.weights`` in place after an optimizer step with learning rate ``lr``,
        checking their finiteness with ``check`` (a :class:`~pathnorm_lightning.FiniteCheck`)."""
        raise NotImplementedError

    def sparsity_chains(self) -> list[list[Tensor | nn.Module]]:
        """Chains (forward order) of weights or of layers (their ``weight`` read when the metrics
        are computed) whose zeros and hidden units the sparsity metric counts."""
        raise NotImplementedError

    def forward_check(self) -> ForwardCheck | None:
        """What verifies the targets against the forward passes before the first step (called
        after :meth:`resolve_targets`; None: nothing to verify)."""
        return None

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
    def num_steps(self) -> int:
        """Real optimizer steps this callback has acted on (all fits, restored on resume)."""
        return self._hook.num_steps if self._hook is not None else self._num_steps

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        self._num_steps = value
        if self._hook is not None:
            self._hook.num_steps = value

    @property
    @override
    def state_key(self) -> str:
        # Several instances of one class (e.g. a different lam per pair) keep their own state:
        # explicit layers are named in the key ("auto" keeps the class name, as in older
        # checkpoints). Lightning reads it around every hook of every batch: cached per spec.
        spec = self.targets_spec
        cached = self.__dict__.get("_state_key")
        if cached is not None and cached[0] is spec:
            return cached[1]
        key = (
            type(self).__qualname__
            if spec == "auto"
            else self._generate_state_key(targets=_normalize(spec))
        )
        self._state_key = (spec, key)
        return key

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
        self._remove_hook()  # idempotent: a previous fit that died without cleanup
        if self.log_metrics:
            self._check_unique_prefix(trainer)
        targets = _prefixed(type(self).__name__, self.resolve_targets, pl_module)
        chain = layer_chain(pl_module)
        self._hook = self._last_hook = StepHook(
            trainer.optimizers,
            targets,
            self.apply,
            check_finite=self.check_finite,
            owner=type(self).__name__,
            sparsity_chains=self.sparsity_chains(),
            chain=chain,
            num_steps=self._num_steps,
            penalty=self.penalty,
            watch_units=self.watch_units,
            forward_check=self.forward_check(),
            chain_check=chain_check(pl_module, warn=self.log_metrics),
            root=pl_module,
        )
        self._followed = list(trainer.optimizers)
        if self.log_metrics and chain is None and not compiled_chain_links(pl_module):
            # (links hidden by torch.compile: chain_check said why the bounds are left out)
            rank_zero_warn(
                f"{type(self).__name__}: the Linear and convolution layers of "
                f"{type(pl_module).__name__} do not form a chain (a layer does not read exactly "
                "the outputs of the one before it), so the network bounds "
                "pathnorm/path_norm_bound and pathnorm/product_bound are not logged."
            )
        self._last_logged_step = -1

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hook = self._hook
        self._remove_hook()
        if hook is not None:
            hook.flush()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush()

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._flush()  # never save weights a pending check would reject

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hook()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._remove_hook()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Optimizers re-created since (strategy.setup_optimizers(trainer): a reset between
        # stages) are followed from now on. Runs before every batch: a list identity compare.
        if self._hook is not None and trainer.optimizers != self._followed:
            self._hook.follow(trainer.optimizers)
            self._followed = list(trainer.optimizers)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self.log_metrics or self._hook is None or not self._hook.targets:
            return
        if trainer.log_every_n_steps == 0 and self.log_every_n_steps is None:  # type: ignore[attr-defined]
            return  # the trainer's interval, which is "never" (an own one still holds)
        # Runs after every batch: the cheapest test first (all must hold).
        step = trainer.global_step
        if self.log_every_n_steps is None:
            # The trainer's own flush condition, as Lightning's LearningRateMonitor uses it.
            if not trainer._logger_connector.should_update_logs:
                return
        elif step % self.log_every_n_steps:
            return
        if pl_module.automatic_optimization and trainer.fit_loop._should_accumulate():
            return  # no step on this batch (as Lightning's own step logging)
        if step != self._last_logged_step:
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
    def metric_values(self) -> dict[str, float]:
        """Current metric values as Python floats, keyed by their logged names
        (``pathnorm/sparsity``, ...); after ``fit``, those of the weights it trained, computed
        now (empty before the first fit)."""
        if self._last_hook is None:
            return {}
        return {f"{self.log_prefix}/{k}": v for k, v in self._last_hook.metrics().items()}

    def log_metric_values(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log :meth:`metric_values` (identical on every rank: the weights are replicated, so no
        ``sync_dist``).

        As ``LearningRateMonitor`` does, the values go to every logger directly, at Lightning's
        step (its loggers write on rank zero only), and into ``trainer.callback_metrics`` (for
        ``ModelCheckpoint`` and ``EarlyStopping``). ``pl_module.log`` (about 0.3 ms per value on
        CPU) runs only with ``prog_bar=True``, for the progress bar.
        """
        scalars = self.metric_values()
        if self.prog_bar:
            for name, value in scalars.items():
                pl_module.log(
                    name, value, on_step=True, on_epoch=False, prog_bar=True, logger=False,
                    batch_size=1,
                )  # fmt: skip
        # float32 tensors, as Lightning keeps logged values
        trainer.callback_metrics.update(
            {n: torch.tensor(v, dtype=torch.float32) for n, v in scalars.items()}
        )
        if trainer.loggers:
            # The step axis Lightning's own step-level logging uses.
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=step)

    # --- mechanics ---------------------------------------------------------------------
    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._num_steps = self._hook.num_steps
            self._hook.remove()
            self._hook = None
            self._followed = []

    def _flush(self) -> None:
        if self._hook is not None:
            self._hook.flush()

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


def _normalize(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    return value


class PathNormProx(AfterOptimizerStep):
    """Proximal SGD on the 1-path-norm: after every real optimizer step, apply the exact prox
    of ``lam * lr * sum_pairs path_norm(first.weight, second.weight)`` to every pair.

    Biases are untouched. A pair's two weights must sit in one optimizer, in parameter groups
    of equal learning rates at each step (the prox needs one step size), else ``ValueError``.

    Example::

        trainer = Trainer(callbacks=[PathNormProx(lam=1e-3)])

    Args:
        lam: regularization strength lambda (finite, >= 0); the prox step is ``lam * lr``.
        pairs: ``"auto"`` pairs the ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` layers in
            module order, (L1, L2), (L3, L4), ...; or explicit ``[("encoder.0", "encoder.2"),
            ...]`` module names. A convolution's output channels are its hidden units.
        log_every_n_steps, log_metrics, prog_bar, check_finite, log_prefix: see
            :class:`AfterOptimizerStep`.
    """

    watch_units = True
    penalty = "path-norm"

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
        self.lam = _check_nonneg(lam, "lam", "PathNormProx")
        self.pairs = _prefixed("PathNormProx", normalize_pairs, pairs)
        super().__init__(
            log_every_n_steps, log_metrics, prog_bar, check_finite, log_prefix, self.pairs
        )
        self._layer_pairs: list[LayerPair] = []

    @override
    def config(self) -> dict[str, Any]:
        return {"lam": self.lam, "pairs": self.pairs, **super().config()}

    @override
    def resolve_targets(self, pl_module: pl.LightningModule) -> list[StepTarget]:
        self._layer_pairs = resolve_pairs(pl_module, self.pairs)
        return [pair_target(p) for p in self._layer_pairs]

    @override
    def apply(self, target: StepTarget, lr: float, check: FiniteCheck) -> None:
        prox_pair(target, self.lam * lr, check)

    @override
    def sparsity_chains(self) -> list[list[Tensor | nn.Module]]:
        return [[p.first, p.second] for p in self._layer_pairs]

    @override
    def forward_check(self) -> ForwardCheck | None:
        return forward_check(self._layer_pairs)


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
        self.layers = _prefixed(type(self).__name__, normalize_layers, layers)
        super().__init__(
            log_every_n_steps, log_metrics, prog_bar, check_finite, log_prefix, self.layers
        )
        self._layers: list[nn.Module] = []

    @override
    def config(self) -> dict[str, Any]:
        return {"layers": self.layers, **super().config()}

    @override
    def resolve_targets(self, pl_module: pl.LightningModule) -> list[StepTarget]:
        found = resolve_layers(pl_module, self.layers)
        self._layers = [layer for _, layer in found]
        return [
            StepTarget(f"layer {name!r}", (weight_parameter(name, layer),), ((name, layer),), True)
            for name, layer in found
        ]

    @override
    def sparsity_chains(self) -> list[list[Tensor | nn.Module]]:
        # the layers in order, split into maximal runs whose units chain
        runs: list[list[Tensor | nn.Module]] = []
        previous: nn.Module | None = None
        for layer in self._layers:
            if previous is not None and chains(previous, layer):
                runs[-1].append(layer)
            else:
                runs.append([layer])
            previous = layer
        return runs


class L1Prox(_LayerwiseBase):
    """Proximal SGD on the l1 norm of the chosen layers' weights: soft-thresholding by
    ``lam * lr`` after every real optimizer step (the paper's sparsity baseline).

    Args:
        lam: regularization strength (finite, >= 0); the threshold is ``lam * lr``.
        layers: ``"auto"`` (every ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d``) or module
            names.
        log_every_n_steps, log_metrics, prog_bar, check_finite, log_prefix: see
            :class:`AfterOptimizerStep`.
    """

    penalty = "l1"

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
    def apply(self, target: StepTarget, lr: float, check: FiniteCheck) -> None:
        check(target)
        prox_l1_(target.weights[0], self.lam * lr, check_finite=False)  # checked


class LayerwiseLinfProjection(_LayerwiseBase):
    """Projected SGD with ``||W||_inf <= radius`` per chosen layer: after every real optimizer
    step each row of ``W`` is projected onto the l1 ball of that radius (the paper's layer-wise
    Lipschitz baseline; the product of the radii bounds the network's Lipschitz constant).

    For a convolution the rows are output channels (``weight[c]`` flattened, the seam's
    ``in_view``). Every row of the unrolled convolution holds some of those weights, so its
    l_inf operator norm is at most ``radius`` too.

    Args:
        radius: the l1 radius of every row (finite, >= 0); independent of the learning rate.
        layers: ``"auto"`` (every ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d``) or module
            names.
        log_every_n_steps, log_metrics, prog_bar, check_finite, log_prefix: see
            :class:`AfterOptimizerStep`.
    """

    penalty = "linf-ball"

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
    def apply(self, target: StepTarget, lr: float, check: FiniteCheck) -> None:
        check(target)
        if target.views is None:  # a target built by hand: its weight is the matrix
            project_rows_l1_ball_(target.weights[0], self.radius, check_finite=False)
            return
        (rows,) = target.views.matrices(target.weights)
        project_rows_l1_ball_(rows, self.radius, check_finite=False)  # checked
        target.views.write_back(target.weights, (rows,))
