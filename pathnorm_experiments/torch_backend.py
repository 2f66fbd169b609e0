"""Torch side of the main job: the paper's MLP or its convolutional twin, (proximal) SGD, PGD
and evaluation.

Two training engines share one model, one step semantics and one evaluation:

* :func:`train_loop` — a plain torch loop (used by the lam sweep for speed): SGD step on the
  cross-entropy (plus ``lam * g`` for ``method="penalty"``), then for ``method="prox"`` the
  library's prox with step ``lr * lam`` (``pathnorm_lightning.functional``), or the row-wise
  l1-ball projection of radius ``1/lam`` for ``linf``; a layer pair's units come from the
  layer seam (``pathnorm_lightning.layers``), so the same step serves the conv network.
* :func:`train_lightning` — a ``lightning.Trainer`` with the library's callbacks
  (``PathNormProx``, ``L1Prox``, ``LayerwiseLinfProjection``) doing the same after every
  optimizer step. Lightning is imported only there.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, cast

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from pathnorm_experiments.certify import (
    ConvLayer,
    Layer,
    effective_nonzero_fraction,
    nonzero_fraction,
)
from pathnorm_experiments.data import Dataset
from pathnorm_experiments.draws import initial_layer_weights, initial_weights, shuffle_orders
from pathnorm_experiments.evaluation import build_result
from pathnorm_experiments.results import History
from pathnorm_experiments.settings import IMAGE_SHAPE, N_CLASSES, TrainConfig, float_key
from pathnorm_lightning import layers as seam
from pathnorm_lightning.functional import path_norm, project_rows_l1_ball_, prox_l1_

__all__ = [
    "apply_prox_",
    "build_conv_model",
    "build_model",
    "build_network",
    "evaluate",
    "linear_layers",
    "numpy_layers",
    "penalty",
    "pgd_attack",
    "record_sparsity",
    "robust_error",
    "torch_dtype",
    "train_loop",
    "weight_layers",
]

_ACTS: dict[str, Callable[[], nn.Module]] = {"elu": nn.ELU, "relu": nn.ReLU, "tanh": nn.Tanh}

#: a layer of the layer seam (``pathnorm_lightning.layers``): a weight and a bias
WeightLayer: TypeAlias = "nn.Linear | nn.modules.conv._ConvNd"


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
            :func:`~pathnorm_experiments.draws.initial_weights` (PyTorch's default
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
        _load_initial(model, initial_weights(widths, seed))
    return model


def build_conv_model(
    channels: int,
    kernel_size: int = 5,
    stride: int = 2,
    activation: str = "elu",
    *,
    seed: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Sequential:
    """The paper's network with a convolution for its hidden layer, on flat 784-pixel inputs:
    ``Unflatten(1, 28, 28) -> Conv2d(1, channels, kernel_size, stride) -> act -> Flatten ->
    Linear(channels * positions, 10)``. No padding: the pair's ``R`` is the unrolled network's
    1-path-norm (docs/conv_units.md).

    Args:
        channels: the convolution's output channels (its hidden units).
        kernel_size: its square kernel.
        stride: its stride.
        activation: ``"elu"``, ``"relu"`` or ``"tanh"``.
        seed: draw the initial weights with
            :func:`~pathnorm_experiments.draws.initial_layer_weights` (PyTorch's default
            distribution, the draw the Keras backend makes too); ``None``: PyTorch's own.
        dtype: the parameters' dtype.

    Returns:
        The model.
    """
    if activation not in _ACTS:
        raise ValueError(f"activation must be one of {sorted(_ACTS)}, got {activation!r}")
    cfg = TrainConfig(  # checks the geometry and computes the shapes
        model="conv", hidden=(channels,), kernel_size=kernel_size, stride=stride
    )
    conv = nn.Conv2d(IMAGE_SHAPE[0], channels, kernel_size, stride=stride, dtype=dtype)
    model = nn.Sequential(
        nn.Unflatten(1, IMAGE_SHAPE),
        conv,
        _ACTS[activation](),
        nn.Flatten(),
        nn.Linear(cfg.widths[1], N_CLASSES, dtype=dtype),
    )
    if seed is not None:
        _load_initial(model, initial_layer_weights(cfg.weight_shapes, seed))
    return model


def build_network(cfg: TrainConfig) -> nn.Sequential:
    """``cfg``'s network (``cfg.model``: the MLP or the conv network), seeded with ``cfg.seed``,
    in ``cfg.dtype``."""
    dtype = torch_dtype(cfg.dtype)
    if cfg.model == "conv":
        return build_conv_model(
            cfg.hidden[0], cfg.kernel_size, cfg.stride, cfg.activation, seed=cfg.seed, dtype=dtype
        )
    return build_model(cfg.widths, cfg.activation, seed=cfg.seed, dtype=dtype)


def _load_initial(model: nn.Module, draw: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy a NumPy draw (weight, bias per layer, torch layout) into the weight layers."""
    with torch.no_grad():
        for layer, (w, b) in zip(weight_layers(model), draw, strict=True):
            layer.weight.copy_(torch.from_numpy(w))
            cast(Tensor, layer.bias).copy_(torch.from_numpy(b))


