"""How the hook of :mod:`pathnorm_lightning.hook` checks that the weights it updates are finite:
at the step (:class:`SyncCheck`, or the prox's own check) or, on CUDA, without stalling the GPU
(:class:`DeferredCheck`); and the error that names the target and the step."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pathnorm_lightning._common import NonFiniteWeightsError, finite_flag

if TYPE_CHECKING:
    from pathnorm_lightning._target import StepTarget


class FiniteCheck:
    """How an update checks that its weights are finite; this base class checks nothing. An
    update calls the check on its target unless :attr:`synchronous` is set: then it checks by
    itself (the prox's own ``check_finite``, free in the CPU kernel)."""

    #: Whether a check at this step, waiting for the device, is wanted.
    synchronous = False

    def __call__(self, target: StepTarget) -> None:
        """Check ``target``'s weights (or queue a check of them)."""

    def collect(self, keep: int | None = None) -> None:
        """Raise on a failed check that has completed (deferred checks only)."""


class SyncCheck(FiniteCheck):
    """Checks at this step, with one host sync (CPU, where that costs nothing)."""

    synchronous = True

    def __call__(self, target: StepTarget) -> None:
        flag = finite_flag(target.weights)
        if flag is not None and not bool(flag):
            raise NonFiniteWeightsError(target.name)


#: What to do when a deferred flag turns out False: ``(step, target name) -> None``.
OnFalse = Callable[[int, str], None]


class DeferredCheck(FiniteCheck):
    """Checks without stalling the GPU: an on-device flag per step is copied asynchronously
    into a pinned host slot and read when it has arrived (a few steps later at most; all of
    them by :meth:`collect` with ``keep=0``). The same queue carries other on-device flags
    (:meth:`push`), e.g. whether a pair has a hidden unit left. ``owner``: the name errors
    start with; ``step()``: the number of the step being checked.
    """

    def __init__(self, owner: str, step: Callable[[], int]) -> None:
        self.owner = owner
        self.step = step
        self.pending: deque[tuple[int, str, int, OnFalse]] = deque()  # (step, name, slot, ...)
        self.flags: Tensor | None = None
        self.events: list[torch.cuda.Event] = []
        self.next_slot = 0

    def __call__(self, target: StepTarget) -> None:
        flag = finite_flag(target.weights)
        if flag is not None:
            self.push(flag, target.name, self._non_finite)

    def push(self, flag: Tensor, name: str, on_false: OnFalse) -> None:
        """Queue the on-device 0-d bool ``flag``; ``on_false(step, name)`` runs if it is False."""
        if self.flags is None:  # allocated once: pinned slots, and an event per slot
            self.flags = torch.ones(_MAX_PENDING, dtype=torch.bool, pin_memory=True)
            self.events = [torch.cuda.Event() for _ in range(_MAX_PENDING)]
        self.collect(keep=_MAX_PENDING - 1)  # the slot must be free (rarely waits)
        slot = self.next_slot
        self.next_slot = (slot + 1) % _MAX_PENDING
        self.flags[slot].copy_(flag, non_blocking=True)
        self.events[slot].record(torch.cuda.current_stream(flag.device))
        self.pending.append((self.step(), name, slot, on_false))

    def collect(self, keep: int | None = None) -> None:
        """Read the flags that have arrived; with ``keep``, wait until at most ``keep`` remain."""
        while self.pending:
            step, name, slot, on_false = self.pending[0]
            if keep is None or len(self.pending) <= keep:
                if not self.events[slot].query():
                    return
            else:
                self.events[slot].synchronize()
            self.pending.popleft()
            assert self.flags is not None
            if not bool(self.flags[slot]):
                on_false(step, name)

    def _non_finite(self, step: int, name: str) -> None:
        self.pending.clear()
        raise non_finite(self.owner, name, step)


_MAX_PENDING = 64  # CUDA flags in flight before a step waits for the oldest


class StepError(NonFiniteWeightsError):
    """Non-finite weights, reported by the hook with the target and the step."""


def non_finite(owner: str, name: str, step: int | None = None) -> NonFiniteWeightsError:
    when = "the optimizer step" if step is None else f"optimizer step {step}"
    late = (
        ""
        if step is None
        else " (on CUDA the check reads its flag when it has reached the host, without "
        "stalling the GPU, so training may have gone on for a few steps)"
    )
    return StepError(
        f"{owner}: the weights of {name} contain NaN or inf after {when}{late}; check the "
        "learning rate and the loss for divergence. The prox of non-finite weights is undefined."
    )
