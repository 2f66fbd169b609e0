"""The sweep engine on tiny grids (the embedded MNIST subset, 1 epoch): columns and units,
clean <= PGD <= certified on every row, lr selection on validation only, resume without
recomputation, missing seeds added and another protocol refused, two sweeps of one folder
sharing its groups, shards that add up to the unsharded sweep, the checked reading of a
results file, and the main job's training."""

from __future__ import annotations

import csv
import io
import math
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pathnorm_experiments import _sweep_run
from pathnorm_experiments import sweep as S
from pathnorm_experiments.data import load_embedded
from pathnorm_experiments.report_data import settings_from_rows
from pathnorm_experiments.runs import (
    claim_group,
    load_pending,
    release_group,
    row_group_key,
    save_pending,
)

EPS = ("0.02", "0.05", "0.1", "0.15", "0.2", "0.3")
# the columns, written out here so that a change of COLUMNS cannot pass unnoticed
EXPECTED_COLUMNS = [
    "dataset",
    "regularizer",
    "optimizer",
    "lam",
    "lr",
    "seed",
    "epochs",
    "n_train",
    "selected",
    "val_error",
    "clean_error",
    "clean_error_full",
    *(f"{k}@{e}" for k in ("robust_error", "robust_error_strong") for e in EPS),
    *(f"{k}@{e}" for k in ("certified_lipschitz", "certified_interval") for e in EPS),
    "nonzero",
    "nonzero_live",
    "path_norm",
    "machine",
    # the settings that define a run besides its key (added after the first 41 columns)
    "batch_size",
    "hidden",
    "eval_samples",
    "pgd_steps",
    "strong_restarts",
    # the hidden units that compact keeps (added last; empty in rows from before it)
    "hidden_alive",
]
CFG = S.SweepConfig(
    datasets=("embedded",),
    lams={"none": (0.0,), "l1": (1e-3,), "path": (2e-3,), "linf": (0.2,)},
    lrs=(0.05, 0.5),
    seeds=(0, 1),
    epochs=1,
    eval_samples=100,
    pgd_steps=4,
    strong_restarts=1,
    val_size=6000,  # 10% of the 600 training images
)


@pytest.fixture(scope="module")
def data() -> dict[str, S.Prepared]:
    torch.set_num_threads(1)
    return {"embedded": S.prepare(load_embedded().subset(600, 300), CFG)}


@pytest.fixture(scope="module")
def full_run(
    data: dict[str, S.Prepared], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, int]]:
    out = tmp_path_factory.mktemp("full")
    counts = S.run_sweep(CFG, data, out, machine="test machine", log=io.StringIO())
    return out / "runs.csv", counts


def _by_key(path: Path) -> dict[str, dict[str, str]]:
    return {S.row_key(r): r for r in S.read_rows(path)}


def _f(row: dict[str, str], col: str) -> float:
    return float(row[col])


def test_columns_units_and_ordering(
    full_run: tuple[Path, dict[str, int]], data: dict[str, S.Prepared]
) -> None:
    path, counts = full_run
    with path.open() as f:
        assert next(csv.reader(f)) == EXPECTED_COLUMNS
    rows = S.read_rows(path)
    # 6 groups (none; l1 and path with both optimizers; linf): 2 lrs at seed 0, seed 1 at the
    # selected lr
    assert counts == {
        "groups": 6,
        "done_before": 0,
        "written": 6,
        "remaining": 0,
        "claimed": 0,
        "trained": 18,
        "evaluated": 12,
    }
    assert len(rows) == 18
    assert {(r["regularizer"], r["optimizer"]) for r in rows} == {
        ("none", "prox"),
        ("l1", "prox"),
        ("l1", "penalty"),
        ("path", "prox"),
        ("path", "penalty"),
        ("linf", "prox"),
    }
    n_eval, n_test = data["embedded"].x_eval.shape[0], data["embedded"].x_test.shape[0]
    assert (n_eval, n_test, data["embedded"].n_train) == (100, 300, 540)
    for r in rows:
        assert r["n_train"] == "540" and r["epochs"] == "1" and r["machine"] == "test machine"
        protocol = [r[c] for c in ("batch_size", "hidden", "eval_samples", "pgd_steps")]
        assert protocol == ["100", "200", "100", "4"] and r["strong_restarts"] == "1"
        # percent, in steps of one image of its set
        for col, n in (("clean_error", n_eval), ("clean_error_full", n_test), ("val_error", 60)):
            v = _f(r, col)
            assert 0 <= v <= 100 and v * n / 100 == pytest.approx(round(v * n / 100), abs=1e-6)
        assert 0 < _f(r, "nonzero_live") <= _f(r, "nonzero") <= 100 and _f(r, "path_norm") > 0
        # no regularization zeroes no unit; the others keep at most the 200 units
        alive = int(r["hidden_alive"])
        assert alive == 200 if r["regularizer"] == "none" else 0 <= alive <= 200
        eps_cols = [c for c in EXPECTED_COLUMNS if "@" in c]
        if r["selected"] == "0":
            assert all(r[c] == "" for c in eps_cols)
            continue
        assert r["selected"] == "1"
        clean, prev_strong = _f(r, "clean_error"), 0.0
        for e in EPS:
            pgd, strong = _f(r, f"robust_error@{e}"), _f(r, f"robust_error_strong@{e}")
            lip, ivl = _f(r, f"certified_lipschitz@{e}"), _f(r, f"certified_interval@{e}")
            # clean <= PGD <= strong attack <= certified error (= 100 - certified accuracy)
            assert clean <= pgd <= strong <= min(lip, ivl) <= 100, (r, e)
            assert strong >= prev_strong  # the strong attack keeps what a smaller eps found
            prev_strong = strong
    # a regularized model is certified somewhere (the columns are not all 100)
    assert min(_f(r, "certified_interval@0.02") for r in rows if r["selected"] == "1") < 100


