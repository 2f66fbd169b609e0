"""Torch side of the main job: the paper's MLP, (proximal) SGD, PGD and evaluation.

Two training engines share one model, one step semantics and one evaluation:

* :func:`train_loop` — a plain torch loop (used by the lam sweep for speed): SGD step on the
  cross-entropy (plus ``lam * g`` for ``method="penalty"``), then for ``method="prox"`` the
  library's prox with step ``lr * lam`` (``pathnorm_lightning.functional``), or the row-wise
  l1-ball projection of radius ``1/lam`` for ``linf``.
* :func:`train_lightning` — a ``lightning.Trainer`` with the library's callbacks
  (``PathNormProx``, ``L1Prox``, ``LayerwiseLinfProjection``) doing the same after every
  optimizer step. Lightning is imported only there.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from pathnorm_experiments.certify import effective_nonzero_fraction, nonzero_fraction
from pathnorm_experiments.config import (
    History,
    TrainConfig,
    float_key,
    initial_weights,
    shuffle_orders,
)
from pathnorm_experiments.data import Dataset
from pathnorm_experiments.evaluation import build_result
from pathnorm_lightning.functional import (
    path_norm,
    project_rows_l1_ball_,
    prox_l1_,
    prox_path_norm_,
)

__all__ = [
    "apply_prox_",
    "build_model",
    "evaluate",
    "linear_layers",
    "penalty",
    "pgd_attack",
    "record_sparsity",
    "robust_error",
    "torch_dtype",
    "train_loop",
]

_ACTS: dict[str, Callable[[], nn.Module]] = {"elu": nn.ELU, "relu": nn.ReLU, "tanh": nn.Tanh}


def build_model(
    widths: Sequence[int],
    activation: str = "elu",
    *,
    seed: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Sequential:
    """MLP ``Linear -> act -> ... -> Linear``.

    Args:
        widths: layer widths from input to output, e.g. (784, 200, 10).
        activation: ``"elu"``, ``"relu"`` or ``"tanh"``.
        seed: draw the initial weights with
            :func:`~pathnorm_experiments.config.initial_weights` (PyTorch's default
            distribution from a NumPy generator, the draw the Keras backend makes too);
            ``None``: PyTorch's own initialisation from its global generator.
        dtype: the parameters' dtype (the NumPy draw is rounded to it once).

    Returns:
        The model.
    """
    if len(widths) < 2:
        raise ValueError(f"widths needs input and output sizes, got {widths}")
    if activation not in _ACTS:
        raise ValueError(f"activation must be one of {sorted(_ACTS)}, got {activation!r}")
    mods: list[nn.Module] = []
    for i in range(len(widths) - 1):
        if i:
            mods.append(_ACTS[activation]())
        mods.append(nn.Linear(widths[i], widths[i + 1], dtype=dtype))
    model = nn.Sequential(*mods)
    if seed is not None:
        with torch.no_grad():
            for lin, (w, b) in zip(
                linear_layers(model), initial_weights(widths, seed), strict=True
            ):
                lin.weight.copy_(torch.from_numpy(w))
                lin.bias.copy_(torch.from_numpy(b))
    return model


def torch_dtype(name: str) -> torch.dtype:
    """``torch.float32`` or ``torch.float64`` for a :class:`TrainConfig` ``dtype``."""
    return {"float32": torch.float32, "float64": torch.float64}[name]


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    """The model's ``nn.Linear`` layers in forward order."""
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def penalty(layers: Sequence[nn.Linear], regularizer: str) -> Tensor:
    """Differentiable ``g``: l1 = sum |W|, path = sum of pairwise 1-path-norms (biases excluded)."""
    if regularizer in ("none", "linf"):
        return layers[0].weight.new_zeros(())
    if regularizer == "l1":
        return torch.stack([lin.weight.abs().sum() for lin in layers]).sum()
    if regularizer == "path":
        return torch.stack(
            [path_norm(layers[i].weight, layers[i + 1].weight) for i in range(0, len(layers), 2)]
        ).sum()
    raise ValueError(f"unknown regularizer {regularizer!r}")


@torch.no_grad()
def apply_prox_(layers: Sequence[nn.Linear], regularizer: str, lam: float, lr: float) -> None:
    """The proximal step after an SGD step of size ``lr`` (in place, the library's functions)."""
    if regularizer == "none" or lam == 0:
        return
    if regularizer == "l1":
        for lin in layers:
            prox_l1_(lin.weight, lr * lam)
    elif regularizer == "path":
        for i in range(0, len(layers), 2):
            prox_path_norm_(layers[i].weight, layers[i + 1].weight, lr * lam, check_finite=False)
    elif regularizer == "linf":
        for lin in layers:
            project_rows_l1_ball_(lin.weight, 1.0 / lam)
    else:
        raise ValueError(f"unknown regularizer {regularizer!r}")


