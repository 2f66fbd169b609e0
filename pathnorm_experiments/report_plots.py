"""The plots of the results report (:mod:`pathnorm_experiments.report`), per dataset.

Each figure has one legend, outside the axes on the right, so no legend covers data; lam axes
are logarithmic and labelled at the grid's values only. Every point is the mean over seeds
with the seeds' min-max as error bars.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pathnorm_experiments.regularizers import OPTIMIZERS, TABLE
from pathnorm_experiments.report_data import (
    COMPACTED,
    KIND_LABELS,
    KINDS,
    MEASURE_LABELS,
    OPT_LABELS,
    REG_LABELS,
    REGULARIZED,
    Setting,
    baseline,
    col,
    compacted_sizes,
    dataset_label,
    method_label,
    settings_of,
)

__all__ = ["plot_dataset"]

STYLES = {"prox": ("o", "-"), "penalty": ("s", "--")}
# every (regularizer, optimizer) trained: a constraint has only its projection (prox)
SERIES = tuple(
    (r, o) for r in REGULARIZED for o in OPTIMIZERS if o == "prox" or not TABLE[r].constraint
)
_OPT_SHORT = {**OPT_LABELS, "prox": f"{OPT_LABELS['prox']} / projection"}
MEASURE_COLORS = (("nonzero", "black"), ("nonzero_live", "tab:orange"))


def _points(ss: Sequence[Setting], x: str, y: str) -> tuple[np.ndarray, ...] | None:
    """x and y means with their min-max as error bars, over the settings that have both."""
    ok = [s for s in ss if x in s.stats and y in s.stats]
    if not ok:
        return None
    xs, ys = ([s.stats[c] for s in ok] for c in (x, y))
    return (
        np.array([v.mean for v in xs]),
        np.array([v.mean for v in ys]),
        np.array([[v.mean - v.lo for v in xs], [v.hi - v.mean for v in xs]]),
        np.array([[v.mean - v.lo for v in ys], [v.hi - v.mean for v in ys]]),
    )


def _draw(
    ax: Any, pts: tuple[np.ndarray, ...] | None, color: str, opt: str, label: str, xerr: bool = True
) -> None:
    if pts is None:
        return
    x, y, ex, ey = pts
    marker, line = STYLES[opt]
    ax.errorbar(
        x, y, yerr=ey, xerr=ex if xerr else None, marker=marker, ls=line, color=color,
        ms=4, lw=1, capsize=2, elinewidth=0.8, label=label,
    )  # fmt: skip


def _star(ax: Any, base: Setting | None, x: str, y: str) -> None:
    """The unregularized baseline's (x, y) as a star, where it has both."""
    if base is not None and x in base.stats and y in base.stats:
        ax.plot(
            [base.stats[x].mean], [base.stats[y].mean], "*", color="black", ms=11, ls="none",
            label="no regularization",
        )  # fmt: skip


def _lam_axis(ax: Any, lams: Sequence[float]) -> None:
    """A log lam axis ticked at the grid's values; a value closer than 6% of the axis to the
    last labelled one keeps an unlabelled tick, and many labels stand upright."""
    from matplotlib.ticker import NullFormatter, NullLocator

    ax.set_xscale("log")
    lams = sorted(set(lams))
    if not lams:
        return
    ax.set_xticks(lams)
    ax.set_xlim(lams[0] / 1.4, lams[-1] * 1.4)  # a margin in log space (one lam: a range)
    logs = np.log10(lams)
    gap = 0.06 * max(float(logs[-1] - logs[0]), 1e-12)
    labels, last = [], -np.inf
    for lam, lg in zip(lams, logs, strict=True):
        keep = lg - last >= gap
        labels.append(f"{lam:g}" if keep else "")
        last = lg if keep else last
    ax.set_xticklabels(labels, rotation=90 if len(lams) > 4 else 0)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _vs_lam(
    plt: Any,
    settings: Mapping[tuple, Setting],
    ds: str,
    figsize: tuple[float, float],
    series: Sequence[tuple[str, str, str]],
) -> tuple[Any, Any]:
    """One panel per regularizer: each of ``series`` (column, label, colour) against lam (mean,
    min-max bars), per optimizer."""
    fig, axes = plt.subplots(
        1, len(REGULARIZED), figsize=figsize, layout="constrained", sharey=True
    )
    for ax, reg in zip(axes, REGULARIZED, strict=True):
        lams: list[float] = []
        for opt in OPTIMIZERS:
            ss = settings_of(settings, ds, reg, opt)
            lams += [s.lam for s in ss]
            for c, name, color in series:
                pts = _points(ss, c, c)
                if pts is not None:
                    x = np.array([s.lam for s in ss if c in s.stats])
                    label = f"{name}, {_OPT_SHORT[opt]}"
                    _draw(ax, (x, *pts[1:]), color, opt, label, xerr=False)
        _lam_axis(ax, lams)
        ax.set_xlabel("λ" + (" (radius 1/λ)" if reg == "linf" else ""))
        ax.set_title(REG_LABELS[reg], fontsize=10)
        ax.grid(alpha=0.3)
    return fig, axes


def _legend(fig: Any) -> None:
    """One legend for the figure, outside the axes on the right (labels deduplicated)."""
    seen: dict[str, Any] = {}
    for ax in fig.axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab, h)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside right upper", fontsize=8)


