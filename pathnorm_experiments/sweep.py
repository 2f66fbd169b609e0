"""The paper's protocol as a resumable, parallel, shardable sweep, one CSV row per run.

Protocol: the 784-200-10 ELU network, batch 100, plain SGD (an SGD step on the cross-entropy,
then the library's prox with step ``lr * lam``, or the projection for ``linf``; or SGD on
``CE + lam * g`` for ``optimizer="penalty"``), over the grid
dataset x regularizer x optimizer x lam x lr x seed.

* Validation: a fixed, stratified, seeded split of the training set, 1/12 of it (5,000 of
  MNIST's and Fashion-MNIST's 60,000; 584 of KMNIST's 7,011 offline images), never trained on.
  ``n_train`` counts the images trained on.
* Learning-rate selection, per group (dataset, regularizer, optimizer, lam): every lr is trained
  with the selection seeds (default: seed 0), and the lr of the lowest mean validation error is
  selected (ties: the smaller lr). The other seeds run at the selected lr only. The test set is
  never looked at for the choice.
* Evaluation: clean error on all test images (``clean_error_full``) and, for every run, on one
  fixed stratified sample of 2,000 test images (``clean_error``). Only selected runs are
  attacked and certified, on that same sample: the paper's PGD (cross-entropy, 40 steps of
  eps/20, random start), a stronger attack (the union of the paper's PGD, margin PGD with
  restarts, and the strong attack's success at every smaller eps, whose points lie in the
  larger ball too), the per-pair Lipschitz certificate (:mod:`~pathnorm_experiments.certify`)
  and interval bound propagation (:func:`~pathnorm_experiments.certify.interval_certified_mask`). Certified columns hold the
  error that is NOT certified, so ``clean <= robust <= robust_strong <= certified`` per row.
  All errors are in percent.

Engineering: runs go to ``--jobs`` worker processes (one torch thread each). A group's rows are
appended to the CSV in one locked write when its last run ends; a finished run of an unfinished
group waits in ``<out>/.pending/`` (weights and metrics), so an interrupted sweep recomputes
nothing that finished. ``--shard K/N`` takes the groups whose key hashes to K-1 mod N (a group
never spans shards: its lr selection needs all its runs), and :func:`merge` joins shard files
by run key.

CLI: ``python -m pathnorm_experiments.sweep --data-dir DIR --out docs/results --jobs 2``
(``--dry-run`` prints the grid and a time estimate; ``merge OUT IN...`` joins result files).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import csv
import fcntl
import hashlib
import io
import json
import math
import multiprocessing
import os
import platform
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from pathnorm_experiments import certify
from pathnorm_experiments.config import float_key, initial_weights, shuffle_orders
from pathnorm_experiments.data import N_CLASSES, DataError, Dataset, load_dataset
from pathnorm_lightning.functional import (
    path_norm,
    project_rows_l1_ball_,
    prox_l1_,
    prox_path_norm_,
)

__all__ = [
    "COLUMNS",
    "EPS",
    "Prepared",
    "RunSpec",
    "SweepConfig",
    "append_rows",
    "build_groups",
    "coarse_to_fine",
    "evaluate_run",
    "main",
    "merge",
    "prepare",
    "read_rows",
    "row_key",
    "run_sweep",
    "stratified_indices",
    "summarize",
    "train_run",
]

EPS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3)
# lam grids: from "no effect" (1e-5) to where clean error collapses (MNIST, 3 epochs at lr 0.2:
# path 3e-3 30%, 4e-3 72%; l1 7e-3 15%, 1e-2 89%; linf 1 (radius 1) 38%), densest where clean
# error climbs; linf lam = 1 / radius
LAMS: dict[str, tuple[float, ...]] = {
    "none": (0.0,),
    "l1": (1e-5, 3e-5, 1e-4, 3e-4, 6e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2),
    "path": (1e-5, 3e-5, 1e-4, 3e-4, 6e-4, 1e-3, 1.5e-3, 2e-3, 2.5e-3, 3e-3, 4e-3),
    "linf": (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 1.0),
}
LRS = (0.05, 0.1, 0.2, 0.5)
SEEDS = (0, 1, 2)
REGULARIZERS = ("none", "l1", "path", "linf")
OPTIMIZERS = ("prox", "penalty")
FULL_TRAIN = 60000  # the published training-set size the validation share refers to
VAL_SIZE = 5000
VAL_SEED = 20190  # the validation split and the evaluation sample: one fixed draw each
EVAL_SEED = 20191

_KEY_COLUMNS = ("dataset", "regularizer", "optimizer", "lam", "lr", "seed", "epochs", "n_train")


def _eps_columns(eps: Sequence[float]) -> list[str]:
    return [
        f"{kind}@{float_key(e)}"
        for kind in (
            "robust_error",
            "robust_error_strong",
            "certified_lipschitz",
            "certified_interval",
        )
        for e in eps
    ]


COLUMNS = (
    *_KEY_COLUMNS,
    "selected",
    "val_error",
    "clean_error",
    "clean_error_full",
    *_eps_columns(EPS),
    "nonzero",
    "nonzero_live",
    "path_norm",
    "machine",
)


@dataclass(frozen=True)
class SweepConfig:
    """The grid and the evaluation settings (defaults: the paper's protocol).

    ``lams`` maps each regularizer to its lam grid (``none``: ``(0.0,)``). ``select_seeds`` are
    the seeds every lr is trained with for the selection (a subset of ``seeds``).
    ``eval_samples``: the size of the stratified test sample attacked and certified (None: all).
    ``val_size``: validation images per 60,000 training images (scaled for a smaller set).
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
    eps: tuple[float, ...] = EPS
    pgd_steps: int = 40
    strong_restarts: int = 2
    eval_samples: int | None = 2000
    val_size: int = VAL_SIZE

    def __post_init__(self) -> None:
        bad = [r for r in self.regularizers if r not in REGULARIZERS]
        if bad:
            raise ValueError(f"regularizers must be among {REGULARIZERS}, got {bad}")
        bad = [o for o in self.optimizers if o not in OPTIMIZERS]
        if bad:
            raise ValueError(f"optimizers must be among {OPTIMIZERS}, got {bad}")
        for reg in self.regularizers:
            lams = self.lams.get(reg)
            if not lams:
                raise ValueError(f"no lam grid for regularizer {reg!r}: give lams[{reg!r}]")
            if any(not (math.isfinite(v) and v >= 0) for v in lams) or (
                reg != "none" and min(lams) <= 0
            ):
                raise ValueError(f"lams[{reg!r}] must be finite and > 0 (none: 0), got {lams}")
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
        if tuple(self.eps) != EPS:
            # the CSV's columns are fixed; other radii belong in another file format
            raise ValueError(f"eps must be the CSV's radii {EPS}, got {self.eps}")


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
        return _key(
            self.dataset,
            self.regularizer,
            self.optimizer,
            float_key(self.lam),
            float_key(self.lr),
            str(self.seed),
            str(self.epochs),
            str(self.n_train),
        )

    @property
    def group_key(self) -> str:
        """The key of the lr-selection group (the run key without lr and seed)."""
        return _key(
            self.dataset,
            self.regularizer,
            self.optimizer,
            float_key(self.lam),
            str(self.epochs),
            str(self.n_train),
        )


def _key(*parts: str) -> str:
    return "|".join(parts)


def row_key(row: Mapping[str, str]) -> str:
    """The run key of a CSV row (its key columns joined by ``|``)."""
    return _key(*(str(row[c]) for c in _KEY_COLUMNS))


def _row_group_key(row: Mapping[str, str]) -> str:
    return _key(
        row["dataset"],
        row["regularizer"],
        row["optimizer"],
        row["lam"],
        row["epochs"],
        row["n_train"],
    )


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
        return RunSpec(
            self.dataset,
            self.regularizer,
            self.optimizer,
            self.lam,
            lr,
            seed,
            self.epochs,
            self.n_train,
        )

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
    """The grid's groups in the order they run: dataset by dataset, the baseline first, then
    rounds that take one lam of every (regularizer, optimizer), coarse to fine over its grid.

    Args:
        cfg: the grid.
        n_train: training images (after the validation split) per dataset to sweep.

    Returns:
        The groups; ``none`` appears once (its optimizer is recorded as ``prox``: with lam 0
        both are plain SGD), ``linf`` only with ``prox`` (its projection).
    """
    combos: list[tuple[str, str, list[float]]] = []
    for opt in cfg.optimizers:
        for reg in cfg.regularizers:
            if reg == "none" or (reg == "linf" and opt != "prox"):
                continue
            lams = sorted(cfg.lams[reg])
            combos.append((reg, opt, [lams[i] for i in coarse_to_fine(len(lams))]))
    groups = []
    for ds in cfg.datasets:
        if ds not in n_train:
            continue

        def group(reg: str, opt: str, lam: float, ds: str = ds) -> Group:
            return Group(
                ds,
                reg,
                opt,
                float(lam),
                cfg.epochs,
                n_train[ds],
                tuple(cfg.lrs),
                tuple(cfg.seeds),
                tuple(cfg.select_seeds),
            )

        if "none" in cfg.regularizers:
            groups += [group("none", "prox", lam) for lam in cfg.lams["none"]]
        for r in range(max((len(c[2]) for c in combos), default=0)):
            groups += [group(reg, opt, lams[r]) for reg, opt, lams in combos if r < len(lams)]
    return groups


def stratified_indices(y: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A class-stratified sample of ``n`` indices of ``y`` (sorted), deterministic in ``seed``.

    Each class gets its share of ``n`` in proportion to its frequency (largest remainders
    round), drawn without replacement.

    Args:
        y: integer labels.
        n: sample size, 1 <= n <= len(y).
        seed: the generator's seed.

    Returns:
        Sorted int64 indices.
    """
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


def prepare(data: Dataset, cfg: SweepConfig) -> Prepared:
    """Split ``data``'s training set into train and validation, and draw the test sample.

    Args:
        data: the dataset.
        cfg: the sweep (``val_size`` per 60,000 training images, ``eval_samples``).

    Returns:
        The tensors.
    """
    n = data.x_train.shape[0]
    n_val = max(1, round(n * cfg.val_size / FULL_TRAIN))
    if n_val >= n:
        raise ValueError(f"{data.name}: {n} training images leave none after {n_val} validation")
    val = stratified_indices(data.y_train, n_val, VAL_SEED)
    train = np.setdiff1d(np.arange(n), val)
    n_test = data.x_test.shape[0]
    n_eval = n_test if cfg.eval_samples is None else min(cfg.eval_samples, n_test)
    ev = stratified_indices(data.y_test, n_eval, EVAL_SEED)

    def t(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    return Prepared(
        data.name,
        t(data.x_train[train]),
        t(data.y_train[train]),
        t(data.x_train[val]),
        t(data.y_train[val]),
        t(data.x_test[ev]),
        t(data.y_test[ev]),
        t(data.x_test),
        t(data.y_test),
    )


# ---------------------------------------------------------------- training and evaluation


def _forward(ws: Sequence[Tensor], bs: Sequence[Tensor], x: Tensor) -> Tensor:
    h = x
    last = len(ws) - 1
    for i, (w, b) in enumerate(zip(ws, bs, strict=True)):
        h = torch.addmm(b, h, w.t())
        if i < last:
            h = F.elu(h)
    return h


def _penalty(ws: Sequence[Tensor], reg: str) -> Tensor:
    if reg == "l1":
        return sum((w.abs().sum() for w in ws), ws[0].new_zeros(()))
    if reg == "path":
        return sum((path_norm(ws[i], ws[i + 1]) for i in range(0, len(ws), 2)), ws[0].new_zeros(()))
    return ws[0].new_zeros(())


def train_run(
    spec: RunSpec, data: Prepared, cfg: SweepConfig, *, steps: int | None = None
) -> tuple[list[Tensor], list[Tensor]] | None:
    """Train one run; returns its ``(weights, biases)`` (torch layout), or None if it diverged.

    The initial weights and the epochs' orders are those of the main job
    (:func:`~pathnorm_experiments.config.initial_weights`,
    :func:`~pathnorm_experiments.config.shuffle_orders`), so a run is deterministic.

    Args:
        spec: the run.
        data: its dataset's split.
        cfg: batch size and hidden width.
        steps: stop after this many SGD steps (benchmarks); None: ``spec.epochs`` epochs.

    Returns:
        The trained parameters, or None when a weight became NaN or infinite.
    """
    widths = (data.x_train.shape[1], cfg.hidden, N_CLASSES)
    device = data.x_train.device
    ws, bs = [], []
    for w, b in initial_weights(widths, spec.seed):
        ws.append(torch.tensor(w, dtype=torch.float32, device=device, requires_grad=True))
        bs.append(torch.tensor(b, dtype=torch.float32, device=device, requires_grad=True))
    params = [p for pair in zip(ws, bs, strict=True) for p in pair]
    x, y = data.x_train, data.y_train
    n, batch = x.shape[0], cfg.batch_size
    orders = shuffle_orders(n, spec.epochs, spec.seed)
    reg, lam, lr = spec.regularizer, spec.lam, spec.lr
    use_penalty = spec.optimizer == "penalty" and reg in ("l1", "path") and lam > 0
    step = 0
    for epoch in range(spec.epochs):
        perm = torch.from_numpy(orders[epoch]).to(device)
        for s in range(0, n, batch):
            idx = perm[s : s + batch]
            loss = F.cross_entropy(_forward(ws, bs, x[idx]), y[idx])
            if use_penalty:
                loss = loss + lam * _penalty(ws, reg)
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                torch._foreach_add_(params, grads, alpha=-lr)
                if spec.optimizer == "prox":
                    _prox_(ws, reg, lam, lr)
            step += 1
            if steps is not None and step >= steps:
                return [w.detach() for w in ws], [b.detach() for b in bs]
        if not all(bool(torch.isfinite(p).all()) for p in params):
            return None
    return [w.detach() for w in ws], [b.detach() for b in bs]


def _prox_(ws: Sequence[Tensor], reg: str, lam: float, lr: float) -> None:
    if reg == "l1":
        for w in ws:
            prox_l1_(w, lr * lam)
    elif reg == "path":
        for i in range(0, len(ws), 2):
            prox_path_norm_(ws[i], ws[i + 1], lr * lam, check_finite=False)
    elif reg == "linf":
        for w in ws:
            project_rows_l1_ball_(w, 1.0 / lam)


def _error_pct(ws: Sequence[Tensor], bs: Sequence[Tensor], x: Tensor, y: Tensor) -> float:
    wrong = 0
    with torch.no_grad():
        for s in range(0, x.shape[0], 5000):
            wrong += int((_forward(ws, bs, x[s : s + 5000]).argmax(1) != y[s : s + 5000]).sum())
    return 100.0 * wrong / x.shape[0]


def train_metrics(ws: Sequence[Tensor], bs: Sequence[Tensor], data: Prepared) -> dict[str, float]:
    """The columns every run has: validation, clean errors, sparsity and the path-norm."""
    w_np = [w.cpu().numpy() for w in ws]
    return {
        "val_error": _error_pct(ws, bs, data.x_val, data.y_val),
        "clean_error": _error_pct(ws, bs, data.x_eval, data.y_eval),
        "clean_error_full": _error_pct(ws, bs, data.x_test, data.y_test),
        "nonzero": 100.0 * certify.nonzero_fraction(w_np),
        "nonzero_live": 100.0 * certify.effective_nonzero_fraction(w_np),
        "path_norm": certify.path_norm_bound(w_np),
    }


def _as_model(ws: Sequence[Tensor], bs: Sequence[Tensor]) -> torch.nn.Module:
    from pathnorm_experiments.torch_backend import build_model, linear_layers

    model = build_model([ws[0].shape[1], *(w.shape[0] for w in ws)], "elu")
    model.to(ws[0].device)
    with torch.no_grad():
        for lin, w, b in zip(linear_layers(model), ws, bs, strict=True):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
    return model.eval()


def evaluate_run(
    ws: Sequence[Tensor], bs: Sequence[Tensor], data: Prepared, cfg: SweepConfig, seed: int
) -> dict[str, float]:
    """Attacks and certificates of a selected run on the evaluation sample (errors in %).

    Args:
        ws: weights (out, in).
        bs: biases.
        data: the split (``x_eval``, ``y_eval``).
        cfg: radii, PGD steps, the strong attack's restarts.
        seed: the attacks' random starts.

    Returns:
        ``{"robust_error@EPS", "robust_error_strong@EPS", "certified_lipschitz@EPS",
        "certified_interval@EPS"}`` for every eps.
    """
    from pathnorm_experiments.torch_backend import pgd_attack, robust_error

    model = _as_model(ws, bs)
    x, y = data.x_eval, data.y_eval
    w_np, b_np = [w.cpu().numpy() for w in ws], [b.cpu().numpy() for b in bs]
    x_np, y_np = x.cpu().numpy(), y.cpu().numpy()
    logits = certify.forward(w_np, b_np, x_np, "elu")
    lip = certify.lipschitz_matrix(w_np)
    gen = torch.Generator(device=x.device).manual_seed(seed + 1)
    out: dict[str, float] = {}
    strong = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    for eps in sorted(cfg.eps):
        k = float_key(eps)
        paper = robust_error(model, x, y, eps, steps=cfg.pgd_steps, seed=seed, return_mask=True)
        strong |= paper  # a point found at a smaller eps lies in this ball too
        for _ in range(cfg.strong_restarts):
            alive = torch.nonzero(~strong).flatten()
            if alive.numel() == 0:
                break
            xa = pgd_attack(
                model,
                x[alive],
                y[alive],
                eps,
                steps=cfg.pgd_steps,
                step_size=eps / 10,
                loss="margin",
                generator=gen,
            )
            with torch.no_grad():
                strong[alive[model(xa).argmax(1) != y[alive]]] = True
        cert_lip = certify.certified_mask(
            w_np, b_np, x_np, y_np, eps, "elu", logits=logits, lip=lip
        )
        cert_ibp = certify.interval_certified_mask(w_np, b_np, x_np, y_np, eps, "elu")
        broken = strong.cpu().numpy()
        if (broken & cert_lip).any() or (broken & cert_ibp).any():
            # a sound certificate never meets a successful attack: this is a bug, not a result
            raise RuntimeError(
                f"eps {k}: an attack broke {int((broken & cert_lip).sum())} examples the "
                f"Lipschitz certificate and {int((broken & cert_ibp).sum())} the "
                "interval certificate certified"
            )
        n = x.shape[0]
        out[f"robust_error@{k}"] = 100.0 * float(paper.sum()) / n
        out[f"robust_error_strong@{k}"] = 100.0 * float(strong.sum()) / n
        out[f"certified_lipschitz@{k}"] = 100.0 * (1.0 - float(cert_lip.mean()))
        out[f"certified_interval@{k}"] = 100.0 * (1.0 - float(cert_ibp.mean()))
    return out


# ---------------------------------------------------------------- worker side

_DATA: dict[str, Prepared] = {}  # set in the parent before the workers fork


@dataclass(frozen=True)
class _Task:
    spec: RunSpec
    train: bool  # False: evaluate the given weights
    evaluate: bool
    keep_weights: bool
    weights: tuple[list[np.ndarray], list[np.ndarray]] | None = None


def _worker_init(device: str, data: Mapping[str, Prepared] | None = None) -> None:
    """One thread; the datasets (inherited through fork, or passed to a spawned worker) on
    ``device``."""
    torch.set_num_threads(1)
    if data is not None:
        _DATA.clear()
        _DATA.update(data)
    if device != "cpu":
        for name, p in list(_DATA.items()):
            _DATA[name] = Prepared(p.name, *(getattr(p, f).to(device) for f in _TENSOR_FIELDS))


_TENSOR_FIELDS = ("x_train", "y_train", "x_val", "y_val", "x_eval", "y_eval", "x_test", "y_test")


def _execute(task: _Task, cfg: SweepConfig) -> dict[str, Any]:
    """Run one task in a worker; returns the run's metrics (and weights when asked)."""
    data = _DATA[task.spec.dataset]
    t0 = time.perf_counter()
    result: dict[str, Any] = {}
    if task.train:
        trained = train_run(task.spec, data, cfg)
        if trained is None:
            return {"diverged": True, "seconds": time.perf_counter() - t0}
        ws, bs = trained
        result.update(train_metrics(ws, bs, data))
    else:
        assert task.weights is not None
        device = data.x_train.device
        ws = [torch.from_numpy(w).to(device) for w in task.weights[0]]
        bs = [torch.from_numpy(b).to(device) for b in task.weights[1]]
    if task.evaluate:
        result.update(evaluate_run(ws, bs, data, cfg, task.spec.seed))
    if task.keep_weights:
        result["weights"] = ([w.cpu().numpy() for w in ws], [b.cpu().numpy() for b in bs])
    result["seconds"] = time.perf_counter() - t0
    return result


class _InlineExecutor:
    """``--jobs 1``: the tasks run in this process, as they are submitted."""

    def submit(self, fn: Any, *args: Any) -> cf.Future[Any]:
        fut: cf.Future[Any] = cf.Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # handed to the caller through the future, like a pool
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to stop."""


# ---------------------------------------------------------------- results files


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.10g}"
    return str(value)


def append_rows(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Append ``rows`` to the CSV ``path`` in one locked, flushed write (header if new).

    A torn last line (a writer killed mid-write) is cut off first, so the file always holds
    whole rows.

    Args:
        path: the CSV file (made with its parents if missing).
        rows: rows with the keys of :data:`COLUMNS`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    for row in rows:
        writer.writerow({c: _fmt(row[c]) for c in COLUMNS})
    with path.open("a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size:
                f.seek(0)
                content = f.read()
                cut = content.rfind(b"\n") + 1
                if cut != size:
                    f.truncate(cut)
                    size = cut
            head = "" if size else ",".join(COLUMNS) + "\n"
            f.seek(0, os.SEEK_END)
            f.write((head + buf.getvalue()).encode())
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a results CSV (a torn last line is ignored); [] if the file is missing.

    Raises:
        ValueError: the header is not :data:`COLUMNS`.
    """
    if not path.is_file():
        return []
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    if not text:
        return []
    reader = csv.DictReader(io.StringIO(text))
    if tuple(reader.fieldnames or ()) != COLUMNS:
        raise ValueError(
            f"{path}: the header is not the sweep's columns (expected {len(COLUMNS)} columns "
            f"starting {COLUMNS[:3]}, got {reader.fieldnames}); move the file away or merge it"
        )
    return list(reader)


def summarize(
    rows: Sequence[Mapping[str, str]],
) -> dict[tuple[str, str, str, float], dict[str, Any]]:
    """The selected runs of each (dataset, regularizer, optimizer, lam), over their seeds.

    Args:
        rows: rows of :func:`read_rows`.

    Returns:
        Per group: ``lr`` (the selected one), ``seeds``, ``n_train`` and, for every numeric
        column, ``(mean, min, max)`` over the seeds (the spread a verdict should carry);
        empty cells (diverged runs) are left out of the statistics.
    """
    groups: dict[tuple[str, str, str, float], list[Mapping[str, str]]] = {}
    for r in rows:
        if r["selected"] == "1":
            key = (r["dataset"], r["regularizer"], r["optimizer"], float(r["lam"]))
            groups.setdefault(key, []).append(r)
    numeric = [c for c in COLUMNS[COLUMNS.index("val_error") :] if c != "machine"]
    out: dict[tuple[str, str, str, float], dict[str, Any]] = {}
    for key, rs in sorted(groups.items()):
        stats: dict[str, Any] = {
            "lr": float(rs[0]["lr"]),
            "seeds": sorted(int(r["seed"]) for r in rs),
            "n_train": int(rs[0]["n_train"]),
        }
        for c in numeric:
            vals = [float(r[c]) for r in rs if r[c] not in ("", "nan")]
            if vals:
                stats[c] = (float(np.mean(vals)), min(vals), max(vals))
        out[key] = stats
    return out


def merge(inputs: Sequence[Path], output: Path) -> int:
    """Join result files by run key into ``output`` (sorted by the key columns).

    Rows of one key that agree apart from ``machine`` are kept once. Rows of one key that
    differ are an error: two machines produced different numbers for the same run.

    Args:
        inputs: CSV files (``output`` may be among them).
        output: the merged file, written atomically.

    Returns:
        The number of rows written.
    """
    rows: dict[str, dict[str, str]] = {}
    for p in inputs:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such results file")
        for r in read_rows(p):
            k = row_key(r)
            old = rows.get(k)
            if old is None:
                rows[k] = r
            elif any(old[c] != r[c] for c in COLUMNS if c != "machine"):
                diff = [c for c in COLUMNS if c != "machine" and old[c] != r[c]]
                raise ValueError(
                    f"run {k} appears twice with different values ({', '.join(diff[:5])}; "
                    f"machines {old['machine']!r} and {r['machine']!r}); keep one file's row"
                )

    def order(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return (
            r["dataset"],
            REGULARIZERS.index(r["regularizer"]),
            r["optimizer"],
            float(r["lam"]),
            float(r["lr"]),
            int(r["seed"]),
            int(r["epochs"]),
        )

    tmp = output.with_name(output.name + ".tmp")
    tmp.unlink(missing_ok=True)
    append_rows(tmp, sorted(rows.values(), key=order))
    if not rows:
        tmp.write_text(",".join(COLUMNS) + "\n")
    os.replace(tmp, output)
    return len(rows)


def _results_path(out: Path, shard: tuple[int, int] | None) -> Path:
    return out / ("runs.csv" if shard is None else f"runs.shard-{shard[0]}-of-{shard[1]}.csv")


def _done_groups(out: Path) -> set[str]:
    """Groups with rows in any results file of ``out`` (a group's rows are written together)."""
    done: set[str] = set()
    for p in sorted(out.glob("runs*.csv")):
        done.update(_row_group_key(r) for r in read_rows(p))
    return done


def _pending_path(out: Path, spec: RunSpec) -> Path:
    return out / ".pending" / (hashlib.sha256(spec.key.encode()).hexdigest()[:24] + ".npz")


def _save_pending(out: Path, spec: RunSpec, result: dict[str, Any]) -> None:
    path = _pending_path(out, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in result.items() if k != "weights"}
    arrays: dict[str, np.ndarray] = {}
    if "weights" in result:
        for i, (w, b) in enumerate(zip(*result["weights"], strict=True)):
            arrays[f"w{i}"], arrays[f"b{i}"] = w, b
    tmp = path.with_name(path.stem + ".tmp.npz")
    arrays["meta"] = np.array(json.dumps({"key": spec.key, **meta}))
    np.savez(tmp, **arrays)  # type: ignore[arg-type]
    os.replace(tmp, path)


def _load_pending(out: Path, spec: RunSpec) -> dict[str, Any] | None:
    path = _pending_path(out, spec)
    if not path.is_file():
        return None
    try:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            n = sum(1 for k in z.files if k.startswith("w"))
            if n:
                meta["weights"] = ([z[f"w{i}"] for i in range(n)], [z[f"b{i}"] for i in range(n)])
    except (OSError, ValueError, KeyError):  # a damaged cache file: the run is redone
        return None
    return meta if meta.pop("key", None) == spec.key else None


# ---------------------------------------------------------------- the scheduler


def default_machine(device: str = "cpu") -> str:
    """A short description of this machine for the ``machine`` column."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"cuda {torch.cuda.get_device_name()}, torch {torch.__version__}"
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"cpu {model} ({os.cpu_count()} cores), torch {torch.__version__}"


@dataclass
class _GroupState:
    group: Group
    index: int
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # run key -> result
    selected_lr: float | None = None
    phase: str = "select"  # "select", then "final"
    waiting: set[str] = field(default_factory=set)


def _select_lr(state: _GroupState) -> float | None:
    g = state.group
    best: tuple[float, float] | None = None
    for lr in g.lrs:
        vals = [state.results[g.run(lr, s).key].get("val_error", math.nan) for s in g.select_seeds]
        if any(math.isnan(v) for v in vals):
            continue  # a diverged run: this lr is not chosen
        score = (float(np.mean(vals)), lr)
        if best is None or score < best:
            best = score
    return None if best is None else best[1]


def _rows(state: _GroupState, machine: str) -> list[dict[str, Any]]:
    g = state.group
    rows = []
    for key, res in state.results.items():
        lr, seed = res["_lr"], res["_seed"]
        spec = g.run(lr, seed)
        assert spec.key == key
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
        )
        if res.get("diverged"):
            for c in ("val_error", "clean_error", "clean_error_full"):
                row[c] = math.nan
        else:
            row.update({c: res[c] for c in COLUMNS if c in res})
        rows.append(row)
    rows.sort(key=lambda r: (float(r["lr"]), int(r["seed"])))
    return rows


def run_sweep(
    cfg: SweepConfig,
    data: Mapping[str, Prepared],
    out: Path,
    *,
    jobs: int = 1,
    shard: tuple[int, int] | None = None,
    machine: str | None = None,
    device: str = "cpu",
    stop_after: float | None = None,
    log: Any = None,
    start_method: str | None = None,
) -> dict[str, int]:
    """Run the grid's unfinished groups (of one shard), appending each group's rows when done.

    Args:
        cfg: the grid and evaluation settings.
        data: the prepared datasets, by name (datasets of ``cfg`` missing here are skipped).
        out: the results directory (``runs.csv``, or ``runs.shard-K-of-N.csv``; ``.pending/``).
        jobs: worker processes (1: in this process).
        shard: ``(K, N)``: run only the groups of shard K (1-based) of N.
        machine: the ``machine`` column (default: :func:`default_machine`).
        device: ``"cpu"`` or a CUDA device for the workers' tensors.
        stop_after: seconds after which no new task starts (the running ones finish).
        log: a text stream for progress lines (default stdout).
        start_method: how workers start (default: ``fork`` on CPU, ``spawn`` on CUDA).

    Returns:
        Counts: ``groups`` (in this shard), ``done_before``, ``written`` (groups written now),
        ``remaining``, ``trained`` and ``evaluated`` (runs trained, and attacked and certified,
        now).
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if shard is not None and not 1 <= shard[0] <= shard[1]:
        raise ValueError(f"shard must be K/N with 1 <= K <= N, got {shard[0]}/{shard[1]}")
    log = log or sys.stdout
    if start_method is None:
        start_method = "fork" if device == "cpu" else "spawn"
    machine = machine or default_machine(device)
    out.mkdir(parents=True, exist_ok=True)
    groups = build_groups(cfg, {k: v.n_train for k, v in data.items()})
    if shard is not None:
        groups = [g for g in groups if g.shard(shard[1]) == shard[0] - 1]
    done = _done_groups(out)
    todo = [g for g in groups if g.key not in done]
    counts = {
        "groups": len(groups),
        "done_before": len(groups) - len(todo),
        "written": 0,
        "remaining": len(todo),
        "trained": 0,
        "evaluated": 0,
    }
    if not todo:
        return counts
    results_path = _results_path(out, shard)
    _DATA.clear()
    _DATA.update(data)
    if jobs == 1:
        torch.set_num_threads(1)
        _worker_init(device)
        pool: Any = _InlineExecutor()
    else:
        pool = cf.ProcessPoolExecutor(
            jobs,
            mp_context=multiprocessing.get_context(start_method),
            initializer=_worker_init,
            # fork shares the parent's tensors; a spawned worker (CUDA cannot be used in a
            # forked child once the parent initialised it) gets its own copy
            initargs=(device, None if start_method == "fork" else dict(data)),
        )
    t_start = time.perf_counter()
    states = [_GroupState(g, i) for i, g in enumerate(todo)]
    ready: list[tuple[int, _Task]] = []  # (group index, task): the earliest groups first
    for st in states:
        for spec in st.group.selection_runs():
            cached = _load_pending(out, spec)
            if cached is not None:
                st.results[spec.key] = {**cached, "_lr": spec.lr, "_seed": spec.seed}
            else:
                ready.append((st.index, _Task(spec, True, False, keep_weights=True)))
                st.waiting.add(spec.key)
    running: dict[cf.Future[Any], tuple[_GroupState, _Task]] = {}

    def advance(st: _GroupState) -> None:
        """Move a group on when nothing of it is running: select, then finish."""
        if st.waiting:
            return
        if st.phase == "select":
            st.phase = "final"
            st.selected_lr = _select_lr(st)
            if st.selected_lr is not None:
                g = st.group
                for seed in g.seeds:
                    spec = g.run(st.selected_lr, seed)
                    if seed in g.select_seeds:
                        res = st.results[spec.key]
                        if "robust_error@" + float_key(cfg.eps[0]) in res:
                            continue  # evaluated before an interruption
                        task = _Task(spec, False, True, False, weights=res["weights"])
                    else:
                        cached = _load_pending(out, spec)
                        if cached is not None:
                            st.results[spec.key] = {**cached, "_lr": spec.lr, "_seed": seed}
                            continue
                        task = _Task(spec, True, True, False)
                    ready.append((st.index, task))
                    st.waiting.add(spec.key)
                ready.sort(key=lambda t: t[0])
            if st.waiting:
                return
        append_rows(results_path, _rows(st, machine))
        for key in st.results:
            lr, seed = st.results[key]["_lr"], st.results[key]["_seed"]
            _pending_path(out, st.group.run(lr, seed)).unlink(missing_ok=True)
        counts["written"] += 1
        counts["remaining"] -= 1
        print(
            f"[{counts['done_before'] + counts['written']}/{counts['groups']}] {st.group.key}: "
            f"lr {st.selected_lr} selected ({time.perf_counter() - t_start:.0f} s)",
            file=log,
            flush=True,
        )

    try:
        for st in states:
            advance(st)  # groups whose runs were all pending already
        while ready or running:
            stopping = stop_after is not None and time.perf_counter() - t_start > stop_after
            while ready and len(running) < jobs and not stopping:
                idx, task = ready.pop(0)
                running[pool.submit(_execute, task, cfg)] = (states[idx], task)
            if not running:
                break
            finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                st, task = running.pop(fut)
                res = fut.result()
                spec = task.spec
                prev = st.results.get(spec.key, {})
                merged = {**prev, **res, "_lr": spec.lr, "_seed": spec.seed}
                if not task.train:
                    merged["seconds"] = prev.get("seconds", 0.0) + res["seconds"]
                st.results[spec.key] = merged
                counts["trained"] += task.train
                counts["evaluated"] += task.evaluate
                _save_pending(out, spec, {k: v for k, v in merged.items() if k[0] != "_"})
                st.waiting.discard(spec.key)
                print(
                    f"  {spec.key}: {'train' if task.train else ''}"
                    f"{'+eval' if task.evaluate else ''} {res['seconds']:.1f} s"
                    f"{' DIVERGED' if res.get('diverged') else ''}"
                    + ("" if "val_error" not in res else f" val {res['val_error']:.2f}%"),
                    file=log,
                    flush=True,
                )
                advance(st)
    finally:
        pool.shutdown(wait=True)
    return counts


# ---------------------------------------------------------------- CLI


def _calibrate(cfg: SweepConfig, data: Prepared, device: str) -> dict[str, float]:
    """Seconds per training step of each (regularizer, optimizer) and per evaluated run."""
    torch.set_num_threads(1)
    times = {}
    for reg, opt, lam in (
        ("none", "prox", 0.0),
        ("l1", "prox", 1e-3),
        ("l1", "penalty", 1e-3),
        ("path", "prox", 1e-3),
        ("path", "penalty", 1e-3),
        ("linf", "prox", 0.2),
    ):
        spec = RunSpec(data.name, reg, opt, lam, 0.1, 0, 1, data.n_train)
        train_run(spec, data, cfg, steps=5)  # warm-up (numba, allocator)
        t0 = time.perf_counter()
        train_run(spec, data, cfg, steps=100)
        times[f"{reg}/{opt}"] = (time.perf_counter() - t0) / 100
    base = RunSpec(data.name, "none", "prox", 0.0, 0.1, 0, 1, data.n_train)
    trained = train_run(base, data, cfg, steps=200)
    assert trained is not None
    # the evaluation with a tenth of the PGD steps, scaled: the strong attack's restarts run
    # on the examples the paper's PGD leaves, as they would
    short = max(1, cfg.pgd_steps // 10)
    t0 = time.perf_counter()
    evaluate_run(*trained, data, replace(cfg, pgd_steps=short), 0)
    times["eval"] = (time.perf_counter() - t0) * cfg.pgd_steps / short
    return times


def _estimate(
    groups: Sequence[Group],
    done: set[str],
    data: Mapping[str, Prepared],
    cfg: SweepConfig,
    times: Mapping[str, float],
    jobs: int,
) -> tuple[int, int, float]:
    runs = evals = 0
    seconds = 0.0
    for g in groups:
        if g.key in done:
            continue
        n_runs = len(g.lrs) * len(g.select_seeds) + len(g.seeds) - len(g.select_seeds)
        steps = g.epochs * math.ceil(data[g.dataset].n_train / cfg.batch_size)
        per_step = times[f"{g.regularizer}/{g.optimizer}"]
        runs += n_runs
        evals += len(g.seeds)
        # the eval sample's size scales the attacks; calibrated on this dataset's sample
        seconds += n_runs * steps * per_step + len(g.seeds) * times["eval"]
    return runs, evals, seconds / jobs


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N (e.g. 2/8), got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"need 1 <= K <= N, got {text!r}")
    return k, n


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m pathnorm_experiments.sweep``."""
    p = argparse.ArgumentParser(
        prog="python -m pathnorm_experiments.sweep",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data-dir", default=None, help="holds mnist/, fashion-mnist/, kmnist/")
    p.add_argument("--out", default="docs/results", help="results directory")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (one thread each)")
    p.add_argument("--shard", type=_parse_shard, default=None, help="K/N: the K-th of N slices")
    p.add_argument(
        "--datasets",
        nargs="+",
        default=list(SweepConfig().datasets),
        choices=["mnist", "fashion-mnist", "kmnist", "embedded"],
    )
    p.add_argument("--regularizers", nargs="+", default=list(REGULARIZERS), choices=REGULARIZERS)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument(
        "--select-seeds", type=int, nargs="+", default=[0], help="seeds that run every lr"
    )
    p.add_argument("--eval-samples", type=int, default=2000, help="0: all test images")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] for the workers' tensors")
    p.add_argument("--machine", default=None, help="the machine column (default: detected)")
    p.add_argument("--stop-after", type=float, default=None, help="seconds; then start no new run")
    p.add_argument("--dry-run", action="store_true", help="print the grid size and a time estimate")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; ``merge OUT IN...`` joins result files instead. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        if len(argv) < 3:
            print(
                "usage: python -m pathnorm_experiments.sweep merge OUT.csv IN.csv...",
                file=sys.stderr,
            )
            return 2
        try:
            n = merge([Path(a) for a in argv[2:]], Path(argv[1]))
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {n} rows to {argv[1]}")
        return 0
    args = build_parser().parse_args(argv)
    if args.jobs < 1:
        print(f"error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    try:
        cfg = SweepConfig(
            datasets=tuple(args.datasets),
            regularizers=tuple(args.regularizers),
            lrs=tuple(args.lrs),
            seeds=tuple(args.seeds),
            select_seeds=tuple(args.select_seeds),
            epochs=args.epochs,
            eval_samples=args.eval_samples or None,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    data: dict[str, Prepared] = {}
    for name in cfg.datasets:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the partial-set warning: said below
                ds = load_dataset(name, args.data_dir, allow_partial=True)
        except DataError as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
            continue
        data[name] = prepare(ds, cfg)
        note = " (PARTIAL training set)" if ds.partial else ""
        print(
            f"{name}{note}: {ds.x_train.shape[0]} training images -> {data[name].n_train} "
            f"train + {data[name].x_val.shape[0]} validation; {data[name].x_eval.shape[0]} "
            f"of {ds.x_test.shape[0]} test images attacked and certified"
        )
    if not data:
        print("error: none of the datasets is available; see --data-dir", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.dry_run:
        groups = build_groups(cfg, {k: v.n_train for k, v in data.items()})
        if args.shard is not None:
            groups = [g for g in groups if g.shard(args.shard[1]) == args.shard[0] - 1]
        done = _done_groups(out) if out.is_dir() else set()
        times = _calibrate(cfg, next(iter(data.values())), args.device)
        runs, evals, seconds = _estimate(groups, done, data, cfg, times, args.jobs)
        print(
            f"{len(groups)} groups ({len(groups) - sum(g.key in done for g in groups)} to run): "
            f"{runs} training runs, {evals} evaluated; per step (ms): "
            + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in times.items() if k != "eval")
            + f"; evaluation {times['eval']:.0f} s per selected run"
        )
        print(
            f"estimate: {seconds / 3600:.2f} h with {args.jobs} job(s), if each job has a core "
            "to itself"
        )
        return 0
    counts = run_sweep(
        cfg,
        data,
        out,
        jobs=args.jobs,
        shard=args.shard,
        machine=args.machine,
        device=args.device,
        stop_after=args.stop_after,
    )
    print(
        f"{counts['written']} groups written now, {counts['done_before']} before, "
        f"{counts['remaining']} remaining of {counts['groups']} "
        f"({counts['trained']} runs trained, {counts['evaluated']} evaluated)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
