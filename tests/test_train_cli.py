"""End-to-end: the main job in both backends (and both torch engines), its files and errors;
a tiny ``pathnorm-reproduce --quick`` run."""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pathnorm_experiments import data, reproduce, train
from pathnorm_experiments.config import TrainConfig

TINY = [
    "--epochs", "1", "--n-train", "300", "--n-test", "200", "--pgd-samples", "100",
    "--pgd-steps", "5", "--no-progress", "--threads", "1",
]  # fmt: skip


def run_main(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "run"
    assert train.main([*TINY, "--out", str(out), *extra]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [float(r["eps"]) for r in rows] == [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3]
    for r in rows:
        assert float(r["clean_error"]) <= float(r["robust_error"]) + 1e-9 or float(r["eps"]) == 0
    return result


def check_result(r: dict[str, Any], backend: str) -> None:
    assert r["backend"] == backend and r["dataset"] == "embedded"
    assert r["n_train"] == 300 and r["n_test"] == 200 and r["n_attacked"] == 100
    assert r["timings"]["iterations"] == 3  # 300 samples / batch 100, one epoch
    assert 0 <= r["clean_error"] < 0.9  # learned something in 3 steps at lr 0.1
    keys = ["0.05", "0.1", "0.15", "0.2", "0.25", "0.3"]
    assert list(r["robust_error"]) == keys and list(r["certified_error"]) == keys
    for k in keys:
        assert 0 <= r["robust_error"][k] <= r["certified_error"][k] <= 1
    assert r["path_norm_bound"] <= r["product_bound"] + 1e-6
    assert r["final_regularized_loss"] == pytest.approx(
        r["train_cross_entropy"] + r["config"]["lam"] * r["regularizer_value"]
    )


@pytest.mark.parametrize(
    ("engine", "reg", "method", "lam"),
    [
        ("lightning", "path", "prox", 1e-3),
        ("lightning", "l1", "prox", 5e-2),
        ("loop", "path", "penalty", 1e-3),
        ("loop", "linf", "prox", 0.5),
    ],
)
def test_torch_main_job(tmp_path: Path, engine: str, reg: str, method: str, lam: float) -> None:
    r = run_main(
        tmp_path, "--backend", "torch", "--engine", engine, "--regularizer", reg,
        "--method", method, "--lam", str(lam),
    )  # fmt: skip
    check_result(r, "torch")
    assert r["engine"] == engine
    if reg == "l1":  # the prox (library callback) soft-thresholded many weights to exactly 0
        assert r["nonzero_weights_pct"] < 90
    if method == "penalty":  # plain SGD: no exact zeros
        assert r["nonzero_weights_pct"] == 100
    if reg == "linf":  # the projection enforces ||W||_inf <= 1/lam = 2 in every layer
        assert max(r["layer_linf_norms"]) <= 2 + 1e-4


@pytest.mark.parametrize(("reg", "method"), [("path", "prox"), ("l1", "penalty")])
def test_tf_main_job(tmp_path: Path, reg: str, method: str) -> None:
    pytest.importorskip("tensorflow")
    r = run_main(
        tmp_path, "--backend", "tf", "--regularizer", reg, "--method", method, "--lam", "1e-3"
    )
    check_result(r, "tf")
    assert r["engine"] == "keras"
    if method == "prox":  # PathNormSGD's prox zeroed weights; plain SGD does not
        assert r["effective_nonzero_pct"] < 100
    else:
        assert r["nonzero_weights_pct"] == 100


def test_stronger_attack_finds_at_least_as_much(tmp_path: Path) -> None:
    base = ["--engine", "loop", "--n-test", "300", "--pgd-samples", "300", "--pgd-steps", "20"]
    ce = run_main(tmp_path / "ce", *base)
    both = run_main(tmp_path / "both", *base, "--attack", "ce+margin")
    assert both["config"]["attack"] == "ce+margin"
    assert both["clean_error"] == ce["clean_error"]  # same seed, same training
    for k, v in ce["robust_error"].items():
        assert v <= both["robust_error"][k] <= both["certified_error"][k] + 1e-9


def test_tf_stronger_attack(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    r = run_main(tmp_path, "--backend", "tf", "--attack", "ce+margin")
    check_result(r, "tf")


def test_deeper_net_pairs_layers(tmp_path: Path) -> None:
    r = run_main(tmp_path, "--engine", "loop", "--hidden", "64,32,16", "--lam", "1e-3")
    assert r["config"]["hidden"] == [64, 32, 16]
    check_result(r, "torch")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--regularizer", "linf", "--method", "penalty"], "only the projection form"),
        (["--regularizer", "path", "--hidden", "64,32"], "even number of layers"),
        (["--lam", "-1"], "lam must be a finite number >= 0"),
        (["--epochs", "0"], "epochs must be >= 1"),
        (["--dataset", "mnist", "--data-dir", "/nonexistent"], "not found in /nonexistent/mnist"),
    ],
)
def test_errors_exit_2_with_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert train.main([*TINY, "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--pgd-samples", "-1"],
            "argument --pgd-samples: must be >= 0 (0: all test images), got -1",
        ),
        (
            ["--threads", "-3"],
            "argument --threads: must be >= 0 (0: the framework's default), got -3",
        ),
        (["--threads", "two"], "argument --threads: expected an integer, got 'two'"),
    ],
)
def test_negative_counts_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as e:
        train.main([*TINY, "--out", str(tmp_path), *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize(
    ("field", "value", "all_of"),
    [
        ("pgd_samples", -1, "test"),
        ("pgd_samples", 0, "test"),
        ("eval_train_samples", -5, "training"),
    ],
)
def test_config_refuses_sample_counts_below_1(field: str, value: int, all_of: str) -> None:
    # a negative count sliced x[:-n]: all but the last n images, recorded as n_attacked = -n
    with pytest.raises(ValueError) as e:
        TrainConfig(**{field: value})
    assert str(e.value) == f"{field} must be >= 1, or None for all {all_of} images; got {value}"


def test_pgd_samples_zero_attacks_every_test_image(tmp_path: Path) -> None:
    r = run_main(tmp_path, "--engine", "loop", "--pgd-samples", "0")
    assert r["n_attacked"] == r["n_test"] == 200 and r["config"]["pgd_samples"] is None


@pytest.fixture
def corrupt_kmnist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data dir whose KMNIST train labels are a truncated npz with no known checksum."""
    spec = data.DATASETS["kmnist"]
    labels = tuple(dataclasses.replace(fs, sha256=None) for fs in spec.train_labels)
    monkeypatch.setitem(data.DATASETS, "kmnist", dataclasses.replace(spec, train_labels=labels))
    (tmp_path / "kmnist").mkdir()
    np_file = tmp_path / "kmnist" / "kmnist-train-labels.npz"
    np.savez(np_file, np.zeros(60000, dtype=np.uint8))
    np_file.write_bytes(np_file.read_bytes()[:1000])
    return tmp_path


@pytest.mark.parametrize("command", ["train", "reproduce"])
def test_corrupt_data_file_exits_2_with_message(
    corrupt_kmnist: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    out = corrupt_kmnist / "out"
    common = ["--data-dir", str(corrupt_kmnist), "--out", str(out)]
    if command == "train":
        rc = train.main([*TINY, "--dataset", "kmnist", *common])
    else:
        rc = reproduce.main(["--datasets", "kmnist", *common])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"pathnorm-{command}: error: {corrupt_kmnist}/kmnist/kmnist-train-labels.npz"
    )
    assert "BadZipFile: File is not a zip file" in err
    assert "get kmnist-train-labels.npz from http://codh.rois.ac.jp/kmnist/" in err
    assert not out.exists()


def test_bad_hidden_spec(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        train.main(["--hidden", "a,b"])
    assert "comma-separated widths" in capsys.readouterr().err


def test_module_entry_point_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pathnorm_experiments.train", "--help"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert (
        "--regularizer {none,l1,linf,path}" in out.stdout and "--backend {torch,tf}" in out.stdout
    )


def test_reproduce_checks_data_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--datasets", "mnist", "--data-dir", str(tmp_path), "--out", str(tmp_path / "o")]
    assert reproduce.main(args) == 2
    assert "train-labels-idx1-ubyte.gz not found" in capsys.readouterr().err
    assert not (tmp_path / "o" / "runs").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--pgd-samples", "-5"],
            "argument --pgd-samples: must be >= 0 (0: all test images), got -5",
        ),
        (["--epochs", "0"], "epochs must be >= 1, got 0"),
        (["--epochs", "-2"], "epochs must be >= 1, got -2"),
        (["--lr", "-0.1"], "lr must be a finite number > 0, got -0.1"),
        (["--lams-path", "1e-3", "-0.001"], "lam must be a finite number >= 0, got -0.001"),
    ],
)
def test_reproduce_refuses_bad_arguments_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    out = tmp_path / "o"
    small = [
        "--lams-l1",
        "3e-3",
        "--lams-path",
        "1e-3",
        "--lams-linf",
        "0.5",
        "--pgd-samples",
        "50",
    ]
    argv = ["--quick", "--out", str(out), *small, *args]
    try:
        rc = reproduce.main(argv)
    except SystemExit as e:  # argparse's own refusal
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "pathnorm-reproduce: error:" in err
    assert not out.exists()


def test_reproduce_help_states_the_quick_settings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        reproduce.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "embedded data, small grid, 3 epochs, 1 seed" in help_text
    assert "quick: 3, full: 20 (the paper)" in help_text


def test_reproduce_quick_tiny(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    args = [
        "--quick", "--epochs", "1", "--pgd-samples", "50", "--out", str(out),
        "--lams-l1", "3e-3", "--lams-path", "1e-3", "--lams-linf", "0.5",
    ]  # fmt: skip
    assert reproduce.main(args) == 0
    runs = sorted(p.name for p in (out / "runs").glob("*.json"))
    assert len(runs) == 6  # none + l1 x 2 + linf + path x 2
    pngs = sorted(p.name for p in (out / "img").glob("*.png"))
    assert pngs == [
        f"embedded_{n}.png"
        for n in ("error_vs_lam", "error_vs_nonzero", "loss_vs_iter", "nonzero_vs_iter", "tradeoff")
    ]
    report = (out / "report.md").read_text()
    assert "Prox-SGD ends at a lower regularized loss than SGD" in report
    assert "| embedded | path | Prox-SGD | 0.001 | 1 |" in report
    # re-running skips finished runs and re-plots
    assert reproduce.main([*args, "--report-only"]) == 0
