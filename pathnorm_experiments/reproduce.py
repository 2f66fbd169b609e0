"""``pathnorm-reproduce``: the paper's protocol end to end, then its report.

Runs the resumable sweep (:mod:`pathnorm_experiments.sweep`) into ``--results``, then writes
the report (:mod:`pathnorm_experiments.report`) from that file alone; :data:`DESCRIPTION` (the
``--help`` text) says more. ``--report-only`` needs NumPy and matplotlib, not torch nor the data.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pathnorm_experiments.data import PAPER_DATASETS, DataError, Dataset, load_dataset
from pathnorm_experiments.deps import MissingDependency, require
from pathnorm_experiments.report import write_report
from pathnorm_experiments.report_data import ReportError
from pathnorm_experiments.results import unwritable_dir
from pathnorm_experiments.runs import protocol_clash, read_rows

__all__ = [
    "QUICK",
    "TRAINING_ONLY",
    "build_parser",
    "given_options",
    "main",
    "parse_args",
    "preflight",
    "run_sweep",
    "sweep_config",
]

# --quick: every regularizer and optimizer at 3 lams (enough for every claim to be decided),
# 2 lrs and 2 seeds, on the embedded subset with short training and a short evaluation
QUICK: dict[str, Any] = {
    "lams": {
        "none": (0.0,),
        "l1": (1e-4, 1e-3, 5e-3),
        "path": (1e-4, 1e-3, 3e-3),
        "linf": (0.1, 0.3, 1.0),
    },
    "lrs": (0.1, 0.5),
    "seeds": (0, 1),
    "epochs": 2,
    "eval_samples": 300,
    "pgd_steps": 10,
    "strong_restarts": 1,
}

#: The options that act on the sweep alone: given with --report-only (which trains nothing),
#: they are refused rather than ignored. --quick stays: it also sets the default --out.
TRAINING_ONLY = (
    "--data-dir",
    "--datasets",
    "--seeds",
    "--epochs",
    "--jobs",
    "--device",
    "--stop-after",
)

DESCRIPTION = """\
The paper's protocol end to end: the sweep, then the report.

The sweep (python -m pathnorm_experiments.sweep) trains the 784-200-10 ELU network with
Prox-SGD and SGD on the penalty over the paper's grid of regularizers, lams and lrs, selects
each setting's lr on a validation split, trains 3 seeds at it, and attacks and certifies the
selected runs. It appends one row per run to --results and is resumable: a rerun continues
where the last one stopped. Then the report writes <out>/results.md and its plots
(<out>/img/results/) from --results alone; --report-only writes only the report (no torch,
no data needed). The full protocol takes hours (the sweep's --dry-run estimates it);
--quick runs a tiny grid on the embedded MNIST subset in about 26 s.
"""


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks and appends every option's default to its help."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (no torch import: ``--help`` works without it)."""
    p = argparse.ArgumentParser(
        prog="pathnorm-reproduce", description=DESCRIPTION, formatter_class=_Formatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="embedded data, 3 lams per regularizer, 2 lrs, 2 seeds, 2 epochs, 300 images "
        "attacked with 10 PGD steps",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="only write the report from --results (the training options are refused)",
    )
    p.add_argument("--results", default=None, help="the sweep's CSV (None: <out>/results/runs.csv)")
    p.add_argument(
        "--out",
        default=None,
        help="folder of results.md and img/ (None: docs; quick: reproduce_out)",
    )
    p.add_argument(
        "--data-dir", default=None, help="None: $PATHNORM_DATA_DIR, else ~/.cache/pathnorm"
    )
    p.add_argument(
        "--datasets",
        nargs="+",
        choices=[*PAPER_DATASETS, "embedded"],
        default=None,
        help="None: mnist fashion-mnist kmnist (quick: embedded)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="None: 0 1 2 (quick: 0 1)")
    p.add_argument("--epochs", type=int, default=None, help="None: 20, the paper's (quick: 2)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (one thread each)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] for the sweep's tensors")
    p.add_argument("--stop-after", type=float, default=None, help="seconds; then start no new run")
    return p


def given_options(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, options: Sequence[str]
) -> list[str]:
    """Those of ``options`` that the command line ``argv`` gives to ``parser`` (abbreviated or
    not, whatever their value, a default's included), in the order of ``options``."""
    dests = {option: option.lstrip("-").replace("-", "_") for option in options}
    unset = object()  # argparse fills in a default only where the namespace has no value
    args = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(dests.values(), unset)))
    return [option for option, dest in dests.items() if getattr(args, dest) is not unset]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed command line; argparse's error (status 2) for a training option given with
    ``--report-only``, which would silently not act."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.report_only:
        given = given_options(parser, argv, TRAINING_ONLY)
        if given:
            verb = "acts" if len(given) == 1 else "act"
            parser.error(
                f"{', '.join(given)} only {verb} on the training, which --report-only skips "
                "(it writes the report from --results alone): drop "
                f"{'it' if len(given) == 1 else 'them'}, or drop --report-only"
            )
    return args