def test_lr_selection_uses_validation(full_run: tuple[Path, dict[str, int]]) -> None:
    rows = S.read_rows(full_run[0])
    groups: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        groups.setdefault(row_group_key(r), []).append(r)
    assert len(groups) == 6
    for rs in groups.values():
        seed0 = {float(r["lr"]): _f(r, "val_error") for r in rs if r["seed"] == "0"}
        assert set(seed0) == {0.05, 0.5}
        best = min(seed0, key=lambda lr: (seed0[lr], lr))
        selected = {(float(r["lr"]), r["seed"]) for r in rs if r["selected"] == "1"}
        assert selected == {(best, "0"), (best, "1")}  # every seed at the chosen lr
        assert len(rs) == 3  # the other lr ran with the selection seed only


def test_selection_ignores_the_test_set(data: dict[str, S.Prepared], tmp_path: Path) -> None:
    """Scrambling every test label changes the test columns but not one selection."""
    cfg = replace(CFG, regularizers=("l1", "path"), optimizers=("prox",), strong_restarts=0)
    p = data["embedded"]
    rng = np.random.default_rng(0)
    scrambled = replace(
        p,
        y_eval=torch.from_numpy(rng.permutation(p.y_eval.numpy())),
        y_test=torch.from_numpy(rng.permutation(p.y_test.numpy())),
    )
    a = S.run_sweep(cfg, data, tmp_path / "a", log=io.StringIO())
    b = S.run_sweep(cfg, {"embedded": scrambled}, tmp_path / "b", log=io.StringIO())
    assert a["written"] == b["written"] == 2
    ra, rb = _by_key(tmp_path / "a" / "runs.csv"), _by_key(tmp_path / "b" / "runs.csv")
    assert ra.keys() == rb.keys()
    assert [r["selected"] for r in ra.values()] == [rb[k]["selected"] for k in ra]
    assert [r["val_error"] for r in ra.values()] == [rb[k]["val_error"] for k in ra]
    assert any(ra[k]["clean_error_full"] != rb[k]["clean_error_full"] for k in ra)


def test_group_order_spreads_every_grid_early() -> None:
    for n in range(12):
        assert sorted(S.coarse_to_fine(n)) == list(range(n))
    assert S.coarse_to_fine(7)[:3] == [3, 1, 5]
    groups = S.build_groups(S.SweepConfig(), {"mnist": 55000, "kmnist": 6427})
    assert len(groups) == 2 * 85 and len({g.key for g in groups}) == 170
    first = [(g.regularizer, g.optimizer, g.lam) for g in groups[:6]]
    assert first == [
        ("none", "prox", 0.0),
        ("l1", "prox", 3e-4),
        ("path", "prox", 2e-4),
        ("linf", "prox", 0.1),
        ("l1", "penalty", 3e-4),
        ("path", "penalty", 2e-4),
    ]
    assert {g.dataset for g in groups[:85]} == {"mnist"}


def test_the_reports_settings_summarize_the_selected_runs(
    full_run: tuple[Path, dict[str, int]],
) -> None:
    rows = S.read_rows(full_run[0])
    settings = settings_from_rows(rows)
    assert len(settings) == 6
    st = settings[("embedded", "path", "prox", 2e-3)]
    sel = [r for r in rows if r["regularizer"] == "path" and r["optimizer"] == "prox"]
    sel = [r for r in sel if r["selected"] == "1"]
    assert st.seeds == (0, 1) and st.lr == float(sel[0]["lr"])
    vals = [float(r["robust_error@0.1"]) for r in sel]
    got = st.stats["robust_error@0.1"]
    assert (got.mean, got.lo, got.hi) == pytest.approx((np.mean(vals), min(vals), max(vals)))


def test_select_lr_ties_and_divergence() -> None:
    g = S.Group("d", "l1", "prox", 1e-3, 1, 10, (0.1, 0.2, 0.5), (0, 1), (0, 1))
    st = S.GroupState(g, 0)
    vals = {0.1: (5.0, 7.0), 0.2: (6.0, 6.0), 0.5: (1.0, math.nan)}
    for lr, (v0, v1) in vals.items():
        st.results[g.run(lr, 0).key] = {"val_error": v0}
        st.results[g.run(lr, 1).key] = {"val_error": v1}
    assert S.select_lr(st) == 0.1  # a tie of means (6.0): the smaller lr; 0.5 diverged once