def _tradeoff(plt: Any, settings: Mapping[tuple, Setting], ds: str) -> Any:
    fig, axes = plt.subplots(2, 4, figsize=(17, 7.5), layout="constrained", sharex=True)
    base = baseline(settings, ds)
    for row, eps in zip(axes, (0.1, 0.05), strict=True):
        for ax, kind in zip(row, KINDS, strict=True):
            y = col(kind, eps)
            for reg, opt in SERIES:
                pts = _points(settings_of(settings, ds, reg, opt), "clean_error", y)
                _draw(ax, pts, TABLE[reg].colour, opt, method_label(reg, opt))
            _star(ax, base, "clean_error", y)
            ax.set_title(f"{KIND_LABELS[kind]}, eps {eps:g}", fontsize=10)
            ax.set_ylabel("error %")
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("clean error % (evaluation sample)")
    fig.suptitle(f"{dataset_label(ds)}: clean vs robust error, one point per λ")
    return fig


def _error_vs_lam(plt: Any, settings: Mapping[tuple, Setting], ds: str) -> Any:
    series = (
        ("clean_error", "clean", "black"),
        (col("robust_error", 0.1), "PGD, eps 0.1", "tab:red"),
        (col("certified_interval", 0.1), "not certified (interval), eps 0.1", "tab:blue"),
        (col("certified_lipschitz", 0.1), "not certified (Lipschitz), eps 0.1", "tab:purple"),
    )
    fig, axes = _vs_lam(plt, settings, ds, (16, 4.5), series)
    base = baseline(settings, ds)
    if base is not None:
        clean = base.stats["clean_error"].mean
        for ax in axes:
            ax.axhline(clean, color="gray", lw=0.8, label="clean, no regularization")
    axes[0].set_ylabel("error %")
    fig.suptitle(f"{dataset_label(ds)}: error vs λ")
    return fig


def _sparsity_vs_lam(plt: Any, settings: Mapping[tuple, Setting], ds: str) -> Any:
    from matplotlib.ticker import FormatStrFormatter

    series = [(c, MEASURE_LABELS[c], color) for c, color in MEASURE_COLORS]
    fig, axes = _vs_lam(plt, settings, ds, (15, 4.2), series)
    for ax in axes:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    axes[0].set_ylabel("% of weights nonzero")
    fig.suptitle(f"{dataset_label(ds)}: sparsity vs λ")
    return fig


def _error_vs_nonzero(plt: Any, settings: Mapping[tuple, Setting], ds: str) -> Any:
    from matplotlib.ticker import FormatStrFormatter

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), layout="constrained", sharex="col")
    base = baseline(settings, ds)
    for row, y in zip(axes, ("clean_error", col("robust_error", 0.1)), strict=True):
        for ax, x in zip(row, ("nonzero", "nonzero_live"), strict=True):
            for reg in REGULARIZED:
                pts = _points(settings_of(settings, ds, reg, "prox"), x, y)
                _draw(ax, pts, TABLE[reg].colour, "prox", method_label(reg, "prox"))
            _star(ax, base, x, y)
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.set_ylabel(("clean" if y == "clean_error" else "PGD, eps 0.1") + " error %")
            ax.grid(alpha=0.3)
    for ax, x in zip(axes[-1], ("raw", "live-path"), strict=True):
        ax.set_xlabel(f"% of weights nonzero ({x})")
    # two lines: one would run under the legend at the right
    fig.suptitle(
        f"{dataset_label(ds)}: error vs sparsity\nProx-SGD and the linf projection, one point per λ"
    )
    return fig


def _error_vs_compacted(plt: Any, settings: Mapping[tuple, Setting], ds: str) -> Any:
    """Clean and not-certified error against the hidden units that ``compact`` keeps."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained", sharex=True)
    base = baseline(settings, ds)
    panels = ("clean_error", col("certified_interval", 0.1), col("certified_lipschitz", 0.1))
    for ax, y in zip(axes, panels, strict=True):
        for reg in REGULARIZED:
            pts = _points(settings_of(settings, ds, reg, "prox"), COMPACTED, y)
            _draw(ax, pts, TABLE[reg].colour, "prox", method_label(reg, "prox"))
        _star(ax, base, COMPACTED, y)
        kind, _, eps = y.partition("@")
        ax.set_title(KIND_LABELS[kind] + (f", eps {eps}" if eps else ""), fontsize=10)
        ax.set_xlabel("hidden units after compaction")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("error %")
    fig.suptitle(f"{dataset_label(ds)}: error vs compacted size\nProx-SGD and the linf projection")
    return fig


_FIGURES = (
    ("tradeoff", "clean vs robust and certified error", _tradeoff),
    ("error_vs_lam", "error vs λ", _error_vs_lam),
    ("sparsity_vs_lam", "sparsity vs λ", _sparsity_vs_lam),
    ("error_vs_nonzero", "error vs sparsity", _error_vs_nonzero),
    ("error_vs_compacted", "error vs compacted size", _error_vs_compacted),
)


def plot_dataset(settings: Mapping[tuple, Setting], ds: str, img: Path) -> list[tuple[str, Path]]:
    """Draw the dataset's figures into the folder ``img``; returns (alt text, path) of each PNG.

    Error vs compacted size is drawn only where a row records ``hidden_alive``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for stem, alt, draw in _FIGURES:
        if draw is _error_vs_compacted and not compacted_sizes(settings, ds):
            continue
        fig = draw(plt, settings, ds)
        _legend(fig)
        path = img / f"{ds}_{stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append((f"{dataset_label(ds)}: {alt}", path))
    return written
