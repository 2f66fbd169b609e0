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

A hidden layer may be a :class:`ConvLayer`: the unrolled matrix ``V`` (channels * positions,
in) of a convolution that reads and writes flat channels-first images (as ``nn.Flatten``),
applied as the convolution (``|V| r`` is the convolution with ``|kernel|``: every entry of ``V``
is a kernel weight or zero), so both certificates and the bounds hold unchanged and IBP never
builds ``V``. The read-out is always a matrix. Regularizer values and sparsity count each kernel
weight once (``R = sum_c ||x_c||_1 ||y_c||_1`` over channels, docs/conv_units.md); for a valid
convolution read by the Linear layer, the path-norm bound ``1^T |W_2| |V| 1`` equals that ``R``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeAlias

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pathnorm_experiments.regularizers import REGULARIZERS, regularizer
from pathnorm_experiments.settings import float_key

__all__ = [
    "ConvLayer",
    "Layer",
    "certified_error",
    "certified_mask",
    "effective_nonzero_fraction",
    "forward",
    "interval_certified_error",
    "interval_certified_mask",
    "interval_margin_bounds",
    "layer_linf_norm",
    "lipschitz_matrix",
    "nonzero_fraction",
    "path_norm_bound",
    "product_bound",
    "regularizer_value",
]


def _pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int | np.integer) else tuple(value)
    if len(pair) != 2 or any(int(v) != v for v in pair):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return int(pair[0]), int(pair[1])


class ConvLayer:
    """A 2-D convolution (``groups=1``, zero padding), as a layer of the functions here.

    Args:
        weight: (channels, in_channels, kh, kw), torch layout.
        in_shape: (in_channels, height, width) of its flat channels-first input.
        stride: per axis, or one int for both.
        padding: zeros added on both sides of each axis, or one int for both.
    """

    def __init__(
        self,
        weight: np.ndarray,
        in_shape: Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
    ) -> None:
        self.weight = weight
        self.stride = _pair(stride, "stride")
        self.padding = _pair(padding, "padding")
        if not isinstance(weight, np.ndarray) or weight.ndim != 4:
            raise ValueError(
                "ConvLayer.weight must be a 4-D array (channels, in_channels, kh, kw), got "
                f"{getattr(weight, 'shape', type(weight).__name__)}"
            )
        if len(in_shape) != 3 or weight.shape[1] != in_shape[0]:
            raise ValueError(
                f"ConvLayer: in_shape {tuple(in_shape)} must be (in_channels, height, width) "
                f"with in_channels = weight.shape[1] = {weight.shape[1]}"
            )
        self.in_shape = (int(in_shape[0]), int(in_shape[1]), int(in_shape[2]))
        if min(self.stride) < 1 or min(self.padding) < 0:
            raise ValueError(
                f"ConvLayer: stride must be >= 1 and padding >= 0, got {self.stride}, "
                f"{self.padding}"
            )
        if min(self.out_shape[1:]) < 1:
            raise ValueError(
                f"ConvLayer: a {weight.shape[2]} x {weight.shape[3]} kernel does not fit the "
                f"{in_shape[1]} x {in_shape[2]} input (padding {self.padding})"
            )

    @property
    def out_shape(self) -> tuple[int, int, int]:
        """(channels, out_height, out_width)."""
        grid = [
            (size + 2 * pad - k) // st + 1
            for size, pad, k, st in zip(
                self.in_shape[1:], self.padding, self.weight.shape[2:], self.stride, strict=True
            )
        ]
        return (int(self.weight.shape[0]), grid[0], grid[1])

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the unrolled matrix: (out features, in features)."""
        return (math.prod(self.out_shape), math.prod(self.in_shape))

    def apply(self, h: np.ndarray, *, absolute: bool = False) -> np.ndarray:
        """``V h`` row by row (``|V| h`` with ``absolute``), float64: (N, in) -> (N, out)."""
        w = np.abs(self.weight) if absolute else self.weight
        x = np.asarray(h, dtype=np.float64).reshape(-1, *self.in_shape)
        (ph, pw), (sh, sw) = self.padding, self.stride
        if ph or pw:
            x = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
        windows = sliding_window_view(x, self.weight.shape[2:], axis=(2, 3))[:, :, ::sh, ::sw]
        out = np.tensordot(windows, w.astype(np.float64), axes=((1, 4, 5), (1, 2, 3)))
        return out.transpose(0, 3, 1, 2).reshape(x.shape[0], -1)

    def unrolled(self) -> np.ndarray:
        """``V``, dense (out, in) float64 (the convolution of every basis vector)."""
        return self.apply(np.eye(self.shape[1])).T


Layer: TypeAlias = "np.ndarray | ConvLayer"


def _act(name: str, z: np.ndarray) -> np.ndarray:
    if name == "elu":
        return np.where(z > 0, z, np.expm1(np.minimum(z, 0)))
    if name == "relu":
        return np.maximum(z, 0)
    if name == "tanh":
        return np.tanh(z)
    raise ValueError(f"activation must be elu, relu or tanh (slope in [0, 1]), got {name!r}")


def _check(weights: Sequence[Layer], biases: Sequence[np.ndarray] | None = None) -> None:
    if len(weights) == 0:
        raise ValueError("need at least one weight matrix")
    for i, w in enumerate(weights):
        if not isinstance(w, ConvLayer) and w.ndim != 2:
            raise ValueError(
                f"weights[{i}] must be 2-D (out, in) or a ConvLayer, got shape {w.shape}"
            )
        if i and w.shape[1] != weights[i - 1].shape[0]:
            raise ValueError(
                f"weights[{i}] {w.shape} does not follow weights[{i - 1}] {weights[i - 1].shape}"
            )
    if isinstance(weights[-1], ConvLayer):
        raise ValueError("the last layer must be a matrix (out, in), the read-out, not a ConvLayer")
    units = [(w.weight if isinstance(w, ConvLayer) else w).shape[:1] for w in weights]
    if biases is not None and [b.shape for b in biases] != units:
        raise ValueError(
            "biases must have shapes (out,) matching the weights (a ConvLayer's: (channels,))"
        )


def _readout(weights: Sequence[Layer]) -> np.ndarray:
    """The last layer's matrix (out, in), float64 (:func:`_check` has refused a ConvLayer)."""
    return np.asarray(weights[-1], dtype=np.float64)


