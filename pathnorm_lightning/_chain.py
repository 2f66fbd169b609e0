"""Chains of layer weights: the checks, counts and bounds that :mod:`pathnorm_lightning.metrics`
and the hook's on-demand metrics share, in tensor ops only (no torchmetrics, no Lightning).

A chain is ``[W_1, ..., W_L]`` in forward order, torch layout: ``(out, in)`` for ``nn.Linear``,
``(out, in, *kernel)`` for ``nn.Conv1d`` / ``nn.Conv2d``. The hidden units between ``W_l`` and
``W_{l+1}`` are ``W_l``'s outputs; a Linear weight after a convolution reads them through a
channels-first ``nn.Flatten`` of ``P = in / channels`` positions each. So, with ``n`` units,
``W_l.reshape(n, -1)`` is the seam's ``in_view`` and ``W_{l+1}.reshape(out, n, -1)`` holds unit
``i``'s outgoing weights in ``[:, i, :]`` (the seam's ``out_view`` columns), without a copy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def check_chain(weights: Sequence[Tensor], name: str) -> list[Tensor]:
    """The weights, detached, after checking that they are layer weights (2-D Linear, 3-D/4-D
    convolution) and chain (``name`` prefixes the errors)."""
    weights = [weights] if isinstance(weights, Tensor) else list(weights)
    if not weights:
        raise ValueError(f"{name}.update needs at least one weight matrix, got an empty sequence")
    for index, w in enumerate(weights):
        if not isinstance(w, Tensor) or w.dim() < 2:
            shape = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
            raise ValueError(
                f"{name}.update: weights[{index}] must be a 2-D weight matrix (out, in) or a "
                f"convolution weight (out, in, *kernel), got {shape}"
            )
        if w.is_complex():  # abs() of a complex weight is not what .float() keeps
            raise ValueError(
                f"{name}.update: weights[{index}] is complex ({w.dtype}): the bounds and counts "
                "are defined for real weights; pass real weights (e.g. w.real, w.abs())"
            )
    for index, (a, b) in enumerate(itertools.pairwise(weights)):
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


def absolute(w: Tensor) -> Tensor:
    """``|w|``, float32 or float64 (half types in float32): the one full read of a weight."""
    return (w if w.dtype in (torch.float32, torch.float64) else w.float()).abs()


#: The integers of each float's size: ``|w|`` has its sign bits clear, so an entry is nonzero
#: (or NaN) exactly where its bits are.
_BITS = {torch.float32: np.int32, torch.float64: np.int64}


def count_nonzero(a: Tensor) -> int | Tensor:
    """The nonzero (and NaN) entries of ``a``, an :func:`absolute`: an int on CPU (NumPy counts
    the bits as integers, several times faster than ``torch.count_nonzero`` there), else a 0-d
    long tensor (no host sync)."""
    if a.device.type == "cpu":
        return int(np.count_nonzero(a.numpy().view(_BITS[a.dtype])))
    return torch.count_nonzero(a)


class ChainSums:
    """Each weight read once for all the metrics of one moment: per weight, ``|w|`` summed per
    unit in ``dtype`` and its nonzero count, kept while the object lives (the weights must not
    change meanwhile). One object serves the alive units, the path-norm bound and the
    product bound of several chains that share weights."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._grids: dict[tuple[object, ...], Tensor] = {}  # (weight key, n) -> (out, n)
        self._rows: dict[tuple[object, ...], Tensor] = {}  # weight key -> (out,)
        self._nonzero: dict[tuple[object, ...], int | Tensor] = {}

    def _read(self, w: Tensor, n: int | None) -> tuple[object, ...]:
        """Read ``w`` (once): its nonzero count, and its ``|w|`` summed per unit: as ``(out,
        n)`` over each input unit's positions or taps (``n`` the units it reads), else per
        row. Returns its key."""
        key = _key(w)
        if key in self._nonzero and (n is None or (key, n) in self._grids):
            return key
        a = absolute(w)
        self._nonzero[key] = count_nonzero(a)
        if n is None:
            self._rows[key] = rows(a).sum(1, dtype=self.dtype)  # in float64: no overflow
        elif n == 0:  # reads no unit: every path through it is empty
            self._grids[key, n] = torch.zeros(w.shape[0], 0, dtype=self.dtype, device=w.device)
        else:
            self._grids[key, n] = by_unit(a, n).sum(2, dtype=self.dtype)
        return key

    def grid(self, w: Tensor, n: int) -> Tensor:
        """``|w|`` summed per unit as ``(out, n)``: entry ``[o, i]`` over the positions or taps
        of input unit ``i`` (``n`` the units ``w`` reads)."""
        return self._grids[self._read(w, n), n]

    def row_sums(self, w: Tensor) -> Tensor:
        """``(out,)``: the l1 norm of each row of ``rows(w)`` (each output unit's inputs), from
        its :meth:`grid` when it was read as one."""
        key = self._read(w, None)
        if key not in self._rows:  # read as a grid: its rows summed
            self._rows[key] = next(g for (k, _), g in self._grids.items() if k == key).sum(1)
        return self._rows[key]

    def nonzero(self, w: Tensor) -> int | Tensor:
        """The nonzero (and NaN) entries of ``w``."""
        return self._nonzero[self._read(w, None)]

    def alive(self, w_in: Tensor, w_out: Tensor) -> Tensor:
        """Per hidden unit between ``w_in`` and ``w_out``: whether its incoming weights and its
        outgoing weights both have a nonzero (or NaN) entry (an l1 norm is 0 only there)."""
        n = w_in.shape[0]
        return (self.row_sums(w_in) != 0) & (self.grid(w_out, n).sum(0) != 0)

    def path_norm(self, chain: Sequence[Tensor], reuse: int = 1) -> Tensor:
        """``reuse * 1^T |W_L| ... |W_1| 1``: see :func:`path_norm_bound`."""
        v = self.row_sums(chain[0])  # per unit: ||y_i||_1
        for previous, w in itertools.pairwise(chain):
            v = self.grid(w, previous.shape[0]) @ v
        return v.sum() * reuse

    def product(self, chain: Sequence[Tensor], reuse: int = 1) -> Tensor:
        """``reuse * (sum |W_L|) * prod_{l<L} ||W_l||_inf``: see :func:`product_bound`."""
        last = chain[-1]
        total = self.grid(last, chain[-2].shape[0]) if len(chain) > 1 else self.row_sums(last)
        value = total.sum() * reuse
        for w in chain[:-1]:
            sums = self.row_sums(w)
            # a layer without units passes nothing on: its norm (the max over no rows) is 0
            value = value * (sums.amax() if sums.numel() else sums.new_zeros(()))
        return value


