"""The sweep's results on disk: the columns of ``runs.csv``, run and group keys, locked
appends, the one validating reader of result files, merging, the pending-run cache and the
group claims.

One CSV row per training run; a group's rows (one lr selection) are appended together, so a
group with a row in any results file of a directory has been selected (more seeds may be added
later). A finished run of an unfinished group waits in ``<out>/.pending/`` (metrics, and weights
when needed again). A sweep claims a group in ``<out>/.claims/`` before running it and drops
the claim once its rows are written. NumPy only (no torch), so the report needs no training stack.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import hashlib
import io
import json
import math
import os
import re
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from pathnorm_experiments.data import DATASET_NAMES
from pathnorm_experiments.regularizers import OPTIMIZERS, REGULARIZERS
from pathnorm_experiments.settings import SWEEP_EPS, float_key

__all__ = [
    "COLUMNS",
    "KEY_COLUMNS",
    "LATER_COLUMNS",
    "PROTOCOL_COLUMNS",
    "ResultsError",
    "append_rows",
    "claim_group",
    "folder_rows",
    "join_key",
    "key_cell",
    "load_pending",
    "merge",
    "pending_path",
    "protocol_clash",
    "read_rows",
    "release_group",
    "results_path",
    "row_group_key",
    "row_key",
    "save_pending",
]

KEY_COLUMNS = ("dataset", "regularizer", "optimizer", "lam", "lr", "seed", "epochs", "n_train")
# the settings that define a run besides its key, one value per dataset in a folder:
# eval_samples counts the test images of the evaluation sample (all of them if fewer)
PROTOCOL_COLUMNS = ("batch_size", "hidden", "eval_samples", "pgd_steps", "strong_restarts")

_EPS_KINDS = ("robust_error", "robust_error_strong", "certified_lipschitz", "certified_interval")
COLUMNS = (
    *KEY_COLUMNS,
    "selected",
    "val_error",
    "clean_error",
    "clean_error_full",
    *(f"{kind}@{float_key(e)}" for kind in _EPS_KINDS for e in SWEEP_EPS),
    "nonzero",
    "nonzero_live",
    "path_norm",
    "machine",
    *PROTOCOL_COLUMNS,
    "hidden_alive",
)
# appended last: the hidden units that compact keeps (pathnorm_experiments.compaction); empty
# in rows written before the column, whose weights are gone
LATER_COLUMNS = ("hidden_alive",)


def join_key(*parts: str) -> str:
    """A run or group key: its parts, as the CSV writes them, joined by ``|``."""
    return "|".join(parts)


def key_cell(column: str, text: str) -> str:
    """A key cell's value as the sweep writes it (``1e-03`` -> ``0.001``, ``00`` -> ``0``)."""
    if column in ("lam", "lr"):
        return float_key(float(text) + 0.0)  # + 0.0: -0.0 is 0
    return str(int(text)) if column in _INT_MIN else text


def row_key(row: Mapping[str, Any]) -> str:
    """The run key of a CSV row, its numbers as the sweep writes them: one run, one key."""
    return join_key(*(key_cell(c, str(row[c])) for c in KEY_COLUMNS))


def row_group_key(row: Mapping[str, Any]) -> str:
    """The lr-selection group key of a CSV row (its run key without lr and seed)."""
    return join_key(*(key_cell(c, str(row[c])) for c in KEY_COLUMNS if c not in ("lr", "seed")))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.10g}"
    return str(value)


@contextlib.contextmanager
def _flocked(f: IO[Any], operation: int) -> Iterator[None]:
    """``flock`` ``f`` for the block, then unlock it: explicitly, as a process forked meanwhile
    holds the file open too (closing would not release the lock)."""
    fcntl.flock(f, operation)
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)


