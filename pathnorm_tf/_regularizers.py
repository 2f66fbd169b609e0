"""The regularizers the Keras optimizers apply after each real step, one class each: the twins
of the torch callbacks ``PathNormProx``, ``L1Prox`` and ``LayerwiseLinfProjection``.

Each class says what configures it (:attr:`Regularizer.strength`), what it acts on
(:attr:`Regularizer.targets`) and how it updates one target (:meth:`Regularizer.update`: tf ops
over static shapes, for eager, graph and XLA use). The optimizers (:mod:`pathnorm_tf.optimizers`)
pick a class by its name in :data:`REGULARIZERS` (``regularizer="path" | "l1" | "linf"``) and
do the rest: resolving the targets, the once-per-real-update invariant, the finiteness check
and the writes.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import tensorflow as tf

from pathnorm_tf._baselines import project_linf_operator_norm, soft_threshold

__all__ = ["REGULARIZERS", "L1Prox", "LinfProjection", "PathProx", "Regularizer"]

#: ``(kernel_in, kernel_out, step) -> (new_in, new_out)``: the exact prox on unit views; with
#: ``verdict=True`` also whether every entry was finite (``functional._prox_kernels``).
Prox = Callable[..., tuple[tf.Tensor, ...]]


class Regularizer(abc.ABC):
    """One regularizer: its configuration and its update of one target."""

    #: the public name (``regularizer=...``)
    name: ClassVar[str]
    #: ``"lam"``: a prox with step ``lam * lr``; ``"radius"``: a projection (no lr)
    strength: ClassVar[str]
    #: ``"pairs"`` (two kernels sharing hidden units) or ``"layers"`` (one kernel each)
    targets: ClassVar[str]

    def __init__(self, value: float) -> None:
        self.value = value

    def step(self, learning_rate: Any) -> tf.Tensor:
        """``lam * lr`` in float64, rounded once (as the torch side's Python float)."""
        return tf.constant(self.value, tf.float64) * tf.cast(learning_rate, tf.float64)

    @abc.abstractmethod
    def update(
        self, values: Sequence[tf.Tensor], layout: Any, learning_rate: Any, prox: Prox
    ) -> list[tf.Tensor]:
        """The target's new kernels from ``values`` (its kernels, read once): a pair's
        ``layout`` is its :class:`~pathnorm_tf.layers.PairLayout`, a layer's its
        :class:`~pathnorm_tf.layers.LayerEntry`; ``prox`` is the exact path-norm prox."""

    def checked_update(
        self, values: Sequence[tf.Tensor], layout: Any, learning_rate: Any, prox: Prox
    ) -> tuple[list[tf.Tensor], tf.Tensor] | None:
        """:meth:`update` and whether ``values`` are all finite (0-d bool), read off the
        update's own pass (the new kernels are undefined where it is False); None where the
        update has no such pass (the caller checks the kernels first)."""
        return None


class PathProx(Regularizer):
    """The exact 1-path-norm prox with step ``lam * lr`` on the pair's unit views (the kernels
    themselves for a Dense pair), written back in the kernels' layouts."""

    name, strength, targets = "path", "lam", "pairs"

    def update(
        self, values: Sequence[tf.Tensor], layout: Any, learning_rate: Any, prox: Prox
    ) -> list[tf.Tensor]:
        first, second = values
        view_in, view_out = layout.views(first, second)
        new_in, new_out = prox(view_in, view_out, self.step(learning_rate))
        return list(layout.natives(new_in, new_out, tuple(first.shape), tuple(second.shape)))

    def checked_update(
        self, values: Sequence[tf.Tensor], layout: Any, learning_rate: Any, prox: Prox
    ) -> tuple[list[tf.Tensor], tf.Tensor] | None:
        """The views hold every entry of both kernels, so the prox's per-unit sums judge them
        (``functional._all_finite``)."""
        first, second = values
        view_in, view_out = layout.views(first, second)
        new_in, new_out, finite = prox(view_in, view_out, self.step(learning_rate), verdict=True)
        shapes = tuple(first.shape), tuple(second.shape)
        return list(layout.natives(new_in, new_out, *shapes)), finite


class L1Prox(Regularizer):
    """Soft-thresholding of every weight by ``lam * lr``."""

    name, strength, targets = "l1", "lam", "layers"

    def update(
        self, values: Sequence[tf.Tensor], layout: Any, learning_rate: Any, prox: Prox
    ) -> list[tf.Tensor]:
        return [soft_threshold(values[0], self.step(learning_rate))]


class LinfProjection(Regularizer):
    """Each unit's incoming weights (a column of the entry's in-view) onto the l1 ball of
    ``radius``: ``||K||_{inf->inf} <= radius``, the paper's layer-wise baseline."""

    name, strength, targets = "linf", "radius", "layers"

    def update(
        self, values: Sequence[tf.Tensor], layout: Any, learning_rate: Any, prox: Prox
    ) -> list[tf.Tensor]:
        (value,) = values
        rows = project_linf_operator_norm(layout.in_view(value), self.value, check_finite=False)
        return [layout.in_native(rows, tuple(value.shape))]


#: The regularizers by public name.
REGULARIZERS: dict[str, type[Regularizer]] = {
    cls.name: cls for cls in (PathProx, L1Prox, LinfProjection)
}
