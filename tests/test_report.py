"""The results report from a synthetic ``runs.csv`` in the sweep's format: the rule, the
verdicts of constructed cases (holds / holds in part / does not hold / not enough data),
empty cells and partial grids, the ordering check, and readable PNGs."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pathnorm_experiments import report, report_claims, report_data
from pathnorm_experiments.report_data import Stat, decide, spearman, verdict
from pathnorm_experiments.runs import COLUMNS, read_rows
from pathnorm_experiments.settings import SWEEP_EPS as EPS

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

OFFSETS = (-0.5, 0.0, 0.5)  # per seed: every setting's spread is 1 point
PROTOCOL = {"batch_size": 100, "hidden": 200, "eval_samples": 2000, "pgd_steps": 40}
PROTOCOL["strong_restarts"] = 2


def runs(
    ds: str,
    reg: str,
    opt: str,
    lam: float,
    clean: float,
    pgd: float,
    nz: float = 100.0,
    live: float | None = None,
    ibp: float | None = None,
    lip: float = 95.0,
    nz_spread: float = 1.0,
    n_train: int = 55000,
) -> list[dict[str, Any]]:
    """The rows of one group: an unselected lr (attacks empty) and 3 seeds at the selected
    lr, each seed shifted by OFFSETS (sparsity by OFFSETS * nz_spread)."""
    live = nz if live is None else live
    ibp = pgd + 5 if ibp is None else ibp
    out = []
    for seed, d in enumerate(OFFSETS):
        r: dict[str, Any] = dict.fromkeys(COLUMNS, "")
        r.update(
            dataset=ds, regularizer=reg, optimizer=opt, lam=f"{lam:g}", lr="0.1", seed=seed,
            epochs=20, n_train=n_train, selected=1, val_error=clean + d, clean_error=clean + d,
            clean_error_full=clean + d - 0.3, nonzero=nz + d * nz_spread,
            nonzero_live=live + d * nz_spread, path_norm=10.0, machine="test cpu",
            **PROTOCOL,
        )  # fmt: skip
        for e in EPS:
            r[f"robust_error@{e:g}"] = pgd + d
            r[f"robust_error_strong@{e:g}"] = pgd + 1 + d
            r[f"certified_lipschitz@{e:g}"] = lip + d
            r[f"certified_interval@{e:g}"] = ibp + d
        out.append(r)
    unselected = {**out[0], "lr": "0.5", "selected": 0, "val_error": 99.0}
    for c in COLUMNS[COLUMNS.index("clean_error") : COLUMNS.index("nonzero")]:
        unselected[c] = "" if "@" in c else 50.0
    return [unselected, *out]


def scenario() -> list[dict[str, Any]]:
    """MNIST: path beats L1 and ties linf, path's raw nonzero rises with lam; Fashion-MNIST:
    L1 and linf beat path on PGD, path wins on the interval certificate; KMNIST (partial):
    L1 is more accurate at equal live-path sparsity."""
    rows = []
    for ds, base in (("mnist", 2.0), ("fashion-mnist", 10.0)):
        rows += runs(ds, "none", "prox", 0.0, base, 90.0, nz_spread=0)
    m = "mnist"
    rows += runs(m, "path", "prox", 1e-4, 2.5, 80.0, nz=99.0, live=95.0)
    rows += runs(m, "path", "prox", 1e-3, 3.5, 40.0, nz=80.0, live=30.0)
    rows += runs(m, "path", "prox", 3e-3, 7.0, 30.0, nz=85.0, live=5.0)
    rows += runs(m, "l1", "prox", 1e-4, 2.4, 85.0, nz=90.0)
    rows += runs(m, "l1", "prox", 1e-3, 3.6, 50.0, nz=20.0)
    rows += runs(m, "l1", "prox", 5e-3, 7.5, 60.0, nz=3.0)
    rows += runs(m, "l1", "penalty", 1e-3, 3.5, 61.0, nz_spread=0)
    rows += runs(m, "path", "penalty", 1e-3, 3.4, 45.0, nz_spread=0)
    rows += runs(m, "linf", "prox", 0.2, 3.4, 42.0, nz=70.0, live=60.0)
    f = "fashion-mnist"
    rows += runs(f, "path", "prox", 1e-3, 11.0, 70.0, nz=90.0, live=40.0, ibp=72.0)
    rows += runs(f, "l1", "prox", 1e-3, 11.0, 50.0, nz=30.0, ibp=80.0)
    rows += runs(f, "linf", "prox", 0.2, 11.0, 40.0, nz=60.0, ibp=78.0)
    k, n = "kmnist", 6427
    rows += runs(k, "none", "prox", 0.0, 20.0, 93.0, nz_spread=0, n_train=n)
    rows += runs(k, "path", "prox", 1e-3, 40.0, 80.0, nz=90.0, live=10.0, n_train=n)
    rows += runs(k, "l1", "prox", 1e-3, 30.0, 85.0, nz=15.0, n_train=n)
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return path


def summary_row(page: str, claim: str, measure: str) -> str:
    """The verdict and cell count of one claim's row in the summary table."""
    m = re.search(rf"^\| {re.escape(claim)} \| {re.escape(measure)} \| ([^|]+) \|", page, re.M)
    assert m, (claim, measure)
    return m.group(1).strip()


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((10.0, 11.0), (13.0, 14.0), "a"),  # 3 points apart, spreads 1 + 1
        ((13.0, 14.0), (10.0, 11.0), "b"),
        ((10.0, 12.0), (13.0, 14.0), "tie"),  # 2.5 apart, spreads 2 + 1
        ((10.0, 11.0), (12.0, 13.0), "tie"),  # exactly the combined spread: not beyond it
        ((10.0,), (20.0, 21.0), None),  # one seed: no noise estimate
    ],
)
def test_decide_needs_the_gap_beyond_both_spreads(
    a: tuple[float, ...], b: tuple[float, ...], expected: str | None
) -> None:
    sa, sb = Stat(tuple(range(len(a))), a), Stat(tuple(range(len(b))), b)
    assert decide(sa, sb) == expected
    assert decide(sa, None) is None


