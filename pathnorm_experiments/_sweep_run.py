"""The sweep's runner: the worker processes, the scheduler that moves each lr-selection group
from its selection runs to its seeds at the selected lr, and :func:`run_sweep` (the protocol:
:mod:`pathnorm_experiments.sweep`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import math
import multiprocessing
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pathnorm_experiments._sweep_grid import (
    Group,
    GroupState,
    Prepared,
    RunSpec,
    SweepConfig,
    build_groups,
    group_rows,
    protocol,
    resume_state,
    select_lr,
)
from pathnorm_experiments._sweep_train import evaluate_run, train_metrics, train_run
from pathnorm_experiments.runs import (
    append_rows,
    claim_group,
    folder_rows,
    load_pending,
    pending_path,
    protocol_clash,
    release_group,
    results_path,
    row_group_key,
    save_pending,
)
from pathnorm_experiments.settings import float_key

__all__ = ["check_device", "default_machine", "pending_groups", "run_sweep"]


# ---------------------------------------------------------------- worker side

_DATA: dict[str, Prepared] = {}  # set in the parent before the workers fork


@dataclass(frozen=True)
class _Task:
    spec: RunSpec
    train: bool  # False: evaluate the given weights
    evaluate: bool  # False: a selection run, its weights returned for the selected lr's evaluation
    weights: tuple[list[np.ndarray], list[np.ndarray]] | None = None


def _worker_init(
    device: str, data: Mapping[str, Prepared] | None = None, parent: int | None = None
) -> None:
    """One thread; the datasets (inherited through fork, or passed to a spawned worker) on
    ``device``. A pool's worker (``parent``: the sweep's pid) dies with the sweep."""
    if parent is not None:
        _die_with(parent)
    torch.set_num_threads(1)
    if data is not None:
        _DATA.clear()
        _DATA.update(data)
    if device != "cpu":
        for name, p in list(_DATA.items()):
            _DATA[name] = Prepared(p.name, *(getattr(p, f).to(device) for f in _TENSOR_FIELDS))


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with(parent: int) -> None:
    """End this worker as soon as the sweep ``parent`` ends, however it ends (SIGTERM, SIGKILL,
    an error): on Linux the kernel sends it SIGKILL (``PR_SET_PDEATHSIG``), elsewhere a daemon
    thread polls the parent pid. A worker writes no file (the sweep writes rows and caches), so
    being killed costs only its current run, which a resumed sweep redoes.

    The kernel's signal follows the thread that forked the worker: the one that calls
    :func:`run_sweep` (``submit`` starts the workers), which outlives the pool."""
    if not _set_pdeathsig(signal.SIGKILL):
        watch = threading.Thread(target=_exit_with, args=(parent,), name="die-with-sweep")
        watch.daemon = True
        watch.start()
    if os.getppid() != parent:  # the sweep ended before the worker was armed
        os._exit(1)


def _set_pdeathsig(signum: int) -> bool:
    """Ask the kernel to send this process ``signum`` when its parent ends; False where
    ``prctl`` is not available (not Linux) or refuses."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
    return bool(prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0)


def _exit_with(parent: int, interval: float = 0.5) -> None:
    """Exit this process once it is no longer the child of ``parent`` (re-parented when the
    sweep ends)."""
    while os.getppid() == parent:
        time.sleep(interval)
    os._exit(1)


_TENSOR_FIELDS = ("x_train", "y_train", "x_val", "y_val", "x_eval", "y_eval", "x_test", "y_test")


def _execute(task: _Task, cfg: SweepConfig) -> dict[str, Any]:
    """Run one task in a worker: the run's metrics (and weights when asked)."""
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
    else:
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


# ---------------------------------------------------------------- the scheduler


def check_device(device: str) -> None:
    """Refuse (ValueError) a device the sweep cannot use: it takes cpu, or cuda[:i] where
    torch sees that GPU."""
    try:
        kind, index = torch.device(device).type, torch.device(device).index or 0
    except RuntimeError:
        kind, index = "?", 0
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported: give cpu or cuda[:i]")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "cuda" and index >= n:
        raise ValueError(
            f"device {device!r}: torch {torch.__version__} sees {n} CUDA device(s) here: give "
            + (f"cpu or cuda:0 to cuda:{n - 1}" if n else "cpu")
        )