class Killed(Exception):
    """Stands for a kill signal."""


def test_resume_never_recomputes(
    data: dict[str, S.Prepared],
    tmp_path: Path,
    full_run: tuple[Path, dict[str, int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, bool]] = []
    kill_at = [8]
    real = _sweep_run._execute

    def counting(task: Any, cfg: S.SweepConfig) -> dict[str, Any]:
        calls.append((task.spec.key, task.train))
        if len(calls) == kill_at[0]:
            raise Killed  # the sweep is killed in the middle of the 8th task
        return real(task, cfg)

    monkeypatch.setattr(_sweep_run, "_execute", counting)
    with pytest.raises(Killed):
        S.run_sweep(CFG, data, tmp_path, machine="test machine", log=io.StringIO())
    first = list(calls)
    kill_at[0] = 0
    partial = S.read_rows(tmp_path / "runs.csv")
    assert 0 < len(partial) < 18  # some groups were written, some were not
    calls.clear()
    counts = S.run_sweep(CFG, data, tmp_path, machine="test machine", log=io.StringIO())
    # nothing that finished (the first 7 tasks) ran again; the interrupted one did
    assert not set(calls) & set(first[:7])
    assert first[7] in calls
    assert len(first) - 1 + len(calls) == 18 + 6
    assert counts["done_before"] + counts["written"] == 6
    # the resumed sweep equals the uninterrupted one, row for row
    assert _by_key(tmp_path / "runs.csv") == _by_key(full_run[0])
    assert not any((tmp_path / ".pending").iterdir())  # the cache is emptied group by group
    calls.clear()
    again = S.run_sweep(CFG, data, tmp_path, log=io.StringIO())
    assert calls == [] and again["written"] == 0 and again["done_before"] == 6


def _sweep_child(cfg: S.SweepConfig, data: dict[str, S.Prepared], out: Path, queue: Any) -> None:
    log = io.StringIO()
    counts = S.run_sweep(cfg, data, out, machine="test machine", log=log)
    queue.put((counts, log.getvalue()))


def test_two_sweeps_of_one_folder_share_its_groups(
    data: dict[str, S.Prepared], tmp_path: Path, full_run: tuple[Path, dict[str, int]]
) -> None:
    """Two sweeps started at once on one --out (no --shard): every group runs once, in one of
    them, and the file holds each run once, with the values of a single sweep."""
    cfg = replace(CFG, regularizers=("none", "l1"), optimizers=("prox",))  # 2 groups
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_sweep_child, args=(cfg, data, tmp_path, queue)) for _ in "ab"]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    assert [proc.exitcode for proc in procs] == [0, 0]  # neither died (on a shared temp file)
    counts = [queue.get(timeout=5)[0] for _ in procs]
    assert sum(c["written"] for c in counts) == 2  # no group twice
    assert all(c["written"] + c["claimed"] + c["done_before"] == 2 for c in counts)
    rows = S.read_rows(tmp_path / "runs.csv")  # refuses a run key written twice
    assert len(rows) == 6
    alone = _by_key(full_run[0])
    assert {S.row_key(r): r for r in rows} == {S.row_key(r): alone[S.row_key(r)] for r in rows}
    assert not list((tmp_path / ".claims").glob("*.claim"))  # every claim dropped


def test_claims_skip_a_live_sweep_and_take_over_a_dead_ones(
    data: dict[str, S.Prepared], tmp_path: Path
) -> None:
    host, key = socket.gethostname(), "embedded|none|prox|0|1|540"
    assert claim_group(tmp_path, key) is None  # this process holds it
    (path,) = (tmp_path / ".claims").glob("*.claim")
    assert path.read_text() == f"{host} {os.getpid()}\n{key}\n"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process that has ended, as a killed sweep's
    for holder, taken in (
        (f"{host} {dead.pid}", None),  # stale: taken over
        ("", None),  # empty, as a sweep killed while writing it left it (before: held for ever)
        (f"{host} {os.getppid()}", f"{host} {os.getppid()}"),  # a live process of this machine
        ("another-machine 12", "another-machine 12"),  # cannot be checked: counts as live
    ):
        path.write_text(f"{holder}\n{key}\n")
        assert claim_group(tmp_path, key) == taken
    release_group(tmp_path, key)  # another machine's claim is left alone
    assert path.read_text().startswith("another-machine 12")
    # a sweep skips the claimed group, says so, and runs it once the claim is gone
    cfg = replace(CFG, regularizers=("none",), seeds=(0,))
    log = io.StringIO()
    counts = S.run_sweep(cfg, data, tmp_path, log=log)
    assert (counts["written"], counts["claimed"], counts["remaining"]) == (0, 1, 1)
    assert "skipped, claimed by another sweep (another-machine 12)" in log.getvalue()
    assert not (tmp_path / "runs.csv").exists()
    path.unlink()
    counts = S.run_sweep(cfg, data, tmp_path, log=io.StringIO())
    assert (counts["written"], counts["claimed"], counts["remaining"]) == (1, 0, 0)
    assert not path.exists()