def test_verdict_and_spearman() -> None:
    assert verdict([]) == "not enough data"
    assert verdict([True, True]) == "holds"
    assert verdict([True, False]) == "holds in part"
    assert verdict([False, False]) == "does not hold"
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([3, 1, 2], [3, 2, 1]) == pytest.approx(0.5)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.8660254)  # tied ranks averaged
    assert spearman([1, 1, 1], [1, 2, 3]) != spearman([1, 1, 1], [1, 2, 3])  # NaN


def test_settings_summarize_the_selected_seeds_and_skip_empty_cells(tmp_path: Path) -> None:
    rows = scenario()
    rows[2]["robust_error@0.1"] = ""  # mnist baseline, seed 1 at the selected lr: diverged
    rows[1]["hidden_alive"], rows[3]["hidden_alive"] = 200, 198  # seed 1's: empty (older row)
    path = write_csv(tmp_path / "runs.csv", rows)
    mine = report_data.settings_from_rows(read_rows(path))
    # the reference: every selected row's numbers, grouped by hand
    selected = [r for r in rows if r["selected"] == 1]
    keys = {(r["dataset"], r["regularizer"], r["optimizer"], float(r["lam"])) for r in selected}
    assert set(mine) == keys and len(mine) == 17
    for key, s in mine.items():
        rs = [r for r in selected if (r["dataset"], r["regularizer"], r["optimizer"]) == key[:3]]
        rs = [r for r in rs if float(r["lam"]) == key[3]]
        assert s.lr == 0.1 and s.seeds == (0, 1, 2) and s.n_train == rs[0]["n_train"]
        for c in ("clean_error", "nonzero_live", "robust_error@0.05", "certified_interval@0.3"):
            vals = [float(r[c]) for r in rs]
            st = s.stats[c]
            assert (st.mean, st.lo, st.hi) == pytest.approx((sum(vals) / 3, min(vals), max(vals)))
    base_key = ("mnist", "none", "prox", 0.0)
    base = mine[base_key]
    assert base.stats["robust_error@0.1"].seeds == (0, 2)
    assert base.stats["robust_error@0.1"].fmt() == "90.0 (89.5–90.5)"
    assert base.stats["hidden_alive"].by_seed() == {0: 200.0, 2: 198.0}
    assert not any("hidden_alive" in s.stats for k, s in mine.items() if k != base_key)
    assert report_data.REQUIRED == COLUMNS  # the report reads the sweep's format, torch-free


