"""Interval bound propagation (IBP): a per-example l_inf certificate for MLPs (torch tensors).

Weights use the torch layout (``weights[l]`` has shape (out, in)); the network is
``f(x) = W_L s(... s(W_1 x + b_1) ...) + b_L`` with a monotone activation ``s`` (ELU, ReLU,
tanh). The input set is the l_inf ball of radius ``eps`` around ``x`` intersected with the
pixel box [0, 1], which is the set every attack in this package searches.

* Hidden layers: with the input interval ``[lo, hi]`` written as centre ``c`` and radius
  ``r``, the pre-activation ``W z + b`` lies in ``[W c + b - |W| r, W c + b + |W| r]``
  (exact per coordinate); a monotone ``s`` maps the interval's ends to the ends.
* Last layer: the class difference is bounded directly,
  ``f_y - f_j = (W_L[y] - W_L[j]) h + (b_L[y] - b_L[j]) >= sum_i min(d_i lo_i, d_i hi_i) + db``
  with ``d = W_L[y] - W_L[j]``: exact over the box ``[lo, hi]`` of the last hidden layer, and
  tighter than bounding ``f_y`` from below and ``f_j`` from above separately.

An example is certified at radius ``eps`` when every ``f_y - f_j`` (``j != y``) has a positive
lower bound: no perturbation in the set changes the prediction, so no attack can break it
(and a certified example is classified correctly). Bounds are computed in float64 for the
real-valued network with the given weights; the rounding of a float32 forward pass (relative
1e-7) is not part of the bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from pathnorm_experiments.config import float_key

__all__ = [
    "certified_error",
    "certified_mask",
    "interval_bounds",
    "margin_lower_bounds",
]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "elu": torch.nn.functional.elu,
    "relu": torch.relu,
    "tanh": torch.tanh,
}


def _check(
    weights: Sequence[Tensor], biases: Sequence[Tensor], x: Tensor, eps: float, activation: str
) -> None:
    if len(weights) == 0 or len(weights) != len(biases):
        raise ValueError(
            f"need one bias per weight matrix and at least one layer, got {len(weights)} "
            f"weights and {len(biases)} biases"
        )
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        if w.ndim != 2 or b.shape != (w.shape[0],):
            raise ValueError(
                f"layer {i}: weight must be (out, in) and bias (out,), got {tuple(w.shape)} and "
                f"{tuple(b.shape)}"
            )
        if i and w.shape[1] != weights[i - 1].shape[0]:
            raise ValueError(
                f"weights[{i}] {tuple(w.shape)} does not follow weights[{i - 1}] "
                f"{tuple(weights[i - 1].shape)}"
            )
    if x.ndim != 2 or x.shape[1] != weights[0].shape[1]:
        raise ValueError(
            f"x must be (N, {weights[0].shape[1]}) (flattened inputs), got {tuple(x.shape)}"
        )
    if not (0.0 <= float(eps) < float("inf")):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {sorted(_ACTIVATIONS)} (monotone), got {activation!r}"
        )
    if x.numel() and (float(x.min()) < 0.0 or float(x.max()) > 1.0):
        raise ValueError(
            "x must lie in the pixel box [0, 1] (the certified set is the eps-ball intersected "
            f"with it); got values in [{float(x.min())}, {float(x.max())}]"
        )


def interval_bounds(
    weights: Sequence[Tensor],
    biases: Sequence[Tensor],
    x: Tensor,
    eps: float,
    activation: str = "elu",
) -> tuple[Tensor, Tensor]:
    """Bounds of the last hidden layer's activations over the ball ``||d||_inf <= eps`` in [0, 1].

    Args:
        weights: per layer (out, in); the last one is the output layer (not propagated).
        biases: per layer (out,).
        x: inputs (N, in) with values in [0, 1].
        eps: the l_inf radius.
        activation: ``"elu"``, ``"relu"`` or ``"tanh"``.

    Returns:
        ``(lo, hi)``, float64 (N, width of the last hidden layer); for a network without hidden
        layer, the input box itself.
    """
    _check(weights, biases, x, eps, activation)
    act = _ACTIVATIONS[activation]
    x64 = x.detach().to(torch.float64)
    lo, hi = (x64 - eps).clamp(0.0, 1.0), (x64 + eps).clamp(0.0, 1.0)
    for w, b in zip(weights[:-1], biases[:-1], strict=True):
        w64, b64 = w.detach().to(torch.float64), b.detach().to(torch.float64)
        centre, radius = (hi + lo) / 2, (hi - lo) / 2
        zc = torch.addmm(b64, centre, w64.T)
        zr = radius @ w64.abs().T
        lo, hi = act(zc - zr), act(zc + zr)
    return lo, hi


def margin_lower_bounds(
    weights: Sequence[Tensor],
    biases: Sequence[Tensor],
    x: Tensor,
    y: Tensor,
    eps: float,
    activation: str = "elu",
) -> Tensor:
    """Lower bounds of ``f_y - f_j`` over the certified set, for every class ``j``.

    Args:
        weights: per layer (out, in).
        biases: per layer (out,).
        x: inputs (N, in) in [0, 1].
        y: labels (N,), integers in [0, classes).
        eps: the l_inf radius.
        activation: ``"elu"``, ``"relu"`` or ``"tanh"``.

    Returns:
        float64 (N, classes); the entry of class ``y`` itself is ``+inf``.
    """
    lo, hi = interval_bounds(weights, biases, x, eps, activation)
    w_last = weights[-1].detach().to(torch.float64)
    b_last = biases[-1].detach().to(torch.float64)
    p = w_last.shape[0]
    y = torch.as_tensor(y, device=lo.device).long()
    if y.shape != (x.shape[0],) or (y.numel() and (int(y.min()) < 0 or int(y.max()) >= p)):
        raise ValueError(f"y must be (N,) = ({x.shape[0]},) labels in [0, {p}), got {y}")
    diff = w_last[:, None, :] - w_last[None, :, :]  # (p, p, n): W_L[c] - W_L[j]
    pos, neg = diff.clamp_min(0).reshape(p * p, -1), diff.clamp_max(0).reshape(p * p, -1)
    # min over h in [lo, hi] of d.h: positive entries at lo, negative ones at hi
    low = (lo @ pos.T + hi @ neg.T).reshape(-1, p, p)
    low = low + (b_last[:, None] - b_last[None, :])
    rows = low[torch.arange(y.shape[0], device=lo.device), y]  # (N, p): c = y
    return rows.scatter(1, y[:, None], float("inf"))


def certified_mask(
    weights: Sequence[Tensor],
    biases: Sequence[Tensor],
    x: Tensor,
    y: Tensor,
    eps: float,
    activation: str = "elu",
    *,
    chunk: int = 5000,
) -> Tensor:
    """Boolean (N,): True where IBP proves that no perturbation of size ``eps`` changes class ``y``.

    Args:
        weights: per layer (out, in).
        biases: per layer (out,).
        x: inputs (N, in) in [0, 1].
        y: labels (N,).
        eps: the l_inf radius (the set is the ball intersected with [0, 1]).
        activation: ``"elu"``, ``"relu"`` or ``"tanh"``.
        chunk: examples per block (bounds the (chunk, classes^2) work array).

    Returns:
        The mask, on ``x``'s device.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    y = torch.as_tensor(y, device=x.device)
    parts = [
        (
            margin_lower_bounds(
                weights, biases, x[s : s + chunk], y[s : s + chunk], eps, activation
            )
            > 0
        ).all(1)
        for s in range(0, x.shape[0], chunk)
    ]
    if not parts:
        _check(weights, biases, x, eps, activation)
        return torch.zeros(0, dtype=torch.bool, device=x.device)
    return torch.cat(parts)


def certified_error(
    weights: Sequence[Tensor],
    biases: Sequence[Tensor],
    x: Tensor,
    y: Tensor,
    eps_list: Sequence[float],
    activation: str = "elu",
) -> dict[str, float]:
    """Fraction of examples IBP does NOT certify, per eps (keys: ``float_key(eps)``).

    Args:
        weights: per layer (out, in).
        biases: per layer (out,).
        x: inputs (N, in) in [0, 1], N >= 1.
        y: labels (N,).
        eps_list: the radii.
        activation: ``"elu"``, ``"relu"`` or ``"tanh"``.

    Returns:
        ``{float_key(eps): error}``, errors in [0, 1].
    """
    if x.shape[0] == 0:
        raise ValueError("need at least one example to measure an error rate")
    return {
        float_key(e): 1.0
        - float(certified_mask(weights, biases, x, y, e, activation).double().mean())
        for e in eps_list
    }
