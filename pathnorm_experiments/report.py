"""The results report of the paper's protocol, from the sweep's ``runs.csv`` alone.

:func:`write_report` reads the rows (:mod:`~pathnorm_experiments.report_data`), decides the
paper's claims (:mod:`~pathnorm_experiments.report_claims`), draws the plots
(:mod:`~pathnorm_experiments.report_plots`) and writes ``results.md``. Needs NumPy and
matplotlib, never torch: ``pathnorm-reproduce --report-only`` runs without the training stack.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from pathnorm_experiments.data import DATASET_LABELS, PAPER_DATASETS
from pathnorm_experiments.regularizers import OPTIMIZERS, REGULARIZERS
from pathnorm_experiments.report_claims import ZERO_SHARE, Claim, claims, ordering_violations
from pathnorm_experiments.report_data import (
    COMPARED,
    KIND_LABELS,
    KINDS,
    REG_LABELS,
    ReportError,
    Setting,
    budget_limits,
    col,
    compacted_sizes,
    dataset_label,
    datasets_of,
    settings_from_rows,
    settings_of,
    short_name,
)
from pathnorm_experiments.runs import ResultsError, read_rows

__all__ = ["render", "write_report"]


_SECTION_TITLES = {
    "a": "(a) Sparsity is controlled by λ; SGD on the penalty is never sparse",
    "b": "(b) The 1-path-norm trades clean for robust error better than L1",
    "c": "(c) The 1-path-norm is close to the layer-wise linf constraint",
    "d": "(d) Path sparsity correlates with robustness more than L1 sparsity",
    "e": "(e) KMNIST (partial training set): path struggles to be sparse and accurate",
}

_SECTION_RULES = {
    "a": "Cells: each dataset with at least 3 λ of Prox-SGD. A cell holds when no step to the "
    "next larger λ raises the share of nonzero weights beyond the noise, and the largest λ is "
    "sparser than the smallest beyond it. For SGD, each SGD setting is a cell; it holds when "
    f"every seed has under {ZERO_SHARE:g}% of its weights exactly zero, not when every weight "
    "is nonzero: SGD on the penalty can land a few weights on 0.0 by float rounding (1 in "
    f"{100 / ZERO_SHARE:,.0f} is the rule's limit), where Prox-SGD zeroes whole percents.",
    "b": "Cells: dataset × clean-error budget. A cell holds when path's best error is lower "
    "than L1's beyond the noise. The paper: the 1-path-norm trades accuracy for robustness "
    "better than L1.",
    "c": "Same cells as (b), in its tables (column *path vs linf*). A cell holds when path's best error is lower than linf's or within "
    "noise. The paper: path shows only a slight advantage over the layer-wise constraint.",
    "d": "The paper: compared to L1, the sparsity pattern of the 1-path-norm correlates with "
    "robustness to a higher degree. Cells: each dataset. ρ is Spearman's rank correlation "
    "between the share of nonzero weights and the PGD error at eps 0.1, over the Prox-SGD λ "
    "whose clean error is within 6 points of the baseline (at least 3 λ), once per seed; its "
    "spread is over the seeds. ρ > 0: sparser networks are more robust. A cell holds when "
    "path's ρ exceeds L1's beyond the noise. The error-vs-sparsity plots show the points.",
    "e": "The paper: on harder datasets like KMNIST the 1-path-norm struggles to obtain good "
    "accuracy and sparsity together. Cells: KMNIST × sparsity budget (at most 50, 20 or 10% "
    "of the weights nonzero); KMNIST here has only its partial training set. In each budget, "
    "each regularizer's least clean error among its Prox-SGD settings. A cell holds when L1's "
    "is lower than path's beyond the noise. The other datasets' cells are shown for contrast "
    "and do not count.",
}

RULE = """\
- **Seed spread.** Every number is the mean over the seeds of the selected lr, with the
  seeds' min–max in brackets.
- **Better.** Setting A is better than setting B on an error (or sparser, or correlated more)
  when A's mean beats B's by more than the sum of both seed spreads (max − min). Otherwise the
  two are *within noise*. A comparison needs two seeds on each side.
- **Cells.** A claim is checked in cells: a dataset and a budget (of clean error, of
  sparsity), or a dataset alone. A cell counts when both sides have a setting there.