def test_a_partial_training_set_is_one_below_a_full_one_after_the_sweeps_split() -> None:
    from pathnorm_experiments._sweep_grid import VAL_SIZE, SweepConfig, split_sizes
    from pathnorm_experiments.data import FULL_TRAIN

    assert report_data.SPLIT_TRAIN == split_sizes(SweepConfig(), FULL_TRAIN, 10000)[1] == 55000
    assert SweepConfig().val_size == VAL_SIZE
    assert report_data.dataset_label("kmnist", 55000) == "KMNIST"
    assert report_data.dataset_label("kmnist", 54999, short=True) == "KMNIST (partial)"


def test_report_decides_the_constructed_cases(tmp_path: Path) -> None:
    results = write_csv(tmp_path / "docs" / "results" / "runs.csv", scenario())
    (results.parent / "README.md").write_text("columns\n")
    out = tmp_path / "docs"
    stale = out / "img" / "results" / "old_plot.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    written = report.write_report(results, out)
    page = (out / "results.md").read_text()
    assert written[0] == out / "results.md" and not stale.exists()
    assert "[results/runs.csv](results/runs.csv)" in page
    assert "[results/README.md](results/README.md)" in page
    # the protocol as the rows record it
    assert (
        "784-200-10, ELU, cross-entropy, batch 100, plain SGD at a constant lr, 20 epochs" in page
    )
    assert "stratified sample of 2,000 test images" in page
    assert "(cross-entropy, 40 steps of eps/20, random start)" in page
    assert "margin PGD with 2 restarts" in page
    b, c = (
        "(b) 1-path-norm beats L1 at equal clean error",
        "(c) 1-path-norm is close to layer-wise linf",
    )
    # MNIST: path wins its 3 budgets; Fashion-MNIST: L1 wins its 3
    assert summary_row(page, b, "PGD, eps 0.1") == "**holds in part** (3 of 6 cells)"
    assert summary_row(page, b, "not certified, interval, eps 0.1") == "**holds** (6 of 6 cells)"
    assert summary_row(page, b, "not certified, Lipschitz, eps 0.1") == (
        "**does not hold** (0 of 6 cells)"  # every setting at 95 +- 0.5: within noise
    )
    assert (
        "not certified, Lipschitz: path in 0, L1 in 0, within noise in 12; not certified, "
        "interval: path in 12, L1 in 0, within noise in 0." in page
    )
    # linf has no MNIST setting within 1 point: that cell does not count
    assert summary_row(page, c, "PGD, eps 0.05") == "**holds in part** (2 of 5 cells)"
    a_path = "(a) sparsity of 1-path-norm Prox-SGD falls with λ"
    assert summary_row(page, a_path, "raw nonzero") == "**does not hold** (0 of 1 cells)"
    assert "rises beyond noise: 80.0 → 85.0 at λ 0.001 → 0.003 (lr 0.1 → 0.1)" in page
    assert summary_row(page, a_path, "live-path nonzero") == "**holds** (1 of 1 cells)"
    sgd = "(a) SGD on the penalty leaves under 0.01% of the weights exactly zero"
    assert summary_row(page, sgd, "raw nonzero") == "**holds** (2 of 2 cells)"
    d = "(d) sparsity correlates with robustness more for path than for L1"
    assert summary_row(page, d, "live-path nonzero") == "**holds** (1 of 1 cells)"
    assert summary_row(page, d, "raw nonzero") == "**does not hold** (0 of 1 cells)"
    assert "MNIST: ρ path 1.00 (1.00–1.00) vs L1 0.50 (0.50–0.50)" in page
    e = "(e) KMNIST: path struggles to be sparse and accurate"
    assert summary_row(page, e, "live-path nonzero") == "**holds** (2 of 2 cells)"
    assert summary_row(page, e, "raw nonzero") == "**not enough data** (0 of 0 cells)"
    assert "## KMNIST (partial training set, 6,427 images)" in page
    assert "| KMNIST (partial) | live-path nonzero | 50 |" in page
    assert "**0 violations**" in page
    # the per-dataset table: mean (min-max) over seeds, the unselected lr left out
    assert (
        "| 1-path-norm Prox-SGD | 0.001 | 0.1 | 3 | 3.50 (3.00–4.00) | 3.20 (2.70–3.70) | "
        "40.0 (39.5–40.5) | 41.0 (40.5–41.5) | 95.0 (94.5–95.5) | 45.0 (44.5–45.5) | "
        "80.0 (79.5–80.5) | 30.0 (29.5–30.5) |" in page
    )
    pngs = sorted(p.name for p in (out / "img" / "results").glob("*.png"))
    assert len(pngs) == 12 and "kmnist_tradeoff.png" in pngs
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written[1:])
    assert "![MNIST: error vs sparsity](img/results/mnist_error_vs_nonzero.png)" in page