_SWEEP = """
import pickle, sys
from pathlib import Path
from pathnorm_experiments import sweep as S
cfg, data = pickle.loads(Path(sys.argv[1]).read_bytes())
S.run_sweep(cfg, data, Path(sys.argv[2]), jobs=2, machine="test machine")
"""


def _children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid`` (from /proc; zombies excluded)."""
    kids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == pid and state != "Z":
            kids.add(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: set[int], seconds: float) -> set[int]:
    """The processes of ``pids`` still alive after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return set(filter(_alive, pids))


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc")
def test_a_sweep_killed_by_sigterm_takes_its_workers_and_resumes(
    data: dict[str, S.Prepared], tmp_path: Path
) -> None:
    """A real sweep with --jobs 2, SIGTERMed while its workers run: it dies (default SIGTERM),
    its workers die with it (they were left running, orphans), and a rerun redoes exactly the
    groups without rows, each group once."""
    import pickle

    cfg = replace(CFG, regularizers=("none", "l1"), optimizers=("prox",))  # 2 groups
    (tmp_path / "in.pkl").write_bytes(pickle.dumps((cfg, data)))
    out, log = tmp_path / "out", tmp_path / "log"
    with log.open("w") as f:
        child = [sys.executable, "-c", _SWEEP, str(tmp_path / "in.pkl"), str(out)]
        proc = subprocess.Popen(child, stdout=f, stderr=subprocess.STDOUT)
    try:
        workers: set[int] = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            len(workers) < 2 or " train " not in log.read_text()
        ):
            workers |= _children(proc.pid)
            time.sleep(0.05)
        assert len(workers) == 2 and proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM, log.read_text()
        assert _wait_gone(workers, 10) == set()
    finally:  # nothing left running when the test fails
        proc.kill()
        proc.wait()
        for pid in filter(_alive, workers):
            os.kill(pid, signal.SIGKILL)
    before = S.read_rows(out / "runs.csv")  # whole groups: a killed sweep tears no row
    done = {row_group_key(r) for r in before}
    assert len(before) == 3 * len(done)
    claims = [c.read_text() for c in (out / ".claims").glob("*.claim")]  # the killed sweep's
    counts = S.run_sweep(cfg, data, out, jobs=2, machine="test machine", log=io.StringIO())
    assert (counts["done_before"], counts["written"]) == (len(done), 2 - len(done)), claims
    assert counts["claimed"] == 0  # the killed sweep's claims were taken over
    rows = S.read_rows(out / "runs.csv")  # refuses a run written twice
    groups = [row_group_key(r) for r in rows]
    assert sorted(set(groups)) == ["embedded|l1|prox|0.001|1|540", "embedded|none|prox|0|1|540"]
    assert [groups.count(g) for g in set(groups)] == [3, 3]  # 2 lrs at seed 0, 1 at seed 1
    assert all(r in rows for r in before)  # the rows written before stay as they were
    assert sum(r["selected"] == "1" for r in rows) == 4


