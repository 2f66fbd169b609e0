"""The regularizers of the main job, one table; imports neither torch nor TensorFlow.

Adding one means a row here, its parts in the three backends' tables (``engine.TORCH``: torch
penalty, prox step, Lightning callback; ``tf_backend.KERAS``: Keras penalty and optimizer;
``certify.G``: the certificates' numpy ``g``; each refuses to import without it), its update in
the libraries, and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OPTIMIZERS", "REGULARIZERS", "TABLE", "Regularizer", "regularizer"]


@dataclass(frozen=True)
class Regularizer:
    """One regularizer of the main job: its vocabulary, its report's style and its shape."""

    name: str  # the CLI's and the results' vocabulary
    label: str  # in the report's tables and plots
    colour: str  # matplotlib colour of its series
    penalty_text: str  # what g is in the training curve's "cross-entropy + lam * g"
    lams: tuple[float, ...]  # the sweep's grid (linf: lam = 1 / radius)
    pairs: bool = False  # acts on consecutive layer pairs: needs an even number of layers
    constraint: bool = False  # a hard constraint: projection only, g = 0 at the iterates

    @property
    def regularized(self) -> bool:
        """Whether it changes training at all (``none`` does not)."""
        return self.name != "none"


# lam grids: from "no effect" (1e-5) to where clean error collapses (MNIST, 3 epochs at lr 0.2:
# path 3e-3 30%, 4e-3 72%; l1 7e-3 15%, 1e-2 89%; linf 1 (radius 1) 38%), densest where clean
# error climbs; linf lam = 1 / radius. The order is the grid's, which merged results sort by.
# fmt: off
TABLE: dict[str, Regularizer] = {r.name: r for r in (
    Regularizer("none", "none", "black", "g = 0: no regularizer", (0.0,)),
    Regularizer(
        "l1", "L1", "tab:blue", "g = sum of |w| over all weights",
        (1e-5, 3e-5, 6e-5, 8e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 6e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3,
         7e-3, 1e-2),
    ),
    Regularizer(
        "path", "1-path-norm", "tab:red", "g = sum of the pairs' 1-path-norms",
        (1e-5, 3e-5, 4e-5, 6e-5, 1e-4, 1.2e-4, 1.35e-4, 1.5e-4, 2e-4, 3e-4, 6e-4, 8e-4, 1e-3,
         1.5e-3, 2e-3, 2.5e-3, 3e-3, 4e-3),
        pairs=True,
    ),
    Regularizer(
        "linf", "layer-wise linf", "tab:green", "g = 0: linf is a constraint, ||W||_inf <= 1/lam",
        (0.02, 0.03, 0.04, 0.045, 0.0475, 0.05, 0.07, 0.1, 0.12, 0.15, 0.18, 0.2, 0.3, 0.5, 0.7,
         1.0),
        constraint=True,
    ),
)}
# fmt: on

REGULARIZERS = tuple(TABLE)
# how the regularizer enters training (TrainConfig.method, the CLI's --method, the results'
# "optimizer" column)
OPTIMIZERS = ("prox", "penalty")


def regularizer(name: str) -> Regularizer:
    """The table's row of ``name``; a clear error for an unknown one."""
    try:
        return TABLE[name]
    except KeyError:
        raise ValueError(f"regularizer must be one of {REGULARIZERS}, got {name!r}") from None
