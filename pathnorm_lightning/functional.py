"""Pure tensor functions: the exact 1-path-norm prox, its bounds and the paper's baselines.

Layout (torch, two ``nn.Linear`` layers ``Linear(m, n) -> act -> Linear(n, p)``):
``w_in`` is the first layer's weight, shape (n, m); ``w_out`` the second's, shape (p, n).
Hidden unit ``i`` owns the row ``w_in[i, :]`` (incoming, ``y``) and the column ``w_out[:, i]``
(outgoing, ``x``). The 1-path-norm is ``sum_i ||w_out[:, i]||_1 * ||w_in[i, :]||_1``; biases
are not part of it.

The prox solves, separately for every hidden unit and exactly::

    min_{v, w}  1/2 ||v - x||^2 + 1/2 ||w - y||^2 + lam * ||v||_1 * ||w||_1

Tie rule (the same in every method and in the Keras package): the candidates are ranked in the
order ``(x, 0)``, ``(0, y)``, then the non-trivial stationary points ``(k, L(k))`` by increasing
``k`` (outgoing entries kept), and the first minimum wins, as in the exhaustive reference
``shared_spec/reference.prox_unit``. So when keeping either side alone gives the same objective
(``||x||^2 = ||y||^2`` at a large ``lam``), the outgoing weights are kept.

This module checks arguments and dispatches to the private algorithm modules (listed in the
package docstring; ``_sort`` is the shortest exact algorithm: read it first).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Literal

import torch
from torch import Tensor

from pathnorm_lightning import _baselines
from pathnorm_lightning._common import (
    NonFiniteWeightsError,
    check_matrix,
    check_pair,
    check_scalar,
    check_writable,
    optional_module,
)
from pathnorm_lightning._common import (
    check_finite as _check_finite,
)
from pathnorm_lightning._cuda_graph import cached_graph
from pathnorm_lightning._sort import prox_rows

__all__ = [
    "METHODS",
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

#: The accepted values of ``method`` in :func:`prox_path_norm`.
METHODS = ("auto", "kernel", "sort", "triton")
Method = Literal["auto", "kernel", "sort", "triton"]


def prox_path_norm(
    w_in: Tensor,
    w_out: Tensor,
    lam: float | Tensor,
    *,
    check_finite: bool = True,
    method: Method = "auto",
) -> tuple[Tensor, Tensor]:
    """Exact prox of ``lam * path_norm``: ``argmin 1/2||A - w_in||^2 + 1/2||B - w_out||^2 + lam P(A, B)``.

    Args:
        w_in: first layer weight, shape (n, m).
        w_out: second layer weight, shape (p, n).
        lam: prox step, finite and >= 0 (inside proximal SGD: ``lr * lambda``).
        check_finite: raise :class:`NonFiniteWeightsError` (a ``ValueError``) on NaN/inf
            weights (free with the CPU kernel; elsewhere one device sync, which hot paths on
            accelerators may skip when the weights are known to be finite).
        method: ``"kernel"``: compiled by numba, a few passes over the weights (CPU only; on
            as many threads as torch uses for layers of 32,768+ weights; the first call of a
            process loads it from numba's cache, or compiles it in 11-25 s). ``"sort"``:
            tensor ops, no host sync (any device; on CUDA replayed as a CUDA graph from the
            second call with a layer shape, unless the environment sets
            ``PATHNORM_CUDA_GRAPHS=0``). ``"triton"``: one Triton kernel (CUDA). ``"auto"``:
            ``"kernel"`` on CPU when numba is installed, ``"triton"`` on CUDA when Triton is,
            else ``"sort"``. All are exact and return the same minimiser (tie rule above):
            the minimiser as float64 resolves the objective, so a unit whose one side is
            below ~1e-8 of the other's norm may lose that side at any ``lam > 0`` (a change
            of the objective below 1e-16 of ``1/2 (|x|^2 + |y|^2)``; docs/keras.md).

    Returns:
        ``(w_in_new, w_out_new)``, new tensors of the input dtypes: every method computes
        the thresholds in float64, so the result is the exact prox rounded to them. They
        carry no autograd history (the prox updates weights, outside the graph): a loss of
        them does not reach ``w_in`` and ``w_out``.

    Raises:
        TypeError: ``lam`` is not a real number.
        ValueError: ``lam`` is NaN, inf or negative; the weights do not pair; a method that
            cannot run on these weights.
        NonFiniteWeightsError: with ``check_finite``, a NaN or inf weight.
    """
    return _prox(w_in, w_out, lam, check_finite, method, in_place=False)


def prox_path_norm_(
    w_in: Tensor,
    w_out: Tensor,
    lam: float | Tensor,
    *,
    check_finite: bool = True,
    method: Method = "auto",
) -> tuple[Tensor, Tensor]:
    """In-place :func:`prox_path_norm`: overwrites ``w_in`` and ``w_out`` (parameters too).

    It moves the tensors' version counters, so a backward pass through a graph that saved the
    old weights raises. Weights that share memory (the same tensor twice, tied weights) or are
    expanded (stride 0) are refused with a ``ValueError`` before anything is written.
    """
    return _prox(w_in, w_out, lam, check_finite, method, in_place=True)


def _prox(
    w_in: Tensor,
    w_out: Tensor,
    lam: float | Tensor,
    check_finite: bool,
    method: str,
    in_place: bool,
) -> tuple[Tensor, Tensor]:
    lam = check_scalar(lam, "lam")
    check_pair(w_in, w_out)
    if in_place:
        check_writable([(w_in, "w_in"), (w_out, "w_out")])
    auto = method == "auto"
    method = _resolve_method(method, w_in, w_out)
    if lam == 0.0 or w_in.numel() == 0 or w_out.numel() == 0:
        if check_finite:
            _check_finite(w_in, "w_in")
            _check_finite(w_out, "w_out")
        return (w_in, w_out) if in_place else (w_in.detach().clone(), w_out.detach().clone())
    # For lam >= 1 no support pair is feasible (k l lam^2 >= 1): only the two trivial points
    # remain and the prox no longer depends on lam. Capping keeps lam^2 finite.
    lam = min(lam, 2.0)
    with torch.no_grad():
        if method == "kernel":
            return _prox_kernel(w_in, w_out, lam, check_finite, in_place)
        if method == "triton":
            try:
                return _prox_triton(w_in, w_out, lam, check_finite, in_place)
            except (ValueError, RuntimeError):
                raise
            except Exception as err:
                if not auto:
                    raise
                _disable_triton(err)  # nothing was written: the kernel never launched
        return _prox_sort(w_in, w_out, lam, check_finite, in_place)


def _resolve_method(method: str, w_in: Tensor, w_out: Tensor) -> str:
    """``method`` checked against the weights (whatever ``lam``), or the choice of ``"auto"``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    device = w_in.device.type
    if method == "auto":
        if device == "cpu" and _kernel_module() is not None:
            return "kernel"
        triton = _triton_module() if device == "cuda" else None
        return "triton" if triton is not None and triton.supports(w_in, w_out) else "sort"
    if method == "kernel":
        if _kernel_module() is None:
            raise ValueError(
                'method="kernel" needs numba (pip install numba, or the "torch" extra of '
                'pathnorm); method="sort" works without it'
            )
        if device != "cpu":
            raise ValueError(f'method="kernel" runs on CPU tensors; these are on {w_in.device}')
    if method == "triton":
        triton = _triton_module()
        if triton is None or not triton.supports(w_in, w_out):
            raise ValueError(
                'method="triton" needs Triton and CUDA tensors of a shape it supports '
                f"(got {tuple(w_in.shape)}, {tuple(w_out.shape)} on {w_in.device}); "
                'use method="sort"'
            )
    return method


