"""The main job's outputs: the training trajectory and the result files (JSON + CSV)."""

from __future__ import annotations

import csv
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pathnorm_experiments.settings import float_key

__all__ = ["History", "unwritable_dir", "write_results"]


@dataclass
class History:
    """Training trajectory: one record every ``log_every`` iterations and per epoch."""

    iteration: list[int] = field(default_factory=list)
    batch_objective: list[float] = field(default_factory=list)  # mean over the last records
    nonzero_pct: list[float] = field(default_factory=list)
    effective_nonzero_pct: list[float] = field(default_factory=list)  # on live paths only
    epoch_objective: list[float] = field(default_factory=list)  # on eval_train_samples


def unwritable_dir(out: str | Path) -> str | None:
    """Why files cannot be written in the directory ``out`` (made if missing), in words, else
    None. The check writes a temporary file (or directory) and removes it."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        return "is a file, not a directory"
    existing = out
    while not existing.exists():  # the nearest existing ancestor: the directories go under it
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, so no directory can be made under it"
    try:  # os.access says yes to root even on a read-only mount: try a real write
        if existing == out:
            with tempfile.TemporaryFile(dir=out):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as e:
        return f"cannot write in {existing} ({e.strerror or e})"
    return None


def write_results(result: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    """Write a :func:`~pathnorm_experiments.evaluation.build_result` result as
    ``<out>/results.json`` and the per-eps table ``<out>/results.csv`` (``out`` made if
    missing); returns their paths.

    The CSV's error columns but the last share the attacked test images (``n_attacked``), so
    ``clean_error_attacked <= robust_error <= certified_error`` (and ``<=
    certified_error_interval``) on every row; the last is the clean error on all test images.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jpath, cpath = out / "results.json", out / "results.csv"
    jpath.write_text(json.dumps(result, indent=2) + "\n")
    clean, clean_all = result["clean_error_attacked"], result["clean_error"]
    columns = ("robust_error", "certified_error", "certified_error_interval")
    with cpath.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["eps", "clean_error_attacked", *columns, "clean_error"])
        w.writerow([0.0, clean, clean, clean, clean, clean_all])
        for e in result["config"]["eps"]:
            w.writerow([e, clean, *(result[c][float_key(e)] for c in columns), clean_all])
    return jpath, cpath
