"""Backend-neutral (NumPy, float64) network bounds and per-example l_inf certificates.

Weights use the torch layout: ``weights[l]`` has shape (out, in), the network is
``f(x) = W_L s(... s(W_1 x + b_1) ...) + b_L`` with an activation ``s`` whose slope lies in
[0, 1] (ELU, ReLU, tanh). Along any segment, the Jacobian of ``f_y - f_j`` is
``(W_L[y] - W_L[j]) D_{L-1} W_{L-1} ... D_1 W_1`` with diagonal ``0 <= D <= I``, so
elementwise ``|grad| <= |W_L[y] - W_L[j]| |W_{L-1}| ... |W_1|`` and

    |(f_y - f_j)(x + d) - (f_y - f_j)(x)| <= L_{y,j} ||d||_inf,
    L_{y,j} = |W_L[y] - W_L[j]| |W_{L-1}| ... |W_1| 1

(for one hidden layer ``L_{y,j} = sum_i |V_{y,i} - V_{j,i}| ||W_{i,:}||_1``, a path-norm of the
scalar network ``f_y - f_j``). An example is certified at radius eps when
``f_y(x) - f_j(x) > eps * L_{y,j}`` for every ``j != y``: no perturbation with
``||d||_inf <= eps`` (box-clipped or not) changes the prediction.

The second certificate is interval bound propagation (IBP): the input box
``[max(x - eps, 0), min(x + eps, 1)]`` (pixels stay in [0, 1], as the attacks keep them) is
pushed through each hidden layer as a box, using ``W mu + b +- |W| r`` for a box of center
``mu`` and radius ``r`` and the activation's monotonicity; the last layer is taken exactly on
the margin, ``(W_L[y] - W_L[j]) mu + b_y - b_j - |W_L[y] - W_L[j]| r``, which is the least
value of ``f_y - f_j`` over the last hidden box. An example is certified when that lower bound
is positive for every ``j != y``. Neither certificate implies the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pathnorm_experiments.config import float_key

__all__ = [
    "certified_error",
    "certified_mask",
    "effective_nonzero_fraction",
    "forward",
    "interval_certified_error",
    "interval_certified_mask",
    "interval_margin_bounds",
    "lipschitz_matrix",
    "nonzero_fraction",
    "path_norm_bound",
    "product_bound",
    "regularizer_value",
]


def _act(name: str, z: np.ndarray) -> np.ndarray:
    if name == "elu":
        return np.where(z > 0, z, np.expm1(np.minimum(z, 0)))
    if name == "relu":
        return np.maximum(z, 0)
    if name == "tanh":
        return np.tanh(z)
    raise ValueError(f"activation must be elu, relu or tanh (slope in [0, 1]), got {name!r}")


def _check(weights: Sequence[np.ndarray], biases: Sequence[np.ndarray] | None = None) -> None:
    if len(weights) == 0:
        raise ValueError("need at least one weight matrix")
    for i, w in enumerate(weights):
        if w.ndim != 2:
            raise ValueError(f"weights[{i}] must be 2-D (out, in), got shape {w.shape}")
        if i and w.shape[1] != weights[i - 1].shape[0]:
            raise ValueError(
                f"weights[{i}] {w.shape} does not follow weights[{i - 1}] {weights[i - 1].shape}"
            )
    if biases is not None and [b.shape for b in biases] != [(w.shape[0],) for w in weights]:
        raise ValueError("biases must have shapes (out,) matching the weights")


def forward(
    weights: Sequence[np.ndarray], biases: Sequence[np.ndarray], x: np.ndarray, activation: str
) -> np.ndarray:
    """Logits in float64, shape (N, classes)."""
    _check(weights, biases)
    h = np.asarray(x, dtype=np.float64)
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        h = h @ w.astype(np.float64).T + b.astype(np.float64)
        if i < len(weights) - 1:
            h = _act(activation, h)
    return h


def lipschitz_matrix(weights: Sequence[np.ndarray]) -> np.ndarray:
    """``L[y, j]``: the (l_inf -> |.|) Lipschitz bound of ``f_y - f_j`` (zero diagonal)."""
    _check(weights)
    r = np.ones(weights[0].shape[1])
    for w in weights[:-1]:
        r = np.abs(w.astype(np.float64)) @ r
    last = weights[-1].astype(np.float64)
    diff = np.abs(last[:, None, :] - last[None, :, :])  # (p, p, n)
    return diff @ r


def certified_mask(
    weights: Sequence[np.ndarray],
    biases: Sequence[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    eps: float,
    activation: str,
    *,
    logits: np.ndarray | None = None,
    lip: np.ndarray | None = None,
) -> np.ndarray:
    """Boolean (N,): True where every ``l_inf`` perturbation of size ``eps`` keeps class ``y``."""
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    z = forward(weights, biases, x, activation) if logits is None else logits
    lj = lipschitz_matrix(weights) if lip is None else lip
    y = np.asarray(y, dtype=np.int64)
    idx = np.arange(z.shape[0])
    margin = z[idx, y][:, None] - z  # (N, p): f_y - f_j
    need = eps * lj[y]  # (N, p)
    ok = margin > need
    ok[idx, y] = True
    return ok.all(axis=1)


def certified_error(
    weights: Sequence[np.ndarray],
    biases: Sequence[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    eps_list: Sequence[float],
    activation: str,
) -> dict[str, float]:
    """Fraction of examples NOT certified, per eps (keys: :func:`~pathnorm_experiments.config.float_key`)."""
    z = forward(weights, biases, x, activation)
    lip = lipschitz_matrix(weights)
    return {
        float_key(e): float(
            1.0 - certified_mask(weights, biases, x, y, e, activation, logits=z, lip=lip).mean()
        )
        for e in eps_list
    }


def interval_margin_bounds(
    weights: Sequence[np.ndarray],
    biases: Sequence[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    eps: float,
    activation: str,
    *,
    chunk: int = 1000,
) -> np.ndarray:
    """Lower bounds of ``f_y - f_j`` over the eps-box around each ``x`` within [0, 1] (IBP).

    Args:
        weights: torch layout (out, in), input to output.
        biases: (out,) per layer.
        x: inputs (N, in) in [0, 1].
        y: labels (N,).
        eps: the l_inf radius, >= 0.
        activation: a monotone activation (``elu``, ``relu``, ``tanh``).
        chunk: examples per batch (bounds memory at chunk * classes * width floats).

    Returns:
        (N, classes) float64: the bound for every ``j`` (``+inf`` at ``j = y``).
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    _check(weights, biases)
    _act(activation, np.zeros(1))  # an unknown activation raises here, before any work
    ws = [np.asarray(w, dtype=np.float64) for w in weights]
    bs = [np.asarray(b, dtype=np.float64) for b in biases]
    abs_ws = [np.abs(w) for w in ws[:-1]]
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.int64)
    last, b_last = ws[-1], bs[-1]
    out = np.empty((x.shape[0], last.shape[0]))
    for s in range(0, x.shape[0], chunk):
        xc, yc = x[s : s + chunk], y[s : s + chunk]
        lo, hi = np.clip(xc - eps, 0.0, 1.0), np.clip(xc + eps, 0.0, 1.0)
        for w, aw, b in zip(ws[:-1], abs_ws, bs[:-1], strict=True):
            mu, r = (hi + lo) / 2, (hi - lo) / 2
            center, radius = mu @ w.T + b, r @ aw.T
            # monotone activations map a box's ends to the image box's ends
            lo, hi = _act(activation, center - radius), _act(activation, center + radius)
        mu, r = (hi + lo) / 2, (hi - lo) / 2
        diff = last[yc][:, None, :] - last[None, :, :]  # (n, classes, width): rows W_L[y] - W_L[j]
        bound = (
            np.einsum("njk,nk->nj", diff, mu)
            - np.einsum("njk,nk->nj", np.abs(diff), r)
            + (b_last[yc][:, None] - b_last[None, :])
        )
        bound[np.arange(xc.shape[0]), yc] = np.inf
        out[s : s + chunk] = bound
    return out