- **Verdict.** *Holds*: the claim is true in every cell that counts. *Holds in part*: in
  some. *Does not hold*: in none. *Not enough data*: no cell counts (yet).
- **Budgets.** For (b) and (c), each regularizer's best setting (any optimizer, any λ) among
  those whose mean clean error is at most the unregularized baseline's plus 1, 3 or 6 points.
  "Close" in (c) means path is better or within noise."""


def summary_table(sections: Mapping[str, list[Claim]]) -> list[str]:
    """The claims' verdicts in one table."""
    lines = ["| claim | measure | verdict | evidence |", "| --- | --- | --- | --- |"]
    for letter, cs in sections.items():
        for c in cs:
            lines.append(
                f"| ({letter}) {c.title} | {c.measure} | **{c.verdict}** "
                f"({sum(c.outcomes)} of {len(c.outcomes)} cells) | {c.evidence} |"
            )
    return lines


def coverage(rows: Sequence[Mapping[str, str]], settings: Mapping[tuple, Setting]) -> list[str]:
    """What the file holds: per dataset its rows, settings and lams, and the machines."""
    lines = [
        "| dataset | training images | epochs | rows | selected settings | seeds per setting |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    by_ds = Counter(r["dataset"] for r in rows)
    for ds in datasets_of(settings):
        ss = [s for k, s in settings.items() if k[0] == ds]
        seeds = sorted({len(s.seeds) for s in ss})
        lines.append(
            f"| {dataset_label(ds, ss[0].n_train)} | {ss[0].n_train:,} | {ss[0].epochs} | "
            f"{by_ds[ds]} | {len(ss)} | {', '.join(map(str, seeds))} |"
        )
    lines.append("")
    for ds in datasets_of(settings):
        parts = []
        for reg, opt in itertools.product(REGULARIZERS, OPTIMIZERS):
            ss = settings_of(settings, ds, reg, opt)
            if ss:
                lams = ", ".join(f"{s.lam:g}" for s in ss)
                parts.append(ss[0].method() + ("" if reg == "none" else f" λ {lams}"))
        lines.append(f"- {short_name(settings, ds)}: " + "; ".join(parts) + ".")
    gone = [DATASET_LABELS[d] for d in PAPER_DATASETS if d not in datasets_of(settings)]
    if 0 < len(gone) < len(PAPER_DATASETS):  # only when some of the paper's datasets have rows
        lines.append(f"- No rows yet: {', '.join(gone)}.")
    machines = Counter(r["machine"] for r in rows).most_common()
    used = "; ".join(f"{m} ({n} rows)" for m, n in machines)
    return [*lines, "", *density(settings), "", f"The `machine` column: {used}."]


def density(settings: Mapping[tuple, Setting], within: float = 1.0) -> list[str]:
    """Whether the lam grids are dense enough for the budgets of (b) and (c): per dataset, budget
    and regularizer, some setting's mean clean error lies within ``within`` points under it."""
    gaps, cells = [], 0
    for ds in datasets_of(settings):
        for _, limit in budget_limits(settings, ds):
            for reg in COMPARED:
                errs = [s.stats["clean_error"].mean for s in settings_of(settings, ds, reg)
                        if "clean_error" in s.stats]  # fmt: skip
                near = max((e for e in errs if e <= limit), default=None)
                cells += 1
                if near is None or limit - near > within:
                    have = "none" if near is None else f"{near:.2f}"
                    gaps.append(
                        f"{short_name(settings, ds)} {limit:.2f} {REG_LABELS[reg]} ({have})"
                    )
    if not cells:
        return []
    line = (
        f"Grid density: in {cells - len(gaps)} of {cells} (dataset, clean-error budget, "
        f"regularizer) cells, a setting's mean clean error lies within {within:g} point of the "
        "budget, at or under it"
    )
    return [line + (": all of them." if not gaps else "; not in: " + "; ".join(gaps) + ".")]


_TABLE_COLUMNS = (
    ("clean_error", "clean % (sample)", 2),
    ("clean_error_full", "clean % (all test images)", 2),
    (col("robust_error", 0.1), "PGD % @0.1", 1),
    (col("robust_error_strong", 0.1), "strong % @0.1", 1),
    (col("certified_lipschitz", 0.1), "Lipschitz % @0.1", 1),
    (col("certified_interval", 0.1), "interval % @0.1", 1),
    ("nonzero", "nonzero %", 1),
    ("nonzero_live", "live nonzero %", 1),
)
_TABLE_COLUMNS_005 = tuple(
    (col(k, 0.05), f"{KIND_LABELS[k].replace('not certified, ', '')} % @0.05", 1) for k in KINDS
)


def dataset_table(
    settings: Mapping[tuple, Setting], ds: str, columns: Sequence[tuple[str, str, int]]
) -> list[str]:
    """The dataset's settings, one row each; ``columns``: (CSV column, header, decimals)."""
    head = ["method", "λ", "lr", "seeds", *(t for _, t, _ in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for reg, opt in itertools.product(REGULARIZERS, OPTIMIZERS):
        for s in settings_of(settings, ds, reg, opt):
            cells = [s.method(), f"{s.lam:g}", f"{s.lr:g}", str(len(s.seeds))]
            cells += [s.stats[c].fmt(d) if c in s.stats else "" for c, _, d in columns]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _protocol(settings: Mapping[tuple, Setting], readme: str | None) -> list[str]:
    def v(column: str) -> str:
        """The values of a protocol column over the settings (``2000``, or ``300 or 2000``)."""
        if column == "epochs":
            seen = {s.epochs for s in settings.values()}
        else:
            seen = {s.protocol[column] for s in settings.values() if column in s.protocol}
        return " or ".join(f"{x:,}" for x in sorted(seen)) or "?"

    restarts = v("strong_restarts")
    lines = [
        f"- The paper's network and training: 784-{v('hidden')}-10, ELU, cross-entropy, batch "
        f"{v('batch_size')}, plain SGD at a constant lr, {v('epochs')} epochs. Prox-SGD is an "
        "SGD step, then the prox with step lr·λ (for linf: the projection of every layer's rows "
        "onto the l1 ball of radius 1/λ); SGD is SGD on CE + λ·g.",
        "- The lr of each (dataset, regularizer, optimizer, λ) is chosen by clean error on a "
        "held-out validation split of the training set, never on the test set; the other "
        "seeds then train at that lr.",
        "- Clean error, both attacks and both certificates of a selected run use one fixed "
        f"stratified sample of {v('eval_samples')} test images; *clean (all test images)* is "
        f"beside it. PGD is the paper's attack (cross-entropy, {v('pgd_steps')} steps of "
        "eps/20, random start); the strong attack adds margin PGD with "
        f"{restarts} restart{'' if restarts == '1' else 's'}. The certified columns give the "
        "error that is *not* certified: by the per-pair path-norm Lipschitz bound, and by "
        "interval bound propagation over the eps-box within [0, 1].",
        "- Sparsity: *nonzero* is the share of weights that are not exactly zero; *live "
        "nonzero* counts only weights on a path from an input to an output. The compacted "
        "size (`hidden_alive`) counts the hidden units that `compact` keeps: those with a "
        "nonzero weight in and a nonzero weight out.",
    ]
    if readme:
        lines.append(f"- Columns, grids and how to run the sweep: [{readme}]({readme}).")
    return lines


def claim_sections(sections: Mapping[str, list[Claim]], kmnist_table: list[str]) -> list[str]:
    """One section per claim: its verdicts with their evidence, then its tables."""
    out = []
    for letter, cs in sections.items():
        out += [f"### {_SECTION_TITLES[letter]}", "", _SECTION_RULES[letter], ""]
        if letter == "b":
            out += [_winners(cs), ""]
        for c in cs:
            out.append(f"- {c.title}, {c.measure}: **{c.verdict}**. {c.evidence}.")
        out.append("")
        for c in cs:
            out += c.details
        if letter == "e":
            out += [*kmnist_table, ""]
    return out


def _winners(cs: Sequence[Claim]) -> str:
    """Which regularizer wins under which attack and certificate, both radii together."""
    parts = []
    for kind in KINDS:
        label = KIND_LABELS[kind]
        mine = [c for c in cs if c.measure.startswith(label + ",")]
        path = sum(c.wins for c in mine)
        l1 = sum(c.losses for c in mine)
        ties = sum(len(c.outcomes) for c in mine) - path - l1
        parts.append(f"{label}: path in {path}, L1 in {l1}, within noise in {ties}")
    return "Cells won, eps 0.05 and 0.1 together: " + "; ".join(parts) + "."


def render(
    rows: Sequence[Mapping[str, str]],
    settings: Mapping[tuple, Setting],
    results_link: str,
    readme_link: str | None = None,
    images: Mapping[str, Sequence[tuple[str, str]]] | None = None,
) -> str:
    """The markdown page of ``rows`` and their :func:`settings_from_rows`.

    Links and image paths are relative to the page; ``images``: per dataset, (alt, path) of its
    plots; no README link without ``readme_link``.
    """
    sections, kmnist_table = claims(settings)
    checked, bad = ordering_violations(rows)
    out = [
        "# Results: the paper's claims",
        "",
        "<!-- generated by pathnorm-reproduce --report-only from the results file; do not edit -->",
        "",
        f"Everything below is computed from [{results_link}]({results_link}) alone, one row "
        "per training run, by `pathnorm-reproduce --report-only`.",
        "",
        "## Protocol",
        "",
        *_protocol(settings, readme_link),
        "",
        "## What the results file holds",
        "",
        *coverage(rows, settings),
        "",
        "## How the verdicts are decided",
        "",
        RULE,
        "",
        "## The claims",
        "",
        *summary_table(sections),
        "",
        *claim_sections(sections, kmnist_table),
        "## Check: clean ≤ PGD ≤ strong attack ≤ certified",
        "",
        f"Checked on {checked} (row, eps) pairs with every column filled, for both "
        f"certificates: **{len(bad)} violations**"
        + (" (the first 20 below)." if len(bad) > 20 else "."),
        "",
        *(f"- {b}" for b in bad[:20]),
    ]
    for ds in datasets_of(settings):
        first = next(s for k, s in settings.items() if k[0] == ds)
        out += ["", f"## {dataset_label(ds, first.n_train)}", ""]
        out += [*dataset_table(settings, ds, _TABLE_COLUMNS), "", "At eps 0.05:", ""]
        out += [*dataset_table(settings, ds, _TABLE_COLUMNS_005), ""]
        out += [f"![{alt}]({path})" for alt, path in (images or {}).get(ds, ())]
        if not compacted_sizes(settings, ds):
            out += [
                "",
                "No run of this dataset records its compacted size (`hidden_alive`: rows written "
                "before that column leave it empty), so error against it is not plotted.",
            ]
    return "\n".join(out).rstrip("\n") + "\n"


def write_report(results: Path, out: Path, img_subdir: str = "img/results") -> list[Path]:
    """Write ``<out>/results.md`` and its plots (``<out>/<img_subdir>/*.png``) from the sweep's
    CSV; remove that folder's other (stale) PNGs.

    Returns:
        The page and the PNGs written.

    Raises:
        ReportError: the results cannot be reported.
    """
    from pathnorm_experiments import report_plots

    if not results.is_file():
        raise ReportError(
            f"{results}: no such results file: run the sweep first (pathnorm-reproduce), or give "
            "--results"
        )
    try:
        rows = read_rows(results)
    except ResultsError as e:
        raise ReportError(str(e)) from None
    if not rows:
        raise ReportError(f"{results}: no rows yet: the sweep has not finished a group")
    settings = settings_from_rows(rows)
    if not settings:
        raise ReportError(f"{results}: no selected run yet")

    def rel(path: Path) -> str:
        return Path(os.path.relpath(path, out)).as_posix()

    img = out / img_subdir
    img.mkdir(parents=True, exist_ok=True)
    images: dict[str, list[tuple[str, str]]] = {}
    pngs: list[Path] = []
    for ds in datasets_of(settings):
        for alt, path in report_plots.plot_dataset(settings, ds, img):
            pngs.append(path)
            images.setdefault(ds, []).append((alt, rel(path)))
    for stale in set(img.glob("*.png")) - set(pngs):
        stale.unlink()
    readme = results.parent / "README.md"
    md = out / "results.md"
    md.write_text(
        render(rows, settings, rel(results), rel(readme) if readme.is_file() else None, images)
    )
    return [md, *pngs]
