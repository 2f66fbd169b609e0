"""The data layer of the results report: the sweep's rows, summarized per setting, and the rule.

Summarizes the selected runs of ``runs.csv`` per (dataset, regularizer, optimizer, lam) over
their seeds. NumPy only, never torch, so the report can be redrawn without the training stack.

The rule (:func:`decide`): setting A beats setting B on a column when A's mean is lower by
more than the sum of both seed spreads (max - min), with at least two seeds on each side. A
claim holds if it holds in every cell (dataset, budget) with both sides, holds in part if in
some, does not hold if in none, and has not enough data if no cell has both (:func:`verdict`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pathnorm_experiments.data import DATASET_LABELS, FULL_TRAIN, PAPER_DATASETS
from pathnorm_experiments.regularizers import TABLE
from pathnorm_experiments.runs import COLUMNS, PROTOCOL_COLUMNS, ResultsError

__all__ = [
    "BUDGETS",
    "ReportError",
    "Setting",
    "Stat",
    "baseline",
    "best_within",
    "budget_limits",
    "col",
    "compacted_sizes",
    "dataset_label",
    "datasets_of",
    "decide",
    "method_label",
    "settings_from_rows",
    "spearman",
    "verdict",
]

VERDICT_EPS = (0.1, 0.05)
BUDGETS = (1.0, 3.0, 6.0)  # clean-error budgets: points above the baseline's clean error
SPARSITY_BUDGETS = (50.0, 20.0, 10.0)  # % of weights nonzero, for the KMNIST remark
MIN_SEEDS = 2
KINDS = ("robust_error", "robust_error_strong", "certified_lipschitz", "certified_interval")
KIND_LABELS = {
    "clean_error": "clean",
    "robust_error": "PGD",
    "robust_error_strong": "strong attack",
    "certified_lipschitz": "not certified, Lipschitz",
    "certified_interval": "not certified, interval",
}
REG_LABELS = {name: r.label for name, r in TABLE.items()}
REGULARIZED = tuple(name for name, r in TABLE.items() if r.regularized)  # the plots' panels
COMPARED = ("path", "l1", "linf")  # the claims' order: path, then what it is compared with
OPT_LABELS = {"prox": "Prox-SGD", "penalty": "SGD"}
MEASURE_LABELS = {"nonzero": "raw nonzero", "nonzero_live": "live-path nonzero"}
COMPACTED = "hidden_alive"  # the hidden units that compact keeps (empty in older rows)
DATASET_ORDER = (*PAPER_DATASETS, "embedded")
# a full training set less the sweep's validation split (_sweep_grid.VAL_SIZE): fewer is partial
SPLIT_TRAIN = FULL_TRAIN - 5000
REQUIRED = COLUMNS  # a results file has the sweep's columns, checked by runs.read_rows
_NUMERIC = (*COLUMNS[COLUMNS.index("val_error") : COLUMNS.index("machine")], "hidden_alive")
PROTOCOL = ("epochs", "n_train", *PROTOCOL_COLUMNS)  # one value per dataset in a report


class ReportError(ResultsError):
    """The results file cannot be reported (missing, not the sweep's format, inconsistent)."""


def col(kind: str, eps: float) -> str:
    """The CSV column of an error ``kind`` at radius ``eps`` (``robust_error@0.1``)."""
    return f"{kind}@{eps:g}"


@dataclass(frozen=True)
class Stat:
    """One column of one setting over its seeds (empty cells left out)."""

    seeds: tuple[int, ...]
    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        """The mean over seeds (within ``[lo, hi]``: equal seeds' float mean can round past)."""
        return min(max(float(np.mean(self.values)), self.lo), self.hi)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    @property
    def spread(self) -> float:
        return self.hi - self.lo

    def by_seed(self) -> dict[int, float]:
        return dict(zip(self.seeds, self.values, strict=True))

    def fmt(self, digits: int = 1) -> str:
        """``mean (min-max)``; the mean alone for one seed."""
        if self.n == 1:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ({self.lo:.{digits}f}–{self.hi:.{digits}f})"


@dataclass(frozen=True)
class Setting:
    """The selected runs of one (dataset, regularizer, optimizer, lam)."""

    dataset: str
    regularizer: str
    optimizer: str
    lam: float
    lr: float
    epochs: int
    n_train: int
    stats: Mapping[str, Stat] = field(default_factory=dict)
    protocol: Mapping[str, int] = field(default_factory=dict)  # PROTOCOL_COLUMNS' values

    @property
    def seeds(self) -> tuple[int, ...]:
        """The seeds with a clean error (all seeds that trained without diverging)."""
        s = self.stats.get("clean_error")
        return s.seeds if s else ()

    def method(self) -> str:
        return method_label(self.regularizer, self.optimizer)


def method_label(reg: str, opt: str) -> str:
    """How a regularizer is trained: ``L1 Prox-SGD``, ``layer-wise linf projection``, ``none``."""
    r = TABLE[reg]
    if not r.regularized:
        return "none"
    return f"{r.label} {'projection' if r.constraint else OPT_LABELS[opt]}"


def parse_value(text: str) -> float | None:
    """A cell's number; None for an empty cell, ``nan`` or an infinity."""
    if text in ("", "nan"):
        return None
    v = float(text)
    return v if math.isfinite(v) else None


def settings_from_rows(rows: Iterable[Mapping[str, str]]) -> dict[tuple, Setting]:
    """The selected runs of :func:`~pathnorm_experiments.runs.read_rows`' rows, keyed by
    ``(dataset, regularizer, optimizer, lam)``.

    Raises:
        ReportError: one dataset's rows differ in a :data:`PROTOCOL` column, or one setting's
            selected rows have different lrs.
    """
    groups: dict[tuple, list[Mapping[str, str]]] = {}
    protocol: dict[tuple[str, str], set[str]] = {}
    for r in rows:
        for c in PROTOCOL:
            protocol.setdefault((r["dataset"], c), set()).add(str(int(r[c])))  # by value
        if r["selected"] == "1":
            key = (r["dataset"], r["regularizer"], r["optimizer"], float(r["lam"]))
            groups.setdefault(key, []).append(r)
    for (ds, c), seen in protocol.items():
        if len(seen) > 1:
            raise ReportError(
                f"rows of {ds} have several {c}: {', '.join(sorted(seen, key=float))}; the report "
                "compares one protocol: keep one in the file (the others in another file)"
            )
    out = {}
    for key, rs in sorted(groups.items()):
        if len(lrs := {float(r["lr"]) for r in rs}) > 1:
            raise ReportError(f"{key}: selected rows at several lrs {sorted(lrs)}")
        stats = {}
        for c in _NUMERIC:
            pairs = [(int(r["seed"]), v) for r in rs if (v := parse_value(r[c])) is not None]
            if pairs:
                seeds, values = zip(*sorted(pairs), strict=True)
                stats[c] = Stat(seeds, values)
        r0 = rs[0]
        out[key] = Setting(
            *key,  # type: ignore[arg-type]
            float(r0["lr"]),
            int(r0["epochs"]),
            int(r0["n_train"]),
            stats,
            {c: int(r0[c]) for c in PROTOCOL_COLUMNS},
        )
    return out


def decide(a: Stat | None, b: Stat | None) -> str | None:
    """``"a"`` or ``"b"``: which is lower beyond the seed noise; ``"tie"``: neither; None: either
    is missing or has under two seeds."""
    if a is None or b is None or a.n < MIN_SEEDS or b.n < MIN_SEEDS:
        return None
    noise = a.spread + b.spread
    if b.mean - a.mean > noise:
        return "a"
    if a.mean - b.mean > noise:
        return "b"
    return "tie"


def stat_of(s: Setting | None, column: str) -> Stat | None:
    return None if s is None else s.stats.get(column)


def verdict(outcomes: Sequence[bool]) -> str:
    """The verdict of a claim's cell outcomes (the module docstring's rule)."""
    if not outcomes:
        return "not enough data"
    if all(outcomes):
        return "holds"
    return "holds in part" if any(outcomes) else "does not hold"


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN if either is constant."""
    rx, ry = _ranks(x), _ranks(y)
    if np.ptp(rx) == 0 or np.ptp(ry) == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(v: Sequence[float]) -> np.ndarray:
    """The 0-based ranks of ``v``; ties share their average rank."""
    _, inverse, counts = np.unique(
        np.asarray(v, dtype=float), return_inverse=True, return_counts=True
    )
    first = np.cumsum(counts) - counts  # the rank of each value's first copy
    return (first + (counts - 1) / 2)[inverse]


def datasets_of(settings: Mapping[tuple, Setting]) -> list[str]:
    """The datasets with a setting, in the paper's order."""
    names = {k[0] for k in settings}
    known = [d for d in DATASET_ORDER if d in names]
    return known + sorted(names - set(known))


def dataset_label(name: str, n_train: int | None = None, short: bool = False) -> str:
    """``KMNIST (partial training set, 6,427 images)``, or short ``KMNIST (partial)``."""
    label = DATASET_LABELS.get(name, name)
    if name == "kmnist" and n_train is not None and n_train < SPLIT_TRAIN:
        label += " (partial)" if short else f" (partial training set, {n_train:,} images)"
    return label


def short_name(settings: Mapping[tuple, Setting], ds: str) -> str:
    """The dataset's short label (KMNIST on its partial training set says so)."""
    n = next((s.n_train for k, s in settings.items() if k[0] == ds), None)
    return dataset_label(ds, n, short=True)


def settings_of(
    settings: Mapping[tuple, Setting], ds: str, reg: str, opt: str | None = None
) -> list:
    return sorted(
        (s for k, s in settings.items() if k[0] == ds and k[1] == reg and opt in (None, k[2])),
        key=lambda s: (s.optimizer, s.lam),
    )


def compacted_sizes(settings: Mapping[tuple, Setting], ds: str) -> bool:
    """Whether a setting of ``ds`` records :data:`COMPACTED` (older rows leave it empty)."""
    return any(k[0] == ds and COMPACTED in s.stats for k, s in settings.items())


def baseline(settings: Mapping[tuple, Setting], ds: str) -> Setting | None:
    """The unregularized setting of ``ds`` if it has a clean error."""
    s = settings.get((ds, "none", "prox", 0.0))
    return s if s is not None and "clean_error" in s.stats else None


def budget_limits(settings: Mapping[tuple, Setting], ds: str) -> list[tuple[float, float]]:
    """(budget, the mean clean error it allows) per clean-error budget; [] without a baseline."""
    base = baseline(settings, ds)
    return [] if base is None else [(b, base.stats["clean_error"].mean + b) for b in BUDGETS]


def best_within(cands: Sequence[Setting], max_clean: float, column: str) -> Setting | None:
    """The setting of least mean ``column`` among those with mean clean error <= ``max_clean``
    and at least two seeds in ``column``."""
    ok = [
        s
        for s in cands
        if "clean_error" in s.stats
        and s.stats["clean_error"].mean <= max_clean + 1e-9
        and column in s.stats
        and s.stats[column].n >= MIN_SEEDS
    ]
    return min(ok, key=lambda s: (s.stats[column].mean, s.lam)) if ok else None
