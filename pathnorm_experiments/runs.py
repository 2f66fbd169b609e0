"""The sweep's results on disk: the columns of ``runs.csv``, run and group keys, locked
appends, reading, summarizing and merging result files, and the cache of pending runs.

One CSV row per training run; a group's rows (one lr selection) are appended together, so a
group with a row in any results file of a directory is done. A finished run of an unfinished
group waits in ``<out>/.pending/`` (its metrics, and its weights when they are needed again).
NumPy only (no torch import), so the report reads results without the training stack.
"""

from __future__ import annotations

import csv
import fcntl
import hashlib
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pathnorm_experiments.config import float_key

__all__ = [
    "COLUMNS",
    "EPS",
    "KEY_COLUMNS",
    "REGULARIZERS",
    "append_rows",
    "done_groups",
    "join_key",
    "load_pending",
    "merge",
    "pending_path",
    "read_rows",
    "results_path",
    "row_group_key",
    "row_key",
    "save_pending",
    "summarize",
]

EPS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3)
REGULARIZERS = ("none", "l1", "path", "linf")  # the grid's order, which merge sorts by
KEY_COLUMNS = ("dataset", "regularizer", "optimizer", "lam", "lr", "seed", "epochs", "n_train")


def _eps_columns(eps: Sequence[float]) -> list[str]:
    return [
        f"{kind}@{float_key(e)}"
        for kind in (
            "robust_error",
            "robust_error_strong",
            "certified_lipschitz",
            "certified_interval",
        )
        for e in eps
    ]


COLUMNS = (
    *KEY_COLUMNS,
    "selected",
    "val_error",
    "clean_error",
    "clean_error_full",
    *_eps_columns(EPS),
    "nonzero",
    "nonzero_live",
    "path_norm",
    "machine",
)


def join_key(*parts: str) -> str:
    """A run or group key: its parts, as the CSV writes them, joined by ``|``."""
    return "|".join(parts)


def row_key(row: Mapping[str, str]) -> str:
    """The run key of a CSV row (its key columns joined by ``|``)."""
    return join_key(*(str(row[c]) for c in KEY_COLUMNS))


def row_group_key(row: Mapping[str, str]) -> str:
    """The lr-selection group key of a CSV row (its run key without lr and seed)."""
    return join_key(
        row["dataset"],
        row["regularizer"],
        row["optimizer"],
        row["lam"],
        row["epochs"],
        row["n_train"],
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.10g}"
    return str(value)


