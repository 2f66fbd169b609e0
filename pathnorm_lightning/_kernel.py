"""The Python side of the compiled CPU prox (:mod:`._kernel_jit`, numba): the arguments as the
compiled entry takes them, the step hook's planned entry, and the one-time compile."""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import numba
import numpy as np
import torch
from torch import Tensor

from pathnorm_lightning._common import compute_dtype, non_finite
from pathnorm_lightning._kernel_jit import _PRESORT, _prox_all, _prox_par

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


def _compile_signatures(entry: Any, layouts: str = "CF", chunks: bool = False) -> None:
    """Compile ``entry`` for float32 and float64 and each layout of the short side (C: a
    contiguous copy; F: the view w_out.T), with the thread count after ``lam`` if ``chunks``."""
    for dt in (numba.float32, numba.float64):
        for layout in layouts:
            short = dt[:, ::1] if layout == "C" else dt[::1, :]
            lam = (numba.float64, numba.intp) if chunks else (numba.float64,)
            entry.compile((short, dt[:, ::1], *lam, numba.boolean, numba.boolean, _SORTED_TYPE))
    entry.disable_compile()


_SORTED_TYPE = numba.float64[:, ::1]

# A layer runs on several threads only from this many weights (n * m) and this many units per
# thread: below, waking a thread costs more than it saves.
_PARALLEL_WEIGHTS = 1 << 15
_PARALLEL_UNITS = 32
_parallel_pid: int | None = None  # the process that may run _prox_par (-1: none); see below


def _chunks(n: int, m: int) -> int:
    """Threads for the kernel on ``n`` units of ``m`` long-side weights: as many as torch's
    intra-op threads (what the training step around it uses; 1 in a process set to one
    thread), at most numba's thread count and one per ``_PARALLEL_UNITS`` units; 1 for a small
    layer, or when numba's threading layer is its ``workqueue`` (slower than one thread here,
    and it aborts the process when two threads launch parallel code at once)."""
    if n * m < _PARALLEL_WEIGHTS:
        return 1
    k = min(torch.get_num_threads(), n // _PARALLEL_UNITS)
    if k < 2 or not _parallel_ok():
        return 1
    return min(k, numba.get_num_threads())  # after the check: reading it starts numba's layer


def _parallel_ok() -> bool:
    """Whether this process may run :func:`_prox_par`: numba's threading layer (chosen at its
    first parallel launch, which the first call makes after compiling or loading the entry, as
    :func:`_compile`) is OpenMP or TBB, and this process launched it. GNU OpenMP's threads do
    not survive a fork, and numba ends a forked child that launches parallel code after its
    parent did: such a child keeps to one thread."""
    global _parallel_pid
    if _parallel_pid is None:
        with _COMPILE_LOCK:
            if _parallel_pid is None:
                try:
                    # It takes the short side transposed, C-contiguous (w_out itself): two
                    # signatures, about 4 s each; a short side that is a C-contiguous copy
                    # (p > 1) runs on one thread.
                    _compile_signatures(_prox_par, layouts="C", chunks=True)
                    x = np.zeros((2, 2))
                    _prox_par(x, np.zeros((2, 2)), 1.0, 2, False, True, _NOT_SORTED)
                    ok = numba.threading_layer() in ("omp", "tbb")
                except Exception as err:  # the one-thread entry still works
                    warnings.warn(
                        f"pathnorm: the prox kernel's entry for several threads is not "
                        f"available ({type(err).__name__}: {err}); it runs on one thread.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    ok = False
                _parallel_pid = os.getpid() if ok else -1
    return _parallel_pid == os.getpid()


def _f_layout(short: np.ndarray) -> bool:
    """Whether ``short.T`` is C-contiguous, the one layout :func:`_prox_par` takes it in."""
    return bool(short.flags.f_contiguous)


def _run_parallel(
    entry: Any, short: np.ndarray, long: np.ndarray, lam: float, chunks: int, *flags: Any
) -> int:
    """``entry`` (:func:`_prox_par`, given ``short.T``) on ``chunks`` of numba's threads (the
    calling thread's numba thread count restored after)."""
    threads = numba.get_num_threads()
    if threads == chunks:
        return int(entry(short.T, long, lam, chunks, *flags))
    numba.set_num_threads(chunks)
    try:
        return int(entry(short.T, long, lam, chunks, *flags))
    finally:
        numba.set_num_threads(threads)


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
    chunks = _chunks(*long.shape) if _f_layout(short) else 1
    if chunks > 1:
        return _run_parallel(
            _prox_par, short, long, lam, chunks, check_finite, short_is_out, x_sorted
        )
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

    __slots__ = ("_entry", "_long", "_par", "_short", "_sorted", "w_in", "w_out")

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
        self._entry = _entry_point(_prox_all, args)
        # The parallel entry, looked up on its first use; False: not compiled for this layout.
        self._par: Any = None if _f_layout(self._short) else False

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
        # torch's thread count may change between steps
        chunks = 1 if self._par is False else _chunks(*self._long.shape)
        if chunks > 1:
            if self._par is None:
                self._par = _entry_point(
                    _prox_par, (short.T, self._long, lam, 2, True, True, self._sorted)
                )
            bad = _run_parallel(
                self._par, short, self._long, lam, chunks, check_finite, True, self._sorted
            )
        else:
            bad = self._entry(short, self._long, lam, check_finite, True, self._sorted)
        if bad >= 0:  # unit `bad` holds a NaN or inf; nothing was written
            raise non_finite("w_out" if bool(torch.isfinite(self.w_in[bad]).all()) else "w_in")
        torch.autograd.graph.increment_version(self.w_in)  # written by numba, behind
        torch.autograd.graph.increment_version(self.w_out)  # autograd's back
        return True


def _entry_point(dispatcher: Any, args: tuple[Any, ...]) -> Any:
    """The compiled function for ``args``, called without numba's type dispatch."""
    compiled = dispatcher.overloads.get(tuple(numba.typeof(a) for a in args))
    entry = getattr(compiled, "entry_point", None)
    return dispatcher if entry is None else entry