def sweep_config(args: argparse.Namespace) -> Any:
    """The sweep's configuration of the command line (imports the sweep, hence torch).

    Raises:
        ValueError: a setting the sweep refuses (the message says which).
    """
    from pathnorm_experiments.sweep import SweepConfig

    kw: dict[str, Any] = dict(QUICK) if args.quick else {}
    kw["datasets"] = tuple(args.datasets or (["embedded"] if args.quick else PAPER_DATASETS))
    if args.seeds is not None:
        kw["seeds"] = tuple(args.seeds)
    if args.epochs is not None:
        kw["epochs"] = args.epochs
    return SweepConfig(**kw)


def _check_existing(results: Path, cfg: Any, data: dict[str, Dataset]) -> None:
    """Refuse (ValueError) a results file whose rows of these datasets have another protocol
    (epochs, evaluation sample ...): the report compares one protocol per dataset."""
    from pathnorm_experiments.sweep import protocol, split_sizes

    rows = read_rows(results)
    for name, ds in data.items():
        _, n_train, n_eval = split_sizes(cfg, ds.x_train.shape[0], ds.x_test.shape[0])
        expected = {"epochs": cfg.epochs, "n_train": n_train, **protocol(cfg, n_eval)}
        clash = protocol_clash(rows, name, expected)
        if clash is not None:
            col, theirs = clash
            raise ValueError(
                f"--results {results} holds rows of {name} with {col} {theirs}, and this run's "
                f"{col} is {expected[col]}: give another --results (one protocol per file)"
            )


def preflight(args: argparse.Namespace, results: Path, out: Path) -> tuple[Any, dict[str, Dataset]]:
    """Check, before any training, everything the sweep and the report will need.

    Returns:
        The sweep's configuration and the loaded datasets (None and {} for ``--report-only``).

    Raises:
        MissingDependency: torch (for training) or matplotlib (for the plots) is missing.
        ValueError: a setting is refused, or ``out`` or the results' folder cannot be written.
        DataError: a dataset is missing or corrupt.
        ReportError: ``--report-only`` and the results file cannot be reported.
    """
    if not args.report_only:
        require(("torch",), "pathnorm-reproduce (the sweep trains with the torch loop)")
    require(("matplotlib",), "pathnorm-reproduce (the plots)")
    folders = [("--out", out)] + ([] if args.report_only else [("--results", results.parent)])
    for name, folder in folders:  # --report-only only reads --results
        problem = unwritable_dir(folder)
        if problem is not None:
            raise ValueError(f"{name} {folder}: {problem}: choose another {name}")
    if args.report_only:
        if not results.is_file():
            raise ReportError(f"--results {results}: no such file: run the sweep first")
        return None, {}
    if results.name != "runs.csv":
        raise ValueError(
            f"--results {results}: the sweep writes a file named runs.csv in the folder you give: "
            "name the file runs.csv"
        )
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    cfg = sweep_config(args)
    from pathnorm_experiments._sweep_run import check_device

    check_device(args.device)
    data = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # KMNIST's partial training set: labelled in the report
        for name in cfg.datasets:
            data[name] = load_dataset(name, args.data_dir, allow_partial=True)
    _check_existing(results, cfg, data)
    return cfg, data


def run_sweep(
    cfg: Any, data: dict[str, Dataset], results: Path, args: argparse.Namespace
) -> dict[str, int]:
    """Run the sweep's unfinished groups into ``results`` (see :func:`sweep.run_sweep`)."""
    from pathnorm_experiments import sweep

    prepared = {}
    for name, ds in data.items():
        prep = prepared[name] = sweep.prepare(ds, cfg)
        note = " (partial training set)" if ds.partial else ""
        print(
            f"{name}{note}: {prep.n_train} training, {prep.x_val.shape[0]} validation, "
            f"{prep.x_eval.shape[0]} test images attacked and certified",
            flush=True,
        )
    return sweep.run_sweep(
        cfg,
        prepared,
        results.parent,
        jobs=args.jobs,
        device=args.device,
        stop_after=args.stop_after,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``pathnorm-reproduce``; returns the exit status."""
    args = parse_args(argv)
    out = Path(args.out or ("reproduce_out" if args.quick else "docs"))
    results = Path(args.results) if args.results else out / "results" / "runs.csv"
    t0 = time.perf_counter()
    try:  # every need is checked before the first run
        cfg, data = preflight(args, results, out)
        if not args.report_only:
            counts = run_sweep(cfg, data, results, args)
            print(
                f"sweep: {counts['written']} groups written now, {counts['done_before']} before, "
                f"{counts['remaining']} remaining ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
            if counts["remaining"]:
                print("rerun the same command to continue the sweep", flush=True)
        written = write_report(results, out)
    except (DataError, ValueError, MissingDependency) as e:  # ReportError is a ValueError
        print(f"pathnorm-reproduce: error: {e}", file=sys.stderr)
        return 2
    where = f" in {written[1].parent}" if len(written) > 1 else ""
    print(f"wrote {written[0]} and {len(written) - 1} plots{where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
