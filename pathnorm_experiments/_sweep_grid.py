"""The sweep's grid and data split: the settings, the runs and lr-selection groups in the order
they run, the lr selection, the rows of a finished group, and each dataset's train / validation
/ evaluation split (the protocol: :mod:`pathnorm_experiments.sweep`).

A group is one (dataset, regularizer, optimizer, lam); groups hash to shards, so a group never
spans two machines.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pathnorm_experiments.data import FULL_TRAIN, Dataset
from pathnorm_experiments.regularizers import OPTIMIZERS, REGULARIZERS, TABLE
from pathnorm_experiments.runs import COLUMNS, PROTOCOL_COLUMNS, join_key, key_cell
from pathnorm_experiments.settings import SWEEP_EPS, float_key

__all__ = [
    "Group",
    "GroupState",
    "Prepared",
    "RunSpec",
    "SweepConfig",
    "build_groups",
    "coarse_to_fine",
    "group_rows",
    "prepare",
    "protocol",
    "resume_state",
    "select_lr",
    "split_sizes",
    "stratified_indices",
]

LAMS = {name: r.lams for name, r in TABLE.items()}  # the table's grids
LRS = (0.05, 0.1, 0.2, 0.5)
SEEDS = (0, 1, 2)
VAL_SIZE = 5000  # validation images per FULL_TRAIN (a published training set) images
VAL_SEED = 20190  # the validation split and the evaluation sample: one fixed draw each
EVAL_SEED = 20191


@dataclass(frozen=True)
class SweepConfig:
    """The grid and the evaluation settings (defaults: the paper's protocol).

    ``lams``: each regularizer's lam grid (``none``: ``(0.0,)``). ``select_seeds``: the seeds
    every lr is trained with (a subset of ``seeds``). ``eval_samples``: the stratified test
    sample attacked and certified (None: all). ``val_size``: validation images per 60,000
    training images (scaled for a smaller set).
    """

    datasets: tuple[str, ...] = ("mnist", "fashion-mnist", "kmnist")
    regularizers: tuple[str, ...] = REGULARIZERS
    optimizers: tuple[str, ...] = OPTIMIZERS
    lams: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: dict(LAMS))
    lrs: tuple[float, ...] = LRS
    seeds: tuple[int, ...] = SEEDS
    select_seeds: tuple[int, ...] = (0,)
    epochs: int = 20
    batch_size: int = 100
    hidden: int = 200
    eps: tuple[float, ...] = SWEEP_EPS
    pgd_steps: int = 40
    strong_restarts: int = 2
    eval_samples: int | None = 2000
    val_size: int = VAL_SIZE

    def __post_init__(self) -> None:
        for name, allowed in (("regularizers", REGULARIZERS), ("optimizers", OPTIMIZERS)):
            bad = [v for v in getattr(self, name) if v not in allowed]
            if bad:
                raise ValueError(f"{name} must be among {allowed}, got {bad}")
        for reg in self.regularizers:
            lams = self.lams.get(reg)
            if not lams:
                raise ValueError(f"no lam grid for regularizer {reg!r}: give lams[{reg!r}]")
            if any(not (math.isfinite(v) and v >= 0) for v in lams) or (
                reg != "none" and min(lams) <= 0
            ):
                raise ValueError(f"lams[{reg!r}] must be finite and > 0 (none: 0), got {lams}")
        lists = ("datasets", "regularizers", "optimizers", "lrs", "seeds", "select_seeds")
        for name, values in [(n, tuple(getattr(self, n))) for n in lists] + [
            (f"lams[{r!r}]", tuple(self.lams[r])) for r in self.regularizers
        ]:
            if len(set(values)) < len(values):
                raise ValueError(f"{name} must be distinct, got {values}: give each value once")
        if not self.lrs or any(not (math.isfinite(v) and v > 0) for v in self.lrs):
            raise ValueError(f"lrs must be finite numbers > 0, got {self.lrs}")
        if not self.seeds or any(int(s) < 0 for s in self.seeds):
            raise ValueError(f"seeds must be integers >= 0, got {self.seeds}")
        if not self.select_seeds or not set(self.select_seeds) <= set(self.seeds):
            raise ValueError(
                f"select_seeds {self.select_seeds} must be a non-empty subset of seeds {self.seeds}"
            )
        for name in ("epochs", "batch_size", "hidden", "pgd_steps", "val_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.strong_restarts < 0:
            raise ValueError(f"strong_restarts must be >= 0, got {self.strong_restarts}")
        if self.eval_samples is not None and self.eval_samples < 1:
            raise ValueError(f"eval_samples must be >= 1 or None, got {self.eval_samples}")
        if tuple(self.eps) != SWEEP_EPS:
            # the CSV's columns are fixed; other radii belong in another file format
            raise ValueError(f"eps must be the CSV's radii {SWEEP_EPS}, got {self.eps}")


@dataclass(frozen=True)
class RunSpec:
    """One training run of the grid."""

    dataset: str
    regularizer: str
    optimizer: str
    lam: float
    lr: float
    seed: int
    epochs: int
    n_train: int

    @property
    def key(self) -> str:
        """The run key: the CSV's key columns, as written there."""
        head, tail = self._parts()
        return join_key(*head, float_key(self.lr), str(self.seed), *tail)

    @property
    def group_key(self) -> str:
        """The key of the lr-selection group (the run key without lr and seed)."""
        head, tail = self._parts()
        return join_key(*head, *tail)

    def _parts(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The key's columns before lr and after seed."""
        head = (self.dataset, self.regularizer, self.optimizer, float_key(self.lam))
        return head, (str(self.epochs), str(self.n_train))


@dataclass(frozen=True)
class Group:
    """The runs of one (dataset, regularizer, optimizer, lam) whose lr is selected together."""

    dataset: str
    regularizer: str
    optimizer: str
    lam: float
    epochs: int
    n_train: int
    lrs: tuple[float, ...]
    seeds: tuple[int, ...]
    select_seeds: tuple[int, ...]

    def run(self, lr: float, seed: int) -> RunSpec:
        """The run of this group at ``lr`` and ``seed``."""
        g = self
        return RunSpec(g.dataset, g.regularizer, g.optimizer, g.lam, lr, seed, g.epochs, g.n_train)

    @property
    def key(self) -> str:
        """The group key (see :attr:`RunSpec.group_key`)."""
        return self.run(self.lrs[0], self.seeds[0]).group_key

    def selection_runs(self) -> list[RunSpec]:
        """The runs every lr is trained with (the selection seeds)."""
        return [self.run(lr, s) for lr in self.lrs for s in self.select_seeds]

    def shard(self, n: int) -> int:
        """The 0-based shard of ``n`` this group belongs to (a stable hash of its key)."""
        return int(hashlib.sha256(self.key.encode()).hexdigest(), 16) % n


def coarse_to_fine(n: int) -> list[int]:
    """The indices 0..n-1, the middle first, then the middles of the halves, and so on.

    A sweep stopped early then holds every regularizer at lams spread over its grid.
    """
    order, spans = [], [(0, n - 1)]
    while spans:
        lo, hi = spans.pop(0)
        if lo > hi:
            continue
        mid = (lo + hi) // 2
        order.append(mid)
        spans += [(lo, mid - 1), (mid + 1, hi)]
    return order


def build_groups(cfg: SweepConfig, n_train: Mapping[str, int]) -> list[Group]:
    """The grid's groups of the datasets in ``n_train`` (training images after the validation
    split) in the order they run: dataset by dataset, the baseline first, then rounds that take
    one lam of every (regularizer, optimizer), coarse to fine over its grid.

    ``none`` appears once (recorded as ``prox``: with lam 0 both are plain SGD), ``linf`` only
    with ``prox`` (its projection).
    """
    combos: list[list[tuple[str, str, float]]] = []  # per (regularizer, optimizer), in order
    for opt in cfg.optimizers:
        for reg in cfg.regularizers:
            if reg == "none" or (reg == "linf" and opt != "prox"):
                continue
            lams = sorted(cfg.lams[reg])
            combos.append([(reg, opt, lams[i]) for i in coarse_to_fine(len(lams))])
    order: list[tuple[str, str, float]] = []
    if "none" in cfg.regularizers:
        order += [("none", "prox", lam) for lam in cfg.lams["none"]]
    for one_round in itertools.zip_longest(*combos):  # one lam of each (regularizer, optimizer)
        order += [c for c in one_round if c is not None]
    grid = (tuple(cfg.lrs), tuple(cfg.seeds), tuple(cfg.select_seeds))
    return [
        Group(ds, reg, opt, float(lam), cfg.epochs, n_train[ds], *grid)
        for ds in cfg.datasets
        if ds in n_train
        for reg, opt, lam in order
    ]


def stratified_indices(y: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A class-stratified sample of ``n`` (1 <= n <= len(y)) indices of the labels ``y``, as
    sorted int64, deterministic in ``seed``: each class gets its share of ``n`` in proportion
    to its frequency (largest remainders round), drawn without replacement."""
    if not 1 <= n <= y.shape[0]:
        raise ValueError(f"sample size must be in [1, {y.shape[0]}], got {n}")
    classes, counts = np.unique(y, return_counts=True)
    share = counts * (n / y.shape[0])
    take = np.floor(share).astype(np.int64)
    extra = n - int(take.sum())
    take[np.argsort(-(share - take), kind="stable")[:extra]] += 1
    rng = np.random.default_rng(seed)
    idx = [
        rng.choice(np.flatnonzero(y == c), int(k), replace=False)
        for c, k in zip(classes, take, strict=True)
    ]
    return np.sort(np.concatenate(idx)).astype(np.int64)


@dataclass(frozen=True)
class Prepared:
    """One dataset split for the sweep, as torch tensors (float32 images, int64 labels)."""

    name: str
    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_eval: Tensor  # the stratified test sample: clean, attacks, certificates
    y_eval: Tensor
    x_test: Tensor  # all test images: clean_error_full
    y_test: Tensor

    @property
    def n_train(self) -> int:
        """Training images (the validation split excluded)."""
        return int(self.x_train.shape[0])


def split_sizes(cfg: SweepConfig, n: int, n_test: int) -> tuple[int, int, int]:
    """(validation images, training images, evaluation sample) of :func:`prepare` for a
    dataset of ``n`` training and ``n_test`` test images."""
    n_val = max(1, round(n * cfg.val_size / FULL_TRAIN))
    return n_val, n - n_val, n_test if cfg.eval_samples is None else min(cfg.eval_samples, n_test)


def prepare(data: Dataset, cfg: SweepConfig) -> Prepared:
    """Split ``data``'s training set into train and validation (``cfg.val_size``), and draw
    the test sample (``cfg.eval_samples``)."""
    n = data.x_train.shape[0]
    n_val, _, n_eval = split_sizes(cfg, n, data.x_test.shape[0])
    if n_val >= n:
        raise ValueError(f"{data.name}: {n} training images leave none after {n_val} validation")
    val = stratified_indices(data.y_train, n_val, VAL_SEED)
    train = np.setdiff1d(np.arange(n), val)
    ev = stratified_indices(data.y_test, n_eval, EVAL_SEED)
    split = (data.x_train[train], data.y_train[train], data.x_train[val], data.y_train[val])
    test = (data.x_test[ev], data.y_test[ev], data.x_test, data.y_test)
    return Prepared(data.name, *(torch.from_numpy(np.ascontiguousarray(a)) for a in split + test))


@dataclass
class GroupState:
    """A group's progress in a sweep: its runs' results so far and what it waits for."""

    group: Group
    index: int
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # run key -> result
    selected_lr: float | None = None
    phase: str = "select"  # "select", then "final"
    waiting: set[str] = field(default_factory=set)


def resume_state(group: Group, rows: Sequence[Mapping[str, str]], index: int) -> GroupState | None:
    """What is left to run of ``group`` (as the sweep's settings define it, ``index`` in its
    order), given its rows in the folder's results files (a row may be in two files).

    Returns:
        The whole group (no rows yet); only the seeds missing at the recorded selected lr (a
        state in its final phase); or None when nothing is left (every seed is there, or every
        lr diverged).

    Raises:
        ValueError: the rows were selected among other lrs, or with other selection seeds, or
            have two selected lrs: rerunning would mix two selections.
    """
    if not rows:
        return GroupState(group, index)
    mine = sorted({float_key(lr) for lr in group.lrs}, key=float)
    lr_of = [(key_cell("lr", r["lr"]), r) for r in rows]  # by value: 5e-01 is 0.5
    lrs = sorted({lr for lr, _ in lr_of}, key=float)
    if lrs != mine:
        raise ValueError(
            f"group {group.key} has runs at lr {' '.join(lrs)} and this sweep selects among "
            f"{' '.join(mine)} (--lrs): the selection would differ; give --lrs {' '.join(lrs)} "
            "to continue it, or another --out"
        )
    chosen = sorted({lr for lr, r in lr_of if r["selected"] == "1"}, key=float)
    if len(chosen) > 1:
        raise ValueError(
            f"group {group.key} has selected runs at two lrs ({', '.join(chosen)}): keep the rows "
            "of one selection"
        )
    picked = {int(r["seed"]) for lr, r in lr_of if lr not in chosen}
    if picked and picked != set(group.select_seeds):
        seeds = " ".join(map(str, sorted(picked)))
        raise ValueError(
            f"group {group.key} selected its lr with seeds {seeds} and this sweep with "
            f"{' '.join(map(str, group.select_seeds))} (--select-seeds): give --select-seeds "
            f"{seeds} to continue it, or another --out"
        )
    if not chosen:
        return None  # every lr diverged: no lr is selected, no seed to add
    have = {int(r["seed"]) for lr, r in lr_of if lr == chosen[0]}
    missing = tuple(s for s in group.seeds if s not in have)
    if not missing:
        return None
    more = replace(group, seeds=missing, select_seeds=())
    return GroupState(more, index, selected_lr=float(chosen[0]), phase="final")


def select_lr(state: GroupState) -> float | None:
    """The lr of the lowest mean validation error over the selection seeds (ties: the smaller
    lr); an lr with a diverged run is never chosen. None when every lr diverged."""
    g = state.group
    scores = []
    for lr in g.lrs:
        vals = [state.results[g.run(lr, s).key].get("val_error", math.nan) for s in g.select_seeds]
        if not any(math.isnan(v) for v in vals):  # a diverged run: this lr is not chosen
            scores.append((float(np.mean(vals)), lr))
    return min(scores)[1] if scores else None


def protocol(cfg: SweepConfig, n_eval: int) -> dict[str, int]:
    """The :data:`~pathnorm_experiments.runs.PROTOCOL_COLUMNS` of a dataset whose evaluation
    sample holds ``n_eval`` test images."""
    return {c: n_eval if c == "eval_samples" else getattr(cfg, c) for c in PROTOCOL_COLUMNS}


def group_rows(
    state: GroupState, machine: str, settings: Mapping[str, int]
) -> list[dict[str, Any]]:
    """The CSV rows (:data:`~pathnorm_experiments.runs.COLUMNS`) of a finished group, by lr
    and seed (a diverged run: NaN errors). Each result of ``state`` holds ``_lr`` and ``_seed``;
    ``settings``: the :func:`protocol` columns."""
    g = state.group
    rows = []
    for key, res in state.results.items():
        lr, seed = res["_lr"], res["_seed"]
        assert g.run(lr, seed).key == key
        row: dict[str, Any] = dict.fromkeys(COLUMNS, "")
        row.update(
            dataset=g.dataset,
            regularizer=g.regularizer,
            optimizer=g.optimizer,
            lam=float_key(g.lam),
            lr=float_key(lr),
            seed=seed,
            epochs=g.epochs,
            n_train=g.n_train,
            selected=int(lr == state.selected_lr),
            machine=machine,
            **settings,
        )
        if res.get("diverged"):
            row.update(dict.fromkeys(("val_error", "clean_error", "clean_error_full"), math.nan))
        else:
            row.update({c: res[c] for c in COLUMNS if c in res})
        rows.append(row)
    rows.sort(key=lambda r: (float(r["lr"]), int(r["seed"])))
    return rows
