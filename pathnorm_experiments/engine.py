"""The torch engine of the main job: one training loop for ``pathnorm-train --engine loop`` and
the sweep, and each regularizer's torch parts.

:func:`run` trains a :class:`~pathnorm_experiments.settings.TrainConfig`: an SGD step on the
cross-entropy (plus ``lam * g`` for ``method="penalty"``), then for ``method="prox"`` the
library's prox with step ``lr * lam`` (or the row-wise l1-ball projection of radius ``1/lam``
for a constraint). A layer pair's units come from the layer seam (``pathnorm_lightning.layers``),
so the same step serves the conv network. The loop is bare torch (``torch.autograd.grad``,
``torch._foreach_add_``) for the sweep's speed.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import pathnorm_lightning
from pathnorm_experiments.certify import effective_nonzero_fraction, nonzero_fraction
from pathnorm_experiments.data import Dataset
from pathnorm_experiments.draws import shuffle_orders
from pathnorm_experiments.regularizers import REGULARIZERS, regularizer
from pathnorm_experiments.results import History
from pathnorm_experiments.settings import TrainConfig
from pathnorm_experiments.torch_backend import (
    WeightLayer,
    build_network,
    evaluate,
    mean_ce,
    torch_dtype,
    weight_layers,
)
from pathnorm_lightning import layers as seam
from pathnorm_lightning.functional import (
    path_norm,
    project_rows_l1_ball_,
    prox_l1_,
    prox_path_norm_,
)

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback

__all__ = [
    "TORCH",
    "TorchRegularizer",
    "Trained",
    "epoch_objective",
    "penalty",
    "record_sparsity",
    "run",
    "train_loop",
]


def _l1(layers: Sequence[WeightLayer]) -> Tensor:
    return torch.stack([layer.weight.abs().sum() for layer in layers]).sum()


def _path(layers: Sequence[WeightLayer]) -> Tensor:
    terms = []
    for first, second in zip(layers[::2], layers[1::2], strict=True):
        n_units = seam.entry_of(first).units_out(first)
        flatten = seam.flatten_positions(first, second)
        terms.append(path_norm(seam.in_view(first), seam.out_view(second, n_units, flatten)))
    return torch.stack(terms).sum()


def _prox_l1(layers: Sequence[WeightLayer], lam: float, lr: float) -> None:
    for layer in layers:
        prox_l1_(layer.weight, lr * lam)


def _prox_path(layers: Sequence[WeightLayer], lam: float, lr: float) -> None:
    # an nn.Linear's seam views are its weight: skip the seam's lookups (20 us, a tenth of a step)
    for first, second in zip(layers[::2], layers[1::2], strict=True):
        if type(first) is nn.Linear and type(second) is nn.Linear:
            prox_path_norm_(first.weight, second.weight, lr * lam, check_finite=False)
        else:
            seam.prox_pair_(first, second, lr * lam, check_finite=False)


def _project_linf(layers: Sequence[WeightLayer], lam: float, lr: float) -> None:
    for layer in layers:
        if type(layer) is nn.Linear:
            project_rows_l1_ball_(layer.weight, 1.0 / lam)
        else:
            rows = seam.in_view(layer).detach()  # a view of the weight (or a copy, written back)
            project_rows_l1_ball_(rows, 1.0 / lam)
            seam.write_in(layer, rows)


@dataclass(frozen=True)
class TorchRegularizer:
    """A regularizer's torch parts: the differentiable ``g`` (None: ``g = 0``), the in-place
    proximal step ``(layers, lam, lr)`` after an SGD step of size ``lr``, and the library's
    Lightning callback ``(lam, prog_bar)`` doing that step (None: no step)."""

    penalty: Callable[[Sequence[WeightLayer]], Tensor] | None
    prox: Callable[[Sequence[WeightLayer], float, float], None] | None
    callback: Callable[[float, bool], Callback] | None


TORCH: dict[str, TorchRegularizer] = {
    "none": TorchRegularizer(None, None, None),
    # the callbacks import Lightning on first use (pathnorm_lightning's lazy exports)
    "l1": TorchRegularizer(
        _l1, _prox_l1, lambda lam, bar: pathnorm_lightning.L1Prox(lam=lam, prog_bar=bar)
    ),
    "path": TorchRegularizer(
        _path, _prox_path, lambda lam, bar: pathnorm_lightning.PathNormProx(lam=lam, prog_bar=bar)
    ),
    "linf": TorchRegularizer(
        None,
        _project_linf,
        lambda lam, bar: pathnorm_lightning.LayerwiseLinfProjection(radius=1.0 / lam, prog_bar=bar),
    ),
}
if tuple(TORCH) != REGULARIZERS:  # a new row of the table needs its torch parts here
    raise ImportError(f"engine.TORCH covers {tuple(TORCH)}, the table has {REGULARIZERS}")


def penalty(layers: Sequence[WeightLayer], name: str) -> Tensor:
    """Differentiable ``g`` of the regularizer ``name`` (biases excluded; a convolution's
    channels are its units); 0 for none and for a constraint."""
    g = TORCH[regularizer(name).name].penalty
    return layers[0].weight.new_zeros(()) if g is None else g(layers)


def record_sparsity(hist: History, layers: Sequence[WeightLayer]) -> None:
    """Append the raw and the live-path % of nonzero weights to ``hist``."""
    ws = [layer.weight.detach().cpu().numpy() for layer in layers]
    hist.nonzero_pct.append(100.0 * nonzero_fraction(ws))
    hist.effective_nonzero_pct.append(100.0 * effective_nonzero_fraction(ws))


@torch.no_grad()
def epoch_objective(model: nn.Module, cfg: TrainConfig, x: Tensor, y: Tensor) -> float:
    """The regularized objective ``mean CE + lam * g`` on ``(x, y)`` (the curve's per epoch)."""
    g = float(penalty(weight_layers(model), cfg.regularizer))
    return mean_ce(model, x, y) + cfg.lam * g


@dataclass
class Trained:
    """A trained network, its training curve (empty when not recorded) and timings."""

    model: nn.Sequential
    history: History = field(default_factory=History)
    timings: dict[str, float] = field(default_factory=dict)


def _progress_bar(cfg: TrainConfig, total: int, progress: bool) -> Any:
    """A tqdm bar over ``total`` steps, or None (no progress wanted, or tqdm not installed)."""
    if not progress or importlib.util.find_spec("tqdm") is None:  # a bar only: optional
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"{cfg.regularizer}/{cfg.method}", unit="it")


