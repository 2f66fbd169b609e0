"""The exact 1-path-norm prox as one Triton kernel, host side: the checks, the launch
configuration and the launches (CUDA; on CPU tensors under Triton's interpreter,
``TRITON_INTERPRET=1``). The kernel and its algorithm: :mod:`pathnorm_lightning._triton_kernels`.

Layout and problem as in :mod:`pathnorm_lightning.functional`: hidden unit ``i`` owns
``x = w_out[:, i]`` (outgoing) and ``y = w_in[i, :]`` (incoming).

Nothing is read back on the host: ``lam`` may be a device tensor (read by the kernel, so a
captured CUDA graph replays with new values), and non-finite weights are reported through an
int32 flag on the device (``|= 1`` for ``w_in``, ``|= 2`` for ``w_out``), to be read whenever the
caller chooses. A unit holding NaN or inf gets an unspecified result; the other units are exact.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from typing import Any

import torch
from torch import Tensor

from pathnorm_lightning import _triton_kernels
from pathnorm_lightning._common import optional_module

__all__ = ["MAX_SIDE", "available", "prox_inplace", "supports"]

# The longest side a unit may have: the full search holds the long side and two float64 prefix
# sums in registers; past this it spills, and a sort-based method is the better choice.
MAX_SIDE = 8192

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Above this, lam admits no support pair at all (k l lam^2 >= 1 for every k, l >= 1): only the
# two trivial points remain and the prox no longer depends on lam. Capping keeps lam^2 finite.
_LAM_CAP = 2.0
# Feasibility tiles of at most this many pairs per unit block (registers).
_TILE = 8192
# The band search: at most this many columns (a power of two; 0: always the full search), for
# long sides of at least _BAND_MIN_BLOCK (below that the full sort is as cheap).
_BAND = 64
_BAND_MIN_BLOCK = 256

_KERNELS: dict[bool, Any] = {}  # the jitted kernel, per interpreter mode


def _interpreting() -> bool:
    """Whether Triton's interpreter runs the kernel: ``TRITON_INTERPRET=1`` was set before triton
    was imported (it builds its language library for one mode then; Lightning imports it with
    torch's compiler)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    triton = optional_module("triton")
    return triton is not None and type(triton.language.standard.sum).__name__ == (
        "InterpretedFunction"
    )


def available() -> bool:
    """Whether the kernel can run here: Triton imports, and there is a CUDA device or Triton's
    interpreter is on (``TRITON_INTERPRET=1``, for CPU tensors)."""
    return (_interpreting() or torch.cuda.is_available()) and optional_module("triton") is not None


def supports(w_in: Tensor, w_out: Tensor) -> bool:
    """Whether :func:`prox_inplace` handles this pair (else use another method): paired 2-D
    weights of one dtype (float32/64, float16, bfloat16) and device (CUDA, or CPU under the
    interpreter), sides of at most :data:`MAX_SIDE`, no expanded storage, Triton available."""
    if not (isinstance(w_in, Tensor) and isinstance(w_out, Tensor)):
        return False
    if w_in.dim() != 2 or w_out.dim() != 2 or w_in.shape[0] != w_out.shape[1]:
        return False
    if w_in.dtype != w_out.dtype or w_in.dtype not in _DTYPES or w_in.device != w_out.device:
        return False
    if max(w_in.shape[1], w_out.shape[0]) > MAX_SIDE:
        return False
    for w in (w_in, w_out):
        if any(s == 0 and d > 1 for s, d in zip(w.stride(), w.shape, strict=True)):
            return False
    device = w_in.device.type
    if device != "cuda" and not (device == "cpu" and _interpreting()):
        return False
    return optional_module("triton") is not None


def _pow2(size: int) -> int:
    """The least power of two >= ``size`` (1 for 0)."""
    return 1 << max(size - 1, 0).bit_length()


def _block(size: int) -> int:
    """The register block for a side of ``size`` entries (a power of two, at least 16)."""
    return max(16, _pow2(size))


def _lam_args(lam: float | Tensor, device: torch.device) -> tuple[int, Tensor | None]:
    """``(bits, tensor)``: a Python ``lam`` goes to the kernel as the bit pattern of its float64
    (Triton passes Python floats as float32); a tensor ``lam`` is read on the device."""
    if isinstance(lam, Tensor):
        if lam.numel() != 1 or not lam.is_floating_point() or lam.device != device:
            raise ValueError(
                f"lam must be a one-element floating tensor on {device}, got shape "
                f"{tuple(lam.shape)}, {lam.dtype} on {lam.device}"
            )
        return 0, lam
    if isinstance(lam, bool) or not isinstance(lam, (int, float)):
        raise ValueError(f"lam must be a real number or a tensor, got {lam!r}")
    value = float(lam)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"lam must be a finite number >= 0, got {lam!r}")
    return struct.unpack("<q", struct.pack("<d", min(value, _LAM_CAP)))[0], None


