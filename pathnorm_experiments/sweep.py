"""The paper's protocol as a resumable, parallel, shardable sweep, one CSV row per run.

The protocol (docs/results/README.md gives it in full, with the columns): the 784-200-10 ELU
network at batch 100, trained with Prox-SGD or SGD on the penalty over the grid dataset x
regularizer x optimizer x lam x lr x seed. Each group (dataset, regularizer, optimizer, lam)
trains every lr with the selection seeds and selects the lr of least mean validation error (a
fixed stratified 1/12 of the training set); its other seeds run at that lr only. Selected runs
are attacked (the paper's PGD, a stronger union of attacks) and certified (per-pair Lipschitz,
interval bounds) on one stratified sample of the test set; every run records its clean error,
sparsity and ``hidden_alive`` (the units ``compact`` keeps). Errors are in percent.

Engineering: ``--jobs`` worker processes; a rerun recomputes nothing (finished runs are
cached), refuses other settings with the setting named, and adds more seeds at each group's
recorded lr; two sweeps of one folder share its groups; ``--shard K/N`` takes the groups whose
key hashes to K-1 mod N and ``merge`` joins shard files by run key.

Where things live: the grid, its groups and the data split in ``_sweep_grid``; one run's
training and evaluation in ``_sweep_train``; the workers and the scheduler in ``_sweep_run``;
the results files, the pending cache and the claims in :mod:`~pathnorm_experiments.runs`
(torch-free); the command line here.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from pathnorm_experiments._sweep_grid import (
    LRS,
    SEEDS,
    Group,
    GroupState,
    Prepared,
    RunSpec,
    SweepConfig,
    build_groups,
    coarse_to_fine,
    prepare,
    protocol,
    select_lr,
    split_sizes,
    stratified_indices,
)
from pathnorm_experiments._sweep_run import default_machine, pending_groups, run_sweep
from pathnorm_experiments._sweep_train import (
    calibrate,
    estimate,
    evaluate_run,
    train_metrics,
    train_run,
)
from pathnorm_experiments.data import PAPER_DATASETS, DataError, load_dataset
from pathnorm_experiments.regularizers import REGULARIZERS
from pathnorm_experiments.runs import COLUMNS, append_rows, merge, read_rows, row_key

__all__ = [
    "COLUMNS",
    "Group",
    "GroupState",
    "Prepared",
    "RunSpec",
    "SweepConfig",
    "append_rows",
    "build_groups",
    "build_parser",
    "coarse_to_fine",
    "default_machine",
    "evaluate_run",
    "main",
    "merge",
    "prepare",
    "protocol",
    "read_rows",
    "row_key",
    "run_sweep",
    "select_lr",
    "split_sizes",
    "stratified_indices",
    "train_metrics",
    "train_run",
]


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N (e.g. 2/8), got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"need 1 <= K <= N, got {text!r}")
    return k, n


def _parse_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m pathnorm_experiments.sweep``."""
    p = argparse.ArgumentParser(
        prog="python -m pathnorm_experiments.sweep",
        description="The paper's protocol as a resumable, parallel, shardable sweep, one CSV row "
        "per run in OUT/runs.csv (OUT/runs.shard-K-of-N.csv with --shard). A rerun continues "
        "where the last one stopped and adds missing seeds; a folder whose runs were made with "
        "other settings is refused. Two sweeps of one folder share its groups.",
        epilog="To join result files (the shards of --shard) by run key: "
        "python -m pathnorm_experiments.sweep merge OUT.csv IN.csv [IN.csv ...]; rows of one "
        "run key must agree (apart from the machine column).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data-dir", default=None, help="holds mnist/, fashion-mnist/, kmnist/")
    p.add_argument("--out", default="docs/results", help="results directory")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (one thread each)")
    p.add_argument("--shard", type=_parse_shard, default=None, help="K/N: the K-th of N slices")
    p.add_argument(
        "--datasets",
        nargs="+",
        default=list(SweepConfig().datasets),
        choices=[*PAPER_DATASETS, "embedded"],
        help="the datasets to sweep",
    )
    p.add_argument(
        "--regularizers",
        nargs="+",
        default=list(REGULARIZERS),
        choices=REGULARIZERS,
        help="the regularizers to sweep",
    )
    p.add_argument("--epochs", type=int, default=20, help="training epochs of every run")
    p.add_argument(
        "--lrs", type=float, nargs="+", default=list(LRS), help="the lrs each group selects among"
    )
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=list(SEEDS),
        help="seeds at the selected lr (a rerun with more seeds runs the missing ones)",
    )
    p.add_argument(
        "--select-seeds", type=int, nargs="+", default=[0], help="seeds that run every lr"
    )
    p.add_argument("--eval-samples", type=int, default=2000, help="0: all test images")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] for the workers' tensors")
    p.add_argument(
        "--machine",
        default=None,
        help="the machine column; None: this machine's CPU or GPU and torch version",
    )
    p.add_argument(
        "--stop-after",
        type=_parse_seconds,
        default=None,
        help="seconds (> 0); then start no new run",
    )
    p.add_argument("--dry-run", action="store_true", help="print the grid size and a time estimate")
    return p


