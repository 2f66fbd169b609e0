"""Chains of Linear weights in forward order, torch layout (``[W_1, ..., W_L]``, ``W_l`` of shape
(d_l, d_{l-1})): the checks, counts and bounds that the torchmetrics ``Metric``s of
:mod:`pathnorm_lightning.metrics` and the hook's on-demand metrics share, in tensor ops only (no
torchmetrics, no Lightning).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor


def check_chain(weights: Sequence[Tensor], name: str) -> list[Tensor]:
    """The weights, detached, after checking that they are 2-D and chain (``name`` prefixes
    the errors)."""
    if isinstance(weights, Tensor):
        weights = [weights]
    weights = list(weights)
    if not weights:
        raise ValueError(f"{name}.update needs at least one weight matrix, got an empty sequence")
    for index, w in enumerate(weights):
        if not isinstance(w, Tensor) or w.dim() != 2:
            shape = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
            raise ValueError(
                f"{name}.update: weights[{index}] must be a 2-D weight matrix (out, in), got {shape}"
            )
    for index in range(len(weights) - 1):
        a, b = weights[index], weights[index + 1]
        if a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{name}.update: weights[{index}] {tuple(a.shape)} and weights[{index + 1}] "
                f"{tuple(b.shape)} do not chain: weights[l].shape[0] (out) must equal "
                "weights[l + 1].shape[1] (in); pass the layers in forward order, torch layout"
            )
    return [w.detach() for w in weights]


def acc_dtype(w: Tensor) -> torch.dtype:
    """The dtype bounds accumulate in: products of many row sums overflow float16/bfloat16;
    float64 is cheap at these sizes (MPS has no float64)."""
    return torch.float32 if w.device.type == "mps" else torch.float64


def any_nonzero(w: Tensor, dim: int) -> Tensor:
    """Whether each slice along ``dim`` has a nonzero (or NaN) entry."""
    if w.shape[dim] == 0:
        return torch.zeros(w.shape[1 - dim], dtype=torch.bool, device=w.device)
    return w.abs().amax(dim) != 0


def alive_units(w_in: Tensor, w_out: Tensor) -> Tensor:
    """Per hidden unit between ``w_in`` (n, m) and ``w_out`` (p, n): whether its incoming row and
    its outgoing column both have a nonzero entry."""
    return any_nonzero(w_in, 1) & any_nonzero(w_out, 0)


def abs_sum(w: Tensor, dim: int | None, dtype: torch.dtype) -> Tensor:
    """``|w|`` summed over ``dim`` (all when None), in ``dtype``: float32 and float64 weights
    are summed in their own dtype (no full-size copy), half types in float32 (no overflow)."""
    if w.dtype not in (torch.float32, torch.float64):
        w = w.float()
    a = w.abs()
    return (a.sum() if dim is None else a.sum(dim)).to(dtype)


def counts(chain: Sequence[Tensor]) -> tuple[Tensor, int, Tensor, int]:
    """``(zeros, entries, alive units, hidden units)`` of a checked chain; the zeros and alive
    units are 0-d long tensors on the weights' device (no host sync)."""
    zeros = torch.zeros((), dtype=torch.long, device=chain[0].device)
    alive = torch.zeros_like(zeros)
    for w in chain:
        # count_nonzero and amax: several times faster on CPU than reducing a bool mask
        zeros += w.numel() - torch.count_nonzero(w)
    for w_in, w_out in itertools.pairwise(chain):
        alive += alive_units(w_in, w_out).sum()
    return zeros, sum(w.numel() for w in chain), alive, sum(w.shape[0] for w in chain[:-1])


def path_norm_bound(chain: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """``1^T |W_L| ... |W_1| 1`` of a checked chain, accumulated in ``dtype``."""
    v = abs_sum(chain[0], 1, dtype)  # |W_1| 1
    for w in chain[1:]:
        v = w.to(dtype).abs() @ v
    return v.sum()


def product_bound(chain: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """``(sum |W_L|) * prod_{l<L} ||W_l||_inf`` of a checked chain, accumulated in ``dtype``."""
    value = abs_sum(chain[-1], None, dtype)
    for w in chain[:-1]:
        rows = abs_sum(w, 1, dtype)
        # a layer without units passes nothing on: its norm (the max over no rows) is 0
        value = value * (rows.amax() if rows.numel() else rows.new_zeros(()))
    return value