def _apply(layer: Layer, h: np.ndarray, *, absolute: bool = False) -> np.ndarray:
    """``h @ W.T`` in float64 (``|W|`` with ``absolute``): (N, in) -> (N, out)."""
    if isinstance(layer, ConvLayer):
        return layer.apply(h, absolute=absolute)
    w = np.asarray(layer, dtype=np.float64)
    return h @ (np.abs(w) if absolute else w).T


def _bias(layer: Layer, b: np.ndarray) -> np.ndarray:
    """The bias of every output feature (a convolution's, repeated over its positions)."""
    b = np.asarray(b, dtype=np.float64)
    return np.repeat(b, math.prod(layer.out_shape[1:])) if isinstance(layer, ConvLayer) else b


def _natives(weights: Sequence[Layer]) -> list[np.ndarray]:
    """The weights in their own torch layout (a convolution's (C, C_in, *k), counted once),
    after checking that the units chain: a Linear layer after a convolution reads its channels
    through a channels-first Flatten."""
    if len(weights) == 0:
        raise ValueError("need at least one weight matrix")
    ws = [w.weight if isinstance(w, ConvLayer) else np.asarray(w) for w in weights]
    for i, w in enumerate(ws):
        if w.ndim < 2:
            raise ValueError(f"weights[{i}] must be a layer weight (out, in, ...), got {w.shape}")
        if i == 0:
            continue
        prev = ws[i - 1]
        flatten = prev.ndim > 2 and w.ndim == 2
        if (w.ndim > 2 and prev.ndim == 2) or (
            w.shape[1] % prev.shape[0] if flatten and prev.shape[0] else w.shape[1] != prev.shape[0]
        ):
            raise ValueError(
                f"weights[{i}] {w.shape} does not follow weights[{i - 1}] {prev.shape}"
            )
    return ws


