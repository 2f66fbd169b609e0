"""Run the test files in several pytest processes, ``--jobs`` at a time; print the slowest tests.

Separate processes bound the suite's memory: TensorFlow keeps every program it compiled for as
long as the process lives (9 GB over the whole suite in one process), and it cannot be made to
forget them. So each file that loads TensorFlow runs in a process of its own (or of its group,
``TF_GROUPS``), and the other files share ``2 --jobs`` processes (a process start costs a few
seconds of imports; a TensorFlow one also its first graph and XLA compilations, several seconds
more). Processes start only while the sum of their measured peaks (``PEAK``) stays within
``MEMORY_BUDGET``. The longest processes start first (``SECONDS``), so the cores stay busy to the
end. Each process's time and peak memory (resident) are printed.

    python .ci/pytest_files.py [--jobs 2] [--slowest 10] [TEST_FILE ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path

#: Test files that load TensorFlow (each gets a process of its own, or its group's).
TF_FILES = ("test_tf_", "test_spec_tf", "test_cross_backend", "test_train_cli", "test_backend_")
#: TensorFlow files that share one process, group by group, in this order: each alone would pay
#: TensorFlow's imports and first compilations for a few seconds of tests (the first group), or
#: their memory together stays within a process's share of MEMORY_BUDGET. A process of files
#: that never load torch loads neither torch nor Triton (tests/conftest.py: TORCH_FREE).
TF_GROUPS = (
    ("test_tf_private_api.py", "test_backend_compaction_keras.py", "test_tf_compact.py",
     "test_tf_layers.py", "test_backend_agreement.py", "test_backend_scalars.py"),
    ("test_spec_tf.py", "test_tf_functional.py"),
    ("test_tf_metrics.py", "test_tf_edge_cases.py"),
)  # fmt: skip
#: Files run as several processes (``--shard K/N``, tests/conftest.py), each compiling less.
SHARDS = {"test_tf_optimizers.py": 2}
#: Peak resident memory (GiB) of one process of a file, or of one shard (``"<file> K/N"``), or of
#: a group (by its first file), as this script printed it; other TensorFlow files count as
#: TF_PEAK, the groups of other files as OTHER_PEAK.
PEAK = {
    "test_tf_optimizers.py 0/2": 1.55,
    "test_tf_optimizers.py 1/2": 2.3,
    "test_cross_backend.py": 2.35,
    "test_spec_tf.py": 2.5,  # with test_tf_functional
    "test_tf_metrics.py": 2.35,  # with test_tf_edge_cases
    "test_tf_band_fast.py": 1.6,
    "test_tf_private_api.py": 1.65,  # the first group
    "test_train_cli.py": 1.35,
}
TF_PEAK, OTHER_PEAK = 1.8, 1.2
#: Seconds one process of a file (or shard, or group) took, as this script printed it on a quiet
#: 2-core machine (the TensorFlow groups and shards: 0.8 times their CPU seconds run alone): the
#: longest start first, so that no long one is left running alone at the end.
#: Other TensorFlow files count as TF_SECONDS; the groups of other files by their size.
SECONDS = {
    "test_tf_optimizers.py 0/2": 63,
    "test_tf_optimizers.py 1/2": 82,
    "test_spec_tf.py": 84,  # with test_tf_functional
    "test_tf_band_fast.py": 80,
    "test_cross_backend.py": 70,
    "test_tf_metrics.py": 67,  # with test_tf_edge_cases
    "test_train_cli.py": 37,
    "test_tf_private_api.py": 32,  # the first group
    # the groups of other files, by their first file
    "test_prox_methods.py": 76,
    "test_callbacks.py": 66,
    "test_shared_spec.py": 49,
    "test_sweep.py": 44,
}
TF_SECONDS = 40
#: Processes start only while the sum of their peaks stays within this (GiB).
MEMORY_BUDGET = 4.0

Group = tuple[list[Path], str | None]  # files, shard


def groups(files: list[Path], jobs: int) -> list[Group]:
    """The processes to run, largest first: one per TensorFlow group, file or shard of a file,
    ``2 jobs`` for the rest."""
    files = sorted(files, key=lambda f: f.stat().st_size, reverse=True)
    tf: list[Group] = []
    for names in TF_GROUPS:
        group = sorted((f for f in files if f.name in names), key=lambda f: names.index(f.name))
        if group:
            tf.append((group, None))
    grouped = {name for names in TF_GROUPS for name in names}
    for f in (f for f in files if f.name.startswith(TF_FILES) and f.name not in grouped):
        n = SHARDS.get(f.name, 1)
        tf += [([f], f"{k}/{n}" if n > 1 else None) for k in range(n)]
    rest: list[list[Path]] = [[] for _ in range(2 * jobs)]  # smaller: they fill in beside TF
    for i, f in enumerate(f for f in files if not f.name.startswith(TF_FILES)):
        rest[i % len(rest)].append(f)
    return sorted([*tf, *((g, None) for g in rest if g)], key=_seconds, reverse=True)


def _measured(table: Mapping[str, float], group: Group) -> float | None:
    """The group's entry in ``table``: its shard's (``"<file> K/N"``), else its first file's."""
    name = group[0][0].name
    return table.get(f"{name} {group[1]}", table.get(name))


