"""torchmetrics ``Metric``s of a layer chain: sparsity, the 1-path-norm bound, the product bound.

Every metric takes a *chain* of weights in forward order, torch layout: ``update([W_1, ..., W_L])``
with ``W_l`` an ``nn.Linear`` weight (d_l, d_{l-1}) or an ``nn.Conv1d`` / ``nn.Conv2d`` weight
(C_l, C_{l-1}, *kernel), consecutive shapes chaining (a Linear weight after a convolution reads
its channels, the hidden units, through a channels-first ``nn.Flatten``). For one Linear pair
``[w_in, w_out]`` the bounds equal :func:`~pathnorm_lightning.path_norm` and
:func:`~pathnorm_lightning.product_bound`; for a convolution pair they are ``s`` times those of
the layer seam's unit views, ``s`` the last layer's factor (``reuse``, docs/conv_units.md).
Several ``update`` calls accumulate: ``Sparsity`` pools the counts, the bounds average the
values (each ``update`` is one snapshot of a network). Across processes the states are summed,
so identical replicas report their common value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

from pathnorm_lightning._chain import acc_dtype, check_chain, counts, path_norm_bound, product_bound

__all__ = ["PathNormBound", "ProductBound", "Sparsity"]


class Sparsity(Metric):
    """Fraction of exactly-zero weights, and fraction of hidden units still alive.

    A hidden unit between ``W_l`` and ``W_{l+1}`` is alive when its incoming row
    ``W_l[j, :]`` and its outgoing column ``W_{l+1}[:, j]`` both have a nonzero entry.
    ``compute()`` returns ``{"sparsity": ..., "alive_units": ...}``; ``alive_units`` is NaN when
    no update had hidden units (single matrices only).
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    zeros: Tensor
    total: Tensor
    alive: Tensor
    units: Tensor

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for state in ("zeros", "total", "alive", "units"):
            self.add_state(state, default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, weights: Sequence[Tensor]) -> None:
        """Count the zeros of every matrix and the alive units between consecutive ones."""
        zeros, total, alive, units = counts(check_chain(weights, "Sparsity"))
        self.zeros += zeros.to(self.zeros.device)
        self.total += total
        self.alive += alive.to(self.alive.device)
        self.units += units

    def compute(self) -> dict[str, Tensor]:
        """``{"sparsity": zeros / entries, "alive_units": alive / hidden units}`` (NaN: no
        entry, no hidden unit)."""
        sparsity = self.zeros.double() / self.total.double()  # 0 / 0: NaN
        if self.units == 0:
            alive = torch.tensor(float("nan"), dtype=torch.float64, device=self.units.device)
        else:
            alive = self.alive.double() / self.units.double()
        return {"sparsity": sparsity, "alive_units": alive}


class _ChainBound(Metric):
    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    #: ``(chain, dtype, reuse) -> bound``: the bound of a checked chain, accumulated in ``dtype``
    _bound: Callable[[list[Tensor], torch.dtype, int], Tensor]
    #: The states' names, ``sum_<_state>`` and ``count_<_state>``: one per class (with shared
    #: names, a MetricCollection merges two bounds equal at their first update for good)
    _state: str

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        zero = torch.tensor(0.0, dtype=torch.float64)
        self.add_state(f"sum_{self._state}", default=zero, dist_reduce_fx="sum")
        count = torch.tensor(0, dtype=torch.long)
        self.add_state(f"count_{self._state}", default=count, dist_reduce_fx="sum")

    def update(self, weights: Sequence[Tensor], *, reuse: int | None = None) -> None:
        """Add the bound of the network ``W_L act(... act(W_1 x))`` given as ``[W_1, ..., W_L]``.

        ``reuse``: the factor ``s`` of the last layer, how many times the unrolled network reads
        each of its weights at most (``layers.entry_of(layer).reuse(layer, in_positions)``,
        ``in_positions`` the spatial shape the layer reads); required when the last weight is a
        convolution's, 1 (the default) for a Linear layer.
        """
        name = type(self).__name__
        chain = check_chain(weights, name)
        if reuse is None:
            if chain[-1].dim() > 2:
                raise ValueError(
                    f"{name}.update: the chain ends with a convolution weight "
                    f"{tuple(chain[-1].shape)}, whose bound grows with the positions it reads; "
                    "pass reuse=s, its factor: pathnorm_lightning.layers.entry_of(conv)"
                    ".reuse(conv, in_positions) with the spatial shape of its input"
                )
            reuse = 1
        if isinstance(reuse, bool) or not isinstance(reuse, int) or reuse < 1:
            raise ValueError(f"{name}.update: reuse must be a positive int, got {reuse!r}")
        value = self._bound(chain, acc_dtype(chain[0]), reuse)
        total, count = self._states()
        # in float64 whatever the state's dtype: module.to(torch.float16) (Lightning's
        # "16-true") casts the states too, and a float16 sum overflows at 65504
        total = total.to(torch.float64) + value.to(total.device, torch.float64)
        setattr(self, f"sum_{self._state}", total)
        setattr(self, f"count_{self._state}", count + 1)

    def _states(self) -> tuple[Tensor, Tensor]:
        return getattr(self, f"sum_{self._state}"), getattr(self, f"count_{self._state}")

    def compute(self) -> Tensor:
        """Mean of the bounds passed to ``update`` (NaN before any update)."""
        total, count = self._states()
        if count == 0:
            return torch.tensor(float("nan"), dtype=torch.float64, device=count.device)
        return total / count


class PathNormBound(_ChainBound):
    """1-path-norm of a chain: ``1^T |W_L| ... |W_1| 1``, the sum over input-output paths of the
    product of absolute weights; with convolutions, ``s`` times that of the per-channel weights
    (each channel's weights summed over its taps or positions), which bounds the path norm of
    the unrolled network. It upper-bounds the (l_inf, l_1) Lipschitz constant of
    ``W_L act(... act(W_1 x))`` for activations with slope in [0, 1] (and max or average pooling
    between).
    """

    _bound = staticmethod(path_norm_bound)
    _state = "path_norm"


class ProductBound(_ChainBound):
    """Layer-wise bound ``s * (sum |W_L|) * prod_{l<L} ||W_l||_inf`` (``||W||_inf``: largest row
    l1 norm of the weight as (out, everything else): for a convolution, the l_inf operator norm
    of its unrolled matrix is at most that). Also an upper bound on the (l_inf, l_1) Lipschitz
    constant, never below :class:`PathNormBound`.
    """

    _bound = staticmethod(product_bound)
    _state = "product"
