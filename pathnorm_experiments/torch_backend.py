"""Torch side of the main job: the paper's MLP or its convolutional twin, its layers as the
certificates take them, and the evaluation of a trained network (clean, PGD-robust and certified
errors). Training is :mod:`~pathnorm_experiments.engine`'s or
:mod:`~pathnorm_experiments.lightning_module`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeAlias, cast

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from pathnorm_experiments.attacks_torch import robust_error
from pathnorm_experiments.certify import ConvLayer, Layer
from pathnorm_experiments.data import Dataset
from pathnorm_experiments.draws import initial_layer_weights, initial_weights
from pathnorm_experiments.evaluation import build_result
from pathnorm_experiments.results import History
from pathnorm_experiments.settings import IMAGE_SHAPE, N_CLASSES, TrainConfig, float_key
from pathnorm_lightning import layers as seam

__all__ = [
    "WeightLayer",
    "build_conv_model",
    "build_model",
    "build_network",
    "evaluate",
    "linear_layers",
    "mean_ce",
    "numpy_layers",
    "torch_dtype",
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
    """MLP ``Linear -> act -> ... -> Linear`` of ``widths`` (input to output: 784, 200, 10).

    Args:
        seed: draw the initial weights with :func:`~pathnorm_experiments.draws.initial_weights`
            (the draw the Keras backend makes too); ``None``: PyTorch's own initialisation.
        dtype: the parameters' dtype (the NumPy draw is rounded to it once).
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
    1-path-norm (docs/conv_units.md). ``seed`` and ``dtype`` as in :func:`build_model` (the
    seeded draw: :func:`~pathnorm_experiments.draws.initial_layer_weights`).
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
    """``cfg``'s network (MLP or conv), seeded with ``cfg.seed``, in ``cfg.dtype``."""
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
    """The layers the regularizers act on (the layer seam's: ``nn.Linear``, ``nn.Conv1d``,
    ``nn.Conv2d``), in module order."""
    return [cast(WeightLayer, m) for m in model.modules() if isinstance(m, tuple(seam.ENTRIES))]


@torch.no_grad()
def mean_ce(model: nn.Module, x: Tensor, y: Tensor, chunk: int = 10000) -> float:
    """The mean cross-entropy of ``model`` on ``(x, y)``, in chunks."""
    total = 0.0
    for s in range(0, x.shape[0], chunk):
        total += float(F.cross_entropy(model(x[s : s + chunk]), y[s : s + chunk], reduction="sum"))
    return total / x.shape[0]


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
    model: nn.Module, cfg: TrainConfig, data: Dataset, history: History, timings: dict[str, float]
) -> dict[str, Any]:
    """Clean, PGD-robust and certified errors, bounds, sparsity and the final objective."""
    t0 = time.perf_counter()
    model.eval()
    dtype = torch_dtype(cfg.dtype)
    x_te, y_te = torch.from_numpy(data.x_test).to(dtype), torch.from_numpy(data.y_test)
    with torch.no_grad():
        wrong_clean = model(x_te).argmax(1) != y_te
    n_adv = x_te.shape[0] if cfg.pgd_samples is None else min(cfg.pgd_samples, x_te.shape[0])
    attack = partial(robust_error, model, x_te[:n_adv], y_te[:n_adv], steps=cfg.pgd_steps)
    robust = {}
    for e in cfg.eps:
        wrong = attack(e, seed=cfg.seed, return_mask=True)
        if cfg.attack == "ce+margin":
            wrong |= attack(e, seed=cfg.seed + 1, loss="margin", return_mask=True)
        robust[float_key(e)] = float(wrong.double().mean())  # exact k/n, as NumPy gives
    x_tr = torch.from_numpy(data.x_train[: cfg.eval_train_samples]).to(dtype)
    ce = mean_ce(model, x_tr, torch.from_numpy(data.y_train[: cfg.eval_train_samples]))
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