def _by_unit(w: np.ndarray, n: int) -> np.ndarray:
    """``|w|``-ready view (out, n, taps or positions) of a weight reading ``n`` units."""
    return w.reshape(w.shape[0], n, -1) if n else w.reshape(w.shape[0], 0, 1)


def forward(
    weights: Sequence[Layer], biases: Sequence[np.ndarray], x: np.ndarray, activation: str
) -> np.ndarray:
    """Logits in float64, shape (N, classes)."""
    _check(weights, biases)
    h = np.asarray(x, dtype=np.float64)
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        h = _apply(w, h) + _bias(w, b)
        if i < len(weights) - 1:
            h = _act(activation, h)
    return h


def _abs_chain(weights: Sequence[Layer]) -> np.ndarray:
    """``|W_{L-1}| ... |W_1| 1``: per last hidden feature, the bound of its input's effect."""
    r = np.ones((1, weights[0].shape[1]))
    for w in weights[:-1]:
        r = _apply(w, r, absolute=True)
    return r[0]


def lipschitz_matrix(weights: Sequence[Layer]) -> np.ndarray:
    """``L[y, j]``: the (l_inf -> |.|) Lipschitz bound of ``f_y - f_j`` (zero diagonal)."""
    _check(weights)
    r = _abs_chain(weights)
    last = _readout(weights)
    diff = np.abs(last[:, None, :] - last[None, :, :])  # (p, p, n)
    return diff @ r