_TRITON_FAILED = False  # set when the Triton prox failed to build here: "auto" avoids it


def planned_prox(w_in: Tensor, w_out: Tensor) -> Callable[[float, bool], bool] | None:
    """The ``method="auto"`` in-place prox of this pair with the per-call checks done once, for
    a caller that applies it at every step: ``(lam, check_finite) -> bool`` (False: that ``lam``
    is left to :func:`prox_path_norm_`). Valid while the weights keep their storage, shape and
    dtype. None where the pair fails a check (the facade will raise it) or the plan does not
    apply (not the CPU kernel, or weights that need working copies)."""
    try:
        check_pair(w_in, w_out)
        check_writable([(w_in, "w_in"), (w_out, "w_out")])
        if _resolve_method("auto", w_in, w_out) != "kernel":
            return None
    except ValueError:
        return None
    kernel = _kernel_module()
    assert kernel is not None  # checked by _resolve_method
    if not kernel.PlannedProx.applies(w_in, w_out):
        return None
    return kernel.PlannedProx(w_in, w_out)  # type: ignore[no-any-return]


def _kernel_module() -> ModuleType | None:
    """``pathnorm_lightning._kernel`` (numba), or None when numba is not installed."""
    return optional_module("pathnorm_lightning._kernel")


def _triton_module() -> ModuleType | None:
    """``pathnorm_lightning._triton`` when it imports and Triton can run here, else None."""
    return None if _TRITON_FAILED else _triton_ready()