def default_machine(device: str = "cpu") -> str:
    """This machine, briefly, for the ``machine`` column."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"cuda {torch.cuda.get_device_name()}, torch {torch.__version__}"
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"cpu {model} ({os.cpu_count()} cores), torch {torch.__version__}"


class _Written:
    """The rows of a folder's results files (``runs*.csv``), read again when a file changed."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._stamp: tuple[tuple[str, int, int], ...] | None = None
        self._files: list[tuple[Path, list[dict[str, str]]]] = []
        self._by_group: dict[str, list[dict[str, str]]] = {}

    def files(self) -> list[tuple[Path, list[dict[str, str]]]]:
        """Every results file of the folder with its rows."""
        paths = sorted(self.out.glob("runs*.csv")) if self.out.is_dir() else []
        stamp = tuple((str(q), st.st_size, st.st_mtime_ns) for q in paths for st in [q.stat()])
        if stamp != self._stamp:
            self._files = folder_rows(self.out)
            self._by_group = {}
            for _, rows in self._files:
                for r in rows:
                    self._by_group.setdefault(row_group_key(r), []).append(r)
            self._stamp = stamp
        return self._files

    def group(self, key: str) -> list[dict[str, str]]:
        """The rows of the group ``key``, as the files hold them now."""
        self.files()
        return self._by_group.get(key, [])


# how a protocol column is set, for the message that refuses a mismatch
_SETTING = {
    "epochs": "--epochs",
    "n_train": "the data (--data-dir)",
    "eval_samples": "--eval-samples",
    "batch_size": "SweepConfig.batch_size",
    "hidden": "SweepConfig.hidden",
    "pgd_steps": "SweepConfig.pgd_steps",
    "strong_restarts": "SweepConfig.strong_restarts",
}


def _check_protocol(
    written: _Written,
    cfg: SweepConfig,
    data: Mapping[str, Prepared],
    settings: Mapping[str, Mapping[str, int]],
) -> None:
    """Raise ValueError (naming the file, the setting, both values and what to do) for rows of
    a dataset of this sweep made with other epochs, training-set size or :func:`protocol`."""
    for path, rows in written.files():
        for ds, mine in settings.items():
            expected = {"epochs": cfg.epochs, "n_train": data[ds].n_train, **mine}
            clash = protocol_clash(rows, ds, expected)
            if clash is None:
                continue
            col, theirs = clash
            how = _SETTING[col]
            if col == "n_train":
                fix = f"use the data those runs trained on ({theirs} training images)"
            else:
                fix = f"give {how} {theirs}" if how.startswith("--") else f"set {how} = {theirs}"
            raise ValueError(
                f"{path} holds {ds} runs with {col} {theirs}, and this sweep's {col} is "
                f"{expected[col]} ({how}): a folder holds one protocol per dataset; {fix} to "
                "continue those runs, or give another --out"
            )