def record_sparsity(hist: History, layers: Sequence[nn.Linear]) -> None:
    """Append the raw and the live-path % of nonzero weights to ``hist``."""
    ws = [lin.weight.detach().cpu().numpy() for lin in layers]
    hist.nonzero_pct.append(100.0 * nonzero_fraction(ws))
    hist.effective_nonzero_pct.append(100.0 * effective_nonzero_fraction(ws))


@torch.no_grad()
def _mean_ce(model: nn.Module, x: Tensor, y: Tensor, chunk: int = 10000) -> float:
    total = 0.0
    for s in range(0, x.shape[0], chunk):
        total += float(F.cross_entropy(model(x[s : s + chunk]), y[s : s + chunk], reduction="sum"))
    return total / x.shape[0]


def pgd_attack(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    eps: float,
    *,
    steps: int = 40,
    step_size: float | None = None,
    random_start: bool = True,
    loss: str = "ce",
    generator: torch.Generator | None = None,
) -> Tensor:
    """l_inf PGD (Madry et al.): ascent on ``loss`` by signed gradients, projected on the eps-box
    around ``x`` intersected with [0, 1]. Default step ``eps / 20`` as in the paper.

    ``loss``: ``"ce"`` (cross-entropy, the paper's attack) or ``"margin"`` (Carlini-Wagner
    margin ``max_{j != y} z_j - z_y``).
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if loss not in ("ce", "margin"):
        raise ValueError(f"loss must be 'ce' or 'margin', got {loss!r}")
    step = eps / 20 if step_size is None else step_size
    x = x.detach()
    lo, hi = (x - eps).clamp_min(0), (x + eps).clamp_max(1)
    if random_start:
        noise = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        x_adv = torch.min(torch.max(x + (2 * noise - 1) * eps, lo), hi)
    else:
        x_adv = x.clone()
    for _ in range(steps):
        x_adv.requires_grad_(True)
        z = model(x_adv)
        if loss == "ce":
            obj = F.cross_entropy(z, y, reduction="sum")
        else:
            zy = z.gather(1, y[:, None])[:, 0]
            other = z.masked_fill(F.one_hot(y, z.shape[1]).bool(), -math.inf).amax(1)
            obj = (other - zy).sum()
        (grad,) = torch.autograd.grad(obj, x_adv)
        x_adv = torch.min(torch.max(x_adv.detach() + step * grad.sign(), lo), hi)
    return x_adv.detach()


def robust_error(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    eps: float,
    *,
    steps: int = 40,
    restarts: int = 1,
    loss: str = "ce",
    step_size: float | None = None,
    seed: int = 0,
    chunk: int = 2000,
    return_mask: bool = False,
) -> Any:
    """Fraction of examples misclassified at ``x`` or at any PGD restart's adversarial point."""
    g = torch.Generator(device=x.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    wrong = []
    for s in range(0, x.shape[0], chunk):
        xb, yb = x[s : s + chunk], y[s : s + chunk]
        with torch.no_grad():
            w = model(xb).argmax(1) != yb
        if eps > 0:
            for _ in range(restarts):
                xa = pgd_attack(
                    model, xb, yb, eps, steps=steps, loss=loss, generator=g, step_size=step_size
                )
                with torch.no_grad():
                    w |= model(xa).argmax(1) != yb
        wrong.append(w)
    model.train(was_training)
    mask = torch.cat(wrong)
    return mask if return_mask else float(mask.double().mean())


def _weights_numpy(model: nn.Module) -> tuple[list[np.ndarray], list[np.ndarray]]:
    layers = linear_layers(model)
    return (
        [lin.weight.detach().cpu().numpy().copy() for lin in layers],
        [lin.bias.detach().cpu().numpy().copy() for lin in layers],
    )


def evaluate(
    model: nn.Module,
    cfg: TrainConfig,
    data: Dataset,
    history: History,
    timings: dict[str, float],
) -> dict[str, Any]:
    """Clean, PGD-robust and certified errors, bounds, sparsity and the final objective."""
    t0 = time.perf_counter()
    model.eval()
    dtype = torch_dtype(cfg.dtype)
    x_te, y_te = torch.from_numpy(data.x_test).to(dtype), torch.from_numpy(data.y_test)
    with torch.no_grad():
        wrong_clean = model(x_te).argmax(1) != y_te
    n_adv = x_te.shape[0] if cfg.pgd_samples is None else min(cfg.pgd_samples, x_te.shape[0])
    xa, ya = x_te[:n_adv], y_te[:n_adv]
    robust = {}
    for e in cfg.eps:
        wrong = robust_error(model, xa, ya, e, steps=cfg.pgd_steps, seed=cfg.seed, return_mask=True)
        if cfg.attack == "ce+margin":
            wrong |= robust_error(
                model,
                xa,
                ya,
                e,
                steps=cfg.pgd_steps,
                seed=cfg.seed + 1,
                loss="margin",
                return_mask=True,
            )
        robust[float_key(e)] = float(wrong.double().mean())  # exact k/n, as NumPy gives
    x_tr, y_tr = torch.from_numpy(data.x_train).to(dtype), torch.from_numpy(data.y_train)
    if cfg.eval_train_samples is not None:
        x_tr, y_tr = x_tr[: cfg.eval_train_samples], y_tr[: cfg.eval_train_samples]
    ce = _mean_ce(model, x_tr, y_tr)
    weights, biases = _weights_numpy(model)
    timings["eval_s"] = time.perf_counter() - t0
    return build_result(
        cfg,
        data,
        weights,
        biases,
        clean_error=float(wrong_clean.double().mean()),
        clean_error_attacked=float(wrong_clean[:n_adv].double().mean()),
        robust_error=robust,
        train_ce=ce,
        n_adv=n_adv,
        history=history,
        timings=timings,
        backend="torch",
    )


def _progress_bar(cfg: TrainConfig, total: int, progress: bool) -> Any:
    """A tqdm bar over ``total`` steps, or None (no progress wanted, or tqdm not installed)."""
    if not progress or importlib.util.find_spec("tqdm") is None:  # a bar only: optional
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"{cfg.regularizer}/{cfg.method}", unit="it")


