"""l_inf PGD on a torch classifier (Madry et al.), the paper's attack and the CW-margin one,
and the robust error it measures. The Keras twin is :mod:`~pathnorm_experiments.attacks_tf`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["pgd_attack", "robust_error"]


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
    """Signed-gradient ascent on ``loss`` (``"ce"``, or ``"margin"``: ``max_{j != y} z_j - z_y``),
    projected on the eps-box around ``x`` within [0, 1]; default step ``eps / 20``, the paper's."""
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
    """Fraction of examples misclassified at ``x`` or at any PGD restart's adversarial point
    (with ``return_mask``, the (N,) boolean tensor)."""
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