class _Scheduler:
    """The tasks of a sweep's unfinished groups, the earliest group's first.

    A group is claimed when its first task is about to start, so two sweeps of one folder share
    the groups; one claimed by a live sweep is skipped. A group moves on when nothing of it
    runs: after its selection runs its lr is selected and that lr's other seeds queued; after
    those its rows are written, its cache emptied and its claim dropped."""

    def __init__(
        self,
        cfg: SweepConfig,
        out: Path,
        results: Path,
        plan: Pending,
        counts: dict[str, int],
        machine: str,
        log: Any,
    ) -> None:
        self.cfg, self.out, self.results = cfg, out, results
        self.counts, self.machine, self.log = counts, machine, log
        self.settings, self.written = plan.settings, plan.written
        self.t_start = time.perf_counter()
        self.todo = list(plan.todo)  # in order; claimed one at a time by _activate
        self.next = 0
        self.active: dict[int, GroupState] = {}
        self.held: set[str] = set()  # the keys of the groups this sweep claimed
        self.ready: list[tuple[int, _Task]] = []  # (group index, task): the earliest groups first

    def _activate(self) -> bool:
        """Claim the next group that needs work and queue its first tasks (one whose runs were
        all cached is written at once); False when no group is left."""
        while self.next < len(self.todo):
            planned = self.todo[self.next]
            self.next += 1
            key = planned.group.key
            holder = claim_group(self.out, key)
            if holder is not None:
                self.counts["claimed"] += 1
                print(f"  {key}: skipped, claimed by another sweep ({holder})", file=self.log)
                continue
            self.held.add(key)
            # rows written since the plan (by another sweep) count: resume the whole group
            cfg = self.cfg
            full = replace(planned.group, seeds=tuple(cfg.seeds), select_seeds=cfg.select_seeds)
            st = resume_state(full, self.written.group(key), planned.index)
            if st is None:
                self._release(key)
                self.counts["done_before"] += 1
                self.counts["remaining"] -= 1
                continue
            self.active[st.index] = st
            if st.phase == "select":
                for spec in st.group.selection_runs():
                    if not self._take_pending(st, spec):
                        self._queue(st, _Task(spec, True, False))
            else:
                assert st.selected_lr is not None
                self._queue_selected(st, st.selected_lr)
            self.advance(st)
            return True
        return False

    def _release(self, key: str) -> None:
        release_group(self.out, key)
        self.held.discard(key)

    def release_all(self) -> None:
        """Drop every claim still held (the groups left unfinished)."""
        for key in list(self.held):
            self._release(key)

    def _take_pending(self, st: GroupState, spec: RunSpec) -> bool:
        """Take the run's result from the pending cache; False if not there."""
        cached = load_pending(self.out, spec.key, self.settings[spec.dataset])
        if cached is None:
            return False
        st.results[spec.key] = {**cached, "_lr": spec.lr, "_seed": spec.seed}
        return True

    def _queue(self, st: GroupState, task: _Task) -> None:
        self.ready.append((st.index, task))
        st.waiting.add(task.spec.key)

    def run(self, pool: Any, jobs: int, stop_after: float | None) -> None:
        """Run the tasks on ``pool``, ``jobs`` at a time; none starts after ``stop_after`` s."""
        running: dict[cf.Future[Any], tuple[GroupState, _Task]] = {}
        while True:
            elapsed = time.perf_counter() - self.t_start
            stopping = stop_after is not None and elapsed > stop_after
            while len(running) < jobs and not stopping:
                if not self.ready and not self._activate():
                    break
                if self.ready:
                    idx, task = self.ready.pop(0)
                    fut = pool.submit(_execute, task, self.cfg)
                    running[fut] = (self.active[idx], task)
            if not running:
                break
            finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                st, task = running.pop(fut)
                self._record(st, task, fut.result())
                self.advance(st)

    def _record(self, st: GroupState, task: _Task, res: dict[str, Any]) -> None:
        """Merge a finished task's result into its group's, cache it, and log it."""
        spec = task.spec
        prev = st.results.get(spec.key, {})
        merged = {**prev, **res, "_lr": spec.lr, "_seed": spec.seed}
        if not task.train:
            merged["seconds"] = prev.get("seconds", 0.0) + res["seconds"]
        st.results[spec.key] = merged
        self.counts["trained"] += task.train
        self.counts["evaluated"] += task.evaluate
        kept = {k: v for k, v in merged.items() if k[0] != "_"}
        save_pending(self.out, spec.key, kept, self.settings[spec.dataset])
        st.waiting.discard(spec.key)
        print(
            f"  {spec.key}: {'train' if task.train else ''}"
            f"{'+eval' if task.evaluate else ''} {res['seconds']:.1f} s"
            f"{' DIVERGED' if res.get('diverged') else ''}"
            + ("" if "val_error" not in res else f" val {res['val_error']:.2f}%"),
            file=self.log,
            flush=True,
        )

    def advance(self, st: GroupState) -> None:
        """Move a group on when nothing of it is running: select, then finish."""
        if st.waiting:
            return
        if st.phase == "select":
            st.phase = "final"
            st.selected_lr = select_lr(st)
            if st.selected_lr is not None:
                self._queue_selected(st, st.selected_lr)
            if st.waiting:
                return
        self._write(st)

    def _queue_selected(self, st: GroupState, lr: float) -> None:
        """Queue the runs at the selected ``lr`` not done before an interruption: the selection
        seeds' kept weights are evaluated, the other seeds trained and evaluated."""
        g = st.group
        for seed in g.seeds:
            spec = g.run(lr, seed)
            if seed in g.select_seeds:
                res = st.results[spec.key]
                if "robust_error@" + float_key(self.cfg.eps[0]) in res:
                    continue  # evaluated before an interruption
                task = _Task(spec, False, True, weights=res["weights"])
            elif self._take_pending(st, spec):
                continue
            else:
                task = _Task(spec, True, True)
            self._queue(st, task)
        self.ready.sort(key=lambda t: t[0])

    def _write(self, st: GroupState) -> None:
        """Append the group's rows, drop its pending cache, and log it."""
        g = st.group
        append_rows(self.results, group_rows(st, self.machine, self.settings[g.dataset]))
        for key in st.results:
            pending_path(self.out, key).unlink(missing_ok=True)
        self._release(g.key)
        del self.active[st.index]
        counts = self.counts
        counts["written"] += 1
        counts["remaining"] -= 1
        what = "selected" if st.group.select_seeds else f"selected before; seeds {g.seeds} added"
        print(
            f"[{counts['done_before'] + counts['written']}/{counts['groups']}] {g.key}: "
            f"lr {st.selected_lr} {what} ({time.perf_counter() - self.t_start:.0f} s)",
            file=self.log,
            flush=True,
        )


