"""The paper's layer-wise baselines: soft-thresholding (l1 prox) and the row-wise l1-ball
projection (a bound on each layer's l_inf operator norm)."""

from __future__ import annotations

import torch
from torch import Tensor

from pathnorm_lightning._common import compute_dtype, optional_module


def soft_threshold(w: Tensor, lam: float) -> Tensor:
    """``sign(w) max(|w| - lam, 0)``: the prox of ``lam ||w||_1``, a new tensor."""
    return torch.sign(w) * (w.abs() - lam).clamp_min(0)


def project_rows(w: Tensor, radius: float) -> Tensor:
    """Each row of ``w`` (n, m) projected onto ``{z : ||z||_1 <= radius}``, a new tensor.

    Exact: on CPU with numba, :mod:`._kernel_ball`; otherwise sort-based, vectorised over rows.

    References:
        Duchi, Shalev-Shwartz, Singer, Chandra, "Efficient projections onto the l1-ball for
        learning in high dimensions", ICML 2008.
    """
    if radius == 0.0:
        return torch.zeros_like(w)
    if w.numel() == 0:  # no rows, or rows of no entries: nothing to project
        return w.detach().clone()
    kernel = optional_module("pathnorm_lightning._kernel_ball")  # numba: 8x faster on CPU
    if kernel is not None and w.device.type == "cpu":
        out = torch.empty(w.shape, dtype=compute_dtype(w.dtype)).copy_(w.detach())
        kernel.project_rows_(out, radius)
        return out.to(w.dtype)
    return project_rows_sort(w, radius)


def project_rows_sort(w: Tensor, radius: float) -> Tensor:
    """:func:`project_rows` by one sort per row (``radius > 0``, at least one entry)."""
    cd = compute_dtype(w.dtype)
    u = w.detach().to(cd)
    au = u.abs()
    s = torch.sort(au, dim=1, descending=True).values
    cs = s.cumsum(1)
    j = torch.arange(1, u.shape[1] + 1, device=u.device, dtype=cd)
    rho = ((s - (cs - radius) / j) > 0).sum(1, keepdim=True).clamp_min(1)
    theta = ((cs.gather(1, rho - 1) - radius) / rho.to(cd)).clamp_min(0)
    inside = au.sum(1, keepdim=True) <= radius
    out = torch.where(inside, u, torch.sign(u) * (au - theta).clamp_min(0))
    return out.to(w.dtype)