def interval_certified_mask(
    weights: Sequence[np.ndarray],
    biases: Sequence[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    eps: float,
    activation: str,
) -> np.ndarray:
    """Boolean (N,): True where IBP proves that no input in the eps-box within [0, 1] changes
    the predicted class away from ``y`` (see :func:`interval_margin_bounds`)."""
    return np.asarray((interval_margin_bounds(weights, biases, x, y, eps, activation) > 0).all(1))


def interval_certified_error(
    weights: Sequence[np.ndarray],
    biases: Sequence[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    eps_list: Sequence[float],
    activation: str,
) -> dict[str, float]:
    """Fraction of examples NOT certified by IBP, per eps (keys:
    :func:`~pathnorm_experiments.config.float_key`)."""
    return {
        float_key(e): float(
            1.0 - interval_certified_mask(weights, biases, x, y, e, activation).mean()
        )
        for e in eps_list
    }


def path_norm_bound(weights: Sequence[np.ndarray]) -> float:
    """Full 1-path-norm ``1^T |W_L| ... |W_1| 1``: the (l_inf, l_1) Lipschitz bound of f."""
    _check(weights)
    r = np.ones(weights[0].shape[1])
    for w in weights:
        r = np.abs(w.astype(np.float64)) @ r
    return float(r.sum())


def product_bound(weights: Sequence[np.ndarray]) -> float:
    """Layer-wise bound ``||W_L||_{inf->1} prod_{l<L} ||W_l||_inf`` (sum|W_L| times max row sums)."""
    _check(weights)
    out = float(np.abs(weights[-1]).astype(np.float64).sum())
    for w in weights[:-1]:
        out *= float(np.abs(w.astype(np.float64)).sum(1).max())
    return out


def regularizer_value(weights: Sequence[np.ndarray], regularizer: str) -> float:
    """``g(weights)``: l1 = sum |w|, path = sum of pairwise 1-path-norms, linf/none = 0.

    ``linf`` is a constraint (its indicator is 0 at the feasible iterates the projection makes).
    """
    _check(weights)
    if regularizer in ("none", "linf"):
        return 0.0
    if regularizer == "l1":
        return float(sum(np.abs(w.astype(np.float64)).sum() for w in weights))
    if regularizer == "path":
        if len(weights) % 2:
            raise ValueError(f"path pairs layers: need an even number, got {len(weights)}")
        return float(
            sum(
                (
                    np.abs(weights[i + 1]).astype(np.float64).sum(0)
                    * np.abs(weights[i]).astype(np.float64).sum(1)
                ).sum()
                for i in range(0, len(weights), 2)
            )
        )
    raise ValueError(f"regularizer must be none, l1, linf or path, got {regularizer!r}")


def nonzero_fraction(weights: Sequence[np.ndarray]) -> float:
    """Fraction of weight entries (biases excluded) that are exactly nonzero."""
    _check(weights)
    total = sum(w.size for w in weights)
    return float(sum(np.count_nonzero(w) for w in weights) / total)


def effective_nonzero_fraction(weights: Sequence[np.ndarray]) -> float:
    """Fraction of weight entries that are nonzero AND lie on a path from an input to an output.

    A proximal step on the path-norm can zero a unit's outgoing weights but keep its incoming
    ones (or vice versa); such weights do not affect the function and a pruned network drops
    them, so this counts only weights of units connected on both sides.
    """
    _check(weights)
    nz = [w != 0 for w in weights]
    fwd = [np.ones(weights[0].shape[1], dtype=bool)]  # units reachable from the input
    for m in nz:
        fwd.append((m & fwd[-1][None, :]).any(1))
    bwd = [np.ones(weights[-1].shape[0], dtype=bool)]  # units that reach an output
    for m in reversed(nz):
        bwd.append((m & bwd[-1][:, None]).any(0))
    bwd.reverse()
    live = sum(int((m & bwd[i + 1][:, None] & fwd[i][None, :]).sum()) for i, m in enumerate(nz))
    return float(live / sum(w.size for w in weights))
