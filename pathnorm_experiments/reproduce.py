"""``pathnorm-reproduce``: the paper's lam sweep (SGD vs Proximal SGD), plots and claim table.

For every dataset and seed it trains the unregularized baseline, then ``l1`` and ``path`` with
both ``penalty`` (plain SGD on CE + lam g) and ``prox`` (Proximal SGD), and ``linf`` with its
projection, over a lam grid; each run is stored as ``<out>/runs/<name>.json`` (re-running
skips finished runs). Then it writes PNG plots like the paper's figures into ``<out>/img/``
and a markdown report ``<out>/report.md`` that checks the paper's claims with numbers.

Runs use the plain torch loop of :mod:`pathnorm_experiments.torch_backend`, which applies the
library's prox functions (``pathnorm_lightning.functional``) after every SGD step with step
``lr * lam``: the same step semantics as the Lightning callbacks, without Trainer overhead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pathnorm_experiments.config import (
    DEFAULT_EPS,
    TrainConfig,
    float_key,
    nonnegative_int,
    unwritable_dir,
)
from pathnorm_experiments.data import DataError, load_dataset
from pathnorm_experiments.deps import MissingDependency, require
from pathnorm_experiments.evaluation import legend_below, place_legends

__all__ = [
    "GRIDS",
    "build_parser",
    "main",
    "make_plots",
    "make_report",
    "preflight",
    "run_config",
    "run_sweep",
]

# lam grids per regularizer (subsets of the paper's 41-value grid, chosen to span
# "no effect" to "too strong" for a 784-200-10 net at lr 0.1)
GRIDS: dict[str, dict[str, tuple[float, ...]]] = {
    "quick": {"l1": (1e-4, 1e-3, 3e-3), "path": (1e-4, 5e-4, 1e-3), "linf": (0.1, 0.2, 0.5)},
    "full": {
        "l1": (1e-4, 3e-4, 1e-3, 3e-3),
        "path": (1e-4, 3e-4, 1e-3, 2e-3),
        "linf": (0.05, 0.1, 0.2, 0.5),
    },
}
TRADEOFF_EPS = 0.1
COLORS = {"none": "black", "l1": "tab:blue", "linf": "tab:green", "path": "tab:red"}
LABELS = {"none": "none", "l1": "L1", "linf": "layer-wise linf", "path": "1-path-norm"}


def run_name(dataset: str, reg: str, method: str, lam: float, seed: int) -> str:
    """File stem of one run (distinct lams give distinct stems, see ``float_key``)."""
    return f"{dataset}_{reg}_{method}_lam{float_key(lam)}_s{seed}"


def plan(
    datasets: Sequence[str], grid: dict[str, tuple[float, ...]], seeds: Sequence[int]
) -> list[tuple[str, str, str, float, int]]:
    """All runs (dataset, regularizer, method, lam, seed), cheapest first within a dataset."""
    runs = []
    for ds in datasets:
        for seed in seeds:
            runs.append((ds, "none", "prox", 0.0, seed))
            for reg in ("l1", "linf", "path"):
                methods = ("prox",) if reg == "linf" else ("penalty", "prox")
                for method in methods:
                    for lam in grid[reg]:
                        runs.append((ds, reg, method, lam, seed))
    return runs


def run_config(
    run: tuple[str, str, str, float, int],
    *,
    epochs: int,
    lr: float,
    pgd_samples: int | None,
    log_every: int,
    eval_train_samples: int | None,
) -> TrainConfig:
    """The :class:`TrainConfig` of one planned run (raises ValueError on a bad setting)."""
    _, reg, method, lam, seed = run
    return TrainConfig(
        regularizer=reg,
        method=method,
        lam=lam,
        lr=lr,
        epochs=epochs,
        seed=seed,
        pgd_samples=pgd_samples,
        log_every=log_every,
        eval_train_samples=eval_train_samples,
    )


def run_sweep(
    runs: Sequence[tuple[str, str, str, float, int]],
    out: Path,
    *,
    epochs: int,
    lr: float,
    data_dir: str | None,
    pgd_samples: int | None,
    log_every: int,
    eval_train_samples: int | None,
    allow_partial: bool = False,
) -> list[dict[str, Any]]:
    """Train and evaluate each run (skipping those already on disk); returns all results."""
    import torch

    from pathnorm_experiments.torch_backend import train_loop

    torch.set_num_threads(1)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    cache: dict[str, Any] = {}
    results = []
    t_start = time.perf_counter()
    for k, run in enumerate(runs, 1):
        ds = run[0]
        path = out / "runs" / f"{run_name(*run)}.json"
        if path.is_file():
            results.append(json.loads(path.read_text()))
            continue
        if ds not in cache:
            cache.clear()
            cache[ds] = load_dataset(ds, data_dir, allow_partial=allow_partial)
        cfg = run_config(
            run,
            epochs=epochs,
            lr=lr,
            pgd_samples=pgd_samples,
            log_every=log_every,
            eval_train_samples=eval_train_samples,
        )
        t0 = time.perf_counter()
        try:
            _, res = train_loop(cfg, cache[ds], progress=False)
        except FloatingPointError as e:
            print(f"[{k}/{len(runs)}] {path.stem}: diverged ({e}); skipped", flush=True)
            continue
        path.write_text(json.dumps(res) + "\n")
        results.append(res)
        print(
            f"[{k}/{len(runs)}] {path.stem}: clean {100 * res['clean_error']:.2f}% robust@0.1 "
            f"{100 * res['robust_error'].get('0.1', math.nan):.1f}% nonzero "
            f"{res['nonzero_weights_pct']:.1f}% raw, {res['effective_nonzero_pct']:.1f}% on live "
            f"paths, obj {res['final_regularized_loss']:.4f} "
            f"({time.perf_counter() - t0:.0f} s, total {time.perf_counter() - t_start:.0f} s)",
            flush=True,
        )
    return results


def _key(r: dict[str, Any]) -> tuple[str, str, str, float]:
    c = r["config"]
    return r["dataset"], c["regularizer"], c["method"], float(c["lam"])


def aggregate(
    results: Sequence[dict[str, Any]],
) -> dict[tuple[str, str, str, float], dict[str, Any]]:
    """Mean (and count) over seeds of the scalar metrics, per (dataset, reg, method, lam)."""
    groups: dict[tuple[str, str, str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        groups[_key(r)].append(r)
    agg = {}
    for k, rs in groups.items():
        eps_keys = list(rs[0]["robust_error"])
        agg[k] = {
            "n": len(rs),
            "clean": float(np.mean([r["clean_error"] for r in rs])),
            "robust": {e: float(np.mean([r["robust_error"][e] for r in rs])) for e in eps_keys},
            "certified": {
                e: float(np.mean([r["certified_error"][e] for r in rs])) for e in eps_keys
            },
            # interval bound propagation: absent from runs written before it was measured
            "interval": {
                e: float(np.mean([r["certified_error_interval"][e] for r in rs]))
                for e in eps_keys
                if all(e in r.get("certified_error_interval", {}) for r in rs)
            },
            "nonzero": float(np.mean([r["nonzero_weights_pct"] for r in rs])),
            "live": float(np.mean([r["effective_nonzero_pct"] for r in rs])),
            "objective": float(np.mean([r["final_regularized_loss"] for r in rs])),
            "path_norm": float(np.mean([r["path_norm_bound"] for r in rs])),
            "product": float(np.mean([r["product_bound"] for r in rs])),
            "runs": rs,
        }
    return agg


def _datasets(agg: dict[tuple[str, str, str, float], Any]) -> list[str]:
    return sorted({k[0] for k in agg})


def _lams(
    agg: dict[tuple[str, str, str, float], Any], ds: str, reg: str, method: str
) -> list[float]:
    return sorted(k[3] for k in agg if k[0] == ds and k[1] == reg and k[2] == method)


def _lam_axis(ax: Any, lams: Sequence[float]) -> None:
    """A log lam axis ticked at the grid's values; log minor labels (2x10^-1, 3x10^-1, ...)
    crowd a short decade, so only these are labelled, upright when there are many, and a
    value too close to the last labelled one (under 6% of the axis) keeps an unlabelled tick."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    ax.set_xticks(list(lams))
    logs = np.log10(lams)
    gap = 0.06 * max(float(logs[-1] - logs[0]), 1e-12)
    labels, last = [], -np.inf
    for lam, lg in zip(lams, logs, strict=True):
        keep = lg - last >= gap
        labels.append(f"{lam:g}" if keep else "")
        last = lg if keep else last
    ax.set_xticklabels(labels, rotation=90 if len(lams) > 4 else 0)
    ax.xaxis.set_minor_formatter(NullFormatter())


