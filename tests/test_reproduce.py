"""``pathnorm-reproduce``: every need checked before the first run (one-line errors, status 2),
and the quick protocol end to end on the embedded data: sweep, report, resumption."""

from __future__ import annotations

import csv
import importlib.metadata
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pathnorm_experiments import deps, reproduce
from pathnorm_experiments.runs import COLUMNS, append_rows


@pytest.fixture
def no_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the sweep started before every need was checked")

    monkeypatch.setattr(reproduce, "run_sweep", refuse)


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line error of a refused command line (status 2)."""
    try:
        rc = reproduce.main(argv)
    except SystemExit as e:  # argparse's own refusal
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 or err.startswith("usage:"), err
    return err


@pytest.mark.usefixtures("no_sweep")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--epochs", "0"], "pathnorm-reproduce: error: epochs must be >= 1, got 0"),
        (["--seeds", "-1"], "pathnorm-reproduce: error: seeds must be integers >= 0, got (-1,)"),
        (["--jobs", "0"], "pathnorm-reproduce: error: --jobs must be >= 1, got 0"),
        (["--results", "{tmp}/r.csv"], "the sweep writes a file named runs.csv"),
        (["--datasets", "mnist", "--data-dir", "{tmp}"], "train-labels-idx1-ubyte.gz not found"),
        (["--datasets", "cifar"], "argument --datasets: invalid choice: 'cifar'"),
        (["--seeds", "0", "0"], "error: seeds must be distinct, got (0, 0): give each value once"),
        (["--datasets", "embedded", "embedded"], "datasets must be distinct"),
        (["--device", "meta"], "error: device 'meta' is not supported: give cpu or cuda[:i]"),
        (["--device", "bogus"], "error: device 'bogus' is not supported: give cpu or cuda[:i]"),
        (["--device", "cuda:99"], "CUDA device(s) here: give cpu"),
    ],
)
def test_bad_settings_are_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    out = tmp_path / "o"
    argv = ["--quick", "--out", str(out), *(a.format(tmp=tmp_path) for a in extra)]
    assert message in error_of(argv, capsys)
    assert not out.exists()


@pytest.mark.usefixtures("no_sweep")
def test_missing_matplotlib_and_a_blocked_out_are_refused_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert error_of(["--quick", "--out", str(blocker / "o")], capsys) == (
        f"pathnorm-reproduce: error: --out {blocker / 'o'}: {blocker} is a file, so no "
        "directory can be made under it: choose another --out\n"
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert error_of(["--report-only", "--out", str(tmp_path / "o")], capsys) == (
        "pathnorm-reproduce: error: pathnorm-reproduce (the plots) needs matplotlib, which is "
        'not installed: install it with pip install -e ".[experiments]" in the pathnorm '
        "checkout\n"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.usefixtures("no_sweep")
def test_a_wheel_install_is_told_the_wheel_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(deps, "installed_wheel_version", lambda: "0.1.0")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert error_of(["--report-only", "--out", str(tmp_path / "o")], capsys) == (
        "pathnorm-reproduce: error: pathnorm-reproduce (the plots) needs matplotlib, which is "
        'not installed: install it with pip install "pathnorm[experiments]==0.1.0"\n'
    )


def test_the_install_kind_is_told_by_where_the_code_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert deps.installed_wheel_version() is None  # this checkout
    assert deps.pip_install("torch") == 'pip install -e ".[torch]"'
    assert deps.where() == " in the pathnorm checkout"
    monkeypatch.setattr(deps, "_ROOT", tmp_path)  # site-packages: no pyproject.toml
    assert deps.installed_wheel_version() == importlib.metadata.version("pathnorm")

    def absent(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.0")
    assert deps.pip_install("torch") == 'pip install "pathnorm[torch]==0.1.0"'
    assert deps.where() == ""
    monkeypatch.setattr(importlib.metadata, "version", absent)  # not installed: a source tree
    assert deps.installed_wheel_version() is None


def test_results_of_another_protocol_are_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_sweep: None
) -> None:
    results = tmp_path / "o" / "results" / "runs.csv"
    row: dict[str, Any] = dict.fromkeys(COLUMNS, "")
    row.update(dataset="embedded", regularizer="none", optimizer="prox", lam=0, lr=0.1, seed=0)
    row.update(epochs=2, n_train=4583, selected=0, val_error=10.0, machine="m", batch_size=100)
    row.update(hidden=200, eval_samples=300, pgd_steps=10, strong_restarts=1)
    quick = ["--quick", "--out", str(tmp_path / "o")]
    for setting, ours, theirs in (("epochs", 2, 20), ("eval_samples", 300, 2000)):
        results.unlink(missing_ok=True)
        append_rows(results, [{**row, setting: theirs}])
        err = error_of(quick, capsys)
        assert (
            f"--results {results} holds rows of embedded with {setting} {theirs}, and this "
            f"run's {setting} is {ours}: give another --results (one protocol per file)"
        ) in err
    results.unlink()
    append_rows(results, [{**row, "seed": "x"}])
    err = error_of(quick, capsys)
    assert f"{results}, line 2, column seed: 'x' is not a whole number" in err


@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_stop_after_must_be_positive_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    # -1 and 0 started no run and sent every rerun to the same end; nan meant no limit
    out = tmp_path / "o"
    assert error_of(["--quick", "--out", str(out), "--stop-after", value], capsys) == (
        "pathnorm-reproduce: error: --stop-after must be a number of seconds > 0, got "
        f"{float(value)}\n"
    )
    assert not (out / "results").exists()


def test_report_only_refuses_a_missing_or_foreign_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--report-only", "--out", str(tmp_path / "o")]
    missing = tmp_path / "none.csv"
    assert error_of([*out, "--results", str(missing)], capsys) == (
        f"pathnorm-reproduce: error: --results {missing}: no such file: run the sweep first\n"
    )
    foreign = tmp_path / "results.csv"
    foreign.write_text("eps,robust_error\n0.1,0.5\n")
    err = error_of([*out, "--results", str(foreign)], capsys)
    assert "not a results file of the sweep: 46 columns missing (dataset, regularizer" in err
    # a short row (the last line is whole: not a write in progress)
    header = ",".join(COLUMNS)
    short = tmp_path / "short.csv"
    short.write_text(f"{header}\nmnist,l1,prox,0.001,0.1,0\n")
    assert error_of([*out, "--results", str(short)], capsys) == (
        f"pathnorm-reproduce: error: {short}, line 2: 6 fields where the header has 46: column "
        "epochs (7 of 46) and after are missing; repair or remove the row\n"
    )


@pytest.mark.usefixtures("no_sweep")
@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--quick", "--seeds", "5", "--epochs", "3", "--jobs", "0"], "--seeds, --epochs, --jobs"),
        (["--jobs=1"], "--jobs"),  # the default's value, given: still refused
        (["--device", "cpu"], "--device"),
        (["--epo", "3"], "--epochs"),  # abbreviated
        (["--data-dir", "{tmp}", "--datasets", "mnist", "--stop-after", "9"], None),
    ],
)
def test_report_only_refuses_the_training_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], named: str | None
) -> None:
    """They would be ignored: --report-only trains nothing."""
    out = tmp_path / "o"
    argv = ["--report-only", "--out", str(out), *(a.format(tmp=tmp_path) for a in extra)]
    err = error_of(argv, capsys).splitlines()[-1]
    named = named or "--data-dir, --datasets, --stop-after"
    verb = "act" if "," in named else "acts"
    assert err == (
        f"pathnorm-reproduce: error: {named} only {verb} on the training, which --report-only "
        "skips (it writes the report from --results alone): drop "
        f"{'them' if ',' in named else 'it'}, or drop --report-only"
    )
    assert not out.exists()


def test_report_only_takes_quick_out_and_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The options that act on the report pass (--quick: the default --out)."""
    missing = tmp_path / "none.csv"
    argv = ["--report-only", "--quick", "--out", str(tmp_path / "o"), "--results", str(missing)]
    assert error_of(argv, capsys) == (
        f"pathnorm-reproduce: error: --results {missing}: no such file: run the sweep first\n"
    )
    assert (
        reproduce.given_options(reproduce.build_parser(), ["--quick"], reproduce.TRAINING_ONLY)
        == []
    )


