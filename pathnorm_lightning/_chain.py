"""Chains of layer weights in forward order, torch layout: the checks, counts and bounds that the
torchmetrics ``Metric``s of :mod:`pathnorm_lightning.metrics` and the hook's on-demand metrics
share, in tensor ops only (no torchmetrics, no Lightning).

A chain is ``[W_1, ..., W_L]``, each the weight of a layer of the layer seam
(:mod:`pathnorm_lightning.layers`) in its torch layout: ``(out, in)`` for ``nn.Linear``,
``(out, in, *kernel)`` for ``nn.Conv1d`` / ``nn.Conv2d``. The hidden units between ``W_l`` and
``W_{l+1}`` are ``W_l``'s outputs (features or channels); a Linear weight after a convolution
reads them through a channels-first ``nn.Flatten`` of ``P = in / channels`` positions each.
So, with ``n`` units, ``W_l.reshape(n, -1)`` is the seam's ``in_view`` (row ``i``: unit ``i``'s
incoming weights) and ``W_{l+1}.reshape(out, n, -1)`` holds unit ``i``'s outgoing weights in
``[:, i, :]`` (the columns of the seam's ``out_view``, grouped by output), without a copy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor


def check_chain(weights: Sequence[Tensor], name: str) -> list[Tensor]:
    """The weights, detached, after checking that they are layer weights (2-D Linear, 3-D/4-D
    convolution) and chain (``name`` prefixes the errors)."""
    if isinstance(weights, Tensor):
        weights = [weights]
    weights = list(weights)
    if not weights:
        raise ValueError(f"{name}.update needs at least one weight matrix, got an empty sequence")
    for index, w in enumerate(weights):
        if not isinstance(w, Tensor) or w.dim() < 2:
            shape = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
            raise ValueError(
                f"{name}.update: weights[{index}] must be a 2-D weight matrix (out, in) or a "
                f"convolution weight (out, in, *kernel), got {shape}"
            )
    for index in range(len(weights) - 1):
        a, b = weights[index], weights[index + 1]
        what = f"{name}.update: weights[{index}] {tuple(a.shape)} and weights[{index + 1}] "
        if b.dim() > 2 and a.dim() == 2:
            raise ValueError(
                f"{what}{tuple(b.shape)}: a convolution cannot read the units of a Linear layer"
            )
        flatten = a.dim() > 2 and b.dim() == 2  # a Flatten between a convolution and a Linear
        if b.shape[1] % a.shape[0] if flatten and a.shape[0] else a.shape[0] != b.shape[1]:
            rule = (
                "weights[l + 1].shape[1] must be a multiple of weights[l].shape[0] (channels "
                "times positions, through a channels-first Flatten)"
                if flatten
                else "weights[l].shape[0] (out) must equal weights[l + 1].shape[1] (in)"
            )
            raise ValueError(
                f"{what}{tuple(b.shape)} do not chain: {rule}; pass the layers in forward "
                "order, torch layout"
            )
    return [w.detach() for w in weights]


def acc_dtype(w: Tensor) -> torch.dtype:
    """The dtype bounds accumulate in: products of many row sums overflow float16/bfloat16;
    float64 is cheap at these sizes (MPS has no float64)."""
    return torch.float32 if w.device.type == "mps" else torch.float64


def rows(w: Tensor) -> Tensor:
    """``w`` as ``(units, incoming)``: row ``i`` is the incoming weights of output unit ``i``."""
    return w.reshape(w.shape[0], math.prod(w.shape[1:]))


def by_unit(w: Tensor, n: int) -> Tensor:
    """``w`` (reading ``n > 0`` units) as ``(out, n, positions or taps)``."""
    return w.reshape(w.shape[0], n, math.prod(w.shape[1:]) // n)


def alive_units(w_in: Tensor, w_out: Tensor) -> Tensor:
    """Per hidden unit between ``w_in`` and ``w_out``: whether its incoming weights and its
    outgoing weights both have a nonzero (or NaN) entry."""
    n = w_in.shape[0]
    if w_in.numel() == 0 or w_out.numel() == 0:  # no unit, or none with weights on both sides
        return torch.zeros(n, dtype=torch.bool, device=w_in.device)
    return (rows(w_in).abs().amax(1) != 0) & (by_unit(w_out, n).abs().amax((0, 2)) != 0)


def abs_sum(w: Tensor, dim: int | tuple[int, ...] | None, dtype: torch.dtype) -> Tensor:
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


def path_norm_bound(chain: Sequence[Tensor], dtype: torch.dtype, reuse: int = 1) -> Tensor:
    """``reuse * 1^T |W_L| ... |W_1| 1`` of a checked chain, accumulated in ``dtype``, where a
    convolution or a Linear layer after a Flatten acts on per-unit values: ``|W_l|`` summed
    over each unit's positions or taps (an upper bound of the unrolled network's path norm at
    every position, see docs/conv_units.md); ``reuse``: the factor ``s`` of the last layer."""
    v = abs_sum(rows(chain[0]), 1, dtype)  # per unit: ||y_i||_1
    for w in chain[1:]:
        n = v.shape[0]
        v = abs_sum(by_unit(w, n), 2, dtype) @ v if n else v.new_zeros(w.shape[0])
    return v.sum() * reuse


def product_bound(chain: Sequence[Tensor], dtype: torch.dtype, reuse: int = 1) -> Tensor:
    """``reuse * (sum |W_L|) * prod_{l<L} ||W_l||_inf`` of a checked chain, accumulated in
    ``dtype`` (``||W||_inf``: the largest row l1 norm of the seam's ``in_view``)."""
    value = abs_sum(chain[-1], None, dtype) * reuse
    for w in chain[:-1]:
        sums = abs_sum(rows(w), 1, dtype)
        # a layer without units passes nothing on: its norm (the max over no rows) is 0
        value = value * (sums.amax() if sums.numel() else sums.new_zeros(()))
    return value