def certified_mask(
    weights: Sequence[Layer],
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
    ok = margin > eps * lj[y]
    ok[idx, y] = True
    return ok.all(axis=1)


def certified_error(
    weights: Sequence[Layer],
    biases: Sequence[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    eps_list: Sequence[float],
    activation: str,
) -> dict[str, float]:
    """Fraction of examples NOT certified, per eps (keys:
    :func:`~pathnorm_experiments.settings.float_key`)."""
    z = forward(weights, biases, x, activation)
    lip = lipschitz_matrix(weights)
    return {
        float_key(e): float(
            1.0 - certified_mask(weights, biases, x, y, e, activation, logits=z, lip=lip).mean()
        )
        for e in eps_list
    }


def interval_margin_bounds(
    weights: Sequence[Layer],
    biases: Sequence[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    eps: float,
    activation: str,
    *,
    chunk: int = 1000,
) -> np.ndarray:
    """Lower bounds of ``f_y - f_j`` over the eps-box around each ``x`` within [0, 1] (IBP).

    ``chunk`` examples at a time (memory: chunk * classes * width floats). Returns (N, classes)
    float64, ``+inf`` at ``j = y``.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    _check(weights, biases)
    _act(activation, np.zeros(1))  # an unknown activation raises before any work
    bs = [_bias(w, b) for w, b in zip(weights, biases, strict=True)]
    x = np.asarray(x, dtype=np.float64)
    if x.size and not 0.0 <= x.min() <= x.max() <= 1.0:  # the box would not contain x
        raise ValueError(f"x must lie in [0, 1], the inputs' range, got [{x.min()}, {x.max()}]")
    y = np.asarray(y, dtype=np.int64)
    last, b_last = _readout(weights), bs[-1]
    out = np.empty((x.shape[0], last.shape[0]))
    for s in range(0, x.shape[0], chunk):
        xc, yc = x[s : s + chunk], y[s : s + chunk]
        lo, hi = np.clip(xc - eps, 0.0, 1.0), np.clip(xc + eps, 0.0, 1.0)
        for w, b in zip(weights[:-1], bs[:-1], strict=True):
            mu, r = (hi + lo) / 2, (hi - lo) / 2
            center, radius = _apply(w, mu) + b, _apply(w, r, absolute=True)
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
    weights: Sequence[Layer],
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
    weights: Sequence[Layer],
    biases: Sequence[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    eps_list: Sequence[float],
    activation: str,
) -> dict[str, float]:
    """Fraction of examples NOT certified by IBP, per eps (keys:
    :func:`~pathnorm_experiments.settings.float_key`)."""
    return {
        float_key(e): float(
            1.0 - interval_certified_mask(weights, biases, x, y, e, activation).mean()
        )
        for e in eps_list
    }


def path_norm_bound(weights: Sequence[Layer]) -> float:
    """Full 1-path-norm ``1^T |W_L| ... |W_1| 1``: the (l_inf, l_1) Lipschitz bound of f (of
    the unrolled network where a layer is a :class:`ConvLayer`)."""
    _check(weights)
    return float((np.abs(_readout(weights)) @ _abs_chain(weights)).sum())


def layer_linf_norm(layer: Layer) -> float:
    """``||W||_inf``: the largest row l1 norm (of the unrolled matrix of a convolution)."""
    rows = _apply(layer, np.ones((1, layer.shape[1])), absolute=True)[0]
    return float(rows.max()) if rows.size else 0.0


def product_bound(weights: Sequence[Layer]) -> float:
    """Layer-wise bound ``||W_L||_{inf->1} prod_{l<L} ||W_l||_inf`` (sum |W_L| times the
    largest row sums)."""
    _check(weights)
    out = float(np.abs(_readout(weights)).sum())
    for w in weights[:-1]:
        out *= layer_linf_norm(w)
    return out


def _l1(ws: Sequence[np.ndarray]) -> float:
    return float(sum(np.abs(w.astype(np.float64)).sum() for w in ws))


def _path(ws: Sequence[np.ndarray]) -> float:
    if len(ws) % 2:
        raise ValueError(f"path pairs layers: need an even number, got {len(ws)}")
    total = 0.0
    for w_in, w_out in zip(ws[::2], ws[1::2], strict=True):
        n = w_in.shape[0]
        y_norms = np.abs(w_in.astype(np.float64)).reshape(n, -1).sum(1)
        x_norms = np.abs(_by_unit(w_out, n).astype(np.float64)).sum((0, 2))
        total += float((x_norms * y_norms).sum())
    return total


#: each regularizer's ``g`` on the weights in their native layouts, float64 (None: ``g = 0``,
#: none and the constraints, whose indicator is 0 at the feasible iterates)
G: dict[str, Callable[[Sequence[np.ndarray]], float] | None] = {
    "none": None,
    "l1": _l1,
    "path": _path,
    "linf": None,
}
if tuple(G) != REGULARIZERS:  # a new row of the table needs its g here
    raise ImportError(f"certify.G covers {tuple(G)}, the table has {REGULARIZERS}")


def regularizer_value(weights: Sequence[Layer], name: str) -> float:
    """``g(weights)`` of the regularizer ``name`` (l1: sum |w|; path: sum of pairwise
    1-path-norms, a convolution's channels as units; linf, none: 0)."""
    g = G[regularizer(name).name]
    ws = _natives(weights)
    return 0.0 if g is None else g(ws)


def nonzero_fraction(weights: Sequence[Layer]) -> float:
    """Fraction of weight entries (biases excluded) that are exactly nonzero (a convolution's
    kernel weights counted once)."""
    ws = _natives(weights)
    total = sum(w.size for w in ws)
    return float(sum(np.count_nonzero(w) for w in ws) / total)


def effective_nonzero_fraction(weights: Sequence[Layer]) -> float:
    """Fraction of weight entries that are nonzero AND lie on a path from an input to an output.

    The path-norm prox can zero a unit's outgoing weights but keep its incoming ones (or vice
    versa); such weights do not affect the function, so only units connected on both sides
    count. A convolution's units are its channels, reached through any nonzero kernel weight
    (a valid convolution applies each at every position).
    """
    ws = _natives(weights)
    nz = [_by_unit(w, (ws[i - 1].shape[0] if i else w.shape[1])) != 0 for i, w in enumerate(ws)]
    fwd = [np.ones(nz[0].shape[1], dtype=bool)]  # units reachable from the input
    for m in nz:
        fwd.append((m & fwd[-1][None, :, None]).any((1, 2)))
    bwd = [np.ones(nz[-1].shape[0], dtype=bool)]  # units that reach an output
    for m in reversed(nz):
        bwd.append((m & bwd[-1][:, None, None]).any((0, 2)))
    bwd.reverse()
    live = sum(
        int((m & bwd[i + 1][:, None, None] & fwd[i][None, :, None]).sum()) for i, m in enumerate(nz)
    )
    return float(live / sum(w.size for w in ws))
