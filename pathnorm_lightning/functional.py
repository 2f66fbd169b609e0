"""Pure tensor functions: the exact 1-path-norm prox, its bounds and the paper's baselines.

Layout (torch, two ``nn.Linear`` layers ``Linear(m, n) -> act -> Linear(n, p)``):
``w_in`` is the first layer's weight, shape (n, m); ``w_out`` the second's, shape (p, n).
Hidden unit ``i`` owns the row ``w_in[i, :]`` (incoming) and the column ``w_out[:, i]``
(outgoing). The 1-path-norm is ``sum_i ||w_out[:, i]||_1 * ||w_in[i, :]||_1``; biases are
not part of it.

The prox solves, separately for every hidden unit (x = outgoing, y = incoming weights)::

    min_{v, w}  1/2 ||v - x||^2 + 1/2 ||w - y||^2 + lam * ||v||_1 * ||w||_1

exactly. The objective is non-convex; every minimiser is a stationary point
``v = S(x, lam ||w||_1)``, ``w = S(y, lam ||v||_1)`` (S = soft-threshold) fixed by its support
sizes ``(k, l)`` (top-k of |x|, top-l of |y|), or one of the trivial points ``(x, 0)`` and
``(0, y)``. The feasible supports form a staircase (downward closed, Lemma 4 of the paper) and
the objective decreases along it (Lemma 8), so the minimiser lies among the pairs
``(k, L(k))``, ``L(k)`` the largest feasible ``l`` for ``k``. Two tensor implementations
evaluate all of them at once, with no Python loop over units or support sizes:

* ``_prox_rows`` ("sort"): one sort per row, cumulative sums, a fixed-length vectorised
  binary search for ``L(k)`` and an argmin; nothing waits on the device. On CUDA it is replayed
  as a CUDA graph (``_GraphedSort``).

and ``pathnorm_lightning._kernel`` ("kernel", the CPU default when numba is installed) compiles
a band variant unit by unit to machine code: the same mathematics in a few passes over the
weights, without the dispatch of a hundred tensor operations.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from types import ModuleType
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "NonFiniteWeightsError",
    "path_norm",
    "product_bound",
    "project_rows_l1_ball",
    "project_rows_l1_ball_",
    "prox_l1",
    "prox_l1_",
    "prox_path_norm",
    "prox_path_norm_",
]


def _check_scalar(value: float | Tensor, name: str) -> float:
    if isinstance(value, (str, bytes, bool)) or value is None:
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = float(value.item())
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


class NonFiniteWeightsError(ValueError):
    """A weight given to the prox holds NaN or inf (the prox is undefined there)."""


def _check_matrix(w: Tensor, name: str, check_finite: bool) -> None:
    if not isinstance(w, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"{name} must be a 2-D weight matrix, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {w.dtype}")
    if check_finite:
        _check_finite(w, name)


def _finite_flag(weights: Sequence[Tensor]) -> Tensor | None:
    """On-device 0-d bool: whether every entry is finite (None for no entries), in one pass:
    min/max propagate NaN and expose +-inf (about 7x cheaper on CPU than ``isfinite(w).all()``,
    which allocates a mask)."""
    ends = [e.reshape(1) for w in weights if w.numel() for e in torch.aminmax(w.detach())]
    return torch.isfinite(torch.cat(ends)).all() if ends else None


def _check_finite(w: Tensor, name: str) -> None:
    """Raise on NaN/inf, with one host sync."""
    flag = _finite_flag([w])
    if flag is not None and not bool(flag):
        raise _non_finite(name)


def _non_finite(name: str) -> NonFiniteWeightsError:
    return NonFiniteWeightsError(
        f"{name} contains NaN or inf; the prox of non-finite weights is undefined "
        "(check the learning rate and the loss for divergence)"
    )


def _check_pair(w_in: Tensor, w_out: Tensor, check_finite: bool) -> None:
    _check_matrix(w_in, "w_in", check_finite)
    _check_matrix(w_out, "w_out", check_finite)
    if w_in.shape[0] != w_out.shape[1]:
        raise ValueError(
            f"w_in (n, m) = {tuple(w_in.shape)} and w_out (p, n) = {tuple(w_out.shape)} do not "
            f"pair: w_in.shape[0] must equal w_out.shape[1] (the hidden width n)"
        )
    if w_in.device != w_out.device:
        raise ValueError(f"w_in is on {w_in.device} but w_out is on {w_out.device}")
    if w_in.dtype != w_out.dtype:
        raise ValueError(
            f"w_in is {w_in.dtype} but w_out is {w_out.dtype}: the prox couples both in one "
            "precision; cast one to the other's dtype"
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32



def _soft_threshold(
    z: Tensor, t: Tensor, *, scratch: Tensor | None = None, out: Tensor | None = None
) -> Tensor:
    """``sign(z) max(|z| - t, 0)`` with a per-row threshold ``t`` (n, 1); ``t = inf`` gives 0.

    ``z - clip(z, -t, t)``, computed in ``scratch`` and written to ``out`` (may be ``z``).
    """
    clipped = torch.maximum(z, -t, out=scratch) if scratch is not None else torch.maximum(z, -t)
    torch.minimum(clipped, t, out=clipped)
    return torch.sub(z, clipped, out=out if out is not None else clipped)


def _prox_rows(x: Tensor, y: Tensor, lam: float | Tensor) -> tuple[Tensor, Tensor]:
    """Exact prox per row pair: ``x`` (n, p) outgoing, ``y`` (n, m) incoming weights.

    ``lam`` may be a 0-d float64 tensor on the weights' device (the CUDA graph feeds it so): no
    Python branch depends on its value, and it rounds as a Python float would.
    """
    n, p = x.shape
    m = y.shape[1]
    if p > m:  # enumerate the shorter side, search the longer one (the problem is symmetric)
        w, v = _prox_rows(y, x, lam)
        return v, w
    dt = x.dtype
    lam2 = lam * lam
    ax, ay = x.abs(), y.abs()
    xs = torch.sort(ax, dim=1, descending=True).values
    ys = torch.sort(ay, dim=1, descending=True).values
    zero = x.new_zeros(n, 1)
    cx = xs.cumsum(1)  # cx[:, k - 1] = X_k, the sum of the k largest |x|
    cy = torch.cat([zero, ys.cumsum(1)], 1)  # cy[:, l] = Y_l
    cx2 = (xs * xs).cumsum(1)
    cy2 = torch.cat([zero, (ys * ys).cumsum(1)], 1)
    yl = torch.cat([zero, ys], 1)  # yl[:, l] = l-th largest |y| (l >= 1)
    by = cy - torch.arange(m + 1, device=x.device, dtype=dt) * yl  # Y_l - l y_l >= 0
    k = torch.arange(1, p + 1, device=x.device, dtype=dt)
    ax_k = cx - k * xs  # X_k - k x_k >= 0
    lam_x = lam * cx
    l_max = 1.0 / (k * lam2)  # inf for lam = 0

    # (k, l) is feasible iff d = 1 - k l lam^2 > 0 and the last kept entries of both candidate
    # vectors are >= 0; multiplied through by d:
    #   v_k >= 0  <=>  x_k + lam^2 l (X_k - k x_k) >= lam Y_l
    #   w_l >= 0  <=>  y_l + lam^2 k (Y_l - l y_l) >= lam X_k   (vacuous for l = 0)
    # L(k) = the largest feasible l in [0, m] for k = 1..p. l = 0 is always feasible and the
    # feasible set is downward closed in l, so L(k) is built bit by bit (binary lifting): try
    # L + 2^j from the top bit down, keep it when feasible. One gather per step fetches
    # (lam Y_l, y_l, Y_l - l y_l); columns past m hold lam Y_l = inf, which fails the first test,
    # so no step needs clamping. Every step is a fixed set of tensor operations (nothing waits
    # on the device), about a dozen, for bit_length(m) steps.
    top = 1 << (m.bit_length() - 1)
    table = torch.stack([lam * cy, yl, by], 1)  # (n, 3, m + 1): planes copy row by row
    pad = table.new_zeros(n, 3, top)
    pad[:, 0] = math.inf
    table = torch.cat([table, pad], 2)
    lam2_k = lam2 * k
    lo = torch.zeros(n, p, dtype=torch.long, device=x.device)
    bit = top
    while bit:
        cand = lo + bit  # >= 1, <= m + top
        lf = cand.to(dt)
        g = table.gather(2, cand.unsqueeze(1).expand(n, 3, p))
        ok = torch.addcmul(xs, lam2 * lf, ax_k) >= g[:, 0]
        ok &= torch.addcmul(g[:, 1], lam2_k, g[:, 2]) >= lam_x
        ok &= lf < l_max
        lo = torch.where(ok, cand, lo)
        bit >>= 1

    lf = lo.to(dt)
    d = 1.0 - k * lf * lam2
    ly = cy.gather(1, lo)
    a = ((cx - k * lam * ly) / d).clamp_min(0)  # ||v||_1 of the candidate
    b = ((ly - lf * lam * cx) / d).clamp_min(0)  # ||w||_1 of the candidate
    h = _candidate_objective(cx, cy2.gather(1, lo), cx2, ly, k, lf, lam * b, lam * a, lam)
    # Candidates: (0, y) (= k = 0, l = m), (k, L(k)) for k = 1..p, and (x, 0) (Lemma 8 makes
    # it redundant when L(p) > 0; kept for safety). Thresholds: lam * b for v, lam * a for w.
    h = torch.cat([-0.5 * cy2[:, m:], h, -0.5 * cx2[:, p - 1 :]], 1)
    inf = torch.full_like(zero, math.inf)
    t_v = torch.cat([inf, lam * b, zero], 1)
    t_w = torch.cat([zero, torch.where(lo == 0, math.inf, lam * a), inf], 1)
    best = h.argmin(1, keepdim=True)
    return _soft_threshold(x, t_v.gather(1, best)), _soft_threshold(y, t_w.gather(1, best))


def _candidate_objective(
    big_x: Tensor,
    ly2: Tensor,
    cx2: Tensor,
    ly: Tensor,
    k: Tensor,
    lf: Tensor,
    t_v: Tensor,
    t_w: Tensor,
    lam: float | Tensor,
) -> Tensor:
    """Objective (up to 1/2 (||x||^2 + ||y||^2)) of the point that support sizes ``(k, l)``
    and thresholds ``t_v = lam b``, ``t_w = lam a`` produce, from that point's own l1 norms
    ``X_k - k t_v`` and ``Y_l - l t_w``: near ``d = 1 - k l lam^2 = 0``, ``a`` and ``b`` carry
    rounding amplified by ``1 / d``, and the closed form in ``a, b`` could misrank nearly equal
    candidates. ``big_x``, ``ly``: X_k and Y_l; ``cx2``, ``ly2``: their sums of squares."""
    nv = (big_x - k * t_v).clamp_min(0)
    nw = (ly - lf * t_w).clamp_min(0)
    return 0.5 * (k * t_v * t_v + lf * t_w * t_w - cx2 - ly2) + lam * nv * nw



def prox_path_norm(
    w_in: Tensor,
    w_out: Tensor,
    lam: float | Tensor,
    *,
    check_finite: bool = True,
    method: Literal["auto", "kernel", "sort"] = "auto",
) -> tuple[Tensor, Tensor]:
    """Exact prox of ``lam * path_norm``: ``argmin 1/2||A - w_in||^2 + 1/2||B - w_out||^2 + lam P(A, B)``.

    Args:
        w_in: first layer weight, shape (n, m).
        w_out: second layer weight, shape (p, n).
        lam: prox step, finite and >= 0 (inside proximal SGD: ``lr * lambda``).
        check_finite: raise :class:`NonFiniteWeightsError` (a ``ValueError``) on NaN/inf
            weights (free with the CPU kernel; elsewhere one device sync, which hot paths on
            accelerators may skip when the weights are known to be finite).
        method: ``"kernel"``: compiled by numba, a few passes over the weights per call (CPU
            only; the first call of a process loads it from numba's cache, or compiles it in a
            few seconds on a new machine). ``"sort"`` sorts whole rows in tensor ops and never
            syncs (accelerators, and CPU without numba; on CUDA it runs as a CUDA graph,
            captured at the second call with a layer shape and replayed after, unless the
            environment sets ``PATHNORM_CUDA_GRAPHS=0``). ``"auto"``: ``"kernel"`` on CPU when
            numba is installed, else ``"sort"``. All are exact and return the same minimiser.

    Returns:
        ``(w_in_new, w_out_new)``, new tensors of the input dtypes. Half precision inputs are
        computed in float32 and cast back.
    """
    return _prox(w_in, w_out, lam, check_finite, method, in_place=False)


_KERNEL: object = None  # the compiled kernel module once imported, False if numba is missing


def _kernel_module() -> ModuleType | None:
    """``pathnorm_lightning._kernel`` (numba), or None when numba is not installed."""
    global _KERNEL
    if _KERNEL is None:
        try:
            from pathnorm_lightning import _kernel
        except ImportError:
            _KERNEL = False
        else:
            _KERNEL = _kernel
    return _KERNEL if isinstance(_KERNEL, ModuleType) else None


def _auto_method(w_in: Tensor, w_out: Tensor) -> str:
    """``"kernel"`` on CPU with numba, else ``"sort"``."""
    if w_in.device.type == "cpu" and _kernel_module() is not None:
        return "kernel"
    return "sort"


def _prox_kernel(
    w_in: Tensor, w_out: Tensor, lam: float, check_finite: bool, in_place: bool
) -> tuple[Tensor, Tensor]:
    """The compiled CPU kernel (``method="kernel"``), on contiguous float32/64 working copies,
    or straight on ``w_in`` when it is one (in place)."""
    kernel = _kernel_module()
    if kernel is None:
        raise ValueError(
            'method="kernel" needs numba (pip install numba, or the "torch" extra of '
            'pathnorm); method="sort" works without it'
        )
    if w_in.device.type != "cpu":
        raise ValueError(f'method="kernel" runs on CPU tensors; these are on {w_in.device}')
    cd = _compute_dtype(w_in.dtype)
    n, m = w_in.shape
    p = w_out.shape[0]

    def working(w: Tensor) -> Tensor:  # C-contiguous, dtype cd: ``w`` itself when possible
        if in_place and w.dtype == cd and w.is_contiguous():
            return w.detach()
        return torch.empty(w.shape, dtype=cd).copy_(w.detach())

    a, b = working(w_in), working(w_out)  # (n, m), (p, n)
    with torch.no_grad():
        if p <= m:  # the short side is read and written through the transposed view
            bad = kernel.prox_inplace(b.numpy().T, a.numpy(), lam, check_finite)
        else:  # the kernel sorts the first (short) side: swap roles (the problem is symmetric)
            long = torch.empty(n, p, dtype=cd).copy_(b.t())  # rows are scanned: contiguous
            bad = kernel.prox_inplace(a.numpy(), long.numpy(), lam, check_finite)
            if bad < 0:
                b.copy_(long.t())
        if bad >= 0:  # unit `bad` holds a NaN or inf; nothing was written
            raise _non_finite("w_out" if bool(torch.isfinite(w_in[bad]).all()) else "w_in")
        if in_place:
            for w, work in ((w_in, a), (w_out, b)):
                if work.data_ptr() != w.data_ptr():
                    w.copy_(work)
            return w_in, w_out
    return a.to(w_in.dtype), b.to(w_out.dtype)


def _prox(
    w_in: Tensor,
    w_out: Tensor,
    lam: float | Tensor,
    check_finite: bool,
    method: str,
    in_place: bool,
) -> tuple[Tensor, Tensor]:
    lam = _check_scalar(lam, "lam")
    _check_pair(w_in, w_out, check_finite=False)
    if method not in ("auto", "kernel", "sort"):
        raise ValueError(f"method must be 'auto', 'kernel' or 'sort', got {method!r}")
    trivial = lam == 0.0 or w_in.numel() == 0 or w_out.numel() == 0
    if not trivial:
        if method == "auto":
            method = _auto_method(w_in, w_out)
    # For lam >= 1 no support pair is feasible (k l lam^2 >= 1): only the two trivial points
    # remain and the prox no longer depends on lam. Capping keeps lam^2 finite.
    lam = min(lam, 2.0)
    graph = None if trivial or method != "sort" else _cuda_graph(w_in, w_out)
    if graph is not None:  # it checks finiteness too, with one sync for both matrices
        return graph(w_in, w_out, lam, check_finite, in_place)
    # The kernel checks finiteness in its first pass over the weights, for free.
    if check_finite and (trivial or method != "kernel"):
        _check_finite(w_in, "w_in")
        _check_finite(w_out, "w_out")
    if trivial:
        return (w_in, w_out) if in_place else (w_in.detach().clone(), w_out.detach().clone())
    if method == "kernel":
        return _prox_kernel(w_in, w_out, lam, check_finite, in_place)
    cd = _compute_dtype(w_in.dtype)
    # Rows of x are units: sorting and scanning along strided rows is much slower, so copy.
    x, y = w_out.detach().to(cd).t().contiguous(), w_in.detach().to(cd)
    with torch.no_grad():
        v, w = _prox_rows(x, y, lam)
        if in_place:
            w_in.copy_(w)
            w_out.copy_(v.t())
            return w_in, w_out
    return w.to(w_in.dtype), v.t().to(w_out.dtype).contiguous()


class _GraphedSort:
    """The ``"sort"`` prox of one layer shape as a CUDA graph, replayed at every call.

    Eagerly, the algorithm is a few hundred small kernels whose launches from Python cost
    several milliseconds per call (several SGD steps of the paper's network on an H100), while
    the GPU itself is busy for a fraction of that. Captured once, a call is a few launches: copy
    the weights and ``lam`` into the graph's input buffers, replay, copy the results out. The
    graph also computes whether the weights are finite, so ``check_finite`` costs one host
    sync for both matrices. The graph keeps its intermediates allocated while it is cached.
    """

    def __init__(self, w_in: Tensor, w_out: Tensor) -> None:
        device = w_in.device
        self.w_in = torch.empty(w_in.shape, dtype=w_in.dtype, device=device)
        self.w_out = torch.empty(w_out.shape, dtype=w_out.dtype, device=device)
        self.lam = torch.zeros((), dtype=torch.float64, device=device)
        self.lock = threading.Lock()
        self.done = torch.cuda.Event()  # the last call's copies out: the next one waits for it
        with torch.no_grad(), torch.cuda.device(device):
            self.w_in.copy_(w_in)
            self.w_out.copy_(w_out)
            self.lam.fill_(1e-3)
            # Warm up on a side stream (library handles, workspaces), then capture.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._compute()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._compute()

    def _compute(self) -> tuple[Tensor, Tensor, Tensor]:
        cd = _compute_dtype(self.w_in.dtype)
        x, y = self.w_out.to(cd).t().contiguous(), self.w_in.to(cd)
        v, w = _prox_rows(x, y, self.lam)
        finite = torch.isfinite(torch.stack([*torch.aminmax(y), *torch.aminmax(x)])).view(2, 2)
        return w.to(self.w_in.dtype), v.t().to(self.w_out.dtype), finite.all(1)

    def __call__(
        self, w_in: Tensor, w_out: Tensor, lam: float, check_finite: bool, in_place: bool
    ) -> tuple[Tensor, Tensor]:
        with self.lock, torch.no_grad(), torch.cuda.device(w_in.device):
            stream = torch.cuda.current_stream()
            stream.wait_event(self.done)  # (no-op before the first call)
            try:
                self.w_in.copy_(w_in)
                self.w_out.copy_(w_out)
                self.lam.fill_(lam)
                self.graph.replay()
                new_in, new_out, finite = self.out
                if check_finite:
                    ok_in, ok_out = finite.tolist()  # the one host sync
                    if not (ok_in and ok_out):
                        raise _non_finite("w_in" if not ok_in else "w_out")
                if in_place:
                    w_in.copy_(new_in)
                    w_out.copy_(new_out)
                    return w_in, w_out
                fmt = torch.contiguous_format
                return new_in.clone(memory_format=fmt), new_out.clone(memory_format=fmt)
            finally:  # a call on another stream waits until this one is done with the buffers
                self.done.record(stream)


_GRAPHS: OrderedDict[tuple, _GraphedSort | None] = OrderedDict()
_SEEN: OrderedDict[tuple, None] = OrderedDict()  # shapes called once so far
_GRAPHS_LOCK = threading.Lock()
_GRAPHS_MAX = 16  # layer shapes whose graphs (and their intermediates) stay cached


def _cuda_graph(w_in: Tensor, w_out: Tensor) -> _GraphedSort | None:
    """The graph for this pair's shapes, dtypes and device, captured on the second call with
    them (a one-off call runs eagerly), or None: not CUDA, ``PATHNORM_CUDA_GRAPHS=0``, inside
    another capture, first call, or capture failed."""
    if w_in.device.type != "cuda" or os.environ.get("PATHNORM_CUDA_GRAPHS", "1") == "0":
        return None
    if torch.cuda.is_current_stream_capturing():  # the caller's own graph records the ops
        return None
    key = (w_in.device, w_in.dtype, w_out.dtype, tuple(w_in.shape), tuple(w_out.shape))
    with _GRAPHS_LOCK:
        if key in _GRAPHS:
            _GRAPHS.move_to_end(key)
            return _GRAPHS[key]
        if key not in _SEEN:
            _SEEN[key] = None
            while len(_SEEN) > 4 * _GRAPHS_MAX:
                _SEEN.popitem(last=False)
            return None
        del _SEEN[key]
        try:
            graph: _GraphedSort | None = _GraphedSort(w_in, w_out)
        except RuntimeError as err:  # e.g. an allocator setting that forbids capture
            warnings.warn(
                f"pathnorm: could not capture the prox as a CUDA graph ({err}); running its "
                "kernels one by one (slower; set PATHNORM_CUDA_GRAPHS=0 to skip the attempt)",
                RuntimeWarning,
                stacklevel=4,
            )
            graph = None
        _GRAPHS[key] = graph
        while len(_GRAPHS) > _GRAPHS_MAX:
            _, old = _GRAPHS.popitem(last=False)
            if old is not None:  # its memory returns to the allocator: let its last call end
                old.done.synchronize()
        return graph


def prox_path_norm_(
    w_in: Tensor,
    w_out: Tensor,
    lam: float | Tensor,
    *,
    check_finite: bool = True,
    method: Literal["auto", "kernel", "sort"] = "auto",
) -> tuple[Tensor, Tensor]:
    """In-place :func:`prox_path_norm`: overwrites ``w_in`` and ``w_out`` (parameters too)."""
    return _prox(w_in, w_out, lam, check_finite, method, in_place=True)


def path_norm(w_in: Tensor, w_out: Tensor) -> Tensor:
    """1-path-norm ``sum_i ||w_out[:, i]||_1 ||w_in[i, :]||_1`` (a 0-d tensor, differentiable).

    It upper-bounds the (l_inf, l_1) Lipschitz constant of ``x -> w_out act(w_in x)`` for any
    activation with slope in [0, 1] (Theorem 1 of the paper).
    """
    _check_pair(w_in, w_out, check_finite=False)
    return (w_out.abs().sum(0) * w_in.abs().sum(1)).sum()


def product_bound(w_in: Tensor, w_out: Tensor) -> Tensor:
    """Layer-wise bound ``||w_out^T||_{inf,1} * ||w_in||_inf`` = ``sum|w_out| * max_i ||w_in[i]||_1``."""
    _check_pair(w_in, w_out, check_finite=False)
    return w_out.abs().sum() * w_in.abs().sum(1).amax()


def prox_l1(w: Tensor, lam: float | Tensor) -> Tensor:
    """Soft-thresholding ``sign(w) max(|w| - lam, 0)``: the prox of ``lam ||w||_1``."""
    lam = _check_scalar(lam, "lam")
    if not isinstance(w, Tensor) or not w.is_floating_point():
        raise ValueError("w must be a floating-point torch.Tensor")
    return torch.sign(w) * (w.abs() - lam).clamp_min(0)


def prox_l1_(w: Tensor, lam: float | Tensor) -> Tensor:
    """In-place :func:`prox_l1`."""
    new = prox_l1(w, lam)
    with torch.no_grad():
        w.copy_(new)
    return w


def project_rows_l1_ball(w: Tensor, radius: float | Tensor) -> Tensor:
    """Project each row of ``w`` (shape (n, m)) onto ``{z : ||z||_1 <= radius}``.

    On an ``nn.Linear`` weight this enforces ``||w||_inf <= radius`` (the l_inf operator norm
    is the largest row l1 norm): the layer-wise constraint of Parseval-style training. Exact
    (sort-based, Duchi et al. 2008), vectorised over rows.
    """
    radius = _check_scalar(radius, "radius")
    _check_matrix(w, "w", check_finite=False)
    cd = _compute_dtype(w.dtype)
    u = w.detach().to(cd)
    if radius == 0.0:
        return torch.zeros_like(w)
    au = u.abs()
    s = torch.sort(au, dim=1, descending=True).values
    cs = s.cumsum(1)
    j = torch.arange(1, u.shape[1] + 1, device=u.device, dtype=cd)
    rho = ((s - (cs - radius) / j) > 0).sum(1, keepdim=True).clamp_min(1)
    theta = ((cs.gather(1, rho - 1) - radius) / rho.to(cd)).clamp_min(0)
    inside = au.sum(1, keepdim=True) <= radius
    out = torch.where(inside, u, torch.sign(u) * (au - theta).clamp_min(0))
    return out.to(w.dtype)


def project_rows_l1_ball_(w: Tensor, radius: float | Tensor) -> Tensor:
    """In-place :func:`project_rows_l1_ball`."""
    new = project_rows_l1_ball(w, radius)
    with torch.no_grad():
        w.copy_(new)
    return w
