"""CUDA graphs of the tensor-op prox: one capture per layer shape, replayed at every call.

Eagerly, the "sort" prox is a few hundred small kernels whose launches from Python cost
several milliseconds per call (several SGD steps of the paper's network on an H100), while the
GPU itself is busy for a fraction of that. Captured once, a call is a few launches. Set
``PATHNORM_CUDA_GRAPHS=0`` to run eagerly.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

from pathnorm_lightning._common import non_finite

#: The per-unit prox a graph replays: ``(x, y, lam) -> (v, w)`` on rows of units.
RowsProx = Callable[[Tensor, Tensor, "float | Tensor"], tuple[Tensor, Tensor]]


class GraphedProx:
    """A tensor-op prox of one layer shape as a CUDA graph, replayed at every call.

    A call copies the weights and ``lam`` into the graph's input buffers, replays it and copies
    the results out. The graph also computes whether the weights are finite, so ``check_finite``
    costs one host sync for both matrices. It keeps its intermediates allocated while cached.
    """

    def __init__(self, w_in: Tensor, w_out: Tensor, rows: RowsProx) -> None:
        device = w_in.device
        self.rows = rows
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
        x, y = self.w_out.to(torch.float64).t().contiguous(), self.w_in.to(torch.float64)
        v, w = self.rows(x, y, self.lam)
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
                        raise non_finite("w_in" if not ok_in else "w_out")
                if in_place:
                    w_in.copy_(new_in)
                    w_out.copy_(new_out)
                    return w_in, w_out
                fmt = torch.contiguous_format
                return new_in.clone(memory_format=fmt), new_out.clone(memory_format=fmt)
            finally:  # a call on another stream waits until this one is done with the buffers
                self.done.record(stream)


_GRAPHS: OrderedDict[tuple, GraphedProx | None] = OrderedDict()
_SEEN: OrderedDict[tuple, None] = OrderedDict()  # shapes called once so far
_GRAPHS_LOCK = threading.Lock()
_GRAPHS_MAX = 16  # layer shapes whose graphs (and their intermediates) stay cached


def cached_graph(w_in: Tensor, w_out: Tensor, rows: RowsProx) -> GraphedProx | None:
    """The graph of ``rows`` for the pair ``(w_in, w_out)``'s shapes, dtypes and device, captured
    on the second call with them (a one-off call runs eagerly); None (run ``rows`` eagerly) when
    not CUDA, ``PATHNORM_CUDA_GRAPHS=0``, inside another capture, on the first call, or when the
    capture failed."""
    if w_in.device.type != "cuda" or os.environ.get("PATHNORM_CUDA_GRAPHS", "1") == "0":
        return None
    if torch.cuda.is_current_stream_capturing():  # the caller's own graph records the ops
        return None
    key = (rows, w_in.device, w_in.dtype, w_out.dtype, tuple(w_in.shape), tuple(w_out.shape))
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
            graph: GraphedProx | None = GraphedProx(w_in, w_out, rows)
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