def _trajectories(plt: Any, agg: dict, ds: str, field: str, ylabel: str) -> Any:
    """Two panels (L1, path): ``history[field]`` vs iteration, SGD dashed, Prox-SGD solid."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    cmap = plt.get_cmap("viridis")
    for ax, reg in zip(axes, ("l1", "path"), strict=True):
        lams = _lams(agg, ds, reg, "prox")
        for i, lam in enumerate(lams):
            col = cmap(i / max(1, len(lams) - 1))
            for method, style in (("penalty", "--"), ("prox", "-")):
                a = agg.get((ds, reg, method, lam))
                if a is None:
                    continue
                h = a["runs"][0]["history"]
                name = "Prox-SGD" if method == "prox" else "SGD"
                ax.plot(
                    h["iteration"], h[field], style, color=col, lw=1, label=f"{name} lam={lam:g}"
                )
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ds}: {LABELS[reg]}")
        legend_below(ax, ncol=3)
    return fig


def make_plots(agg: dict[tuple[str, str, str, float], Any], img: Path) -> list[Path]:
    """The paper's figures, one set per dataset; returns the written PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    te = f"{TRADEOFF_EPS:g}"

    def save(fig: Any, name: str) -> None:
        p = img / name
        fig.tight_layout()
        place_legends(fig)
        fig.savefig(p, dpi=110, bbox_inches="tight")  # the legends below the axes included
        plt.close(fig)
        written.append(p)

    for ds in _datasets(agg):
        # Fig. 1: regularized loss vs iteration, SGD (dashed) vs Prox-SGD (solid), first seed
        fig = _trajectories(plt, agg, ds, "batch_objective", "regularized loss (minibatch mean)")
        fig.axes[0].set_yscale("log")
        fig.axes[1].set_yscale("log")
        save(fig, f"{ds}_loss_vs_iter.png")

        # Fig. 2: clean (left) and robust (right) error vs % nonzero weights
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for reg in ("none", "l1", "linf", "path"):
            for method, marker in (("prox", "o"), ("penalty", "x")):
                pts = [
                    (r["effective_nonzero_pct"], r["clean_error"], r["robust_error"][te])
                    for k, a in agg.items()
                    if k[0] == ds and k[1] == reg and k[2] == method
                    for r in a["runs"]
                ]
                if not pts:
                    continue
                nz, ce, re = zip(*pts, strict=True)
                lab = f"{LABELS[reg]} ({'Prox-SGD' if method == 'prox' else 'SGD'})"
                axes[0].scatter(nz, 100 * np.array(ce), c=COLORS[reg], marker=marker, label=lab)
                axes[1].scatter(nz, 100 * np.array(re), c=COLORS[reg], marker=marker, label=lab)
        for ax, what in zip(
            axes, ("clean test error %", f"robust test error % (PGD eps={te})"), strict=True
        ):
            ax.set_xlabel("% nonzero weights (on live paths)")
            ax.set_ylabel(what)
            ax.set_title(ds)
        legend_below(axes[1], ncol=2)
        save(fig, f"{ds}_error_vs_nonzero.png")

        # Fig. 3: clean and robust error vs lam (Prox-SGD / projection)
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        base = agg.get((ds, "none", "prox", 0.0))
        for ax, reg in zip(axes, ("l1", "linf", "path"), strict=True):
            lams = _lams(agg, ds, reg, "prox")
            if not lams:
                continue
            rows = [agg[(ds, reg, "prox", lam)] for lam in lams]
            ax.plot(lams, [100 * a["clean"] for a in rows], "o-", c="k", label="clean")
            for e, ls in (("0.05", ":"), ("0.1", "-"), ("0.2", "--")):
                if e in rows[0]["robust"]:
                    ax.plot(
                        lams,
                        [100 * a["robust"][e] for a in rows],
                        "s" + ls,
                        c=COLORS[reg],
                        label=f"robust eps={e}",
                    )
            if base is not None:
                ax.axhline(100 * base["clean"], c="gray", lw=0.8, label="clean, no reg.")
            _lam_axis(ax, lams)
            ax.set_xlabel("lam" + (" (radius 1/lam)" if reg == "linf" else ""))
            ax.set_ylabel("test error %")
            ax.set_title(f"{ds}: {LABELS[reg]}")
            legend_below(ax, ncol=2)
        save(fig, f"{ds}_error_vs_lam.png")

        # Fig. 4-7: % nonzero weights vs iteration, SGD vs Prox-SGD
        fig = _trajectories(plt, agg, ds, "effective_nonzero_pct", "% nonzero weights (live paths)")
        save(fig, f"{ds}_nonzero_vs_iter.png")

        # Fig. 8: robustness-accuracy trade-off (one point per lam, mean over seeds)
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, e in zip(axes, ("0.05", te), strict=True):
            for reg in ("l1", "linf", "path"):
                lams = _lams(agg, ds, reg, "prox")
                if not lams:
                    continue
                rows = [agg[(ds, reg, "prox", lam)] for lam in lams]
                ax.plot(
                    [100 * a["clean"] for a in rows],
                    [100 * a["robust"][e] for a in rows],
                    "o-",
                    c=COLORS[reg],
                    label=f"{LABELS[reg]} PGD",
                )
                ax.plot(
                    [100 * a["clean"] for a in rows],
                    [100 * a["certified"][e] for a in rows],
                    "^:",
                    c=COLORS[reg],
                    alpha=0.6,
                    label=f"{LABELS[reg]} certified (Lipschitz)",
                )
                if all(e in a["interval"] for a in rows):
                    ax.plot(
                        [100 * a["clean"] for a in rows],
                        [100 * a["interval"][e] for a in rows],
                        "v--",
                        c=COLORS[reg],
                        alpha=0.6,
                        label=f"{LABELS[reg]} certified (interval)",
                    )
            if base is not None:
                ax.scatter(
                    [100 * base["clean"]],
                    [100 * base["robust"][e]],
                    c="k",
                    marker="*",
                    s=80,
                    label="no reg.",
                )
            ax.set_xlabel("clean test error %")
            ax.set_ylabel(f"error % at eps={e}")
            ax.set_title(f"{ds}: robustness-accuracy trade-off (Prox-SGD)")
            legend_below(ax, ncol=2)
        save(fig, f"{ds}_tradeoff.png")
    return written


