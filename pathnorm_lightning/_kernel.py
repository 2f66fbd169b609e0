"""The Python side of the compiled CPU prox (:mod:`._kernel_jit`, numba): the arguments as the
compiled entry takes them, the step hook's planned entry, and the one-time compile."""

from __future__ import annotations

import threading
from typing import Any

import numba
import numpy as np
import torch
from torch import Tensor

from pathnorm_lightning._common import compute_dtype, non_finite
from pathnorm_lightning._kernel_jit import _PRESORT, _prox_all

_NOT_SORTED = np.empty((0, 0))
_compiled = False
_COMPILE_LOCK = threading.Lock()


def _compile() -> None:
    """Compile (or load from numba's on-disk cache) every signature of the entry point, always
    all of them and in one fixed order, then forbid further compilation.

    Numba's cache names a new signature's file after the entries its index already holds;
    processes that compile different signatures at the same time (parallel test runs, several
    jobs on one machine) can then save one signature's code under another's name. Compiling
    the same list in the same order everywhere makes concurrent writers write the same thing.
    """
    global _compiled
    with _COMPILE_LOCK:  # a second thread must not compile after the first disabled it
        if not _compiled:
            _compile_signatures(_prox_all)
            _compiled = True


def _compile_signatures(entry: Any) -> None:
    for dt in (numba.float32, numba.float64):
        for short in (dt[:, ::1], dt[::1, :]):  # a contiguous copy, or the view w_out.T
            flags = (numba.float64, numba.boolean, numba.boolean)
            entry.compile((short, dt[:, ::1], *flags, _SORTED_TYPE))
    entry.disable_compile()


_SORTED_TYPE = numba.float64[:, ::1]


def prox_inplace(
    short: np.ndarray, long: np.ndarray, lam: float, check_finite: bool, short_is_out: bool
) -> int:
    """Exact prox of every unit, in place: rows of ``short`` (n, p) and ``long`` (n, m), p <= m.

    Args:
        short: one side of every unit, float32 or float64, C- or F-contiguous (e.g. the
            transposed view of a weight).
        long: the other side, the same dtype, C-contiguous (its rows are scanned).
        lam: the prox step, ``0 < lam <= 2``.
        check_finite: stop at the first unit holding a NaN or inf, writing nothing.
        short_is_out: whether ``short`` holds the outgoing weights (it fixes the tie order).

    Returns:
        -1, or (with ``check_finite``) the index of the first unit holding a NaN or inf.
    """
    if not _compiled:
        _compile()
    x_sorted = _NOT_SORTED
    if short.shape[1] > _PRESORT:  # numpy's vectorised sort beats sorting row by row
        x_sorted = np.empty(short.shape)
        np.abs(short, out=x_sorted)
        np.negative(x_sorted, out=x_sorted)
        x_sorted.sort(axis=1)
        np.negative(x_sorted, out=x_sorted)
    return int(_prox_all(short, long, lam, check_finite, short_is_out, x_sorted))