def run(
    cfg: TrainConfig,
    x: Tensor,
    y: Tensor,
    *,
    curve: tuple[Tensor, Tensor] | None = None,
    steps: int | None = None,
    progress: bool = False,
) -> Trained:
    """Train ``cfg``'s network on ``(x, y)`` (inputs (n, 784) in ``cfg.dtype``) on ``x``'s
    device, in the epochs' orders of :func:`~pathnorm_experiments.draws.shuffle_orders`.

    Args:
        curve: record the training curve (every ``cfg.log_every`` steps the mean batch
            objective and the sparsity; per epoch the objective on these examples); None: no
            curve (the sweep), no cost.
        steps: stop after this many steps (benchmarks, calibration); None: ``cfg.epochs``.

    Returns:
        The trained network, its curve and ``{"train_s", "iterations"}``.

    Raises:
        FloatingPointError: a weight became NaN or infinite (checked after every epoch).
    """
    model = build_network(cfg).to(x.device)
    layers = weight_layers(model)
    params: list[Tensor] = list(model.parameters())
    parts = TORCH[cfg.regularizer]
    use_penalty = cfg.method == "penalty" and parts.penalty is not None and cfg.lam > 0
    prox = parts.prox if cfg.method == "prox" and cfg.lam > 0 else None
    n, batch, lam, lr = x.shape[0], cfg.batch_size, cfg.lam, cfg.lr
    orders = shuffle_orders(n, cfg.epochs, cfg.seed)  # as the Keras side's
    out = Trained(model)
    bar = _progress_bar(cfg, cfg.epochs * math.ceil(n / batch), progress)
    t0 = time.perf_counter()
    it, acc, acc_n = 0, 0.0, 0
    model.train()
    for epoch in range(cfg.epochs):
        perm = torch.from_numpy(orders[epoch]).to(x.device)
        for s in range(0, n, batch):
            idx = perm[s : s + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            if use_penalty:
                loss = loss + lam * penalty(layers, cfg.regularizer)
            if curve is not None:
                with torch.no_grad():
                    obj = loss if use_penalty else loss + lam * penalty(layers, cfg.regularizer)
                acc, acc_n = acc + float(obj.detach()), acc_n + 1
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                torch._foreach_add_(params, grads, alpha=-lr)
                if prox is not None:
                    prox(layers, lam, lr)
            it += 1
            if curve is not None and it % cfg.log_every == 0:
                out.history.iteration.append(it)
                out.history.batch_objective.append(acc / acc_n)
                record_sparsity(out.history, layers)
                acc, acc_n = 0.0, 0
                if bar is not None:
                    bar.set_postfix(obj=f"{out.history.batch_objective[-1]:.4f}")
            if bar is not None:
                bar.update(1)
            if steps is not None and it >= steps:
                break
        if steps is not None and it >= steps:
            break
        if not all(bool(torch.isfinite(p).all()) for p in params):
            raise FloatingPointError(
                f"training diverged (NaN/inf weights) at epoch {epoch + 1}; lower --lr or --lam"
            )
        if curve is not None:
            out.history.epoch_objective.append(epoch_objective(model, cfg, *curve))
    if bar is not None:
        bar.close()
    out.timings = {"train_s": time.perf_counter() - t0, "iterations": float(it)}
    return out


def train_loop(
    cfg: TrainConfig, data: Dataset, *, progress: bool = True, evaluate_model: bool = True
) -> tuple[nn.Module, dict[str, Any]]:
    """``pathnorm-train --engine loop``: :func:`run` on ``data``'s training set, recording the
    curve (the objective on the first ``cfg.eval_train_samples`` training images), then
    :func:`~pathnorm_experiments.torch_backend.evaluate`; returns (model, result dict)."""
    dtype = torch_dtype(cfg.dtype)
    x, y = torch.from_numpy(data.x_train).to(dtype), torch.from_numpy(data.y_train)
    curve = (x[: cfg.eval_train_samples], y[: cfg.eval_train_samples])
    trained = run(cfg, x, y, curve=curve, progress=progress)
    if not evaluate_model:
        return trained.model, {"history": trained.history, "timings": trained.timings}
    return trained.model, evaluate(trained.model, cfg, data, trained.history, trained.timings)