def _key(w: Tensor) -> tuple[object, ...]:
    """What identifies a weight's values within one :class:`ChainSums` (its memory as read)."""
    return w.data_ptr(), w.shape, w.stride(), w.dtype, w.device


def alive_units(w_in: Tensor, w_out: Tensor) -> Tensor:
    """Per hidden unit between ``w_in`` and ``w_out``: whether its incoming weights and its
    outgoing weights both have a nonzero (or NaN) entry (one read of each, no count)."""
    n = w_in.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=w_in.device)
    return (rows(absolute(w_in)).sum(1) != 0) & (by_unit(absolute(w_out), n).sum((0, 2)) != 0)


def counts(
    chain: Sequence[Tensor], sums: ChainSums | None = None
) -> tuple[Tensor, int, Tensor, int]:
    """``(zeros, entries, alive units, hidden units)`` of a checked chain; the zeros and alive
    units are 0-d long tensors on the weights' device (no host sync off the CPU). With
    ``sums``, the weights read there are not read again."""
    sums = ChainSums(acc_dtype(chain[0])) if sums is None else sums
    entries = sum(w.numel() for w in chain)
    nonzero = sum((sums.nonzero(w) for w in chain), start=0)
    zeros = torch.as_tensor(entries - nonzero, dtype=torch.long, device=chain[0].device)
    alive = torch.zeros((), dtype=torch.long, device=chain[0].device)
    for w_in, w_out in itertools.pairwise(chain):
        alive = alive + sums.alive(w_in, w_out).sum()
    return zeros, entries, alive, sum(w.shape[0] for w in chain[:-1])


def path_norm_bound(chain: Sequence[Tensor], dtype: torch.dtype, reuse: int = 1) -> Tensor:
    """``reuse * 1^T |W_L| ... |W_1| 1`` of a checked chain, accumulated in ``dtype``, where a
    convolution or a Linear layer after a Flatten acts on per-unit values: ``|W_l|`` summed
    over each unit's positions or taps (an upper bound of the unrolled network's path norm at
    every position, see docs/conv_units.md); ``reuse``: the factor ``s`` of the last layer."""
    return ChainSums(dtype).path_norm(chain, reuse)


def product_bound(chain: Sequence[Tensor], dtype: torch.dtype, reuse: int = 1) -> Tensor:
    """``reuse * (sum |W_L|) * prod_{l<L} ||W_l||_inf`` of a checked chain, accumulated in
    ``dtype`` (``||W||_inf``: the largest row l1 norm of the seam's ``in_view``)."""
    return ChainSums(dtype).product(chain, reuse)


def metric_values(
    sparsity_chains: Sequence[Sequence[Tensor]], network: Sequence[Tensor] | None, reuse: int
) -> dict[str, float]:
    """The metrics of a network now, as Python floats, each weight read once and one host sync
    for all: ``sparsity`` (zeros over entries) and ``alive_units`` (when there are hidden
    units) of the ``sparsity_chains``, ``path_norm_bound`` and ``product_bound`` of the
    ``network`` chain (when given) with its last layer's factor ``reuse``."""
    chains = [check_chain(chain, "metrics") for chain in sparsity_chains]
    net = None if network is None else check_chain(network, "metrics")
    first = next((c[0] for c in (*chains, net or []) if c), None)
    if first is None:
        return {"sparsity": 0.0}
    sums = ChainSums(acc_dtype(first))
    bounds = [] if net is None else [sums.path_norm(net, reuse), sums.product(net, reuse)]
    zeros = torch.zeros((), dtype=torch.long, device=first.device)
    alive, entries, units = torch.zeros_like(zeros), 0, 0
    for chain in chains:
        z, n, a, u = counts(chain, sums)
        zeros, entries, alive, units = zeros + z, entries + n, alive + a, units + u
    # float64 holds counts exactly below 2**53 (float32, MPS only: below 2**24)
    packed = torch.stack([zeros, alive]).to(sums.dtype)
    values = torch.cat([packed, *(b.reshape(1) for b in bounds)]).tolist()  # the one sync
    out = {"sparsity": values[0] / max(entries, 1)}
    if units:
        out["alive_units"] = values[1] / units
    if net is not None:
        out["path_norm_bound"], out["product_bound"] = values[2], values[3]
    return out