def torch_dtype(name: str) -> torch.dtype:
    """``torch.float32`` or ``torch.float64`` for a :class:`TrainConfig` ``dtype``."""
    return {"float32": torch.float32, "float64": torch.float64}[name]


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    """The model's ``nn.Linear`` layers in forward order."""
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def weight_layers(model: nn.Module) -> list[WeightLayer]:
    """The model's layers of the layer seam (``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d``) in
    forward (module) order: the layers the regularizers act on."""
    return [cast(WeightLayer, m) for m in model.modules() if isinstance(m, tuple(seam.ENTRIES))]


def _pair_path_norm(first: nn.Module, second: nn.Module) -> Tensor:
    """``R`` of a layer pair from the seam's views (differentiable)."""
    n_units = seam.entry_of(first).units_out(first)
    flatten = seam.flatten_positions(first, second)
    return path_norm(seam.in_view(first), seam.out_view(second, n_units, flatten))


def penalty(layers: Sequence[WeightLayer], regularizer: str) -> Tensor:
    """Differentiable ``g``: l1 = sum |W|, path = sum of pairwise 1-path-norms (biases
    excluded; a convolution's channels are its units)."""
    if regularizer in ("none", "linf"):
        return layers[0].weight.new_zeros(())
    if regularizer == "l1":
        return torch.stack([layer.weight.abs().sum() for layer in layers]).sum()
    if regularizer == "path":
        return torch.stack(
            [_pair_path_norm(layers[i], layers[i + 1]) for i in range(0, len(layers), 2)]
        ).sum()
    raise ValueError(f"unknown regularizer {regularizer!r}")


@torch.no_grad()
def apply_prox_(layers: Sequence[WeightLayer], regularizer: str, lam: float, lr: float) -> None:
    """The proximal step after an SGD step of size ``lr`` (in place, the library's functions;
    the path prox and the linf rows through the layer seam)."""
    if regularizer == "none" or lam == 0:
        return
    if regularizer == "l1":
        for layer in layers:
            prox_l1_(layer.weight, lr * lam)
    elif regularizer == "path":
        for i in range(0, len(layers), 2):
            seam.prox_pair_(layers[i], layers[i + 1], lr * lam, check_finite=False)
    elif regularizer == "linf":
        for layer in layers:
            rows = seam.in_view(layer).detach()  # a view of the weight (or a copy, written back)
            project_rows_l1_ball_(rows, 1.0 / lam)
            seam.write_in(layer, rows)
    else:
        raise ValueError(f"unknown regularizer {regularizer!r}")


def record_sparsity(hist: History, layers: Sequence[WeightLayer]) -> None:
    """Append the raw and the live-path % of nonzero weights to ``hist``."""
    ws = [layer.weight.detach().cpu().numpy() for layer in layers]
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


def numpy_layers(model: nn.Module, n_inputs: int = 784) -> tuple[list[Layer], list[np.ndarray]]:
    """The weight layers as :mod:`~pathnorm_experiments.certify` takes them, with the biases:
    a Linear weight (out, in); an ``nn.Conv2d`` as a :class:`~pathnorm_experiments.certify.
    ConvLayer` of the input grid one forward pass on ``n_inputs`` zeros shows.

    Raises:
        ValueError: a convolution the certificates do not take (groups, dilation, a padding
            other than zeros given as numbers), or a layer that is neither.
    """
    grids: dict[nn.Module, tuple[int, ...]] = {}
    layers = weight_layers(model)

    def record(module: nn.Module, args: tuple[Tensor, ...]) -> None:
        grids[module] = tuple(args[0].shape[1:])

    hooks = [m.register_forward_pre_hook(record) for m in layers if isinstance(m, nn.Conv2d)]
    try:
        p = next(model.parameters())
        with torch.no_grad():
            model(torch.zeros(1, n_inputs, dtype=p.dtype, device=p.device))
    finally:
        for hook in hooks:
            hook.remove()
    out: list[Layer] = []
    for layer in layers:
        w = layer.weight.detach().cpu().numpy().copy()
        if isinstance(layer, nn.Conv2d):
            if (
                layer.groups != 1
                or layer.dilation != (1, 1)
                or isinstance(layer.padding, str)
                or layer.padding_mode != "zeros"
            ):
                raise ValueError(
                    "the certificates take convolutions with groups=1, dilation=1 and numeric "
                    f"zero padding, got {layer}"
                )
            c_in, height, width = grids[layer]
            padding = cast(tuple[int, ...], layer.padding)
            out.append(ConvLayer(w, (c_in, height, width), layer.stride, padding))
        elif isinstance(layer, nn.Linear):
            out.append(w)
        else:
            raise ValueError(f"the certificates do not take a {type(layer).__name__}")
    return out, [cast(Tensor, layer.bias).detach().cpu().numpy().copy() for layer in layers]


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
    weights, biases = numpy_layers(model, x_te.shape[1])
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
    layers: Sequence[WeightLayer],
    opt: torch.optim.Optimizer,
    cfg: TrainConfig,
    xb: Tensor,
    yb: Tensor,
) -> float:
    """One minibatch: SGD on the CE (plus ``lam * g`` for a penalty), then the prox if any.

    Args:
        model: the network.
        layers: its weight layers.
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
    layers: Sequence[WeightLayer],
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
    model = build_network(cfg)
    layers = weight_layers(model)
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
