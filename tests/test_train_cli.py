"""End-to-end: the main job in both backends (and both torch engines), its files and errors;
its checks of ``pathnorm-reproduce``'s data (the rest: test_reproduce.py)."""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pathnorm_experiments import data, reproduce, settings, train
from pathnorm_experiments.settings import TrainConfig

CPU_NOTE = (
    "; on a CPU-only machine add --extra-index-url https://download.pytorch.org/whl/cpu (else "
    "pip fetches CUDA's torch)"
)

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
    for r in rows:  # the first three share the attacked images
        clean, robust = float(r["clean_error_attacked"]), float(r["robust_error"])
        assert clean <= robust <= float(r["certified_error"])
        assert robust <= float(r["certified_error_interval"])
        assert float(r["clean_error"]) == result["clean_error"]  # on all test images
    assert (out / "training_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return result


def check_result(r: dict[str, Any], backend: str) -> None:
    assert r["backend"] == backend and r["dataset"] == "embedded"
    assert r["n_train"] == 300 and r["n_test"] == 200 and r["n_attacked"] == 100
    assert r["timings"]["iterations"] == 3  # 300 samples / batch 100, one epoch
    assert 0 <= r["clean_error"] < 0.9  # learned something in 3 steps at lr 0.1
    keys = ["0.05", "0.1", "0.15", "0.2", "0.25", "0.3"]
    assert list(r["robust_error"]) == keys and list(r["certified_error"]) == keys
    assert list(r["certified_error_interval"]) == keys
    for k in keys:
        assert 0 <= r["robust_error"][k] <= r["certified_error"][k] <= 1
        assert r["robust_error"][k] <= r["certified_error_interval"][k] <= 1
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


def test_lightning_engine_prints_only_the_jobs_own_lines(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_main(tmp_path, "--backend", "torch", "--engine", "lightning")
    printed = "".join(capfd.readouterr())
    for chatter in ("GPU available", "TPU available", "litlogger", "LeafSpec"):
        assert chatter not in printed
    assert not [w for w in caught if "LeafSpec" in str(w.message)]
    assert printed.startswith("embedded (300 train, 200 test) | backend torch")


def test_tf_main_job_penalty(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    r = run_main(
        tmp_path, "--backend", "tf", "--regularizer", "l1", "--method", "penalty", "--lam", "1e-3"
    )
    check_result(r, "tf")
    assert r["engine"] == "keras"
    assert r["nonzero_weights_pct"] == 100  # plain SGD: no exact zeros


def test_conv_main_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (Keras: test_backend_agreement.py trains and evaluates the conv network in both backends)
    r = run_main(tmp_path, "--backend", "torch", "--model", "conv", "--hidden", "8")
    check_result(r, "torch")
    cfg = r["config"]
    assert (cfg["model"], cfg["hidden"], cfg["kernel_size"], cfg["stride"]) == ("conv", [8], 5, 2)
    assert "conv 8 channels, kernel 5, stride 2" in capsys.readouterr().out
    # a valid convolution read by a Linear layer: the unrolled path norm is R (factor s = 1)
    assert r["path_norm_bound"] == pytest.approx(r["regularizer_value"], rel=1e-9)
    assert r["nonzero_weights_pct"] < 100  # the path prox zeroed weights of the conv pair


BLOCK = "import sys\nfor name in sys.argv[1].split(','):\n    sys.modules[name] = None\n"


def run_without(modules: str, command: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``pathnorm-<command>`` in a fresh process where ``modules`` cannot be imported."""
    code = (
        f"{BLOCK}from pathnorm_experiments.{command} import main\n"
        "raise SystemExit(main(sys.argv[2:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, modules, *argv], capture_output=True, text=True, timeout=300
    )


def test_keras_only_install_runs_the_default_job_on_tf(tmp_path: Path) -> None:
    # no --backend: torch is not installed, so the default is tf (the prox: PathNormSGD)
    pytest.importorskip("tensorflow")
    out = tmp_path / "run"
    proc = run_without("torch,lightning", "train", *TINY, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    r = json.loads((out / "results.json").read_text())
    check_result(r, "tf")
    assert r["engine"] == "keras" and r["config"]["regularizer"] == "path"
    assert r["effective_nonzero_pct"] < 100  # PathNormSGD's prox zeroed weights


TF_HINT = (
    'pip install -e ".[tf-cpu]" (".[tf]" for TensorFlow with GPU support) in the pathnorm checkout'
)


@pytest.mark.parametrize(
    ("blocked", "args", "message"),
    [
        (
            ("tensorflow", "keras"),
            ["--backend", "tf"],
            f"--backend tf needs TensorFlow and Keras, which are not installed: install them with {TF_HINT}",
        ),
        (
            ("keras",),
            ["--backend", "tf"],
            f"--backend tf needs Keras, which is not installed: install it with {TF_HINT}",
        ),
        (
            ("torch", "tensorflow"),
            [],
            'pathnorm-train needs a backend, and neither is installed: pip install -e ".[torch]" '
            '(PyTorch) or pip install -e ".[tf-cpu]" (TensorFlow and Keras) in the pathnorm checkout'
            f"{CPU_NOTE}",
        ),
        (
            ("torch",),
            ["--backend", "torch", "--engine", "loop"],
            '--backend torch needs PyTorch, which is not installed: install it with pip install -e '
            f'".[torch]" in the pathnorm checkout{CPU_NOTE}',
        ),
        (
            ("lightning",),
            ["--backend", "torch"],
            '--backend torch (with --engine lightning) needs Lightning, which is not installed: '
            f'install it with pip install -e ".[torch]" in the pathnorm checkout{CPU_NOTE}',
        ),
    ],
    ids=["torch-only-asks-tf", "no-keras", "nothing", "no-torch-loop", "no-lightning"],
)  # fmt: skip
def test_missing_backend_is_one_line_naming_the_extra(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    blocked: tuple[str, ...],
    args: list[str],
    message: str,
) -> None:
    for name in blocked:  # None in sys.modules: the import fails, as when not installed
        monkeypatch.setitem(sys.modules, name, None)
    _no_training(monkeypatch)
    out = tmp_path / "o"
    assert train.main([*TINY, "--out", str(out), *args]) == 2
    assert capsys.readouterr().err == f"pathnorm-train: error: {message}\n"
    assert not out.exists()


def test_stronger_attack_finds_at_least_as_much(tmp_path: Path) -> None:
    base = ["--engine", "loop", "--n-test", "300", "--pgd-samples", "300", "--pgd-steps", "20"]
    ce = run_main(tmp_path / "ce", *base)
    both = run_main(tmp_path / "both", *base, "--attack", "ce+margin")
    assert both["config"]["attack"] == "ce+margin"
    assert both["clean_error"] == ce["clean_error"]  # same seed, same training
    for k, v in ce["robust_error"].items():
        assert v <= both["robust_error"][k] <= both["certified_error"][k] + 1e-9


def test_tf_stronger_attack_in_float64_matches_torch(tmp_path: Path) -> None:
    # float64 end to end in both backends (training, PGD on CE and margin, certificates):
    # the same initial draw and batch order give the same network to float64 rounding
    common = ("--attack", "ce+margin", "--dtype", "float64")
    # torch first: importing it after TensorFlow aborts in torch's triton import
    t = run_main(tmp_path / "torch", "--backend", "torch", "--engine", "loop", *common)
    pytest.importorskip("tensorflow")
    r = run_main(tmp_path / "tf", "--backend", "tf", *common)
    check_result(r, "tf")
    assert r["config"]["dtype"] == t["config"]["dtype"] == "float64"
    for key in ("path_norm_bound", "product_bound", "final_regularized_loss"):
        assert r[key] == pytest.approx(t[key], rel=1e-12), key
    assert r["clean_error"] == t["clean_error"]
    assert r["certified_error"] == t["certified_error"]
    assert r["certified_error_interval"] == t["certified_error_interval"]


def test_deeper_net_pairs_layers(tmp_path: Path) -> None:
    # lr 1: in 3 steps a 4-layer net at lr 0.1 stays at chance (check_result wants learning)
    r = run_main(tmp_path, "--engine", "loop", "--hidden", "64,32,16", "--lam", "1e-3", "--lr", "1")
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
        (["--stride", "1"], "--stride is the conv network's: add --model conv"),
        (["--model", "conv", "--hidden", "8,8"], "one hidden layer, its convolution"),
        (["--model", "conv", "--kernel-size", "29"], "larger than the 28 x 28 images"),
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


def test_a_partial_training_set_of_no_image_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # it was accepted as an empty training set, and training crashed (ZeroDivisionError)
    d = tmp_path / "kmnist"

    def idx(magic: int, *dims: int) -> bytes:  # an IDX file of zeros
        return struct.pack(f">{1 + len(dims)}I", magic, *dims) + bytes(int(np.prod(dims)))

    files = {  # the truncated training images: the IDX header alone
        "partial/train-images-idx3-ubyte.gz.truncated": idx(data.IMAGE_MAGIC, 60000, 28, 28)[:16],
        "train-labels-idx1-ubyte.gz": idx(data.LABEL_MAGIC, 60000),
        "t10k-images-idx3-ubyte.gz": idx(data.IMAGE_MAGIC, 10000, 28, 28),
        "t10k-labels-idx1-ubyte.gz": idx(data.LABEL_MAGIC, 10000),
    }
    for name, payload in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(gzip.compress(payload, 1))
    args = ["--dataset", "kmnist", "--data-dir", str(tmp_path), "--allow-partial", "--no-verify"]
    assert train.main([*TINY, "--out", str(tmp_path / "o"), *args]) == 2
    assert capsys.readouterr().err.startswith(
        f"pathnorm-train: error: {d}/partial/train-images-idx3-ubyte.gz.truncated: holds no "
        "complete image to train on: get train-images-idx3-ubyte.gz from http://codh.rois.ac.jp/"
    )


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
    text = " ".join(out.stdout.split())
    assert "--regularizer {none,l1,path,linf}" in text and "--backend {auto,torch,tf}" in text
    assert "``" not in text and "::" not in text and ":mod:" not in text  # no raw reST
    for shown in ("(default: auto)", "(default: path)", "(default: 0.001)", "(default: 20)"):
        assert shown in text, shown
    assert "pathnorm-train --backend tf --regularizer l1" in out.stdout  # the examples


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
# --- the output folder: checked first, the summary printed before the files are written -----


def _no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("data were loaded: the --out check came too late")

    monkeypatch.setattr(train, "load_dataset", refuse)


@pytest.mark.parametrize("where", ["under-a-file", "is-a-file", "read-only", "proc"])
def test_unusable_out_exits_2_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out, problem = {
        "under-a-file": (blocker / "run", f"{blocker} is a file, so no directory can be made"),
        "is-a-file": (blocker, "is a file, not a directory"),
        "read-only": (tmp_path / "ro" / "run", f"cannot write in {tmp_path / 'ro'} ("),
        # procfs refuses new entries even to root, for whom a chmod'ed directory is writable
        "proc": (Path("/proc/self/pathnorm_run"), "cannot write in /proc/self ("),
    }[where]
    if where == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes in a read-only directory (the proc case covers this)")
        (tmp_path / "ro").mkdir(mode=0o500)
    _no_training(monkeypatch)
    assert train.main([*TINY, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"pathnorm-train: error: --out {out}: {problem}")
    assert captured.err.rstrip().endswith("choose another --out"), captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""


def test_existing_results_need_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    fast = [*TINY, "--engine", "loop", "--out", str(out)]
    assert train.main(fast) == 0
    before = {f: (out / f).read_bytes() for f in train.OUTPUT_FILES}
    capsys.readouterr()
    assert train.main([*fast, "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"pathnorm-train: error: --out {out} already holds results (results.json, results.csv, "
        "training_curve.png): pass --overwrite to replace them, or choose another --out\n"
    )
    assert {f: (out / f).read_bytes() for f in train.OUTPUT_FILES} == before
    assert train.main([*fast, "--seed", "1", "--overwrite"]) == 0
    assert json.loads((out / "results.json").read_text())["config"]["seed"] == 1


def test_summary_is_printed_before_the_files_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def disk_full(result: dict[str, Any], out: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(train, "write_results", disk_full)
    assert train.main([*TINY, "--engine", "loop", "--out", str(tmp_path / "run")]) == 2
    captured = capsys.readouterr()
    assert "clean error" in captured.out and "robust err %" in captured.out  # the numbers
    assert captured.err.startswith("pathnorm-train: error: could not write the results to ")
    assert captured.err.rstrip().endswith("the summary above holds the numbers")


def test_no_matplotlib_no_plot_and_a_stale_plot_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    fast = [*TINY, "--engine", "loop", "--out", str(out)]
    assert train.main(fast) == 0
    assert (out / "training_curve.png").is_file()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    capsys.readouterr()
    assert train.main([*fast, "--overwrite"]) == 0
    assert not (out / "training_curve.png").exists()  # it showed the previous run
    assert (
        'no training-curve plot: matplotlib is not installed; pip install -e ".[experiments]" '
        "in the pathnorm checkout adds it)"
    ) in capsys.readouterr().out


# --- eps keys ------------------------------------------------------------------------------


def test_close_eps_values_keep_distinct_keys(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = [*TINY, "--engine", "loop", "--out", str(out), "--eps", "0.1", "0.1000001", "1e-05"]
    assert train.main(argv) == 0
    r = json.loads((out / "results.json").read_text())
    assert list(r["robust_error"]) == ["0.1", "0.1000001", "1e-05"]
    assert list(r["certified_error"]) == ["0.1", "0.1000001", "1e-05"]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["eps"] for r in rows] == ["0.0", "0.1", "0.1000001", "1e-05"]


def test_repeated_eps_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train.main([*TINY, "--out", str(tmp_path / "o"), "--eps", "0.1", "0.2", "0.1"]) == 2
    assert "eps values must be distinct, got [0.1] more than once" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "key"),
    [(0.1, "0.1"), (0.05, "0.05"), (1e-5, "1e-05"), (0.1000001, "0.1000001"), (1 / 3, repr(1 / 3))],
)
def test_float_key_reads_back_exactly(value: float, key: str) -> None:
    assert settings.float_key(value) == key and float(key) == value
