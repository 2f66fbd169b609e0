"""Backend-neutral run configuration and result files (JSON + CSV) of the main job."""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ACTIVATIONS",
    "ATTACKS",
    "DEFAULT_EPS",
    "METHODS",
    "REGULARIZERS",
    "TrainConfig",
    "nonnegative_int",
    "write_results",
]

REGULARIZERS = ("none", "l1", "linf", "path")
METHODS = ("prox", "penalty")
ATTACKS = ("ce", "ce+margin")
ACTIVATIONS = ("elu", "relu", "tanh")  # slopes in [0, 1]: the path-norm bounds hold
DEFAULT_EPS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3)


@dataclass(frozen=True)
class TrainConfig:
    """One training run: the paper's network, regularizer, optimiser and evaluation.

    ``regularizer``: ``none``, ``l1`` (lam * sum |w|), ``path`` (lam * sum of the 1-path-norms of
    consecutive layer pairs, the paper's multilayer extension) or ``linf`` (the layer-wise
    constraint ``||W||_inf <= 1/lam`` for every layer, Parseval-style). ``method``: ``prox``
    (proximal SGD: an SGD step on the cross-entropy, then the prox with step ``lr * lam``, or
    the projection for ``linf``) or ``penalty`` (plain SGD on cross-entropy + lam * g, with
    autograd's subgradient). ``linf`` is a hard constraint, so it has only the projection form.
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
    eps: tuple[float, ...] = DEFAULT_EPS
    pgd_steps: int = 40
    attack: str = (
        "ce"  # "ce": the paper's PGD; "ce+margin": also CW-margin PGD, error if either wins
    )
    pgd_samples: int | None = 1000  # test images attacked (None: all); clean error uses all
    log_every: int = 10  # iterations between history records
    eval_train_samples: int | None = 10000  # train images for the regularized loss (None: all)

    def __post_init__(self) -> None:
        if self.regularizer not in REGULARIZERS:
            raise ValueError(f"regularizer must be one of {REGULARIZERS}, got {self.regularizer!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.regularizer == "linf" and self.method != "prox":
            raise ValueError(
                "linf is the hard constraint ||W||_inf <= 1/lam; it has only the projection "
                "form: use method='prox' (--method prox)"
            )
        if not (math.isfinite(self.lam) and self.lam >= 0):
            raise ValueError(f"lam must be a finite number >= 0, got {self.lam}")
        if self.regularizer == "linf" and self.lam == 0:
            raise ValueError("linf needs lam > 0 (the radius is 1/lam); use regularizer='none'")
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
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.regularizer == "path" and len(self.hidden) % 2 != 1:
            raise ValueError(
                f"the path regularizer pairs consecutive layers (the paper's multilayer "
                f"extension), so it needs an even number of layers, i.e. an odd number of hidden "
                f"layers; got hidden={self.hidden} ({len(self.hidden) + 1} layers)"
            )
        if self.attack not in ATTACKS:
            raise ValueError(f"attack must be one of {ATTACKS}, got {self.attack!r}")
        if any(not (0 <= e <= 1) for e in self.eps):
            raise ValueError(f"eps values must be in [0, 1] (pixels are in [0, 1]), got {self.eps}")

    @property
    def widths(self) -> tuple[int, ...]:
        """Layer widths from input to output: (784, *hidden, 10)."""
        return (784, *self.hidden, 10)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        d["eps"] = list(self.eps)
        return d


def nonnegative_int(zero_means: str) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= 0, where 0 means ``zero_means``."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0 (0: {zero_means}), got {n}")
        return n

    return parse


@dataclass
class History:
    """Training trajectory: one record every ``log_every`` iterations and per epoch."""

    iteration: list[int] = field(default_factory=list)
    batch_objective: list[float] = field(default_factory=list)  # mean over the last records
    nonzero_pct: list[float] = field(default_factory=list)
    effective_nonzero_pct: list[float] = field(default_factory=list)  # on live paths only
    epoch_objective: list[float] = field(default_factory=list)  # on eval_train_samples


def write_results(result: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    """Write ``result`` as ``<out>/results.json`` and the per-eps table ``<out>/results.csv``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jpath, cpath = out / "results.json", out / "results.csv"
    jpath.write_text(json.dumps(result, indent=2) + "\n")
    with cpath.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["eps", "clean_error", "robust_error", "certified_error"])
        w.writerow([0.0, result["clean_error"], result["clean_error"], result["clean_error"]])
        for e in result["config"]["eps"]:
            key = f"{e:g}"
            w.writerow(
                [
                    e,
                    result["clean_error"],
                    result["robust_error"][key],
                    result["certified_error"][key],
                ]
            )
    return jpath, cpath
