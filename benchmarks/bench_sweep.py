"""Seconds per step of the sweep's training (the torch engine, ``pathnorm_experiments.engine``,
through ``sweep.train_run``), per regularizer and optimizer.

The sweep trains 784-200-10 ELU at batch 100 with the library's prox after every step. Each
case trains one epoch, ``--repeats`` times, one torch thread; the script prints the median
milliseconds per step and each case's cost over the first case's (by default ``none/prox``:
SGD alone). The sweep also spends a fixed time per run on its metrics (validation, test and
sparsity); its share over a 20-epoch run is printed too.

    python benchmarks/bench_sweep.py [--data-dir DIR] [--repeats 5] [--epochs-per-run 20] \
        [--cases none/prox l1/prox path/prox path/penalty linf/prox]

DIR holds mnist/ (default $PATHNORM_DATA_DIR); random data of MNIST's shape when absent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from pathnorm_experiments.data import DataError, Dataset, load_dataset
from pathnorm_experiments.sweep import RunSpec, SweepConfig, prepare, train_metrics, train_run

ENV_DATA = os.environ.get("PATHNORM_DATA_DIR")
CASES = (
    ("none", "prox", 0.0),
    ("l1", "prox", 1e-3),
    ("path", "prox", 1e-3),
    ("path", "penalty", 1e-3),
    ("linf", "prox", 0.2),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path(ENV_DATA) if ENV_DATA else None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epochs-per-run", type=int, default=20)
    p.add_argument(
        "--cases",
        nargs="+",
        default=[f"{r}/{o}" for r, o, _ in CASES],
        choices=[f"{r}/{o}" for r, o, _ in CASES],
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    try:
        data = load_dataset("mnist", args.data_dir)
        source = "MNIST"
    except DataError:
        rng = np.random.default_rng(0)
        data = Dataset(
            "random",
            rng.uniform(size=(60000, 784)).astype(np.float32),
            rng.integers(0, 10, 60000),
            rng.uniform(size=(10000, 784)).astype(np.float32),
            rng.integers(0, 10, 10000),
            "random",
        )
        source = "random data of MNIST's shape"
    cfg = SweepConfig()
    prep = prepare(data, cfg)
    n = prep.n_train
    steps = -(-n // cfg.batch_size)
    print(
        f"{source}: {n} training images, {steps} steps per epoch, 1 thread, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'case':<14} {'ms/step':>8} {'/ first':>7}")
    sweep_times = []
    trained = None
    for reg, opt, lam in CASES:
        if f"{reg}/{opt}" not in args.cases:
            continue
        spec = RunSpec("mnist", reg, opt, lam, 0.1, 0, 1, n)
        train_run(spec, prep, cfg, steps=10)  # warm-up (numba, allocator)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            trained = train_run(spec, prep, cfg)
            times.append((time.perf_counter() - t0) / steps)
            assert trained is not None
        sweep_times.append(statistics.median(times))
        base = sweep_times[0]
        print(f"{reg + '/' + opt:<14} {1e3 * sweep_times[-1]:>8.3f} {sweep_times[-1] / base:>7.2f}")
    assert trained is not None
    ws, bs = trained
    t0 = time.perf_counter()
    train_metrics(ws, bs, prep)
    per_run = time.perf_counter() - t0
    cheapest = min(sweep_times)  # the per-run cost weighs most on the cheapest run
    share = per_run / (per_run + args.epochs_per_run * steps * cheapest)
    print(
        f"the sweep's per-run metrics take {per_run:.2f} s, {100 * share:.1f}% of the "
        f"cheapest {args.epochs_per_run}-epoch run"
    )


if __name__ == "__main__":
    main()
