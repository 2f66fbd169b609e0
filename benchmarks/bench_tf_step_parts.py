"""Where the Keras prox's time goes inside a compiled train step, as numbers from one run.

The paper's network (784-200-10, ELU, batch 100, MNIST or random data of that shape) is trained
by ``train_on_batch`` (XLA) with ``keras.optimizers.SGD`` and with ``PathNormSGD`` whose prox is
replaced, for the measurement only, by parts of it:

* ``identity``: the kernels unchanged (what the optimizer's machinery around the prox costs);
* ``write``: the final soft-threshold of both kernels only (thresholds from ``kernel_out``);
* ``sums``: ``--sums`` sums per unit over ``kernel_in`` (the long side), each one reduced by
  itself (:func:`pathnorm_tf._xla.reduce_units`: a loop over the long side each), then the
  write;
* ``pairs``: the same sums reduced two at a time, as the prox reduces its statistics
  (:func:`pathnorm_tf._xla.unit_sums`: one loop per pair), then the write; the band prox
  reduces two such pairs (four sums and the packed counts), plus one loop per band entry when
  a unit's band is not empty;
* ``prox``: the real prox.

The models train in turn, ``--steps`` steps each per round, so that all see the same machine
load; the medians over ``--rounds`` rounds of the extra time per step over ``SGD`` are printed.
On XLA's CPU backend each reduced statistic is a loop of its own over the whole long side, and
in a train step that loop reads the kernel from a cache level below the one it sits in when the
prox runs alone (the batch, activations and gradients share the caches).

    python benchmarks/bench_tf_step_parts.py [--rounds 25] [--steps 100] [--threads 1]
        [--sums 4] [--lam 1e-4] [--lr 0.1] [--data-dir DIR]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf
from bench_tf import ENV_DATA, load_mnist, paper_mlp

import pathnorm_tf.optimizers as optimizers
from pathnorm_tf import PathNormSGD, _xla
from pathnorm_tf import functional as F

Kernels = tuple[tf.Tensor, tf.Tensor]


def _write(k_in: tf.Tensor, k_out: tf.Tensor, t_in: tf.Tensor) -> Kernels:
    """The prox's final soft-threshold of both kernels, thresholds ``t_in`` (n,) in float64."""
    t_out = tf.reshape(t_in, [-1, 1])
    new_in = F._soft_threshold_exact(k_in, tf.reshape(t_in, [1, -1]))
    return new_in, F._soft_threshold_exact(k_out, t_out)


def _sums_then_write(
    k_in: tf.Tensor, k_out: tf.Tensor, lam: Any, sums: int, pairs: bool
) -> Kernels:
    """``sums`` per-unit reductions over ``|k_in|`` of the prox's kinds (two at a time if
    ``pairs``), then the write; the thresholds depend on every sum, so none is optimized away
    (they are ~1e-12 of a weight)."""
    x1 = tf.reduce_sum(tf.abs(tf.cast(k_out, tf.float64)), 1)  # (n,)
    (tau,) = _xla.materialized(tf.cast(tf.cast(lam, tf.float64) * x1, k_in.dtype)[tf.newaxis, :])
    ay = tf.abs(k_in)
    r = tf.maximum(ay - tau, 0.0)
    kinds = [ay * ay, r * r, r, tf.cast(ay > tau, ay.dtype), tf.where(ay > 0.5 * tau, ay, 0.0)]
    terms = [kinds[i % len(kinds)] * (1.0 + i) for i in range(sums)]
    parts: list[tf.Tensor] = []
    while terms:
        if pairs and len(terms) > 1:
            parts += _xla.unit_sums(terms.pop(0), terms.pop(0), 1)
        else:
            parts.append(_xla.reduce_units(tf.reduce_sum, terms.pop(0), 1))
    total = tf.add_n([tf.cast(tf.reshape(part, [-1]), tf.float64) for part in parts])
    return _write(k_in, k_out, total * 1e-12)


def variants(sums: int) -> dict[str, Callable[..., Kernels]]:
    real = optimizers._prox_kernels
    zero = tf.constant(0.0, tf.float64)
    return {
        "identity": lambda k_in, k_out, lam, method="auto": (k_in, k_out),
        "write": lambda k_in, k_out, lam, method="auto": _write(
            k_in, k_out, zero * tf.reduce_sum(tf.cast(k_out, tf.float64), 1)
        ),
        f"sums ({sums})": lambda k_in, k_out, lam, method="auto": _sums_then_write(
            k_in, k_out, lam, sums, False
        ),
        f"pairs ({sums})": lambda k_in, k_out, lam, method="auto": _sums_then_write(
            k_in, k_out, lam, sums, True
        ),
        "prox": real,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--steps", type=int, default=100, help="steps per model per round")
    parser.add_argument("--threads", type=int, default=1, help="TF threads (0: default)")
    parser.add_argument("--sums", type=int, default=4, help="sums in the 'sums' parts")
    parser.add_argument("--lam", type=float, default=1e-4)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(ENV_DATA) if ENV_DATA else None,
        help="folder holding mnist/*.gz (default: $PATHNORM_DATA_DIR)",
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1 or args.sums < 1 or args.threads < 0:
        parser.error("--rounds, --steps and --sums must be >= 1, --threads >= 0")
    if args.threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    x, y, source = load_mnist(args.data_dir)
    batches = [
        (tf.constant(x[i : i + 100]), tf.constant(y[i : i + 100])) for i in range(0, len(x), 100)
    ]
    models = {"SGD": paper_mlp(keras.optimizers.SGD(args.lr), True)}
    models["SGD"].train_on_batch(*batches[0])
    real = optimizers._prox_kernels
    try:
        for name, fn in variants(args.sums).items():
            optimizers._prox_kernels = fn  # read when the step is traced (its first call)
            # the parts replace the prox, so no finiteness verdict (the real prox's too, alike)
            opt = PathNormSGD(args.lr, lam=args.lam, check_finite=False)
            models[name] = paper_mlp(opt, True)
            models[name].train_on_batch(*batches[0])
    finally:
        optimizers._prox_kernels = real
    for model in models.values():  # one epoch each: weights as in training
        for xb, yb in batches:
            model.train_on_batch(xb, yb)
    load_before = os.getloadavg()[0]
    per_step: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        start = (r * args.steps) % len(batches)
        chunk = [batches[(start + i) % len(batches)] for i in range(args.steps)]
        for name, model in models.items():
            t0 = time.perf_counter()
            for xb, yb in chunk:
                model.train_on_batch(xb, yb)
            per_step[name].append((time.perf_counter() - t0) / args.steps * 1e6)
    med = {name: statistics.median(v) for name, v in per_step.items()}
    base = med["SGD"]
    print(
        f"TensorFlow {tf.__version__}, {args.threads or os.cpu_count()} threads, {source}; "
        f"PathNormSGD lam {args.lam}, lr {args.lr}; median of {args.rounds} rounds of "
        f"{args.steps} train_on_batch steps"
    )
    print(f"1-minute load average: {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"SGD step: {base:.0f} us")
    for name in list(models)[1:]:
        extra = med[name] - base
        print(f"  {name:12s} +{extra:6.1f} us per step ({med[name] / base:.3f}x SGD)")


if __name__ == "__main__":
    main()