@dataclass(frozen=True)
class Pending:
    """A sweep's groups (of its shard) and what the folder's rows leave of them to run."""

    groups: list[Group]
    todo: list[GroupState]
    settings: dict[str, dict[str, int]]  # per dataset: the protocol columns (:func:`protocol`)
    written: _Written


def pending_groups(
    cfg: SweepConfig, data: Mapping[str, Prepared], out: Path, shard: tuple[int, int] | None
) -> Pending:
    """The grid's groups of the datasets in ``data`` (of shard K of N, if given), in order, and
    what the rows of ``out`` leave of them (see :func:`resume_state`).

    Raises:
        ValueError: the folder's results are unreadable, hold a dataset's runs made with other
            settings, or a group selected among other lrs or selection seeds.
    """
    groups = build_groups(cfg, {k: v.n_train for k, v in data.items()})
    if shard is not None:
        groups = [g for g in groups if g.shard(shard[1]) == shard[0] - 1]
    settings = {name: protocol(cfg, int(p.x_eval.shape[0])) for name, p in data.items()}
    written = _Written(out)
    _check_protocol(written, cfg, data, settings)
    todo: list[GroupState] = []
    for g in groups:
        st = resume_state(g, written.group(g.key), len(todo))
        if st is not None:
            todo.append(st)
    return Pending(groups, todo, settings, written)


def _start_pool(jobs: int, device: str, start_method: str, data: Mapping[str, Prepared]) -> Any:
    """The workers: this process for one job, else a pool of ``jobs`` processes."""
    if jobs == 1:
        _worker_init(device)
        return _InlineExecutor()
    return cf.ProcessPoolExecutor(
        jobs,
        mp_context=multiprocessing.get_context(start_method),
        initializer=_worker_init,
        # fork shares the parent's tensors; a spawned worker (CUDA cannot be used in a
        # forked child once the parent initialised it) gets its own copy
        # the sweep's pid: a worker dies with the sweep (it was left running, an orphan)
        initargs=(device, None if start_method == "fork" else dict(data), os.getpid()),
    )


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
        data: the prepared datasets by name (datasets of ``cfg`` missing here are skipped).
        out: the results directory (``runs.csv``, or ``runs.shard-K-of-N.csv``; ``.pending/``).
        jobs: worker processes (1: in this process).
        shard: ``(K, N)``: only the groups of shard K (1-based) of N.
        machine: the ``machine`` column (default: :func:`default_machine`).
        device: ``"cpu"`` or a CUDA device for the workers' tensors.
        stop_after: seconds (> 0) after which no new task starts (the running ones finish).
        log: a text stream for progress lines (default stdout).
        start_method: how workers start (default: ``fork`` on CPU, ``spawn`` on CUDA).

    Returns:
        Counts: ``groups`` (in this shard), ``done_before``, ``written`` (groups written or
        given their missing seeds now), ``remaining``, ``claimed`` (skipped: another sweep of
        this folder runs them), ``trained`` and ``evaluated`` (runs, now).

    Raises:
        ValueError: as :func:`pending_groups` or :func:`check_device`, before any run.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if stop_after is not None and not (math.isfinite(stop_after) and stop_after > 0):
        raise ValueError(f"--stop-after must be a number of seconds > 0, got {stop_after}")
    check_device(device)
    if shard is not None and not 1 <= shard[0] <= shard[1]:
        raise ValueError(f"shard must be K/N with 1 <= K <= N, got {shard[0]}/{shard[1]}")
    log = log or sys.stdout
    if start_method is None:
        start_method = "fork" if device == "cpu" else "spawn"
    machine = machine or default_machine(device)
    out.mkdir(parents=True, exist_ok=True)
    plan = pending_groups(cfg, data, out, shard)
    counts = {
        "groups": len(plan.groups),
        "done_before": len(plan.groups) - len(plan.todo),
        "written": 0,
        "remaining": len(plan.todo),
        "claimed": 0,
        "trained": 0,
        "evaluated": 0,
    }
    if not plan.todo:
        return counts
    _DATA.clear()
    _DATA.update(data)
    pool = _start_pool(jobs, device, start_method, data)
    scheduler = _Scheduler(cfg, out, results_path(out, shard), plan, counts, machine, log)
    try:
        scheduler.run(pool, jobs, stop_after)
    finally:
        scheduler.release_all()
        pool.shutdown(wait=True)
    return counts