@pytest.mark.parametrize(
    ("nonzero", "holds"),
    [
        (100.0, True),
        (100 * (1 - 3 / 158_800), True),  # 3 float coincidences among 158,800 weights
        (99.9901, True),
        (99.989, False),  # over 1 in 10,000 weights exactly zero
        (95.0, False),
    ],
)
def test_sgd_is_not_sparse_below_a_share_of_exact_zeros(
    tmp_path: Path, nonzero: float, holds: bool
) -> None:
    rows = runs("mnist", "path", "penalty", 1e-3, 3.5, 45.0, nz=100.0, nz_spread=0)
    rows[2]["nonzero"] = nonzero  # one seed
    settings = report_data.settings_from_rows(read_rows(write_csv(tmp_path / "runs.csv", rows)))
    (sgd,) = [c for c in report_claims.sparsity_claims(settings) if "SGD on" in c.title]
    assert sgd.outcomes == [holds]
    assert f"most exact zeros of a seed over 1 SGD settings: {100 - nonzero:.4f}%" in sgd.evidence


def test_partial_grid_says_what_is_missing(tmp_path: Path) -> None:
    rows = [r for r in scenario() if r["dataset"] == "mnist" and r["regularizer"] != "linf"]
    for r in rows:  # every seed of path lam 3e-3 diverged: its error cells are empty
        if (r["regularizer"], r["lam"]) == ("path", "0.003"):
            r.update({c: "" for c in COLUMNS if "error" in c})
    out = tmp_path / "o"
    report.write_report(write_csv(tmp_path / "runs.csv", rows), out)
    page = (out / "results.md").read_text()
    assert "- No rows yet: Fashion-MNIST, KMNIST." in page
    assert "The `machine` column: test cpu (36 rows)." in page
    assert "- MNIST: none; L1 Prox-SGD λ 0.0001, 0.001, 0.005; L1 SGD λ 0.001;" in page
    c = "(c) 1-path-norm is close to layer-wise linf"
    assert summary_row(page, c, "PGD, eps 0.1") == "**not enough data** (0 of 0 cells)"
    assert "[../runs.csv](../runs.csv)" in page and "README" not in page
    assert "| 1-path-norm Prox-SGD | 0.003 | 0.1 | 0 |" in page  # listed, without numbers