def _best_within(
    agg: dict, ds: str, reg: str, max_clean: float, metric: str, eps: str
) -> tuple[float, str] | None:
    """Least ``metric`` error at ``eps`` over the runs of ``reg`` (any method, any lam) whose
    clean error is at most ``max_clean``; returns (error, "method lam")."""
    cands = [
        (a[metric][eps], f"{'Prox-SGD' if k[2] == 'prox' else 'SGD'} lam {k[3]:g}")
        for k, a in agg.items()
        if k[0] == ds and k[1] == reg and a["clean"] <= max_clean and eps in a[metric]
    ]
    return min(cands) if cands else None


def _tradeoff_claim(agg: dict, ds: str, base: dict, metric: str, eps: str) -> str:
    """One line of claim 3: best ``metric`` error per regularizer within clean-error budgets."""
    lines, wins, gaps = [], [], []
    for slack in (0.01, 0.03, 0.06):
        mc = base["clean"] + slack
        best = {reg: _best_within(agg, ds, reg, mc, metric, eps) for reg in ("l1", "linf", "path")}
        fmt = {r: (f"{100 * b[0]:.1f}% ({b[1]})" if b else "no run") for r, b in best.items()}
        lines.append(
            f"clean <= {100 * mc:.1f}%: path {fmt['path']}, L1 {fmt['l1']}, linf {fmt['linf']}"
        )
        bp, bl, bi = best["path"], best["l1"], best["linf"]
        if bp and bl:
            wins.append(bp[0] < bl[0])
        if bp and bi:
            gaps.append(bp[0] - bi[0])
    v1 = "holds" if wins and all(wins) else "holds in part" if any(wins) else "does not hold"
    v2 = (
        "path - linf = " + ", ".join(f"{100 * g:+.1f}" for g in gaps) + " points"
        if gaps
        else "not measured"
    )
    what = {
        "robust": "PGD-robust",
        "certified": "certified (Lipschitz)",
        "interval": "certified (interval bound propagation)",
    }[metric]
    return (
        f"  - {what} error at eps {eps}: better than L1: **{v1}**; vs layer-wise linf: {v2}. "
        + "; ".join(lines)
    )