def prox_tensors(
    w_in: Tensor, w_out: Tensor, lam: float, check_finite: bool, in_place: bool
) -> tuple[Tensor, Tensor]:
    """The kernel on torch CPU weights (``method="kernel"``): on contiguous float32/64 working
    copies, or straight on a weight that is one (in place; its version counter is bumped, as
    any in-place torch op does, so autograd sees the change).

    Raises:
        NonFiniteWeightsError: with ``check_finite``, a NaN or inf weight (nothing written).
    """
    cd = compute_dtype(w_in.dtype)
    n = w_in.shape[0]
    p, m = w_out.shape[0], w_in.shape[1]

    def working(w: Tensor) -> Tensor:  # C-contiguous, dtype cd: ``w`` itself when possible
        if in_place and w.dtype == cd and w.is_contiguous():
            return w.detach()
        return torch.empty(w.shape, dtype=cd).copy_(w.detach())

    a, b = working(w_in), working(w_out)  # (n, m), (p, n)
    with torch.no_grad():
        if p <= m:  # the short side is read and written through the transposed view
            bad = prox_inplace(b.numpy().T, a.numpy(), lam, check_finite, True)
        else:  # the kernel sorts the first (short) side: swap roles (the problem is symmetric)
            long = torch.empty(n, p, dtype=cd).copy_(b.t())  # rows are scanned: contiguous
            bad = prox_inplace(a.numpy(), long.numpy(), lam, check_finite, False)
            if bad < 0:
                b.copy_(long.t())
        if bad >= 0:  # unit `bad` holds a NaN or inf; nothing was written
            raise non_finite("w_out" if bool(torch.isfinite(w_in[bad]).all()) else "w_in")
        if not in_place:
            return a.to(w_in.dtype), b.to(w_out.dtype)
        for w, work in ((w_in, a), (w_out, b)):
            if work.data_ptr() != w.data_ptr():
                w.copy_(work)
            else:  # written by numba, behind autograd's back
                torch.autograd.graph.increment_version(w)
    return w_in, w_out


class PlannedProx:
    """The kernel on one pair's weights as planned by
    :func:`pathnorm_lightning.functional.planned_prox` (the facade's checks ran then): each call
    runs the compiled entry on numpy views cached then, without numba's type dispatch. Valid
    while the weights keep their storage, shape and dtype; only for C-contiguous float32/64 CPU
    weights with ``p <= m`` (the short side ``w_out.T``).
    """

    __slots__ = ("_entry", "_long", "_short", "_sorted", "w_in", "w_out")

    def __init__(self, w_in: Tensor, w_out: Tensor) -> None:
        if not _compiled:
            _compile()
        self.w_in, self.w_out = w_in.detach(), w_out.detach()
        self._short = self.w_out.numpy().T  # (n, p), F-contiguous: written through
        self._long = self.w_in.numpy()  # (n, m)
        self._sorted = (
            np.empty(self._short.shape) if self._short.shape[1] > _PRESORT else _NOT_SORTED
        )
        args = (self._short, self._long, 1.0, True, True, self._sorted)
        compiled = _prox_all.overloads.get(tuple(numba.typeof(a) for a in args))
        entry = getattr(compiled, "entry_point", None)  # skips numba's type dispatch
        self._entry = _prox_all if entry is None else entry

    @staticmethod
    def applies(w_in: Tensor, w_out: Tensor) -> bool:
        """Whether a pair that passed the facade's checks is one this plan runs on."""
        return (
            w_in.device.type == "cpu"
            and w_in.dtype in (torch.float32, torch.float64)
            and w_in.is_contiguous()
            and w_out.is_contiguous()
            and 0 < w_out.shape[0] <= w_in.shape[1]
            and w_in.shape[0] > 0
        )

    def __call__(self, lam: float, check_finite: bool) -> bool:
        """The prox with step ``lam`` in place, as ``prox_path_norm_``; False (nothing done)
        for a ``lam`` outside ``(0, 2]``, which the facade handles (0, capping, errors)."""
        if not 0.0 < lam <= 2.0:
            return False
        short = self._short
        if short.shape[1] > _PRESORT:
            x_sorted = self._sorted
            np.abs(short, out=x_sorted)
            np.negative(x_sorted, out=x_sorted)
            x_sorted.sort(axis=1)
            np.negative(x_sorted, out=x_sorted)
        bad = self._entry(short, self._long, lam, check_finite, True, self._sorted)
        if bad >= 0:  # unit `bad` holds a NaN or inf; nothing was written
            raise non_finite("w_out" if bool(torch.isfinite(self.w_in[bad]).all()) else "w_in")
        torch.autograd.graph.increment_version(self.w_in)  # written by numba, behind
        torch.autograd.graph.increment_version(self.w_out)  # autograd's back
        return True