def test_ordering_violations_are_counted(tmp_path: Path) -> None:
    rows = scenario()
    rows[1]["robust_error@0.3"] = 1.0  # below its clean error
    rows[5]["certified_interval@0.02"] = 0.5  # below the strong attack
    path = write_csv(tmp_path / "runs.csv", rows)
    checked, bad = report_claims.ordering_violations(read_rows(path))
    assert checked == 17 * 3 * len(EPS) and len(bad) == 2
    assert bad[0].startswith("mnist|none|prox|0|0.1|0|20|55000 eps 0.3: clean 1.5, PGD 1")
    out = tmp_path / "o"
    report.write_report(path, out)
    assert "**2 violations**" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda rows: [], "no rows yet"),
        (
            lambda rows: [{**r, "epochs": 5} for r in rows[:3]] + rows[3:],
            "rows of mnist have several epochs: 5, 20; the report compares one protocol",
        ),
        (
            lambda rows: rows[:3] + [{**r, "eval_samples": 50} for r in rows[3:]],
            "rows of mnist have several eval_samples: 50, 2000",
        ),
        # a duplicated run would count as one more seed: refused where it is
        (
            lambda rows: [*rows[:2], rows[1], *rows[2:]],
            "runs.csv, line 4: run mnist|none|prox|0|0.1|0|20|55000 is already on line 3",
        ),
        (  # the same run under another spelling of its numbers: one seed, not two
            lambda rows: [*rows[:2], {**rows[1], "lam": "0.0", "seed": "00"}, *rows[2:]],
            "runs.csv, line 4: run mnist|none|prox|0|0.1|0|20|55000 is already on line 3",
        ),
        (
            lambda rows: [*rows[:4], {**rows[3], "lr": "1e-1", "val_error": 1.0}, *rows[4:]],
            "runs.csv, line 6: run mnist|none|prox|0|0.1|2|20|55000 is already on line 5",
        ),
        (
            lambda rows: [rows[0], {**rows[1], "robust_error@0.1": 250}, *rows[2:]],
            "runs.csv, line 3, column robust_error@0.1: 250 is not a percentage in [0, 100]",
        ),
        (
            lambda rows: [rows[0], {**rows[1], "selected": "yes"}, *rows[2:]],
            "runs.csv, line 3, column selected: 'yes' is not one of 0, 1",
        ),
        (
            lambda rows: [{**rows[0], "clean_error": "abc"}, *rows[1:]],
            "runs.csv, line 2, column clean_error: 'abc' is not a number",
        ),
    ],
)
def test_unreportable_results_are_refused(tmp_path: Path, edit: Any, message: str) -> None:
    path = write_csv(tmp_path / "runs.csv", edit(scenario()))
    with pytest.raises(report_data.ReportError, match=re.escape(message)):
        report.write_report(path, tmp_path / "o")


def test_a_last_row_without_newline_is_read_and_a_cut_one_refused(tmp_path: Path) -> None:
    rows = scenario()
    path = write_csv(tmp_path / "runs.csv", rows)
    whole = path.read_bytes()
    path.write_bytes(whole.rstrip(b"\r\n"))  # an editor's save: every row whole
    assert len(read_rows(path)) == len(rows)  # the last seed of kmnist's L1 counts
    st = report_data.settings_from_rows(read_rows(path))[("kmnist", "l1", "prox", 1e-3)]
    assert st.seeds == (0, 1, 2)
    path.write_bytes(whole[:-40])  # a copy cut short
    with pytest.raises(report_data.ReportError, match=re.escape(
        f"{path}, line {len(rows) + 1}: 37 fields where the header has 46: column nonzero_live "
        "(38 of 46) and after are missing (the file ends within this row: a copy cut short?)"
    )):  # fmt: skip
        report.write_report(path, tmp_path / "o")


