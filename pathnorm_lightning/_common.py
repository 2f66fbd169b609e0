"""Helpers shared by the prox implementations: argument checks, dtype rules, finiteness, scaling.

Every private topic module (``_sort``, ``_kernel``, ``_cuda_graph``, ``_baselines``) imports
only this module, never the public facade :mod:`pathnorm_lightning.functional`.

Exception types (the same in the Keras package): ``TypeError`` for a ``lam`` or ``radius`` that
is not a real number; ``ValueError`` for a NaN, inf or negative real and for a shape, dtype or
device mismatch; :class:`NonFiniteWeightsError` (a ``ValueError``) for weights holding NaN or inf.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import math
import os
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from shared_spec.scalars import finite_nonnegative


class NonFiniteWeightsError(ValueError):
    """A weight given to the prox holds NaN or inf (the prox is undefined there)."""


def check_scalar(value: Any, name: str) -> float:
    """``value`` (a Python or NumPy real, or a 0-d real array or tensor) as a Python float,
    checked to be finite and >= 0; ``name`` is the argument's name, for the error message.
    The rule, and its messages, are the Keras package's (:mod:`shared_spec.scalars`).

    Raises:
        TypeError: not a real number (str, None, complex, a bool of any kind).
        ValueError: NaN, inf, negative, or an array or tensor that is not 0-d.
    """
    if type(value) is float and 0.0 <= value < math.inf:  # the common case, checked quickly
        return value
    return finite_nonnegative(value, name)


def check_matrix(w: Tensor, name: str) -> None:
    """Raise ``ValueError`` unless ``w`` is a 2-D floating-point tensor."""
    if not isinstance(w, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"{name} must be a 2-D weight matrix, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {w.dtype}")


def check_pair(w_in: Tensor, w_out: Tensor) -> None:
    """Raise ``ValueError`` unless ``w_in`` (n, m) and ``w_out`` (p, n) form one layer pair."""
    check_matrix(w_in, "w_in")
    check_matrix(w_out, "w_out")
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


def check_writable(weights: Sequence[tuple[Tensor, str]]) -> None:
    """Raise ``ValueError`` when an in-place update could not write each entry once: a tensor
    with a stride-0 dimension (``expand``) or whose entries overlap (a view spanning fewer
    memory locations than it has entries, as ``unfold`` makes), or two tensors sharing memory (``w`` passed twice,
    views of one storage, tied weights). Checked before anything is written."""
    for w, name in weights:
        if not w.is_contiguous() and any(
            s == 0 and n > 1 for n, s in zip(w.shape, w.stride(), strict=True)
        ):
            raise ValueError(
                f"{name} is an expanded tensor (stride 0: several entries share one memory "
                "location), so an in-place update cannot give each entry its own value; pass "
                f"{name}.contiguous() or use the out-of-place function"
            )
        if not w.is_contiguous() and w.numel() > 1 + sum(
            (n - 1) * abs(s) for n, s in zip(w.shape, w.stride(), strict=True) if n > 0
        ):
            raise ValueError(
                f"{name} is a view whose entries overlap in memory (e.g. from unfold or "
                "as_strided), so an in-place update cannot give each entry its own value; pass "
                f"{name}.contiguous() or use the out-of-place function"
            )
    for (a, name_a), (b, name_b) in itertools.combinations(weights, 2):
        if shares_memory(a, b):
            raise ValueError(
                f"{name_a} and {name_b} share memory (the same tensor, views of one storage, or "
                "tied weights), so the in-place prox would overwrite one with the other; pass "
                "separate tensors, or use the out-of-place prox_path_norm"
            )


def shares_memory(a: Tensor, b: Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` intersect (conservative for strided views;
    live tensors whose address ranges intersect share one allocation)."""
    if a.numel() == 0 or b.numel() == 0 or a.is_meta or a.device != b.device:
        return False

    def span(w: Tensor) -> tuple[int, int]:
        start = w.data_ptr()
        if w.is_contiguous():  # the common case, without a Python loop over the strides
            return start, start + w.numel() * w.element_size()
        extent = sum((n - 1) * abs(s) for n, s in zip(w.shape, w.stride(), strict=True))
        return start, start + (extent + 1) * w.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def rank_zero_warn(message: str, stacklevel: int = 3) -> None:
    """``warnings.warn(message)`` (a ``UserWarning``) on global rank zero only, without importing
    Lightning: the rank a loaded Lightning has set, else the launcher's environment variables."""
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    rank = getattr(getattr(rank_zero, "rank_zero_only", None), "rank", None)
    if rank is None:
        for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
            if os.environ.get(key, "").isdigit():
                rank = int(os.environ[key])
                break
    if not rank:
        warnings.warn(message, UserWarning, stacklevel=stacklevel)


@functools.cache
def optional_module(name: str) -> ModuleType | None:
    """The module ``name``, or None when it (or a package it needs, e.g. numba) cannot be
    imported; imported once."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the prox computes in: float64 stays, every other float type uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def finite_flag(weights: Sequence[Tensor]) -> Tensor | None:
    """On-device 0-d bool: whether every entry is finite (None for no entries), in one pass:
    min/max propagate NaN and expose +-inf (about 7x cheaper on CPU than ``isfinite(w).all()``,
    which allocates a mask)."""
    ends = [e.reshape(1) for w in weights if w.numel() for e in torch.aminmax(w.detach())]
    return torch.isfinite(torch.cat(ends)).all() if ends else None


def check_finite(w: Tensor, name: str) -> None:
    """Raise :class:`NonFiniteWeightsError` on NaN/inf, with one host sync (none on the
    ``meta`` device: no values there)."""
    flag = None if w.is_meta else finite_flag([w])
    if flag is not None and not bool(flag):
        raise non_finite(name)


def non_finite(name: str) -> NonFiniteWeightsError:
    """The error for NaN/inf entries in the weight called ``name``."""
    return NonFiniteWeightsError(
        f"{name} contains NaN or inf; the prox of non-finite weights is undefined "
        "(check the learning rate and the loss for divergence)"
    )


def unit_exponents(*blocks: Tensor) -> Tensor:
    """Per row ``i``, the binary exponent ``e`` with ``max_j |block[i, j]|`` over all blocks in
    ``[2^(e - 1), 2^e)`` (0 for a row of zeros), as int32. Rows are hidden units."""
    tops = [b.abs().amax(1) for b in blocks if b.shape[1]]
    if not tops:
        return torch.zeros(blocks[0].shape[0], dtype=torch.int32, device=blocks[0].device)
    return torch.frexp(torch.stack(tops).amax(0)).exponent


def ldexp_rows(z: Tensor, e: Tensor) -> Tensor:
    """``z[i, :] * 2^e[i]`` per row, exactly (barring under/overflow of the result): in two
    factors built from their bit patterns, each representable (``2^1074`` is not) and exact
    whatever the platform's ``exp2``."""
    bits, mant = (52, torch.int64) if z.dtype == torch.float64 else (23, torch.int32)
    bias = 1023 if z.dtype == torch.float64 else 127
    e = e.to(torch.int64).clamp(-2 * (bias - 1), 2 * bias)  # (non-finite rows stay bounded)
    half = torch.div(e, 2, rounding_mode="floor")
    out = z
    for part in (half, e - half):
        factor = ((part + bias) << bits).to(mant).view(z.dtype)
        out = out * factor.unsqueeze(1)
    return out