def make_report(agg: dict[tuple[str, str, str, float], Any], meta: dict[str, Any]) -> str:
    """Markdown: settings, the full table, and the claim checks with numbers."""
    te = f"{TRADEOFF_EPS:g}"
    out = ["## Settings", ""]
    for name, value in meta.items():
        out.append(f"- {name}: {value}")
    out += ["", "## All runs (mean over seeds)", ""]
    out.append(
        "| dataset | regularizer | method | lam | seeds | clean err % | robust err % eps 0.05 / 0.1 / 0.2 "
        "| certified err % eps 0.05 / 0.1: Lipschitz | interval | nonzero % (live paths) "
        "| path-norm | product bound | final reg. loss |"
    )
    out.append("|" + "---|" * 13)
    for k in sorted(agg):
        a = agg[k]
        r, c, iv = a["robust"], a["certified"], a["interval"]
        out.append(
            f"| {k[0]} | {k[1]} | {'Prox-SGD' if k[2] == 'prox' else 'SGD'} | {k[3]:g} | {a['n']} | "
            f"{100 * a['clean']:.2f} | {100 * r.get('0.05', math.nan):.1f} / {100 * r.get('0.1', math.nan):.1f} / "
            f"{100 * r.get('0.2', math.nan):.1f} | {100 * c.get('0.05', math.nan):.1f} / "
            f"{100 * c.get('0.1', math.nan):.1f} | {100 * iv.get('0.05', math.nan):.1f} / "
            f"{100 * iv.get('0.1', math.nan):.1f} | {a['nonzero']:.1f} ({a['live']:.1f}) | {a['path_norm']:.3g} | "
            f"{a['product']:.3g} | {a['objective']:.4f} |"
        )
    out += ["", "## Claims", ""]
    for ds in _datasets(agg):
        out += [f"### {ds}", ""]
        # Claim 1: Prox-SGD ends at a lower regularized loss than SGD
        wins, total, rows = 0, 0, []
        for reg in ("l1", "path"):
            for lam in _lams(agg, ds, reg, "prox"):
                if (ds, reg, "penalty", lam) in agg:
                    p, s = (
                        agg[(ds, reg, "prox", lam)]["objective"],
                        agg[(ds, reg, "penalty", lam)]["objective"],
                    )
                    total += 1
                    wins += p < s
                    rows.append(f"{LABELS[reg]} lam={lam:g}: Prox-SGD {p:.4f} vs SGD {s:.4f}")
        out.append(
            f"- **Prox-SGD ends at a lower regularized loss than SGD**: {wins} of {total} "
            f"(regularizer, lam) settings -> {'holds' if total and wins == total else 'holds in part' if wins else 'does not hold'}. "
            + "; ".join(rows)
        )
        # Claim 2: sparsity controlled by lam
        parts, monotone = [], True
        for reg in ("l1", "path"):
            lams = _lams(agg, ds, reg, "prox")
            nz = [agg[(ds, reg, "prox", lam)]["live"] for lam in lams]
            monotone &= all(b <= a + 1e-9 for a, b in itertools.pairwise(nz))
            sgd = [
                agg[(ds, reg, "penalty", lam)]["live"]
                for lam in lams
                if (ds, reg, "penalty", lam) in agg
            ]
            parts.append(
                f"{LABELS[reg]} Prox-SGD nonzero % (live paths) at lam "
                + ", ".join(f"{lam:g}: {v:.1f}" for lam, v in zip(lams, nz, strict=True))
                + f" (SGD: {', '.join(f'{v:.1f}' for v in sgd)})"
            )
        out.append(
            f"- **Sparsity is controlled by lam** (Prox-SGD nonzero % decreases with lam): "
            f"{'holds' if monotone else 'does not hold monotonically'}. " + "; ".join(parts)
        )
        # Claim 3: trade-off, path vs l1 vs linf
        base = agg.get((ds, "none", "prox", 0.0))
        if base is not None:
            out.append(
                "- **The 1-path-norm gives a better accuracy-robustness trade-off than L1, close to "
                "the layer-wise constraint**: least error at eps among the runs (both methods, "
                "all lam) whose clean error is within 1 / 3 / 6 points of the unregularized "
                f"baseline (clean {100 * base['clean']:.2f}%, PGD-robust at eps {te} "
                f"{100 * base['robust'][te]:.1f}%):"
            )
            for metric, eps in (
                ("robust", "0.05"),
                ("robust", te),
                ("certified", "0.05"),
                ("interval", "0.05"),
            ):
                if any(eps in a[metric] for a in agg.values()):
                    out.append(_tradeoff_claim(agg, ds, base, metric, eps))
        out.append("")
    return "\n".join(out) + "\n"