def _merge_main(argv: Sequence[str]) -> int:
    """``merge OUT IN...``: join result files into OUT; the exit status."""
    p = argparse.ArgumentParser(
        prog="python -m pathnorm_experiments.sweep merge",
        description="Join result files (the shards of --shard) by run key into OUT.csv (which "
        "may be among the inputs). Rows of one run key must agree (apart from the machine "
        "column), and the rows of one dataset must share one protocol (epochs, n_train, "
        "batch_size, hidden, eval_samples, pgd_steps, strong_restarts). The rows do not record "
        "--lrs and --select-seeds: merge only shards run with the same ones.",
    )
    p.add_argument("out", metavar="OUT.csv")
    p.add_argument("inputs", metavar="IN.csv", nargs="+")
    args = p.parse_args(argv)
    try:
        n = merge([Path(a) for a in args.inputs], Path(args.out))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} rows to {args.out}")
    return 0


def _load_data(cfg: SweepConfig, data_dir: str | None) -> dict[str, Prepared]:
    """The datasets of ``cfg`` that load from ``data_dir``, split; the others are skipped."""
    data: dict[str, Prepared] = {}
    for name in cfg.datasets:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the partial-set warning: said below
                ds = load_dataset(name, data_dir, allow_partial=True)
        except DataError as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
            continue
        data[name] = prepare(ds, cfg)
        note = " (PARTIAL training set)" if ds.partial else ""
        print(
            f"{name}{note}: {ds.x_train.shape[0]} training images -> {data[name].n_train} "
            f"train + {data[name].x_val.shape[0]} validation; {data[name].x_eval.shape[0]} "
            f"of {ds.x_test.shape[0]} test images attacked and certified"
        )
    return data


def _dry_run(
    cfg: SweepConfig, data: Mapping[str, Prepared], out: Path, args: argparse.Namespace
) -> None:
    """Print the grid's size (in ``args.shard``), what ``out`` holds of it, and a time
    estimate timed on the first dataset; ValueError as :func:`run_sweep`."""
    plan = pending_groups(cfg, data, out, args.shard)
    groups, todo = plan.groups, [st.group for st in plan.todo]
    times = calibrate(cfg, next(iter(data.values())))
    runs, evals, seconds = estimate(todo, data, cfg, times, args.jobs)
    print(
        f"{len(groups)} groups ({len(todo)} to run): "
        f"{runs} training runs, {evals} evaluated; per step (ms): "
        + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in times.items() if k != "eval")
        + f"; evaluation {times['eval']:.0f} s per selected run"
    )
    print(
        f"estimate: {seconds / 3600:.2f} h with {args.jobs} job(s), if each job has a core "
        "to itself"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point; ``merge OUT IN...`` joins result files instead. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        return _merge_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.jobs < 1:
        print(f"error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    try:
        cfg = SweepConfig(
            datasets=tuple(args.datasets),
            regularizers=tuple(args.regularizers),
            lrs=tuple(args.lrs),
            seeds=tuple(args.seeds),
            select_seeds=tuple(args.select_seeds),
            epochs=args.epochs,
            eval_samples=args.eval_samples or None,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    data = _load_data(cfg, args.data_dir)
    if not data:
        print("error: none of the datasets is available; see --data-dir", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        if args.dry_run:
            _dry_run(cfg, data, out, args)
            return 0
        counts = run_sweep(
            cfg,
            data,
            out,
            jobs=args.jobs,
            shard=args.shard,
            machine=args.machine,
            device=args.device,
            stop_after=args.stop_after,
        )
    except ValueError as e:  # a folder of another protocol, or an unreadable results file
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{counts['written']} groups written now, {counts['done_before']} before, "
        f"{counts['remaining']} remaining of {counts['groups']} "
        f"({counts['trained']} runs trained, {counts['evaluated']} evaluated)"
    )
    if counts["claimed"]:
        print(
            f"{counts['claimed']} groups skipped: another sweep of {out} runs them (see the log); "
            "rerun this command when it has finished"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
