"""``pathnorm-train``: train the paper's network once, attack it, certify it, write JSON + CSV.

Example (embedded MNIST subset, no data needed, about a minute on 2 CPU cores)::

    pathnorm-train --regularizer path --lam 1e-3
    pathnorm-train --backend tf --regularizer l1 --method penalty --lam 1e-4
    pathnorm-train --dataset mnist --data-dir /data --epochs 20 --out runs/mnist_path
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from pathnorm_experiments.config import (
    ACTIVATIONS,
    ATTACKS,
    DEFAULT_EPS,
    METHODS,
    REGULARIZERS,
    TrainConfig,
    nonnegative_int,
    write_results,
)
from pathnorm_experiments.data import DATASET_NAMES, DataError, load_dataset
from pathnorm_experiments.evaluation import format_summary

__all__ = ["build_parser", "main", "run"]

DEFAULT_EPOCHS = 20  # the paper's


def _hidden(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--hidden takes comma-separated widths such as 200 or 200,100,50, got {text!r}"
        ) from None
    return widths


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="pathnorm-train",
        description="Train an MLP with 1-path-norm / l1 / layer-wise linf regularization "
        "(proximal SGD or penalty SGD), then report clean, PGD-robust and certified error.",
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", choices=("torch", "tf"), default="torch")
    p.add_argument(
        "--engine",
        choices=("lightning", "loop"),
        default="lightning",
        help="torch only: Lightning Trainer + library callbacks, or the plain torch "
        "loop with the library's functional prox (the sweep's engine)",
    )
    p.add_argument("--regularizer", choices=REGULARIZERS, default="path")
    p.add_argument(
        "--method",
        choices=METHODS,
        default="prox",
        help="prox: proximal SGD (projection for linf); penalty: SGD on CE + lam*g",
    )
    p.add_argument("--lam", type=float, default=1e-3, help="lambda; linf: radius 1/lam")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument(
        "--hidden",
        type=_hidden,
        default=(200,),
        help="hidden widths, e.g. 200 or 400,200,100 (path needs an odd count)",
    )
    p.add_argument("--activation", choices=ACTIVATIONS, default="elu")
    p.add_argument("--dataset", choices=DATASET_NAMES, default="embedded")
    p.add_argument(
        "--data-dir", default=None, help="default: $PATHNORM_DATA_DIR or ~/.cache/pathnorm"
    )
    p.add_argument(
        "--allow-partial",
        action="store_true",
        help="accept a partial training set (KMNIST offline copy)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip SHA-256 checks of data files")
    p.add_argument("--n-train", type=int, default=None, help="use only the first N train samples")
    p.add_argument("--n-test", type=int, default=None, help="use only the first N test samples")
    p.add_argument("--eps", type=float, nargs="+", default=list(DEFAULT_EPS))
    p.add_argument("--pgd-steps", type=int, default=40)
    p.add_argument(
        "--attack",
        choices=ATTACKS,
        default="ce",
        help="ce: the paper's PGD on the cross-entropy; ce+margin: also PGD on the CW margin "
        "(an example is robust only if both fail; stronger, twice the time)",
    )
    p.add_argument(
        "--pgd-samples",
        type=nonnegative_int("all test images"),
        default=1000,
        help="test images attacked (0: all)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=nonnegative_int("the framework's default"),
        default=1,
        help="CPU threads (default 1: a 784-200-10 MLP at batch 100 gains little from more, and "
        "on a shared machine extra threads slow it down several-fold; 0: framework default)",
    )
    p.add_argument("--out", default="pathnorm_run", help="output directory for results.json/csv")
    p.add_argument("--no-progress", action="store_true")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load data, train with the chosen backend, evaluate, write results; returns the result."""
    cfg = TrainConfig(
        regularizer=args.regularizer,
        method=args.method,
        lam=args.lam,
        lr=args.lr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        hidden=tuple(args.hidden),
        activation=args.activation,
        seed=args.seed,
        eps=tuple(args.eps),
        pgd_steps=args.pgd_steps,
        attack=args.attack,
        pgd_samples=args.pgd_samples or None,
        eval_train_samples=None,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = load_dataset(
            args.dataset, args.data_dir, allow_partial=args.allow_partial, verify=not args.no_verify
        )
    for w in caught:
        print(f"WARNING: {w.message}", file=sys.stderr)
    if args.n_train is not None or args.n_test is not None:
        data = data.subset(args.n_train, args.n_test)
    progress = not args.no_progress
    if args.backend == "torch":
        import torch

        if args.threads > 0:
            torch.set_num_threads(args.threads)
        if args.engine == "lightning":
            from pathnorm_experiments.lightning_module import train_lightning

            _, result = train_lightning(cfg, data, progress=progress)
        else:
            from pathnorm_experiments.torch_backend import train_loop

            _, result = train_loop(cfg, data, progress=progress)
    else:
        from pathnorm_experiments.tf_backend import train_keras

        _, result = train_keras(cfg, data, progress=progress, threads=args.threads or None)
    result["engine"] = args.engine if args.backend == "torch" else "keras"
    jpath, cpath = write_results(result, args.out)
    print(format_summary(result))
    print(f"wrote {jpath} and {cpath}")
    return result


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``pathnorm-train``."""
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (DataError, ValueError, FloatingPointError) as e:
        print(f"pathnorm-train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