_ORPHAN = """
import os, sys, time
from pathnorm_experiments import _sweep_run as R
if sys.argv[1] == "poll":
    R._set_pdeathsig = lambda signum: False  # as where prctl is missing
parent, (r, w) = os.getpid(), os.pipe()
pid = os.fork()
if pid == 0:
    R._die_with(parent)
    os.write(w, b"armed")
    time.sleep(60)
    os._exit(0)
assert os.read(r, 5) == b"armed"
print(pid, flush=True)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc")
@pytest.mark.parametrize("how", ["prctl", "poll"])
def test_a_worker_dies_with_its_parent(how: str) -> None:
    """A worker armed by ``_die_with`` ends once its parent has: by the kernel's signal, or,
    where prctl is missing, by its thread polling the parent pid."""
    done = subprocess.run(
        [sys.executable, "-c", _ORPHAN, how], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert _wait_gone({int(done.stdout)}, 5) == set()


def test_a_rerun_adds_missing_seeds_and_refuses_another_protocol(
    data: dict[str, S.Prepared],
    tmp_path: Path,
    full_run: tuple[Path, dict[str, int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shutil.copy(full_run[0], tmp_path / "runs.csv")
    before = _by_key(tmp_path / "runs.csv")
    calls: list[tuple[str, bool, bool]] = []
    real = _sweep_run._execute

    def counting(task: Any, cfg: S.SweepConfig) -> dict[str, Any]:
        calls.append((task.spec.key, task.train, task.evaluate))
        return real(task, cfg)

    monkeypatch.setattr(_sweep_run, "_execute", counting)
    cfg = replace(CFG, regularizers=("none", "path"), optimizers=("prox",), seeds=(0, 1, 2))
    counts = S.run_sweep(cfg, data, tmp_path, machine="test machine", log=io.StringIO())
    # seed 2 at each group's recorded lr, trained and evaluated; nothing else runs again
    chosen = {row_group_key(r): r["lr"] for r in before.values() if r["selected"] == "1"}
    expected = [
        (f"embedded|{reg}|prox|{lam}|{chosen[f'embedded|{reg}|prox|{lam}|1|540']}|2|1|540", 1, 1)
        for reg, lam in (("none", "0"), ("path", "0.002"))
    ]
    assert calls == expected
    assert (counts["written"], counts["done_before"], counts["trained"]) == (2, 0, 2)
    after = _by_key(tmp_path / "runs.csv")
    assert {k: after[k] for k in before} == before and len(after) == 20
    assert all(after[k]["selected"] == "1" for k, *_ in expected)
    calls.clear()  # a rerun with fewer or the same seeds has nothing to do
    for seeds in ((0, 1, 2), (0,)):
        again = S.run_sweep(replace(cfg, seeds=seeds), data, tmp_path, log=io.StringIO())
        assert (again["written"], again["done_before"], calls) == (0, 2, [])
    # a setting that defines the runs is refused by name, before any run
    fewer = {"embedded": S.prepare(load_embedded().subset(600, 300), replace(CFG, eval_samples=50))}
    smaller = {"embedded": S.prepare(load_embedded().subset(500, 300), CFG)}
    for other, settings, message in (
        (replace(cfg, eval_samples=50), fewer, "eval_samples 100, and this sweep's eval_samples "
         "is 50 (--eval-samples): a folder holds one protocol per dataset; give --eval-samples "
         "100 to continue those runs"),
        (cfg, smaller, "n_train 540, and this sweep's n_train is 450 (the data (--data-dir)): a "
         "folder holds one protocol per dataset; use the data those runs trained on (540 "
         "training images)"),
        (replace(cfg, pgd_steps=40), data, "pgd_steps 4, and this sweep's pgd_steps is 40 "
         "(SweepConfig.pgd_steps)"),
        (replace(cfg, lrs=(0.05, 0.2)), data, "runs at lr 0.05 0.5 and this sweep selects among "
         "0.05 0.2 (--lrs)"),
        (replace(cfg, select_seeds=(0, 1)), data, "selected its lr with seeds 0 and this sweep "
         "with 0 1 (--select-seeds)"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(message)):
            S.run_sweep(other, settings, tmp_path, log=io.StringIO())
    assert calls == [] and _by_key(tmp_path / "runs.csv") == after


def test_the_cli_refuses_another_protocol_by_name(
    tmp_path: Path, full_run: tuple[Path, dict[str, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copy(full_run[0], tmp_path / "runs.csv")
    # (--stop-after 0.001: a sweep that does not refuse starts no run)
    argv = ["--datasets", "embedded", "--regularizers", "none", "--stop-after", "0.001"]
    rc = S.main([*argv, "--out", str(tmp_path), "--epochs", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {tmp_path / 'runs.csv'} holds embedded runs ")
    assert "with epochs 1, and this sweep's epochs is 2 (--epochs)" in err
    assert "give --epochs 1 to continue those runs, or give another --out" in err


def test_a_cached_run_of_another_protocol_is_redone(tmp_path: Path) -> None:
    protocol = {"batch_size": 100, "hidden": 200, "eval_samples": 100, "pgd_steps": 4}
    save_pending(tmp_path, "k", {"val_error": 1.5}, protocol)
    assert load_pending(tmp_path, "k", protocol) == {"val_error": 1.5}
    assert load_pending(tmp_path, "k", {**protocol, "eval_samples": 50}) is None
    assert load_pending(tmp_path, "other key", protocol) is None


def test_shards_add_up_to_the_unsharded_sweep(
    data: dict[str, S.Prepared], tmp_path: Path, full_run: tuple[Path, dict[str, int]]
) -> None:
    n = 3
    written = []
    for k in range(1, n + 1):
        c = S.run_sweep(
            CFG,
            data,
            tmp_path / f"machine{k}",
            shard=(k, n),
            jobs=2 if k == 1 else 1,  # the process pool too
            machine="test machine",
            log=io.StringIO(),
        )
        written.append(c["written"])
    assert sum(written) == 6 and sum(w > 0 for w in written) >= 2
    files = [tmp_path / f"machine{k}" / f"runs.shard-{k}-of-{n}.csv" for k in range(1, n + 1)]
    keys = [set(_by_key(f)) for f in files if f.is_file()]
    assert sum(len(k) for k in keys) == len(set().union(*keys))  # disjoint
    merged = tmp_path / "runs.csv"
    assert S.merge([f for f in files if f.is_file()], merged) == 18
    assert _by_key(merged) == _by_key(full_run[0])  # same rows, same values
    # merging again (the output among the inputs) is idempotent; a conflict is an error
    assert S.merge([merged, *[f for f in files if f.is_file()]], merged) == 18
    rows = S.read_rows(merged)
    rows[0]["val_error"] = "99"
    bad = tmp_path / "bad.csv"
    S.append_rows(bad, rows[:1])
    with pytest.raises(ValueError, match="appears twice with different values"):
        S.merge([merged, bad], tmp_path / "out.csv")


def _respelled(row: dict[str, str]) -> dict[str, str]:
    """``row`` with its numbers written otherwise (``0.001`` -> ``1.000000e-03``, ``0`` ->
    ``00``), as a spreadsheet may save them."""
    out = {c: f"{float(row[c]):e}" for c in ("lam", "lr")}
    return {**row, **out, **{c: f"0{row[c]}" for c in ("seed", "epochs", "n_train")}}


def test_a_run_is_one_run_however_its_numbers_are_written(
    data: dict[str, S.Prepared],
    tmp_path: Path,
    full_run: tuple[Path, dict[str, int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = S.read_rows(full_run[0])
    S.append_rows(tmp_path / "runs.csv", [_respelled(r) for r in rows])
    assert S.row_key(_respelled(rows[0])) == S.row_key(rows[0])
    calls: list[str] = []
    monkeypatch.setattr(_sweep_run, "_execute", lambda task, cfg: calls.append(task.spec.key))
    counts = S.run_sweep(CFG, data, tmp_path, log=io.StringIO())  # every group is finished
    assert (calls, counts["written"], counts["done_before"]) == ([], 0, 6)
    assert len(S.read_rows(tmp_path / "runs.csv")) == 18
    # merge keeps one row per run (the first file's spelling)
    merged = tmp_path / "merged.csv"
    assert S.merge([full_run[0], tmp_path / "runs.csv"], merged) == 18
    assert _by_key(merged) == _by_key(full_run[0])


@pytest.mark.parametrize(
    ("column", "value", "setting"),
    [("eval_samples", "50", "eval_samples 50"), ("epochs", "2", "epochs 2")],
)
def test_merge_refuses_shards_of_another_protocol(
    tmp_path: Path, full_run: tuple[Path, dict[str, int]], column: str, value: str, setting: str
) -> None:
    rows = S.read_rows(full_run[0])
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    S.append_rows(a, rows[:9])
    S.append_rows(b, [{**r, column: value} for r in rows[9:]])
    with pytest.raises(ValueError, match=re.escape(
        f"{b} holds embedded runs with {setting} and {a} with {column} {rows[0][column]}: the "
        "shards were run with other settings; merge only runs of one protocol"
    )):  # fmt: skip
        S.merge([a, b], tmp_path / "merged.csv")
    assert not (tmp_path / "merged.csv").exists()


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "x"])
def test_stop_after_must_be_positive_seconds(
    data: dict[str, S.Prepared], tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        S.main(["--datasets", "embedded", "--out", str(tmp_path), "--stop-after", value])
    assert e.value.code == 2
    message = f"argument --stop-after: expected a number of seconds > 0, got '{value}'"
    assert message in capsys.readouterr().err
    if value != "x":  # the API (and pathnorm-reproduce through it) refuses it before any run
        with pytest.raises(ValueError, match="--stop-after must be a number of seconds > 0"):
            S.run_sweep(CFG, data, tmp_path / "o", stop_after=float(value))
    assert not (tmp_path / "o").exists()


def test_merge_help_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        S.main(["merge", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: python -m pathnorm_experiments.sweep merge [-h] OUT.csv IN.csv")
    assert "The rows do not record --lrs and --select-seeds" in text


def _row(**values: Any) -> dict[str, Any]:
    """A valid unselected row of the sweep's format, with ``values`` changed."""
    row: dict[str, Any] = dict.fromkeys(S.COLUMNS, "")
    row.update(dataset="embedded", regularizer="l1", optimizer="prox", lam="0.001", lr="0.1")
    row.update(seed=0, epochs=1, n_train=5, selected=0, val_error=1.5, machine="m, with a comma")
    row.update(batch_size=100, hidden=200, eval_samples=100, pgd_steps=4, strong_restarts=1)
    row.update(values)
    return row