def _launch_shape(n: int, block_p: int, block_m: int) -> tuple[int, int, int]:
    """``(units per program, k per tile, warps)``. On a GPU a program takes one unit when its
    long side fills a block of threads (more parallelism, fewer registers per program), a few
    for small layers, a number that depends on the block sizes only (each configuration is a
    compilation). The interpreter runs programs one after another in Python, so it takes as
    many units per program as its tile budget allows (the work is then numpy's)."""
    block_k = max(1, min(block_p, _TILE // block_m))
    per_unit = block_k * block_m
    if _interpreting():
        units = max(1, min((1 << 16) // per_unit, _pow2(n)))
    else:
        units = max(1, 2048 // per_unit)
    warps = 4 if block_m * units <= 2048 else 16  # (fewer registers per thread: no spills)
    return units, block_k, warps


def prox_inplace(
    w_in: Tensor, w_out: Tensor, lam: float | Tensor, flag: Tensor | None = None
) -> None:
    """Exact prox of ``lam * path_norm(w_in, w_out)``, written into ``w_in`` and ``w_out``.

    One kernel launch, two for long sides of 256 or more (the band search, then the full
    search of the units it left, usually none); no host synchronisation, so the call can be
    captured in a CUDA graph (after a first call outside the capture has compiled the kernel
    for these shapes).

    Args:
        w_in, w_out: the (n, m) and (p, n) weights of the two layers (one dtype and device).
        lam: the prox step, >= 0: a Python number, or a one-element floating tensor on the
            weights' device (read by the kernel; the caller keeps it finite and >= 0).
        flag: optional int32 tensor on the weights' device; ``flag[0]`` is ORed with 1 (NaN or
            inf in ``w_in``) or 2 (in ``w_out``), never cleared here.

    Raises:
        ValueError: the pair is not one :func:`supports` accepts, or ``lam``/``flag`` is bad.
    """
    if not supports(w_in, w_out):
        raise ValueError(
            "the Triton prox does not handle this pair: it needs Triton, 2-D weights w_in "
            "(n, m) and w_out (p, n) of one float dtype on one CUDA device (CPU only under "
            f"TRITON_INTERPRET=1), sides of at most {MAX_SIDE} and no expanded storage; got "
            f"w_in {tuple(w_in.shape)} {w_in.dtype} on {w_in.device}, w_out "
            f"{tuple(w_out.shape)} {w_out.dtype} on {w_out.device}; use method='sort'"
        )
    dev = w_in.device
    lam_bits, lam_t = _lam_args(lam, dev)
    if flag is not None and (
        not isinstance(flag, Tensor)
        or flag.dtype != torch.int32
        or flag.numel() < 1
        or flag.device != dev
    ):
        raise ValueError(f"flag must be an int32 tensor on {dev} with at least 1 entry")
    n, m = w_in.shape
    p = w_out.shape[0]
    if n == 0 or m == 0 or p == 0:  # an empty side: the prox is the identity
        return
    kernel = _kernel()
    # Each side as the kernel reads it, strided (no copies): (tensor, unit stride, element
    # stride, length). The shorter side is enumerated, the longer one searched.
    outgoing = (w_out.detach(), w_out.stride(1), w_out.stride(0), p)
    incoming = (w_in.detach(), w_in.stride(0), w_in.stride(1), m)
    swapped = p > m  # the short side is w_in's rows
    short, long_ = (incoming, outgoing) if swapped else (outgoing, incoming)
    block_p, block_m = _block(short[3]), _block(long_[3])
    units, block_k, warps = _launch_shape(n, block_p, block_m)
    grid = (_cdiv(n, units),)
    band = _BAND if block_m >= _BAND_MIN_BLOCK else 0
    dummy = w_in.detach()  # for pointer arguments a configuration does not use
    slots = grid[0] * units
    scratch = torch.empty(slots * band, dtype=torch.float64, device=dev) if band else dummy
    need = torch.empty(slots, dtype=torch.int32, device=dev) if band else dummy
    args = (
        *short,
        *long_,
        n,
        lam_t if lam_t is not None else dummy,
        lam_bits,
        flag if flag is not None else dummy,
        scratch,
        need,
    )
    consts = dict(
        LAM_FROM_PTR=lam_t is not None,
        HAS_FLAG=flag is not None,
        SWAPPED=swapped,
        WIDE=w_in.dtype == torch.float64,
        BF16=w_in.dtype == torch.bfloat16,
        UNITS=units,
        BLOCK_P=block_p,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        BAND=max(band, 1),  # band 0 (no band search): one dummy column
        BAND_K=max(1, min(block_p, _TILE // max(band, 1))),
        LOG_U=units.bit_length() - 1,
        LOG_P=block_p.bit_length() - 1,
        LOG_M=block_m.bit_length() - 1,
        LOG_BAND=max(band, 1).bit_length() - 1,
    )
    if band:  # the band search, then the full search of the units it left (usually none)
        kernel[grid](*args, 1, MODE=1, num_warps=warps, **consts)
        walk = _cdiv(grid[0], _programs(dev))  # units per program, usually none to solve
        kernel[(_cdiv(grid[0], walk),)](*args, walk, MODE=2, num_warps=_full_warps(warps), **consts)
    else:
        kernel[grid](*args, 1, MODE=0, num_warps=_full_warps(warps), **consts)


@functools.cache
def _programs(device: torch.device) -> int:
    """Programs for the deferred-units pass: two per multiprocessor on a GPU (one in the
    interpreter, which runs them one after another)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _full_warps(warps: int) -> int:
    """Warps for the full search: twice the band search's (it holds the whole sorted long side
    and its prefix sums in registers), at most 16."""
    return min(2 * warps, 16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel() -> Any:
    """The jitted kernel, built on first use (so that ``TRITON_INTERPRET`` is read then, not at
    import: the same process may import this module before a test turns the interpreter on)."""
    interpret = _interpreting()
    if interpret not in _KERNELS:
        triton = optional_module("triton")
        if triton is None:
            raise ValueError("the Triton prox needs triton (pip install triton)")
        _KERNELS[interpret] = _triton_kernels.build(triton)
    return _KERNELS[interpret]
