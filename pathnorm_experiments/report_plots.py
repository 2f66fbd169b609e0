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
    Stat,
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
PROX_SERIES = tuple((r, "prox") for r in REGULARIZED)  # the Prox-SGD and projection plots
_OPT_SHORT = {**OPT_LABELS, "prox": f"{OPT_LABELS['prox']} / projection"}
MEASURE_COLORS = (("nonzero", "black"), ("nonzero_live", "tab:orange"))


def _bars(stats: Sequence[Stat]) -> tuple[np.ndarray, np.ndarray]:
    """The means, and their distances down to the seeds' min and up to their max."""
    means = np.array([v.mean for v in stats])
    return means, np.array([[v.mean - v.lo for v in stats], [v.hi - v.mean for v in stats]])


def _draw(
    ax: Any, ss: Sequence[Setting], x: str | None, y: str, color: str, opt: str, label: str
) -> None:
    """The settings with both columns: mean ``y`` against mean ``x`` (None: against lam, no
    bars), with min-max bars."""
    ok = [s for s in ss if y in s.stats and (x is None or x in s.stats)]
    if not ok:
        return
    ys, ey = _bars([s.stats[y] for s in ok])
    xs, ex = (np.array([s.lam for s in ok]), None) if x is None else _bars([s.stats[x] for s in ok])
    marker, line = STYLES[opt]
    ax.errorbar(
        xs, ys, yerr=ey, xerr=ex, marker=marker, ls=line, color=color,
        ms=4, lw=1, capsize=2, elinewidth=0.8, label=label,
    )  # fmt: skip


def _panel(
    ax: Any,
    settings: Mapping[tuple, Setting],
    ds: str,
    series: Sequence[tuple[str, str]],
    x: str,
    y: str,
) -> None:
    """``y`` against ``x`` for each (regularizer, optimizer) of ``series``, and the
    unregularized baseline as a star where it has both."""
    for reg, opt in series:
        ss = settings_of(settings, ds, reg, opt)
        _draw(ax, ss, x, y, TABLE[reg].colour, opt, method_label(reg, opt))
    base = baseline(settings, ds)
    if base is not None and x in base.stats and y in base.stats:
        ax.plot(
            [base.stats[x].mean], [base.stats[y].mean], "*", color="black", ms=11, ls="none",
            label="no regularization",
        )  # fmt: skip
    ax.grid(alpha=0.3)


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
        for opt in OPTIMIZERS:
            ss = settings_of(settings, ds, reg, opt)
            for c, name, color in series:
                _draw(ax, ss, None, c, color, opt, f"{name}, {_OPT_SHORT[opt]}")
        _lam_axis(ax, [s.lam for s in settings_of(settings, ds, reg)])
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
    for row, eps in zip(axes, (0.1, 0.05), strict=True):
        for ax, kind in zip(row, KINDS, strict=True):
            _panel(ax, settings, ds, SERIES, "clean_error", col(kind, eps))
            ax.set_title(f"{KIND_LABELS[kind]}, eps {eps:g}", fontsize=10)
            ax.set_ylabel("error %")
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
    for row, y in zip(axes, ("clean_error", col("robust_error", 0.1)), strict=True):
        for ax, x in zip(row, ("nonzero", "nonzero_live"), strict=True):
            _panel(ax, settings, ds, PROX_SERIES, x, y)
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.set_ylabel(("clean" if y == "clean_error" else "PGD, eps 0.1") + " error %")
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
    panels = ("clean_error", col("certified_interval", 0.1), col("certified_lipschitz", 0.1))
    for ax, y in zip(axes, panels, strict=True):
        _panel(ax, settings, ds, PROX_SERIES, COMPACTED, y)
        kind, _, eps = y.partition("@")
        ax.set_title(KIND_LABELS[kind] + (f", eps {eps}" if eps else ""), fontsize=10)
        ax.set_xlabel("hidden units after compaction")
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
