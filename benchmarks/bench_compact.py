"""What ``compact`` buys: hidden units, parameters and inference time of a path-norm-trained MNIST
network, before and after compaction.

Trains the paper's 784-200-10 ELU network with proximal SGD on the 1-path-norm, as the main job
does (``pathnorm_experiments.torch_backend.train_loop``: all training images, batch 100,
seeded initial weights and order), by default at the MNIST setting of the sweep with under 10%
of its weights on a live path (lam 0.002, lr 0.05, 20 epochs; ``docs/results/runs.csv``). The
real MNIST is read from ``--data-dir`` (default ``$PATHNORM_DATA_DIR``) by the checked loader;
where it is absent the embedded subset (5,000 training images) is used, and the output says
which. The network is then compacted (``pathnorm_lightning.compact``) and both networks are
timed on one batch of 1,000 test images (eval mode, no autograd), interleaved in one process
(the order alternating between repeats; ``pathnorm_experiments.compaction.time_calls``, as
``pathnorm-train`` times them), medians reported.

Prints a few readable lines, then one JSON line with every number.

    python benchmarks/bench_compact.py [--epochs 20] [--lam 0.002] [--lr 0.05] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pathnorm_experiments.certify import effective_nonzero_fraction, nonzero_fraction
from pathnorm_experiments.compaction import time_calls
from pathnorm_experiments.data import DataError, Dataset, load_dataset, load_embedded
from pathnorm_experiments.engine import train_loop
from pathnorm_experiments.settings import TrainConfig
from pathnorm_experiments.sweep import default_machine
from pathnorm_lightning import compact


def load_data(data_dir: Path | None) -> tuple[Dataset, str]:
    """MNIST through the checked loader, else the embedded subset; and which one it is, in words
    (never a path: the output is recorded in the docs)."""
    try:
        data = load_dataset("mnist", data_dir)
        return data, f"MNIST (real, full: {data.x_train.shape[0]:,} training images)"
    except DataError:
        data = load_embedded()
        return data, (
            f"embedded MNIST subset ({data.x_train.shape[0]:,} training images; the MNIST files "
            "were not found)"
        )


def train(args: argparse.Namespace, data: Dataset) -> nn.Module:
    """The trained network: loaded from ``--model`` if that file exists (the lam, lr and epochs
    printed are then the arguments, not necessarily the file's), else trained (and saved there
    when ``--model`` is given)."""
    if args.model is not None and args.model.is_file():
        print(f"loaded the trained network from {args.model}")
        return torch.load(args.model, weights_only=False)
    cfg = TrainConfig(
        regularizer="path", method="prox", lam=args.lam, lr=args.lr, epochs=args.epochs, seed=0
    )
    model, _ = train_loop(cfg, data, progress=False, evaluate_model=False)
    if args.model is not None:
        torch.save(model, args.model)
    return model


def weights(model: nn.Module) -> list[np.ndarray]:
    return [m.weight.detach().numpy() for m in model.modules() if isinstance(m, nn.Linear)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=None, help="holds mnist/*.gz")
    parser.add_argument("--lam", type=float, default=0.002)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=51, help="timed samples per network")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--model", type=Path, default=None, help="load/save the trained model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    data, source = load_data(args.data_dir)
    loaded = args.model is not None and args.model.is_file()
    model = train(args, data).eval()
    small, report = compact(model)
    small.eval()
    x = torch.from_numpy(data.x_test[:1000])
    y = torch.from_numpy(data.y_test[:1000])
    with torch.no_grad():
        before, after = model(x), small(x)
        seconds, _ = time_calls(
            {"before": lambda: model(x), "after": lambda: small(x)}, args.repeats, sample_s=0.02
        )
    result = {
        "bench": "compact",
        "data": source,
        "n_train": int(data.x_train.shape[0]),
        "lam": args.lam,
        "lr": args.lr,
        "epochs": args.epochs,
        "loaded_from": str(args.model) if loaded else None,
        "live_weights_pct": round(100 * effective_nonzero_fraction(weights(model)), 3),
        "nonzero_weights_pct": round(100 * nonzero_fraction(weights(model)), 3),
        "hidden_before": report.units_before,
        "hidden_after": report.units_after,
        "params_before": report.params_before,
        "params_after": report.params_after,
        "ms_per_1000_before": round(1e3 * seconds["before"], 4),
        "ms_per_1000_after": round(1e3 * seconds["after"], 4),
        "speedup": round(seconds["before"] / seconds["after"], 3),
        "max_abs_output_diff": float((after - before).abs().max()),
        "same_predictions": bool(torch.equal(before.argmax(1), after.argmax(1))),
        "test_error_pct_1000": round(100 * float((after.argmax(1) != y).float().mean()), 2),
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "machine": default_machine(),
    }
    print(f"data: {source}; 784-200-10 ELU, path-norm prox lam={args.lam}, lr={args.lr}, "
          f"{args.epochs} epochs; {result['live_weights_pct']}% of the weights on a live path, "
          f"{result['nonzero_weights_pct']}% nonzero")  # fmt: skip
    print(report)
    print(f"inference, batch of 1,000 (median of {args.repeats}, {args.threads} thread(s)): "
          f"{result['ms_per_1000_before']} ms -> {result['ms_per_1000_after']} ms "
          f"({result['speedup']}x); largest output difference "
          f"{result['max_abs_output_diff']:.1e}")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