@functools.cache
def _triton_ready() -> ModuleType | None:
    triton = optional_module("pathnorm_lightning._triton")
    return triton if triton is not None and triton.available() else None


def _disable_triton(err: Exception) -> None:
    """After the Triton prox failed to build, ``"auto"`` uses ``"sort"`` (warned once)."""
    global _TRITON_FAILED
    _TRITON_FAILED = True
    warnings.warn(
        f'pathnorm: the Triton prox failed here ({type(err).__name__}: {err}); method="auto" '
        'runs the "sort" prox on CUDA from now on (method="triton" shows the error)',
        RuntimeWarning,
        stacklevel=4,
    )


def _prox_kernel(
    w_in: Tensor, w_out: Tensor, lam: float, check_finite: bool, in_place: bool
) -> tuple[Tensor, Tensor]:
    """``method="kernel"``: it checks finiteness in its first pass over the weights, for free."""
    kernel = _kernel_module()
    assert kernel is not None  # checked by _resolve_method
    return kernel.prox_tensors(w_in, w_out, lam, check_finite, in_place)


def _prox_sort(
    w_in: Tensor, w_out: Tensor, lam: float, check_finite: bool, in_place: bool
) -> tuple[Tensor, Tensor]:
    """``method="sort"``: eagerly, or replayed as a CUDA graph (which checks finiteness too,
    with one sync for both matrices)."""
    graph = cached_graph(w_in, w_out, prox_rows)
    if graph is not None:
        return graph(w_in, w_out, lam, check_finite, in_place)
    if check_finite:
        _check_finite(w_in, "w_in")
        _check_finite(w_out, "w_out")
    # Rows of x are units: sorting and scanning along strided rows is much slower, so copy; in
    # float64 whatever the weights' dtype, as the kernel (float32 cumulative sums moved the
    # thresholds by ~50 ulps, and with them the zero pattern).
    x, y = w_out.detach().to(torch.float64).t().contiguous(), w_in.detach().to(torch.float64)
    v, w = prox_rows(x, y, lam)
    if in_place:
        w_in.copy_(w)
        w_out.copy_(v.t())
        return w_in, w_out
    return w.to(w_in.dtype), v.t().to(w_out.dtype).contiguous()