def append_rows(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Append ``rows`` (keys :data:`COLUMNS`) to the CSV ``path`` in one locked, flushed write,
    with the header if the file is new (after a newline if its last line lacks one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    for row in rows:
        writer.writerow({c: _fmt(row[c]) for c in COLUMNS})
    with path.open("a+b") as f, _flocked(f, fcntl.LOCK_EX):  # appending: writes go to the end
        f.seek(0)
        old = f.read()
        head = ("" if old.endswith(b"\n") else "\n") if old else ",".join(COLUMNS) + "\n"
        f.write((head + buf.getvalue()).encode())
        f.flush()
        os.fsync(f.fileno())


class ResultsError(ValueError):
    """A results file whose header, row or cell is not the sweep's (the message names the file,
    the line and the column)."""


_PERCENT = COLUMNS[COLUMNS.index("val_error") : COLUMNS.index("path_norm")]
_INT_MIN = {"seed": 0, "epochs": 1, "n_train": 1, **dict.fromkeys(PROTOCOL_COLUMNS, 1)}
_INT_MIN["strong_restarts"] = 0
_VOCABULARY = {
    "dataset": DATASET_NAMES,
    "regularizer": REGULARIZERS,
    "optimizer": OPTIMIZERS,
    "selected": ("0", "1"),
}


def _cell_problem(column: str, text: str) -> str | None:
    """What is wrong with ``text`` in ``column``, or None when it is a value the sweep writes."""
    if column in _VOCABULARY:
        known = _VOCABULARY[column]
        return None if text in known else f"{text!r} is not one of {', '.join(known)}"
    if column in _INT_MIN:
        if not re.fullmatch(r"[0-9]+", text):
            return f"{text!r} is not a whole number"
        low = _INT_MIN[column]
        return None if int(text) >= low else f"{text} is below {low}"
    if column == "machine":
        return None
    if column == "hidden_alive":  # empty: a row from before the column, or a diverged run
        return None if re.fullmatch(r"[0-9]*", text) else f"{text!r} is not a whole number"
    if column in (*_PERCENT, "path_norm") and text in ("", "nan"):
        return None  # not measured (an unselected lr), or a diverged run
    try:
        v = float(text)
    except ValueError:
        return f"{text!r} is not a number"
    if column in _PERCENT:
        return None if 0 <= v <= 100 else f"{text} is not a percentage in [0, 100]"
    if column == "path_norm":
        return None if v >= 0 else f"{text} is negative"
    if math.isfinite(v) and (v >= 0 if column == "lam" else v > 0):  # lam, lr
        return None
    return f"{text} is not a finite number " + (">= 0" if column == "lam" else "> 0")


def _row_problem(row: Mapping[str, str]) -> tuple[str, str] | None:
    """(column, what is wrong) of the first bad cell of ``row``, or None."""
    for c in COLUMNS:
        problem = _cell_problem(c, row[c])
        if problem is not None:
            return c, problem
    if (row["regularizer"] == "none") != (float(row["lam"]) == 0):
        return "lam", f"lam {row['lam']} with regularizer {row['regularizer']} (lam 0 is none)"
    if row["regularizer"] == "linf" and row["optimizer"] != "prox":
        return "optimizer", f"{row['optimizer']!r} with linf (its projection is prox)"
    return None


def _check_header(path: Path, header: Sequence[str]) -> None:
    if tuple(header) == COLUMNS:
        return
    gone = [c for c in COLUMNS if c not in header]
    if gone:
        hint = ""
        if set(gone) <= {*PROTOCOL_COLUMNS, *LATER_COLUMNS}:  # an older sweep's file
            if set(gone) & set(PROTOCOL_COLUMNS):
                hint += "; the file predates the columns that record the protocol: append them "
                hint += "with the values its sweep used"
            if set(gone) & set(LATER_COLUMNS):
                hint += "; the file predates the column hidden_alive: append it last, empty in "
                hint += "every row"
        raise ResultsError(
            f"{path}: not a results file of the sweep: {len(gone)} columns missing "
            f"({', '.join(gone[:4])}{', ...' if len(gone) > 4 else ''}){hint}"
        )
    extra = [c for c in header if c not in COLUMNS]
    raise ResultsError(
        f"{path}, line 1: the header is not the sweep's columns in their order ("
        + (f"unknown columns {extra[:4]}" if extra else "columns in another order")
        + "); move the file away, or write it with the sweep's columns"
    )


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a results CSV as cell text, every cell checked; [] if missing or empty.

    Read under a shared lock, so a group appended by :func:`append_rows` is read whole or not
    at all. Blank lines are skipped; a last line without its newline is read (a cut one is
    refused: it has too few fields).
    Everything else must be as the sweep writes it: the header :data:`COLUMNS`, every column,
    known names, numbers in range (errors and shares in [0, 100], lr > 0, whole seeds ...), each
    run key (compared by value, :func:`row_key`) on one row. ``hidden_alive`` may be empty
    (older rows, diverged runs).

    Raises:
        ResultsError: the first problem, with the file, the line (1 is the header) and column.
    """
    if not path.is_file():
        return []
    # shared: an append (exclusive) is seen whole or not at all
    with path.open("rb") as f, _flocked(f, fcntl.LOCK_SH):
        text = f.read().decode()
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None:
        return []
    _check_header(path, header)
    rows: list[dict[str, str]] = []
    first_line: dict[str, int] = {}
    for fields in reader:
        line = reader.line_num
        if not fields:
            continue
        if len(fields) != len(COLUMNS):
            n = len(fields)
            where = (
                f"column {COLUMNS[n]} ({n + 1} of {len(COLUMNS)}) and after are missing"
                if n < len(COLUMNS)
                else f"{n - len(COLUMNS)} fields more than the header's"
            )
            if not text.endswith("\n") and line > text.count("\n"):
                where += " (the file ends within this row: a copy cut short?)"
            raise ResultsError(
                f"{path}, line {line}: {n} fields where the header has {len(COLUMNS)}: {where}; "
                "repair or remove the row"
            )
        row = dict(zip(COLUMNS, fields, strict=True))
        bad = _row_problem(row)
        if bad is not None:
            raise ResultsError(
                f"{path}, line {line}, column {bad[0]}: {bad[1]}; repair or remove the row"
            )
        key = row_key(row)
        if key in first_line:
            raise ResultsError(
                f"{path}, line {line}: run {key} is already on line {first_line[key]}, and a run "
                "has one row (two sweeps wrote this file at once?): keep one of the two rows"
            )
        first_line[key] = line
        rows.append(row)
    return rows


def folder_rows(out: Path) -> list[tuple[Path, list[dict[str, str]]]]:
    """Every results file of ``out`` (``runs*.csv``) with its rows (see :func:`read_rows`)."""
    return [(p, read_rows(p)) for p in sorted(out.glob("runs*.csv"))]


def protocol_clash(
    rows: Sequence[Mapping[str, str]], dataset: str, expected: Mapping[str, Any]
) -> tuple[str, str] | None:
    """``(column, the row's value)`` of the first setting in which a row of ``dataset``
    differs from ``expected`` (column -> whole number, e.g. ``{"epochs": 20}``); None if all
    agree."""
    for r in rows:
        if r["dataset"] == dataset:
            for c, v in expected.items():
                if int(r[c]) != int(v):
                    return c, r[c]
    return None


def _merge_protocols(files: Sequence[tuple[Path, Sequence[Mapping[str, str]]]]) -> None:
    """Raise ValueError naming two of ``files`` whose rows of one dataset differ in epochs,
    n_train or a :data:`PROTOCOL_COLUMNS` setting."""
    first: dict[str, tuple[Path, Mapping[str, str]]] = {}
    for path, rows in files:
        for r in rows:
            first.setdefault(r["dataset"], (path, r))
        for ds, (p0, r0) in first.items():
            clash = protocol_clash(
                rows, ds, {c: r0[c] for c in ("epochs", "n_train", *PROTOCOL_COLUMNS)}
            )
            if clash is not None:
                col, theirs = clash
                other = "" if p0 == path else f" {p0}"
                raise ValueError(
                    f"{path} holds {ds} runs with {col} {theirs} and{other} with {col} {r0[col]}: "
                    "the shards were run with other settings; merge only runs of one protocol"
                )


def merge(inputs: Sequence[Path], output: Path) -> int:
    """Join result files (``output`` may be among them) by run key into ``output``, written
    atomically and sorted by the key columns; returns the number of rows.

    Rows of one key that agree apart from ``machine`` are kept once; rows that differ are an
    error (two machines produced different numbers for the same run), and so are files whose
    rows of one dataset have another protocol (epochs, n_train, :data:`PROTOCOL_COLUMNS`).
    """
    for p in inputs:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such results file")
    files = [(p, read_rows(p)) for p in inputs]
    _merge_protocols(files)
    rows: dict[str, dict[str, str]] = {}
    for _, file_rows in files:
        for r in file_rows:
            k = row_key(r)
            old = rows.setdefault(k, r)
            diff = [c for c in COLUMNS[len(KEY_COLUMNS) :] if c != "machine" and old[c] != r[c]]
            if diff:
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

    tmp = output.with_name(f"{output.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    append_rows(tmp, sorted(rows.values(), key=order))  # a new file: the header, even alone
    os.replace(tmp, output)
    return len(rows)


def results_path(out: Path, shard: tuple[int, int] | None) -> Path:
    """The results file of ``out``: ``runs.csv``, or ``runs.shard-K-of-N.csv`` for a shard."""
    return out / ("runs.csv" if shard is None else f"runs.shard-{shard[0]}-of-{shard[1]}.csv")


def pending_path(out: Path, key: str) -> Path:
    """The cache file of the run ``key`` in ``out/.pending/`` (a hash of the key names it)."""
    return out / ".pending" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".npz")


def save_pending(
    out: Path, key: str, result: dict[str, Any], protocol: Mapping[str, Any] | None = None
) -> None:
    """Cache a finished run's ``result`` atomically: JSON metrics, and optionally ``weights``
    (``(weights, biases)`` NumPy lists) as arrays. ``key`` and ``protocol`` (the
    :data:`PROTOCOL_COLUMNS` the run was made with) are stored and checked on loading."""
    path = pending_path(out, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in result.items() if k != "weights"}
    arrays: dict[str, np.ndarray] = {}
    if "weights" in result:
        for i, (w, b) in enumerate(zip(*result["weights"], strict=True)):
            arrays[f"w{i}"], arrays[f"b{i}"] = w, b
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")  # one per writer
    head = {"key": key, "protocol": _protocol_text(protocol)}
    arrays["meta"] = np.array(json.dumps({**head, **meta}))
    np.savez(tmp, **arrays)  # type: ignore[arg-type]
    os.replace(tmp, path)


def _protocol_text(protocol: Mapping[str, Any] | None) -> dict[str, str]:
    return {c: _fmt(v) for c, v in sorted((protocol or {}).items())}


def load_pending(
    out: Path, key: str, protocol: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The cached result of the run ``key`` (see :func:`save_pending`), or None when there is
    none, or the file is damaged, belongs to another key or was made with another
    ``protocol`` (the run is then redone)."""
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
    same = meta.pop("key", None) == key
    return meta if meta.pop("protocol", None) == _protocol_text(protocol) and same else None


# ---------------------------------------------------------------- claims


def _claim_path(out: Path, group_key: str) -> Path:
    return out / ".claims" / (hashlib.sha256(group_key.encode()).hexdigest()[:24] + ".claim")


def _me() -> str:
    return f"{socket.gethostname()} {os.getpid()}"


@contextlib.contextmanager
def _claims_locked(out: Path) -> Iterator[None]:
    """Hold the folder's claim lock (claims are read, taken and dropped under it only)."""
    folder = out / ".claims"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "lock").open("a") as f, _flocked(f, fcntl.LOCK_EX):
        yield


def _alive(holder: str) -> bool:
    """Whether the claim's holder (``HOST PID``) may still run: a process of another machine
    cannot be checked from here, so it counts as alive."""
    host, _, pid = holder.partition(" ")
    if host != socket.gethostname() or not pid.isdigit():
        return True
    if int(pid) == os.getpid():
        return False  # this process's own claim, left by a sweep that stopped: taken again
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def claim_group(out: Path, group_key: str, alive: Callable[[str], bool] = _alive) -> str | None:
    """Claim the group ``group_key`` of ``out`` for this process: None when it now holds the
    claim, else the holder (``"HOST PID"``).

    A claim is a file naming its holder, written whole or not at all (a sweep killed while
    writing it left an empty one, which held its group for ever). One whose holder is not
    ``alive`` (a killed sweep of this machine; tests replace the check), or empty, is stale and
    taken over.
    """
    path = _claim_path(out, group_key)
    with _claims_locked(out):
        if path.is_file():
            holder = path.read_text().split("\n", 1)[0]
            if holder and alive(holder):
                return holder
        tmp = path.with_suffix(".tmp")  # one writer at a time: under the lock
        tmp.write_text(f"{_me()}\n{group_key}\n")
        os.replace(tmp, path)
    return None


def release_group(out: Path, group_key: str) -> None:
    """Drop this process's claim of ``group_key`` (another process's claim is left alone)."""
    path = _claim_path(out, group_key)
    with _claims_locked(out):
        if path.is_file() and path.read_text().split("\n", 1)[0] == _me():
            path.unlink()