def _seconds(group: Group) -> float:
    """The expected time of a process: as measured (``SECONDS``), else TF_SECONDS for a
    TensorFlow file and about 1 s per 2.5 kB of tests for a group of other files."""
    files = group[0]
    measured = _measured(SECONDS, group)
    if measured is not None:
        return measured
    if files[0].name.startswith(TF_FILES):
        return TF_SECONDS
    return sum(f.stat().st_size for f in files) / 2500


def _is_tf(group: Group) -> bool:
    return group[0][0].name.startswith(TF_FILES)


def _peak(group: Group) -> float:
    return (_measured(PEAK, group) or TF_PEAK) if _is_tf(group) else OTHER_PEAK


def run(queue: list[Group], jobs: int, report_dir: Path) -> list[str]:
    """Run the groups, at most ``jobs`` at once and within the memory budget (the largest
    group that fits starts first); print each one's time and peak memory; return the names of
    those that failed."""
    running: dict[str, tuple[subprocess.Popen[bytes], float, float]] = {}
    failed: list[str] = []
    pending = list(enumerate(queue))
    while pending or running:
        while pending and len(running) < jobs:
            used = sum(peak for _, _, peak in running.values())
            fits = [k for k, (_, g) in enumerate(pending) if used + _peak(g) <= MEMORY_BUDGET]
            if not fits and running:
                break
            i, group = pending.pop(fits[0] if fits else 0)
            files, shard = group
            name = f"{i:02d}-{files[0].stem}" + (f"+{len(files) - 1}" if len(files) > 1 else "")
            name += f"-{shard.replace('/', 'of')}" if shard else ""
            xml, log = report_dir / f"{name}.xml", report_dir / f"{name}.log"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, files)]
            cmd += ["--shard", shard] if shard else []
            with open(log, "wb") as out:
                proc = subprocess.Popen([*cmd, f"--junitxml={xml}"], stdout=out, stderr=out)
            running[name] = (proc, time.monotonic(), _peak(group))
        time.sleep(0.2)
        for name, (proc, start, _) in list(running.items()):
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == 0:
                continue
            del running[name]
            code = os.waitstatus_to_exitcode(status)
            lines = (report_dir / f"{name}.log").read_text(errors="replace").splitlines()
            summary = next((ln for ln in reversed(lines) if ln.strip()), "(no output)")
            took, peak = time.monotonic() - start, usage.ru_maxrss / 2**20  # KiB -> GiB
            print(f"{name} ({took:.0f} s, {peak:.2f} GiB): {summary.strip('= ')}", flush=True)
            if code not in (0, 5):  # 5: nothing collected
                failed.append(name)
                print("\n".join(lines[-60:]), flush=True)
    return failed


def slowest(report_dir: Path, count: int) -> list[tuple[float, str]]:
    """The ``count`` slowest test cases over all JUnit reports."""
    cases = []
    for xml in report_dir.glob("*.xml"):
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            cases.append((float(case.get("time", 0.0)), name))
    return sorted(cases, reverse=True)[:count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--slowest", type=int, default=10)
    args = parser.parse_args(argv)
    files = args.files or sorted(Path("tests").glob("test_*.py"))
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pathnorm-ci-") as tmp:
        jobs = max(1, args.jobs)
        failed = run(groups(files, jobs), jobs, Path(tmp))
        print(f"\n{args.slowest} slowest tests:")
        for seconds, name in slowest(Path(tmp), args.slowest):
            print(f"{seconds:8.2f} s  {name}")
    print(
        f"\n{len(files)} test files in {time.monotonic() - start:.0f} s; failed: {failed or 'none'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
