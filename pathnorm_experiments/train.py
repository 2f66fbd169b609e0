"""``pathnorm-train``: train the paper's network once, attack it, certify it, write JSON + CSV
(and a training-curve PNG when matplotlib is installed)."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pathnorm_experiments import deps
from pathnorm_experiments.data import DATASET_NAMES, DataError, load_dataset
from pathnorm_experiments.evaluation import format_summary
from pathnorm_experiments.results import unwritable_dir, write_results
from pathnorm_experiments.settings import (
    ACTIVATIONS,
    ATTACKS,
    DTYPES,
    EPS,
    MODELS,
    OPTIMIZERS,
    REGULARIZERS,
    TrainConfig,
)

__all__ = ["OUTPUT_FILES", "OutputError", "build_parser", "check_out", "main", "run"]


def nonnegative_int(zero_means: str) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= 0, where 0 means ``zero_means``."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0 (0: {zero_means}), got {n}")
        return n

    return parse


DEFAULT_EPOCHS = 20  # the paper's
OUTPUT_FILES = ("results.json", "results.csv", "training_curve.png")
EXAMPLES = """examples (the embedded MNIST subset needs no download; 10-40 s each on 2 cores):
  pathnorm-train --regularizer path --lam 1e-3
  pathnorm-train --model conv --lam 1e-4
  pathnorm-train --backend tf --regularizer l1 --method penalty --lam 1e-4
  pathnorm-train --dataset mnist --data-dir /data --epochs 20 --out runs/mnist_path
"""


class OutputError(ValueError):
    """``--out`` cannot take the results (the message says why and what to do)."""


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the epilog's line breaks and appends every option's default to its help."""


def _hidden(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--hidden takes comma-separated widths such as 200 or 200,100,50, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="pathnorm-train",
        description="Train the paper's MLP (or its convolutional twin, --model conv) with\n"
        "1-path-norm / l1 / layer-wise linf regularization\n"
        "(proximal SGD or penalty SGD), then report clean, PGD-robust and certified error\n"
        "(Lipschitz and interval bound propagation).",
        epilog=EXAMPLES,
        formatter_class=_Formatter,
    )
    g = p.add_argument_group("model and training")
    g.add_argument(
        "--backend",
        choices=("auto", "torch", "tf"),
        default="auto",
        help="auto: torch if PyTorch is installed, else tf (TensorFlow + Keras)",
    )
    g.add_argument(
        "--engine",
        choices=("lightning", "loop"),
        default="lightning",
        help="torch only: Lightning Trainer + library callbacks, or the plain torch "
        "loop with the library's functional prox (the sweep's engine)",
    )
    g.add_argument(
        "--model",
        choices=MODELS,
        default="mlp",
        help="mlp: the paper's 784-hidden-10 network; conv: its convolutional twin, "
        "Conv2d(1, C, kernel, stride) without padding -> activation -> Flatten -> Linear(10)",
    )
    g.add_argument("--regularizer", choices=REGULARIZERS, default="path", help="the regularizer")
    g.add_argument(
        "--method",
        choices=OPTIMIZERS,
        default="prox",
        help="prox: proximal SGD (projection for linf); penalty: SGD on CE + lam*g",
    )
    g.add_argument("--lam", type=float, default=1e-3, help="lambda; linf: radius 1/lam")
    g.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (constant)")
    g.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="training epochs")
    g.add_argument("--batch-size", type=int, default=100, help="minibatch size")
    g.add_argument(
        "--hidden",
        type=_hidden,
        default=None,
        help="mlp: hidden widths, e.g. 200 or 400,200,100 (path needs an odd count); conv: the "
        "convolution's channels (None: 200 for mlp, 32 for conv)",
    )
    g.add_argument("--kernel-size", type=int, default=None, help="conv only: the kernel (None: 5)")
    g.add_argument("--stride", type=int, default=None, help="conv only: the stride (None: 2)")
    g.add_argument("--activation", choices=ACTIVATIONS, default="elu", help="hidden activation")
    g.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="weights and data in training and evaluation (float64: for checks, slower)",
    )

    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=DATASET_NAMES, default="embedded", help="the data")
    g.add_argument(
        "--data-dir", default=None, help="None: $PATHNORM_DATA_DIR, else ~/.cache/pathnorm"
    )
    g.add_argument(
        "--allow-partial",
        action="store_true",
        help="accept a partial training set (KMNIST offline copy)",
    )
    g.add_argument("--no-verify", action="store_true", help="skip SHA-256 checks of data files")
    for split in ("train", "test"):
        help_ = f"use only the first N {split} samples (None: all)"
        g.add_argument(f"--n-{split}", type=int, default=None, help=help_)

    g = p.add_argument_group("evaluation")
    g.add_argument("--eps", type=float, nargs="+", default=list(EPS), help="l_inf attack radii")
    g.add_argument("--pgd-steps", type=int, default=40, help="PGD steps (of eps/20 each)")
    g.add_argument(
        "--attack",
        choices=ATTACKS,
        default="ce",
        help="ce: the paper's PGD on the cross-entropy; ce+margin: also PGD on the CW margin "
        "(an example is robust only if both fail; stronger, twice the time)",
    )
    g.add_argument(
        "--pgd-samples",
        type=nonnegative_int("all test images"),
        default=1000,
        help="test images attacked (0: all)",
    )

    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial weights and shuffle")
    g.add_argument(
        "--threads",
        type=nonnegative_int("the framework's default"),
        default=1,
        help="CPU threads (1: a 784-200-10 MLP at batch 100 gains little from more, and "
        "on a shared machine extra threads slow it down several-fold; 0: framework default)",
    )
    g.add_argument(
        "--out", default="pathnorm_run", help="output directory for results.json/csv and the plot"
    )
    g.add_argument("--overwrite", action="store_true", help="replace the results already in --out")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_out(out: str | Path, overwrite: bool) -> None:
    """Check before any training that ``out`` (made later if missing) can take the results.

    Raises:
        OutputError: ``out`` is a file, lies under a file, is not writable, or holds results
            and ``overwrite`` is False.
    """
    out = Path(out)
    problem = unwritable_dir(out)
    if problem is not None:
        raise OutputError(f"--out {out}: {problem}: choose another --out")
    present = [f for f in OUTPUT_FILES if (out / f).exists()]
    if present and not overwrite:
        raise OutputError(
            f"--out {out} already holds results ({', '.join(present)}): pass --overwrite "
            "to replace them, or choose another --out"
        )