def _loop_step(
    model: nn.Module,
    layers: Sequence[nn.Linear],
    opt: torch.optim.Optimizer,
    cfg: TrainConfig,
    xb: Tensor,
    yb: Tensor,
) -> float:
    """One minibatch: SGD on the CE (plus ``lam * g`` for a penalty), then the prox if any.

    Args:
        model: the MLP.
        layers: its linear layers.
        opt: its SGD optimizer.
        cfg: regularizer, method, lam, lr.
        xb: the batch's inputs.
        yb: their labels.

    Returns:
        The batch's regularized objective ``ce + lam * g`` before the step.
    """
    ce = F.cross_entropy(model(xb), yb)
    reg = penalty(layers, cfg.regularizer)
    obj = ce + cfg.lam * reg
    opt.zero_grad(set_to_none=True)
    (obj if cfg.method == "penalty" and cfg.regularizer != "none" else ce).backward()
    opt.step()
    if cfg.method == "prox":
        apply_prox_(layers, cfg.regularizer, cfg.lam, cfg.lr)
    return float(obj.detach())


def _end_epoch(
    model: nn.Module,
    layers: Sequence[nn.Linear],
    cfg: TrainConfig,
    epoch: int,
    x_eval: Tensor,
    y_eval: Tensor,
    hist: History,
) -> None:
    """Stop on non-finite weights; else record the epoch's objective on the evaluation sample."""
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise FloatingPointError(
            f"training diverged (NaN/inf weights) at epoch {epoch + 1}; lower --lr or --lam"
        )
    with torch.no_grad():
        g = float(penalty(layers, cfg.regularizer))
    hist.epoch_objective.append(_mean_ce(model, x_eval, y_eval) + cfg.lam * g)


def train_loop(
    cfg: TrainConfig,
    data: Dataset,
    *,
    progress: bool = True,
    evaluate_model: bool = True,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train with a plain torch loop (see module docstring); returns (model, result dict)."""
    torch.manual_seed(cfg.seed)
    dtype = torch_dtype(cfg.dtype)
    model = build_model(cfg.widths, cfg.activation, seed=cfg.seed, dtype=dtype)
    layers = linear_layers(model)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    x, y = torch.from_numpy(data.x_train).to(dtype), torch.from_numpy(data.y_train)
    x_eval, y_eval = x, y
    if cfg.eval_train_samples is not None:
        x_eval, y_eval = x[: cfg.eval_train_samples], y[: cfg.eval_train_samples]
    n = x.shape[0]
    orders = torch.from_numpy(shuffle_orders(n, cfg.epochs, cfg.seed))  # as the Keras side's
    hist = History()
    bar = _progress_bar(cfg, cfg.epochs * math.ceil(n / cfg.batch_size), progress)
    t0 = time.perf_counter()
    it = 0
    acc, acc_n = 0.0, 0
    model.train()
    for epoch in range(cfg.epochs):
        perm = orders[epoch]
        for s in range(0, n, cfg.batch_size):
            idx = perm[s : s + cfg.batch_size]
            acc += _loop_step(model, layers, opt, cfg, x[idx], y[idx])
            acc_n += 1
            it += 1
            if it % cfg.log_every == 0:
                hist.iteration.append(it)
                hist.batch_objective.append(acc / acc_n)
                record_sparsity(hist, layers)
                acc, acc_n = 0.0, 0
                if bar is not None:
                    bar.set_postfix(obj=f"{hist.batch_objective[-1]:.4f}")
            if bar is not None:
                bar.update(1)
        _end_epoch(model, layers, cfg, epoch, x_eval, y_eval, hist)
    if bar is not None:
        bar.close()
    timings = {"train_s": time.perf_counter() - t0, "iterations": float(it)}
    if not evaluate_model:
        return model, {"history": hist, "timings": timings}
    return model, evaluate(model, cfg, data, hist, timings)