def test_a_last_row_without_newline_is_read_and_a_cut_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "runs.csv"
    S.append_rows(path, [_row(), _row(seed=1)])
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # whole rows, no final newline
    assert [r["seed"] for r in S.read_rows(path)] == ["0", "1"]
    assert S.merge([path], tmp_path / "merged.csv") == 2
    S.append_rows(path, [_row(seed=2)])  # on a line of its own
    rows = S.read_rows(path)
    assert [r["seed"] for r in rows] == ["0", "1", "2"] and rows[2]["machine"] == "m, with a comma"
    with path.open("a") as f:
        f.write("embedded,l1,prox,0.001,0.1,3,1,5,0,2.")  # a writer killed mid-row
    message = (
        f"{path}, line 5: 10 fields where the header has 46: column clean_error (11 of 46) and "
        "after are missing (the file ends within this row: a copy cut short?); repair or remove"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        S.read_rows(path)
    with pytest.raises(ValueError, match=re.escape(message)):  # merge: no run lost silently
        S.merge([path], tmp_path / "merged.csv")
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a results file of the sweep: 46 columns missing"):
        S.read_rows(tmp_path / "other.csv")


def test_locks_are_released_though_a_forked_process_holds_the_file(tmp_path: Path) -> None:
    """A worker forked while a lock is held inherits the open file; leaving the block must
    still release the lock (closing alone would not), or the next writer waits for ever."""
    import fcntl
    import time

    from pathnorm_experiments import runs

    lock = tmp_path / ".claims" / "lock"
    with runs._claims_locked(tmp_path):
        child = os.fork()
        if child == 0:  # the forked worker: holds the inherited descriptor a while
            try:
                time.sleep(5)
            finally:
                os._exit(0)
    try:
        with lock.open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if still held
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [_row(), _row(val_error=2.0)],  # two sweeps wrote one run
            "line 3: run embedded|l1|prox|0.001|0.1|0|1|5 is already on line 2, and a run has "
            "one row",
        ),
        # one run under another spelling of its numbers
        (
            [_row(), _row(lam="1e-03", val_error=2.0)],
            "line 3: run embedded|l1|prox|0.001|0.1|0|1|5 is already on line 2",
        ),
        (
            [_row(), _row(lr="0.10", seed="00", epochs="01", n_train="005")],
            "line 3: run embedded|l1|prox|0.001|0.1|0|1|5 is already on line 2",
        ),
        (
            [_row(regularizer="none", lam="0"), _row(regularizer="none", lam="0.0")],
            "line 3: run embedded|none|prox|0|0.1|0|1|5 is already on line 2",
        ),
        (
            [_row(selected=1, **{"robust_error@0.1": 250})],
            "line 2, column robust_error@0.1: 250 is not a percentage in [0, 100]",
        ),
        (
            [_row(), _row(seed=1, selected="yes")],
            "line 3, column selected: 'yes' is not one of 0, 1",
        ),
        ([_row(val_error="abc")], "line 2, column val_error: 'abc' is not a number"),
        (
            [_row(regularizer="l2")],
            "line 2, column regularizer: 'l2' is not one of none, l1, path, linf",
        ),
        ([_row(dataset="cifar")], "line 2, column dataset: 'cifar' is not one of embedded, mnist,"),
        ([_row(seed="1.5")], "line 2, column seed: '1.5' is not a whole number"),
        ([_row(epochs=0)], "line 2, column epochs: 0 is below 1"),
        ([_row(lr="0")], "line 2, column lr: 0 is not a finite number > 0"),
        ([_row(lam="inf")], "line 2, column lam: inf is not a finite number >= 0"),
        ([_row(path_norm=-1.0)], "line 2, column path_norm: -1 is negative"),
        (
            [_row(regularizer="none")],
            "line 2, column lam: lam 0.001 with regularizer none (lam 0 is none)",
        ),
        (
            [_row(regularizer="linf", optimizer="penalty")],
            "line 2, column optimizer: 'penalty' with linf",
        ),
        ([_row(eval_samples="")], "line 2, column eval_samples: '' is not a whole number"),
        ([_row(hidden_alive="1.5")], "line 2, column hidden_alive: '1.5' is not a whole number"),
        ([_row(hidden_alive="-1")], "line 2, column hidden_alive: '-1' is not a whole number"),
    ],
)
def test_a_bad_cell_is_refused_with_file_line_and_column(
    tmp_path: Path, rows: list[dict[str, Any]], message: str
) -> None:
    path = tmp_path / "runs.csv"
    S.append_rows(path, rows)
    with pytest.raises(ValueError, match=re.escape(f"{path}, {message}")):
        S.read_rows(path)


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        (10, "line 3: 10 fields where the header has 46: column clean_error (11 of 46) and after "
         "are missing; repair or remove the row"),
        (-1, "line 3: 47 fields where the header has 46: 1 fields more than the header's"),
    ],
)  # fmt: skip
def test_a_short_or_long_row_is_refused_with_its_line(
    tmp_path: Path, cut: int, message: str
) -> None:
    path = tmp_path / "runs.csv"
    S.append_rows(path, [_row()])
    fields = next(csv.reader([path.read_text().splitlines()[1]]))
    bad = fields[:cut] if cut > 0 else [*fields, "extra"]
    with path.open("a") as f:
        csv.writer(f, lineterminator="\n").writerow(bad)
    with pytest.raises(ValueError, match=re.escape(f"{path}, {message}")):
        S.read_rows(path)
    with pytest.raises(ValueError, match=re.escape(message)):  # merge reads the same way
        S.merge([path], tmp_path / "merged.csv")


