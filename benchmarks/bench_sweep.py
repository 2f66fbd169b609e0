"""Steps per second of the sweep's training loop against a bare SGD + prox loop of the same net.

The sweep (``pathnorm_experiments.sweep.train_run``) trains 784-200-10 ELU at batch 100 with
the library's prox after every step. The bare loop is the shortest loop that does the same:
an ``nn.Sequential``, ``torch.optim.SGD``, ``zero_grad / backward / step``, then the same
``pathnorm_lightning.functional`` call. Both train one epoch over the same data in the same
order, alternating in one process (so both see the same machine load), one torch thread; the
script prints the median seconds per step of each and the ratio bare / sweep (>= 0.8 is the
target). The sweep also spends a fixed time per run on its metrics (validation, test and
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
from torch import Tensor, nn
from torch.nn import functional as F

from pathnorm_experiments.data import DataError, Dataset, load_dataset
from pathnorm_experiments.draws import initial_weights, shuffle_orders
from pathnorm_experiments.sweep import RunSpec, SweepConfig, prepare, train_metrics, train_run
from pathnorm_lightning.functional import (
    path_norm,
    project_rows_l1_ball_,
    prox_l1_,
    prox_path_norm_,
)

ENV_DATA = os.environ.get("PATHNORM_DATA_DIR")
CASES = (
    ("none", "prox", 0.0),
    ("l1", "prox", 1e-3),
    ("path", "prox", 1e-3),
    ("path", "penalty", 1e-3),
    ("linf", "prox", 0.2),
)


def bare_epoch(x: Tensor, y: Tensor, order: np.ndarray, reg: str, opt: str, lam: float) -> None:
    """One epoch of the bare loop (the prox, or for ``penalty`` autograd on CE + lam g)."""
    lr = 0.1
    first, second = nn.Linear(784, 200), nn.Linear(200, 10)
    model = nn.Sequential(first, nn.ELU(), second)
    with torch.no_grad():
        for lin, (w, b) in zip((first, second), initial_weights((784, 200, 10), 0), strict=True):
            lin.weight.copy_(torch.from_numpy(w))
            lin.bias.copy_(torch.from_numpy(b))
    w1, w2 = first.weight, second.weight
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    perm = torch.from_numpy(order)
    for s in range(0, x.shape[0], 100):
        idx = perm[s : s + 100]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        if opt == "penalty":
            loss = loss + lam * path_norm(w1, w2)
        sgd.zero_grad(set_to_none=True)
        loss.backward()
        sgd.step()
        if opt == "prox":
            with torch.no_grad():
                if reg == "l1":
                    prox_l1_(w1, lr * lam)
                    prox_l1_(w2, lr * lam)
                elif reg == "path":
                    prox_path_norm_(w1, w2, lr * lam, check_finite=False)
                elif reg == "linf":
                    project_rows_l1_ball_(w1, 1 / lam)
                    project_rows_l1_ball_(w2, 1 / lam)


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
    order = shuffle_orders(n, 1, 0)[0]
    print(
        f"{source}: {n} training images, {steps} steps per epoch, 1 thread, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'case':<14} {'bare ms/step':>12} {'sweep ms/step':>13} {'ratio':>6}")
    ratios, sweep_times = [], []
    for reg, opt, lam in CASES:
        if f"{reg}/{opt}" not in args.cases:
            continue
        spec = RunSpec("mnist", reg, opt, lam, 0.1, 0, 1, n)
        bare_epoch(prep.x_train[:1000], prep.y_train[:1000], order[order < 1000], reg, opt, lam)
        train_run(spec, prep, cfg, steps=10)  # warm-up both (numba, allocator)
        t_bare, t_sweep = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            bare_epoch(prep.x_train, prep.y_train, order, reg, opt, lam)
            t_bare.append((time.perf_counter() - t0) / steps)
            t0 = time.perf_counter()
            trained = train_run(spec, prep, cfg)
            t_sweep.append((time.perf_counter() - t0) / steps)
            assert trained is not None
        b, s = statistics.median(t_bare), statistics.median(t_sweep)
        ratios.append(b / s)
        sweep_times.append(s)
        print(f"{reg + '/' + opt:<14} {1e3 * b:>12.3f} {1e3 * s:>13.3f} {b / s:>6.2f}")
    assert trained is not None
    ws, bs = trained
    t0 = time.perf_counter()
    train_metrics(ws, bs, prep)
    per_run = time.perf_counter() - t0
    cheapest = min(sweep_times)  # the per-run cost weighs most on the cheapest run
    share = per_run / (per_run + args.epochs_per_run * steps * cheapest)
    print(
        f"median ratio bare/sweep {statistics.median(ratios):.2f} (min {min(ratios):.2f}); "
        f"the sweep's per-run metrics take {per_run:.2f} s, {100 * share:.1f}% of the "
        f"cheapest {args.epochs_per_run}-epoch run"
    )


if __name__ == "__main__":
    main()