def _backend(args: argparse.Namespace) -> str:
    """The backend to run (``auto`` resolved), after checking its packages are installed."""
    if args.backend == "auto" and deps.missing(("torch",)) and deps.missing(("tensorflow",)):
        raise deps.MissingDependency(
            "pathnorm-train needs a backend, and neither is installed: "
            f"{deps.pip_install('torch')} (PyTorch) or {deps.pip_install('tf-cpu')} (TensorFlow "
            f"and Keras){deps.where()}{deps.cpu_note(['torch'])}"
        )
    backend = deps.default_backend() if args.backend == "auto" else args.backend
    if backend == "torch" and args.engine == "lightning":
        deps.require(("torch", "lightning"), "--backend torch (with --engine lightning)")
    else:
        deps.require(deps.BACKEND_MODULES[backend], f"--backend {backend}")
    return backend


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the setup, load data, train, evaluate, print the summary, write the results;
    returns the result dict (as written to ``results.json``)."""
    conv = args.model == "conv"
    for option, value in (("--kernel-size", args.kernel_size), ("--stride", args.stride)):
        if value is not None and not conv:
            raise ValueError(f"{option} is the conv network's: add --model conv, or drop it")
    hidden = args.hidden if args.hidden is not None else ((32,) if conv else (200,))
    cfg = TrainConfig(
        model=args.model,
        kernel_size=5 if args.kernel_size is None else args.kernel_size,
        stride=2 if args.stride is None else args.stride,
        regularizer=args.regularizer,
        method=args.method,
        lam=args.lam,
        lr=args.lr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        hidden=tuple(hidden),
        activation=args.activation,
        seed=args.seed,
        dtype=args.dtype,
        eps=tuple(args.eps),
        pgd_steps=args.pgd_steps,
        attack=args.attack,
        pgd_samples=args.pgd_samples or None,
        eval_train_samples=None,
    )
    backend = _backend(args)
    check_out(args.out, args.overwrite)  # before training, so no result is lost at the end
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
    model: Any  # the trained network (compacted after the summary)
    if backend == "torch":
        import torch

        if args.threads > 0:
            torch.set_num_threads(args.threads)
        if args.engine == "lightning":
            from pathnorm_experiments.lightning_module import train_lightning

            model, result = train_lightning(cfg, data, progress=progress)
        else:
            from pathnorm_experiments.engine import train_loop

            model, result = train_loop(cfg, data, progress=progress)
    else:
        from pathnorm_experiments.tf_backend import train_keras

        model, result = train_keras(cfg, data, progress=progress, threads=args.threads or None)
    result["engine"] = args.engine if backend == "torch" else "keras"
    print(format_summary(result), flush=True)
    from pathnorm_experiments import compaction  # the compacted network: printed and recorded

    result["compaction"] = compaction.measure(model, data.x_test, backend)
    print(compaction.format_compaction(result["compaction"]), flush=True)
    _write(result, Path(args.out))
    return result


def _write(result: dict[str, Any], out: Path) -> None:
    """Write the result files (the summary is already printed, so a failure loses no numbers)."""
    try:
        jpath, cpath = write_results(result, out)
        png = out / "training_curve.png"
        if deps.missing(("matplotlib",)):
            png.unlink(missing_ok=True)  # an earlier run's plot would not match these results
            print(
                f"wrote {jpath} and {cpath} (no training-curve plot: matplotlib is not installed; "
                f"{deps.pip_install('experiments')}{deps.where()} adds it)"
            )
            return
        from pathnorm_experiments.evaluation import plot_training_curve

        plot_training_curve(result, png)
    except OSError as e:
        raise OutputError(
            f"could not write the results to {out} ({e}); the summary above holds the numbers"
        ) from None
    print(f"wrote {jpath}, {cpath} and the training curve {png}")


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``pathnorm-train``."""
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (DataError, ValueError, FloatingPointError, deps.MissingDependency) as e:
        print(f"pathnorm-train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