def append_rows(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Append ``rows`` to the CSV ``path`` in one locked, flushed write (header if new).

    A torn last line (a writer killed mid-write) is cut off first, so the file always holds
    whole rows.

    Args:
        path: the CSV file (made with its parents if missing).
        rows: rows with the keys of :data:`COLUMNS`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    for row in rows:
        writer.writerow({c: _fmt(row[c]) for c in COLUMNS})
    with path.open("a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size:
                f.seek(0)
                content = f.read()
                cut = content.rfind(b"\n") + 1
                if cut != size:
                    f.truncate(cut)
                    size = cut
            head = "" if size else ",".join(COLUMNS) + "\n"
            f.seek(0, os.SEEK_END)
            f.write((head + buf.getvalue()).encode())
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a results CSV (a torn last line is ignored); [] if the file is missing.

    Raises:
        ValueError: the header is not :data:`COLUMNS`.
    """
    if not path.is_file():
        return []
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    if not text:
        return []
    reader = csv.DictReader(io.StringIO(text))
    if tuple(reader.fieldnames or ()) != COLUMNS:
        raise ValueError(
            f"{path}: the header is not the sweep's columns (expected {len(COLUMNS)} columns "
            f"starting {COLUMNS[:3]}, got {reader.fieldnames}); move the file away or merge it"
        )
    return list(reader)


def summarize(
    rows: Sequence[Mapping[str, str]],
) -> dict[tuple[str, str, str, float], dict[str, Any]]:
    """The selected runs of each (dataset, regularizer, optimizer, lam), over their seeds.

    Args:
        rows: rows of :func:`read_rows`.

    Returns:
        Per group: ``lr`` (the selected one), ``seeds``, ``n_train`` and, for every numeric
        column, ``(mean, min, max)`` over the seeds (the spread a verdict should carry);
        empty cells (diverged runs) are left out of the statistics.
    """
    groups: dict[tuple[str, str, str, float], list[Mapping[str, str]]] = {}
    for r in rows:
        if r["selected"] == "1":
            key = (r["dataset"], r["regularizer"], r["optimizer"], float(r["lam"]))
            groups.setdefault(key, []).append(r)
    numeric = [c for c in COLUMNS[COLUMNS.index("val_error") :] if c != "machine"]
    out: dict[tuple[str, str, str, float], dict[str, Any]] = {}
    for key, rs in sorted(groups.items()):
        stats: dict[str, Any] = {
            "lr": float(rs[0]["lr"]),
            "seeds": sorted(int(r["seed"]) for r in rs),
            "n_train": int(rs[0]["n_train"]),
        }
        for c in numeric:
            vals = [float(r[c]) for r in rs if r[c] not in ("", "nan")]
            if vals:
                stats[c] = (float(np.mean(vals)), min(vals), max(vals))
        out[key] = stats
    return out


def merge(inputs: Sequence[Path], output: Path) -> int:
    """Join result files by run key into ``output`` (sorted by the key columns).

    Rows of one key that agree apart from ``machine`` are kept once. Rows of one key that
    differ are an error: two machines produced different numbers for the same run.

    Args:
        inputs: CSV files (``output`` may be among them).
        output: the merged file, written atomically.

    Returns:
        The number of rows written.
    """
    rows: dict[str, dict[str, str]] = {}
    for p in inputs:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such results file")
        for r in read_rows(p):
            k = row_key(r)
            old = rows.get(k)
            if old is None:
                rows[k] = r
            elif any(old[c] != r[c] for c in COLUMNS if c != "machine"):
                diff = [c for c in COLUMNS if c != "machine" and old[c] != r[c]]
                raise ValueError(
                    f"run {k} appears twice with different values ({', '.join(diff[:5])}; "
                    f"machines {old['machine']!r} and {r['machine']!r}); keep one file's row"
                )

    def order(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return (
            r["dataset"],
            REGULARIZERS.index(r["regularizer"]),
            r["optimizer"],
            float(r["lam"]),
            float(r["lr"]),
            int(r["seed"]),
            int(r["epochs"]),
        )

    tmp = output.with_name(output.name + ".tmp")
    tmp.unlink(missing_ok=True)
    append_rows(tmp, sorted(rows.values(), key=order))
    if not rows:
        tmp.write_text(",".join(COLUMNS) + "\n")
    os.replace(tmp, output)
    return len(rows)


def results_path(out: Path, shard: tuple[int, int] | None) -> Path:
    """The results file of ``out``: ``runs.csv``, or ``runs.shard-K-of-N.csv`` for a shard."""
    return out / ("runs.csv" if shard is None else f"runs.shard-{shard[0]}-of-{shard[1]}.csv")


def done_groups(out: Path) -> set[str]:
    """Groups with rows in any results file of ``out`` (a group's rows are written together)."""
    done: set[str] = set()
    for p in sorted(out.glob("runs*.csv")):
        done.update(row_group_key(r) for r in read_rows(p))
    return done


def pending_path(out: Path, key: str) -> Path:
    """The cache file of the run ``key`` in ``out/.pending/`` (a hash of the key names it)."""
    return out / ".pending" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".npz")


def save_pending(out: Path, key: str, result: dict[str, Any]) -> None:
    """Cache a finished run's ``result`` (JSON metrics; ``weights`` as arrays), atomically.

    Args:
        out: the results directory.
        key: the run key (stored in the file, checked on loading).
        result: the metrics, and optionally ``weights``: ``(weights, biases)`` NumPy lists.
    """
    path = pending_path(out, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in result.items() if k != "weights"}
    arrays: dict[str, np.ndarray] = {}
    if "weights" in result:
        for i, (w, b) in enumerate(zip(*result["weights"], strict=True)):
            arrays[f"w{i}"], arrays[f"b{i}"] = w, b
    tmp = path.with_name(path.stem + ".tmp.npz")
    arrays["meta"] = np.array(json.dumps({"key": key, **meta}))
    np.savez(tmp, **arrays)  # type: ignore[arg-type]
    os.replace(tmp, path)


def load_pending(out: Path, key: str) -> dict[str, Any] | None:
    """The cached result of the run ``key`` (see :func:`save_pending`), or None when there is
    none, or the file is damaged or belongs to another key (the run is then redone)."""
    path = pending_path(out, key)
    if not path.is_file():
        return None
    try:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            n = sum(1 for k in z.files if k.startswith("w"))
            if n:
                meta["weights"] = ([z[f"w{i}"] for i in range(n)], [z[f"b{i}"] for i in range(n)])
    except (OSError, ValueError, KeyError):  # a damaged cache file: the run is redone
        return None
    return meta if meta.pop("key", None) == key else None