def test_without_torch_training_is_refused_in_one_line(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from pathnorm_experiments import reproduce\n"
        f"sys.exit(reproduce.main(['--quick', '--out', {str(tmp_path / 'o')!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == (
        "pathnorm-reproduce: error: pathnorm-reproduce (the sweep trains with the torch loop) "
        'needs PyTorch, which is not installed: install it with pip install -e ".[torch]" in '
        "the pathnorm checkout; on a CPU-only machine add --extra-index-url "
        "https://download.pytorch.org/whl/cpu (else pip fetches CUDA's torch)\n"
    )


def test_help_is_plain_text_with_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        reproduce.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "``" not in text and ":mod:" not in text
    assert "None: mnist fashion-mnist kmnist (quick: embedded)" in text
    assert "the sweep's CSV (None: <out>/results/runs.csv)" in text
    assert "--quick runs a tiny grid on the embedded MNIST subset" in text


@pytest.mark.slow
def test_quick_runs_the_protocol_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rep"
    assert reproduce.main(["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "sweep: 16 groups written now, 0 before, 0 remaining" in printed
    with (out / "results" / "runs.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    # 16 groups (none, l1 and path x 2 optimizers x 3 lams, linf x 3): 2 lrs + 1 more seed each
    assert len(rows) == 48 and sum(r["selected"] == "1" for r in rows) == 32
    assert {r["regularizer"] for r in rows} == {"none", "l1", "path", "linf"}
    page = (out / "results.md").read_text()
    assert "**0 violations**" in page and "## embedded MNIST subset" in page
    sgd = "(a) SGD on the penalty leaves under 0.01% of the weights exactly zero"
    assert f"| {sgd} | raw nonzero | **holds**" in page
    # the trade-off, error and sparsity vs lam, error vs sparsity, error vs compacted size
    assert len(list((out / "img" / "results").glob("embedded_*.png"))) == 5
    # a rerun trains nothing and rewrites the same report
    assert reproduce.main(["--quick", "--out", str(out)]) == 0
    assert "sweep: 0 groups written now, 16 before, 0 remaining" in capsys.readouterr().out
    assert (out / "results.md").read_text() == page