DESCRIPTION = """\
The paper's lam sweep (SGD vs Proximal SGD), its plots and a claim table.

For every dataset and seed it trains the unregularized baseline, then l1 and path with both
penalty (plain SGD on CE + lam g) and prox (Proximal SGD), and linf with its projection, over
a lam grid. Each run is stored as <out>/runs/<name>.json (re-running skips finished runs).
Then it writes PNG plots like the paper's figures into <out>/img/ and a markdown report
<out>/report.md that checks the paper's claims with numbers. Runs use the plain torch loop
(the library's prox functions after every SGD step, step lr * lam) on one thread.
"""


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks and appends every option's default to its help."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="pathnorm-reproduce", description=DESCRIPTION, formatter_class=_Formatter
    )
    p.add_argument(
        "--quick", action="store_true", help="embedded data, small grid, 3 epochs, 1 seed"
    )
    p.add_argument(
        "--datasets",
        nargs="+",
        default=None,
        help="None: embedded (quick), mnist fashion-mnist kmnist (full)",
    )
    p.add_argument(
        "--data-dir", default=None, help="None: $PATHNORM_DATA_DIR, else ~/.cache/pathnorm"
    )
    p.add_argument("--allow-partial", action="store_true", help="accept KMNIST's partial train set")
    p.add_argument("--epochs", type=int, default=None, help="None: quick: 3, full: 20 (the paper)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="None: quick: 0, full: 0..5")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    for reg in ("l1", "path", "linf"):
        p.add_argument(
            f"--lams-{reg}",
            type=float,
            nargs="+",
            default=None,
            help=f"None: quick {' '.join(map(str, GRIDS['quick'][reg]))}, "
            f"full {' '.join(map(str, GRIDS['full'][reg]))}",
        )
    p.add_argument(
        "--pgd-samples",
        type=nonnegative_int("all test images"),
        default=1000,
        help="test images attacked per run (0: all)",
    )
    p.add_argument("--out", default="reproduce_out", help="output directory")
    p.add_argument("--report-only", action="store_true", help="only re-plot from <out>/runs")
    return p


def preflight(
    datasets: Sequence[str], data_dir: str | None, allow_partial: bool, out: Path, report_only: bool
) -> None:
    """Check, before the first run, everything the sweep and its report will need.

    Args:
        datasets: the datasets to load.
        data_dir: their directory.
        allow_partial: accept KMNIST's partial training set.
        out: the output directory.
        report_only: only the report is made (no torch, no data needed).

    Raises:
        MissingDependency: torch (for training) or matplotlib (for the plots) is missing.
        DataError: a dataset is missing or corrupt.
        ValueError: ``out`` cannot be written.
    """
    if not report_only:
        require(("torch",), "pathnorm-reproduce (the sweep trains with the torch loop)")
    require(("matplotlib",), "pathnorm-reproduce (the plots)")
    problem = unwritable_dir(out)
    if problem is not None:
        raise ValueError(f"--out {out}: {problem}: choose another --out")
    if report_only:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ds in datasets:
            load_dataset(ds, data_dir, allow_partial=allow_partial)


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``pathnorm-reproduce``."""
    args = build_parser().parse_args(argv)

    mode = "quick" if args.quick else "full"
    grid = dict(GRIDS[mode])
    for reg, attr in (("l1", "lams_l1"), ("path", "lams_path"), ("linf", "lams_linf")):
        if getattr(args, attr) is not None:
            grid[reg] = tuple(getattr(args, attr))
    datasets = args.datasets or (
        ["embedded"] if args.quick else ["mnist", "fashion-mnist", "kmnist"]
    )
    epochs = args.epochs if args.epochs is not None else (3 if args.quick else 20)
    pgd_samples = args.pgd_samples or None  # 0: all, as in pathnorm-train
    settings = {
        "epochs": epochs,
        "lr": args.lr,
        "pgd_samples": pgd_samples,
        "log_every": 10 if args.quick else 50,
        "eval_train_samples": None,
    }
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else list(range(6)))
    out = Path(args.out)
    runs = plan(datasets, grid, seeds)
    t0 = time.perf_counter()
    try:  # check every setting, package, dataset and the output before hours of training
        if not args.report_only:
            for run in runs:
                run_config(run, **settings)
        preflight(datasets, args.data_dir, args.allow_partial, out, args.report_only)
    except (DataError, ValueError, MissingDependency) as e:
        print(f"pathnorm-reproduce: error: {e}", file=sys.stderr)
        return 2
    if args.report_only:
        results = [json.loads(f.read_text()) for f in sorted((out / "runs").glob("*.json"))]
    else:
        print(
            f"{len(runs)} runs: datasets {datasets}, seeds {seeds}, epochs {epochs}, grid {grid}",
            flush=True,
        )
        results = run_sweep(
            runs,
            out,
            data_dir=args.data_dir,
            allow_partial=args.allow_partial,
            **settings,
        )
    if not results:
        print("no results to report", file=sys.stderr)
        return 1
    agg = aggregate(results)
    pngs = make_plots(agg, out / "img")
    meta = {
        "datasets": ", ".join(datasets),
        "epochs": epochs,
        "seeds": ", ".join(map(str, seeds)),
        "learning rate": args.lr,
        "batch size": 100,
        "network": "784-200-10, ELU",
        "lam grids": "; ".join(f"{k}: {', '.join(f'{v:g}' for v in vs)}" for k, vs in grid.items()),
        "PGD": f"40 steps of eps/20, random start, on {'all' if pgd_samples is None else f'the first {pgd_samples}'} test images; eps {', '.join(f'{e:g}' for e in DEFAULT_EPS)}",
        "runs": len(results),
        "wall time of this invocation (s)": f"{time.perf_counter() - t0:.0f}",
    }
    (out / "report.md").write_text(make_report(agg, meta))
    print(f"wrote {out / 'report.md'} and {len(pngs)} plots in {out / 'img'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
