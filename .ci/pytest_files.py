"""Run the test files in several pytest processes, ``--jobs`` at a time; print the slowest tests.

Separate processes bound the suite's memory: TensorFlow keeps every program it compiled for as
long as the process lives (9 GB over the whole suite in one process), and it cannot be made to
forget them. So each file that loads TensorFlow runs in a process of its own, and the other
files share ``--jobs`` processes (a process start costs a few seconds of imports). Largest
groups start first, so the cores stay busy to the end.

    python .ci/pytest_files.py [--jobs 2] [--slowest 10] [TEST_FILE ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

#: Test files that load TensorFlow (each gets a process of its own).
TF_FILES = ("test_tf_", "test_spec_tf", "test_cross_backend", "test_train_cli", "test_backend_")


def groups(files: list[Path], jobs: int) -> list[list[Path]]:
    """The processes to run, largest first: one per TensorFlow file, ``jobs`` for the rest."""
    files = sorted(files, key=lambda f: f.stat().st_size, reverse=True)
    tf = [[f] for f in files if f.name.startswith(TF_FILES)]
    rest: list[list[Path]] = [[] for _ in range(jobs)]
    for i, f in enumerate(f for f in files if not f.name.startswith(TF_FILES)):
        rest[i % jobs].append(f)
    size = lambda g: sum(f.stat().st_size for f in g)  # noqa: E731
    return sorted([*tf, *(g for g in rest if g)], key=size, reverse=True)


def run(queue: list[list[Path]], jobs: int, report_dir: Path) -> list[str]:
    """Run the groups, at most ``jobs`` at once; return the names of those that failed."""
    running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
    failed: list[str] = []
    pending = list(enumerate(queue))
    while pending or running:
        while pending and len(running) < jobs:
            i, group = pending.pop(0)
            name = f"{i:02d}-{group[0].stem}" + (f"+{len(group) - 1}" if len(group) > 1 else "")
            xml, log = report_dir / f"{name}.xml", report_dir / f"{name}.log"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, group)]
            with open(log, "wb") as out:
                proc = subprocess.Popen([*cmd, f"--junitxml={xml}"], stdout=out, stderr=out)
            running[name] = (proc, time.monotonic())
        time.sleep(0.2)
        for name, (proc, start) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            lines = (report_dir / f"{name}.log").read_text(errors="replace").splitlines()
            summary = next((ln for ln in reversed(lines) if ln.strip()), "(no output)")
            print(f"{name} ({time.monotonic() - start:.0f} s): {summary.strip('= ')}", flush=True)
            if proc.returncode not in (0, 5):  # 5: nothing collected
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