def test_the_plots_are_readable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure
    from test_plots import readability_problems

    checked: dict[str, list[str]] = {}
    save = Figure.savefig

    def checking_savefig(fig: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        problems = readability_problems(fig)
        fig.canvas.draw()
        r = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        title = fig._suptitle  # type: ignore[attr-defined]
        for leg in fig.legends:  # the figure's legend lies clear of every axes and the title
            box = leg.get_window_extent(r)
            if any(box.overlaps(ax.get_tightbbox(r)) for ax in fig.axes):
                problems.append("the legend overlaps an axes")
            if title is not None and box.overlaps(title.get_window_extent(r)):
                problems.append("the legend hides the title")
        checked[Path(fname).name] = problems
        save(fig, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", checking_savefig)
    # the embedded subset's long name (the quick sweep's) in place of MNIST's; its rows record
    # the compacted size, the other datasets' do not (rows from before the column)
    rows = [{**r, "dataset": "embedded", "hidden_alive": round(2 * r["nonzero_live"])}
            if r["dataset"] == "mnist" else r for r in scenario()]  # fmt: skip
    report.write_report(write_csv(tmp_path / "runs.csv", rows), tmp_path / "o")
    assert len(checked) == 13 and "embedded_error_vs_nonzero.png" in checked
    assert [n for n in checked if "compacted" in n] == ["embedded_error_vs_compacted.png"]
    assert {name: p for name, p in checked.items() if p} == {}
    page = (tmp_path / "o" / "results.md").read_text()
    assert page.count("No run of this dataset records its compacted size") == 2  # F-MNIST, KMNIST
    assert "![embedded MNIST subset: error vs compacted size](" in page


def test_report_only_never_imports_torch(tmp_path: Path) -> None:
    results = write_csv(tmp_path / "runs.csv", scenario())
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any torch import now fails
        "from pathnorm_experiments import reproduce\n"
        f"rc = reproduce.main(['--report-only', '--results', {str(results)!r}, "
        f"'--out', {str(tmp_path / 'o')!r}])\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote " in proc.stdout and (tmp_path / "o" / "results.md").is_file()


def test_a_mean_over_equal_seeds_is_their_value() -> None:
    """Three seeds at 0.7: the float mean rounds to 0.6999999999999998, below the smallest
    value, which made negative error bars that matplotlib refuses."""
    assert float(sum([0.7] * 3) / 3) < 0.7  # the case is real
    s = Stat((0, 1, 2), (0.7, 0.7, 0.7))
    assert (s.lo, s.mean, s.hi) == (0.7, 0.7, 0.7)
    assert Stat((0, 1), (1.0, 2.0)).mean == 1.5


def test_grid_density_names_every_budget_without_a_near_setting(tmp_path: Path) -> None:
    """Baselines 2, 10, 20 give budgets 3/5/8, 11/13/16, 21/23/26; a setting counts when its
    mean clean error is at most 1 point under the budget (exactly 1 point counts)."""
    rows = read_rows(write_csv(tmp_path / "runs.csv", scenario()))
    (line,) = report.density(report_data.settings_from_rows(rows))
    assert line.startswith("Grid density: in 7 of 27 ")
    for gap in (
        "MNIST 5.00 1-path-norm (3.50)",  # path: 2.5, 3.4, 3.5, 7.0
        "MNIST 3.00 layer-wise linf (none)",  # linf: 3.4 only
        "Fashion-MNIST 13.00 L1 (11.00)",
        "KMNIST (partial) 21.00 1-path-norm (none)",  # path: 40
    ):
        assert gap in line
    for near in ("MNIST 3.00 1-path-norm", "MNIST 8.00 1-path-norm", "Fashion-MNIST 11.00 L1"):
        assert near not in line


def test_the_benchmark_report_help_names_record() -> None:
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "benchmarks/report.py", "--help"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and "``" not in text
    assert "python benchmarks/report.py record NAME -- COMMAND ..." in text
    assert "as benchmarks/results/NAME.md" in text and "NAME is one of: prox_cpu," in text