def _prox_triton(
    w_in: Tensor, w_out: Tensor, lam: float, check_finite: bool, in_place: bool
) -> tuple[Tensor, Tensor]:
    """``method="triton"``: one kernel launch, in place on the weights or on fresh copies."""
    triton = _triton_module()
    assert triton is not None  # checked by _resolve_method
    if check_finite:  # before anything is written (one sync for both matrices)
        _check_finite(w_in, "w_in")
        _check_finite(w_out, "w_out")
    if not in_place:
        w_in = w_in.detach().clone(memory_format=torch.contiguous_format)
        w_out = w_out.detach().clone(memory_format=torch.contiguous_format)
    triton.prox_inplace(w_in, w_out, lam)
    if in_place:  # written by the kernel, behind autograd's back
        torch.autograd.graph.increment_version(w_in)
        torch.autograd.graph.increment_version(w_out)
    return w_in, w_out


def path_norm(w_in: Tensor, w_out: Tensor) -> Tensor:
    """1-path-norm ``sum_i ||w_out[:, i]||_1 ||w_in[i, :]||_1`` (a 0-d tensor, differentiable):
    a bound of the (l_inf, l_1) Lipschitz constant of ``x -> w_out act(w_in x)`` for any
    activation with slope in [0, 1] (Theorem 1 of the paper)."""
    check_pair(w_in, w_out)
    return (w_out.abs().sum(0) * w_in.abs().sum(1)).sum()


def product_bound(w_in: Tensor, w_out: Tensor) -> Tensor:
    """Layer-wise bound ``||w_out^T||_{inf,1} * ||w_in||_inf`` = ``sum|w_out| * max_i ||w_in[i]||_1``
    (0 for a layer pair without hidden units)."""
    check_pair(w_in, w_out)
    rows = w_in.abs().sum(1)
    top = rows.amax() if rows.numel() else rows.new_zeros(())
    return w_out.abs().sum() * top


def prox_l1(w: Tensor, lam: float | Tensor, *, check_finite: bool = True) -> Tensor:
    """Soft-thresholding ``sign(w) max(|w| - lam, 0)``: the prox of ``lam ||w||_1``
    (``check_finite``: raise :class:`NonFiniteWeightsError` on NaN/inf weights, one sync).
    Tensor ops, so autograd can follow it, unlike the path-norm prox and the projection."""
    lam = check_scalar(lam, "lam")
    if not isinstance(w, Tensor) or not w.is_floating_point():
        raise ValueError("w must be a floating-point torch.Tensor")
    if check_finite:
        _check_finite(w, "w")
    return _baselines.soft_threshold(w, lam)


def prox_l1_(w: Tensor, lam: float | Tensor, *, check_finite: bool = True) -> Tensor:
    """In-place :func:`prox_l1`."""
    new = prox_l1(w, lam, check_finite=check_finite)
    check_writable([(w, "w")])
    with torch.no_grad():
        w.copy_(new)
    return w


def project_rows_l1_ball(w: Tensor, radius: float | Tensor, *, check_finite: bool = True) -> Tensor:
    """Project each row of ``w`` (shape (n, m)) onto ``{z : ||z||_1 <= radius}``, exactly
    (sort-based, Duchi et al. 2008; ``check_finite`` as in :func:`prox_l1`).

    On an ``nn.Linear`` weight this enforces ``||w||_inf <= radius`` (the l_inf operator norm
    is the largest row l1 norm): the layer-wise constraint of Parseval-style training. Exact to
    the rounding of the row's largest entry: a row whose largest entry exceeds ~2^52 times
    ``radius`` (2^23 for float32 weights off the CPU kernel) may land outside the ball by that.
    The result carries no autograd history (as :func:`prox_path_norm`).
    """
    radius = check_scalar(radius, "radius")
    check_matrix(w, "w")
    if check_finite:
        _check_finite(w, "w")
    return _baselines.project_rows(w, radius)


def project_rows_l1_ball_(
    w: Tensor, radius: float | Tensor, *, check_finite: bool = True
) -> Tensor:
    """In-place :func:`project_rows_l1_ball`."""
    new = project_rows_l1_ball(w, radius, check_finite=check_finite)
    check_writable([(w, "w")])
    with torch.no_grad():
        w.copy_(new)
    return w