def test_splits_are_stratified_disjoint_and_fixed() -> None:
    y = np.repeat(np.arange(10), [600, 700, 500, 800, 600, 500, 700, 600, 500, 500])
    idx = S.stratified_indices(y, 600, 3)
    assert idx.size == 600 and np.unique(idx).size == 600
    np.testing.assert_array_equal(np.bincount(y[idx]), [60, 70, 50, 80, 60, 50, 70, 60, 50, 50])
    np.testing.assert_array_equal(idx, S.stratified_indices(y, 600, 3))
    with pytest.raises(ValueError, match="sample size"):
        S.stratified_indices(y, 0, 0)
    d = load_embedded()
    p = S.prepare(d, S.SweepConfig(eval_samples=200))
    assert (p.n_train, p.x_val.shape[0], p.x_eval.shape[0]) == (4583, 417, 200)  # 5000 / 12
    # validation and training images are disjoint and together the whole training set
    seen = {r.tobytes() for r in d.x_train}
    train = {r.tobytes() for r in p.x_train.numpy()}
    val = {r.tobytes() for r in p.x_val.numpy()}
    assert not train & val and train | val == seen and len(seen) == d.x_train.shape[0]
    assert np.bincount(p.y_val.numpy()).min() >= 41


def test_hidden_alive_counts_units_with_weights_in_and_out(data: dict[str, S.Prepared]) -> None:
    """A unit counts when both its incoming row and outgoing column have a nonzero: compact
    removes the others (zero out) or folds them into the next bias (zero in)."""
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(200, 784, generator=gen), torch.randn(10, 200, generator=gen)
    b1, b2 = torch.randn(200, generator=gen), torch.randn(10, generator=gen)
    w2[:, :7] = 0  # zero outgoing
    w1[5:12] = 0  # zero incoming (5, 6: both)
    w1[20, :-1] = 0  # one incoming weight left: alive
    metrics = S.train_metrics([w1, w2], [b1, b2], data["embedded"])
    assert metrics["hidden_alive"] == 200 - 12
    w2[:] = 0  # every unit dead: compact keeps one zero unit, which is not counted
    assert S.train_metrics([w1, w2], [b1, b2], data["embedded"])["hidden_alive"] == 0


