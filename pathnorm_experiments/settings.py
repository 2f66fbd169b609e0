"""The main job's vocabulary and one run's settings: the constants of both backends, the
results key of a number, and :class:`TrainConfig`."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Any

from pathnorm_experiments.regularizers import OPTIMIZERS, REGULARIZERS, regularizer

__all__ = [
    "ACTIVATIONS",
    "ATTACKS",
    "DTYPES",
    "EPS",
    "IMAGE_SHAPE",
    "MODELS",
    "N_CLASSES",
    "OPTIMIZERS",
    "REGULARIZERS",
    "SWEEP_EPS",
    "TrainConfig",
    "float_key",
]

ATTACKS = ("ce", "ce+margin")
ACTIVATIONS = ("elu", "relu", "tanh")  # slopes in [0, 1]: the path-norm bounds hold
EPS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3)  # pathnorm-train's attack radii (its --eps default)
# the sweep's radii: its runs.csv columns, with the paper's smallest, 0.02, for the figures
SWEEP_EPS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3)
DTYPES = ("float32", "float64")
MODELS = ("mlp", "conv")  # the paper's MLP, or its convolutional twin (one conv hidden layer)
IMAGE_SHAPE = (1, 28, 28)  # (channels, height, width) of every dataset's images
N_CLASSES = 10


def float_key(value: float) -> str:
    """The results key of an eps or lam: ``f"{value:g}"`` if it reads back exactly, else ``repr``.

    ``{:g}`` keeps six digits (0.1 and 0.1000001 would share ``"0.1"``); ``repr`` is the
    shortest text that reads back exactly. So distinct values get distinct keys, and the usual
    ones keep their short form (``"0.05"``, ``"1e-05"``).
    """
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


@dataclass(frozen=True)
class TrainConfig:
    """One training run: the paper's network, regularizer, optimiser and evaluation.

    ``model``: ``mlp`` (``784 -> hidden... -> 10``) or ``conv`` (``Conv2d(1, hidden[0],
    kernel_size, stride)`` without padding -> activation -> Flatten -> ``Linear(10)`` on the
    1 x 28 x 28 images; ``hidden`` then holds one entry, the channels). ``regularizer``: a row
    of :mod:`~pathnorm_experiments.regularizers`. ``method``: ``prox`` (an SGD step on the
    cross-entropy, then the prox with step ``lr * lam``, or for ``linf``, a hard constraint
    ``||W||_inf <= 1/lam`` per layer, the projection) or ``penalty`` (SGD on cross-entropy +
    lam * g, with autograd's subgradient; not for ``linf``).
    """

    regularizer: str = "path"
    method: str = "prox"
    lam: float = 1e-3
    lr: float = 0.1
    epochs: int = 10
    batch_size: int = 100
    hidden: tuple[int, ...] = (200,)
    activation: str = "elu"
    seed: int = 0
    dtype: str = "float32"  # of weights and data in training and evaluation (float64: checks)
    eps: tuple[float, ...] = EPS
    pgd_steps: int = 40
    attack: str = "ce"  # "ce": the paper's PGD; "ce+margin": also CW-margin PGD, either wins
    pgd_samples: int | None = 1000  # test images attacked (None: all); clean error uses all
    log_every: int = 10  # iterations between history records
    eval_train_samples: int | None = 10000  # train images for the regularized loss (None: all)
    model: str = "mlp"
    kernel_size: int = 5  # conv only: the convolution's square kernel
    stride: int = 2  # conv only: its stride (no padding: R is the unrolled net's path-norm)

    def __post_init__(self) -> None:
        row = regularizer(self.regularizer)
        for name, allowed in (
            ("method", OPTIMIZERS),
            ("model", MODELS),
            ("activation", ACTIVATIONS),
            ("attack", ATTACKS),
            ("dtype", DTYPES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if row.constraint and self.method != "prox":
            raise ValueError(
                f"{row.name} is a hard constraint of radius 1/lam; it has only the projection "
                "form: use method='prox' (--method prox)"
            )
        if not (math.isfinite(self.lam) and self.lam >= 0):
            raise ValueError(f"lam must be a finite number >= 0, got {self.lam}")
        if row.constraint and self.lam == 0:
            raise ValueError(
                f"{row.name} needs lam > 0 (the radius is 1/lam); use regularizer='none'"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        for name in ("epochs", "batch_size", "pgd_steps", "log_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name, all_of in (
            ("pgd_samples", "all test images"),
            ("eval_train_samples", "all training images"),
        ):
            n = getattr(self, name)
            if n is not None and int(n) < 1:  # a negative n would slice off the last -n images
                raise ValueError(f"{name} must be >= 1, or None for {all_of}; got {n}")
        if any(int(h) < 1 for h in self.hidden):
            raise ValueError(f"hidden widths must be >= 1, got {self.hidden}")
        if self.model == "conv":
            self._check_conv()
        if row.pairs and len(self.hidden) % 2 != 1:
            raise ValueError(
                f"the {row.name} regularizer pairs consecutive layers (the paper's multilayer "
                f"extension), so it needs an even number of layers, i.e. an odd number of hidden "
                f"layers; got hidden={self.hidden} ({len(self.hidden) + 1} layers)"
            )
        if any(not (0 <= e <= 1) for e in self.eps):
            raise ValueError(f"eps values must be in [0, 1] (pixels are in [0, 1]), got {self.eps}")
        repeated = sorted({e for e in self.eps if self.eps.count(e) > 1})
        if repeated:
            raise ValueError(f"eps values must be distinct, got {repeated} more than once")
        if int(self.seed) < 0:  # NumPy's generators take seeds >= 0
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    def _check_conv(self) -> None:
        if len(self.hidden) != 1:
            raise ValueError(
                "the conv network has one hidden layer, its convolution: hidden holds its "
                f"channels, e.g. hidden=(32,) (--hidden 32); got hidden={self.hidden}"
            )
        for name in ("kernel_size", "stride"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kernel_size > min(IMAGE_SHAPE[1:]):
            raise ValueError(
                f"kernel_size {self.kernel_size} is larger than the {IMAGE_SHAPE[1]} x "
                f"{IMAGE_SHAPE[2]} images (the convolution has no padding)"
            )

    @property
    def conv_grid(self) -> tuple[int, int]:
        """The conv network's hidden positions (height, width): a valid (unpadded) convolution
        of ``kernel_size`` at ``stride`` on the 28 x 28 images."""
        height, width = ((size - self.kernel_size) // self.stride + 1 for size in IMAGE_SHAPE[1:])
        return height, width

    @property
    def widths(self) -> tuple[int, ...]:
        """Layer widths from input to output: (784, *hidden, 10); for the conv network, those of
        its unrolled twin: (784, channels * positions, 10)."""
        if self.model == "conv":
            return (784, self.hidden[0] * math.prod(self.conv_grid), N_CLASSES)
        return (784, *self.hidden, N_CLASSES)

    @property
    def weight_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Each layer's weight shape, torch layout: (out, in) for a Linear layer, (channels,
        in_channels, k, k) for the convolution."""
        if self.model == "conv":
            channels, k = self.hidden[0], self.kernel_size
            return ((channels, IMAGE_SHAPE[0], k, k), (N_CLASSES, self.widths[1]))
        return tuple((fan_out, fan_in) for fan_in, fan_out in itertools.pairwise(self.widths))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the MLP's without the convolution's ``kernel_size`` and ``stride``)."""
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        d["eps"] = list(self.eps)
        if self.model != "conv":
            del d["kernel_size"], d["stride"]
        return d