def test_a_file_without_hidden_alive_names_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "runs.csv"
    S.append_rows(path, [_row()])
    lines = path.read_text().splitlines()
    path.write_text("".join(line.rsplit(",", 1)[0] + "\n" for line in lines))
    with pytest.raises(ValueError, match=re.escape(
        "1 columns missing (hidden_alive); the file predates the column hidden_alive: append it "
        "last, empty in every row"
    )):  # fmt: skip
        S.read_rows(path)
    head, *rows = path.read_text().splitlines()
    path.write_text(
        "".join(f"{line}\n" for line in [f"{head},hidden_alive", *(f"{r}," for r in rows)])
    )
    assert [r["hidden_alive"] for r in S.read_rows(path)] == [""]  # empty: accepted


def test_divergence_is_a_row_not_a_crash(data: dict[str, S.Prepared]) -> None:
    spec = S.RunSpec("embedded", "none", "prox", 0.0, 1e30, 0, 1, data["embedded"].n_train)
    assert S.train_run(spec, data["embedded"], CFG) is None


def test_cli_skips_missing_data_and_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert S.main(["--data-dir", str(tmp_path), "--datasets", "mnist", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "skipping mnist" in err and "none of the datasets is available" in err
    assert S.main(["--datasets", "embedded", "--out", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    # none 1 + l1 16 x 2 + path 18 x 2 + linf 16 groups; 4 lrs at seed 0 + seeds 1, 2
    assert "85 groups (85 to run): 510 training runs, 255 evaluated" in out
    assert "estimate:" in out
    assert S.main(["merge", str(tmp_path / "x.csv"), str(tmp_path / "missing.csv")]) == 2
    assert "no such results file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        S.main(["--shard", "4/3"])
    with pytest.raises(ValueError, match="select_seeds"):
        S.SweepConfig(select_seeds=(7,))


@pytest.mark.parametrize(
    "setting",
    [
        {"regularizers": ("none", "none")},
        {"lrs": (0.1, 0.1)},
        {"seeds": (0, 1, 1)},
        {"lams": {**CFG.lams, "l1": (1e-3, 1e-3)}},
    ],
)
def test_a_repeated_value_is_refused(setting: dict[str, Any]) -> None:
    # seeds 0 0 crashed the sweep (KeyError) after writing a group
    with pytest.raises(ValueError, match=r"must be distinct, got \(.*\): give each value once"):
        S.SweepConfig(**setting)


def test_a_device_the_sweep_cannot_use_is_refused(
    data: dict[str, S.Prepared], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="device 'meta' is not supported: give cpu or cuda"):
        S.run_sweep(CFG, data, tmp_path / "o", device="meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ValueError, match=r"device 'cuda': torch .* sees 0 CUDA device\(s\) here: give cpu$"
    ):
        S.run_sweep(CFG, data, tmp_path / "o", device="cuda")
    assert not (tmp_path / "o").exists()


def test_help_names_merge_and_each_default_once() -> None:
    text = " ".join(S.build_parser().format_help().split())
    assert "python -m pathnorm_experiments.sweep merge OUT.csv IN.csv [IN.csv ...]" in text
    assert not re.search(r"\(default: [^)]*\) \(default:", text)  # once per option
    assert "(default: detected)" not in text
    for default in ("(default: 2000)", "(default: [0, 1, 2])", "(default: 20)"):
        assert default in text  # --eval-samples, --seeds, --epochs
