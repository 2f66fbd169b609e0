"""TensorFlow / Keras cost of the exact path-norm prox, as numbers measured in one run.

1. Prox time of ``pathnorm_tf.prox_path_norm`` in float32 on the paper's shapes (m-n-p:
   ``Dense(n) -> ELU -> Dense(p)`` on m inputs), eagerly, in ``tf.function`` and under XLA
   (``jit_compile=True``; per call, and per prox inside one compiled loop, i.e. without the
   call's dispatch, as inside a compiled train step), with ``method="band"`` (the default)
   and ``method="sort"``. (torch's prox has its own script, ``bench_prox.py``: timing both
   frameworks in one process makes their thread pools fight over the cores.)
2. Epoch time of the paper's network (784-200-10, ELU, batch 100, 60,000 MNIST training images
   from ``--data-dir`` (default ``$PATHNORM_DATA_DIR``), read by the project's checked loader,
   or random data of the same shape) trained by ``model.fit``
   with ``keras.optimizers.SGD`` and with ``PathNormSGD``; epochs alternate in one process, so
   both see the same machine load; the medians and their ratio are printed, for wall-clock
   time and for the process's CPU time. ``--driver train_on_batch`` runs the same 600 steps
   as ``train_on_batch`` calls on prepared batches instead: on a loaded machine, ``fit``'s
   hand-offs between the tf.data threads and the step can lose whole multiples of ~1 ms per
   step (epochs then take 1x, 2x or 4x a fixed time), which hides the step's own cost.

    python benchmarks/bench_tf.py [--repeats 3] [--jit 1|0] [--lam 1e-4] [--lr 0.1] [--threads 1]
        [--driver fit|train_on_batch] [--prox-lam 1e-3] [--methods band,sort] [--markdown]

``--threads N`` pins TensorFlow's intra- and inter-op thread pools (and XLA's) to N threads
(0: TensorFlow's default, all cores); ``--threads 1`` gives reproducible numbers on a busy
machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import pathnorm_tf
from pathnorm_experiments.data import DataError, load_dataset
from pathnorm_tf import PathNormSGD, ProxOptimizer, prox_path_norm

SHAPES = [(784, 200, 10), (784, 200, 1), (784, 1000, 10), (512, 512, 512)]
ENV_DATA = os.environ.get("PATHNORM_DATA_DIR")


def timeit(fn: Callable[[], object], min_time: float = 0.5) -> float:
    """Median seconds per call over repeated calls (after warm-up)."""
    for _ in range(2):
        fn()
    samples: list[float] = []
    deadline = time.perf_counter() + min_time
    while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 50):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def trained_like(m: int, n: int, p: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Glorot-scale random kernels (Keras layout), float32."""
    rng = np.random.default_rng(seed)
    k_in = rng.uniform(-1, 1, (m, n)) * np.sqrt(6 / (m + n))
    k_out = rng.uniform(-1, 1, (n, p)) * np.sqrt(6 / (n + p))
    return k_in.astype(np.float32), k_out.astype(np.float32)


def xla_loop_time(
    prox: Callable[[tf.Tensor, tf.Tensor, tf.Tensor], tuple[tf.Tensor, tf.Tensor]],
    k_in: tf.Tensor,
    k_out: tf.Tensor,
    lam: tf.Tensor,
    calls: int = 20,
) -> float:
    """Seconds per prox inside one XLA computation (as in a compiled train step): ``calls``
    proxes in a ``tf.while_loop`` on inputs perturbed below rounding (so nothing is hoisted),
    results kept as loop state (so they are written out); no per-call dispatch."""

    def loop(a: tf.Tensor, b: tf.Tensor, t: tf.Tensor) -> tf.Tensor:
        def body(i: tf.Tensor, out_a: tf.Tensor, out_b: tf.Tensor) -> tuple[tf.Tensor, ...]:
            tiny = tf.cast(i, a.dtype) * 1e-30
            new_a, new_b = prox(a + tiny, b + tiny, t)
            return i + 1, new_a, new_b

        state = (tf.constant(0), tf.zeros_like(a), tf.zeros_like(b))
        _, out_a, out_b = tf.while_loop(lambda i, *_: i < calls, body, state)
        return out_a[0, 0] + out_b[0, 0]

    compiled = tf.function(loop, jit_compile=True)
    return timeit(lambda: compiled(k_in, k_out, lam).numpy()) / calls


def bench_shape(m: int, n: int, p: int, lam: float, method: str) -> dict[str, object]:
    k_in_np, k_out_np = trained_like(m, n, p)
    k_in, k_out = tf.constant(k_in_np), tf.constant(k_out_np)
    lam_t = tf.constant(lam)

    def prox(a: tf.Tensor, b: tf.Tensor, t: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return prox_path_norm(a, b, t, check_finite=False, method=method)

    graph = tf.function(prox)
    xla = tf.function(prox, jit_compile=True)
    return {
        "shape": f"{m}-{n}-{p}",
        "method": method,
        "eager": timeit(lambda: prox(k_in, k_out, lam)[0].numpy()),
        "tf.function": timeit(lambda: graph(k_in, k_out, lam_t)[0].numpy()),
        "xla": timeit(lambda: xla(k_in, k_out, lam_t)[0].numpy()),
        "xla (in loop)": xla_loop_time(prox, k_in, k_out, lam_t),
    }


def bench_prox(lam: float, methods: list[str]) -> list[dict[str, object]]:
    rows = []
    for m, n, p in SHAPES:
        for method in methods:
            row = bench_shape(m, n, p, lam, method)
            rows.append(row)
            times = ", ".join(
                f"{k} {1e3 * float(v):.2f} ms"  # type: ignore[arg-type]
                for k, v in row.items()
                if k not in ("shape", "method")
            )
            print(f"prox {row['shape']:>12} ({method}): {times}", flush=True)
    return rows


def load_mnist(data_dir: Path | None) -> tuple[np.ndarray, np.ndarray, str]:
    """MNIST's training set through the project's checked loader, or random data of its shape
    when it is absent."""
    try:
        d = load_dataset("mnist", data_dir)
    except DataError:
        rng = np.random.default_rng(0)
        x = rng.random((60000, 784), dtype=np.float32)
        return x, rng.integers(0, 10, 60000), "random data of MNIST's shape (60,000)"
    return d.x_train, d.y_train.astype(np.int64), "MNIST train (60,000 images)"


def paper_mlp(optimizer: keras.optimizers.Optimizer, jit: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((784,)), keras.layers.Dense(200, activation="elu"), keras.layers.Dense(10)]
    )
    if isinstance(optimizer, PathNormSGD | ProxOptimizer):
        optimizer.verify_pairs(model)  # show it the model (pairs="auto" checked against it)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit,
    )
    return model


def bench_epoch(
    repeats: int, jit: bool, lam: float, lr: float, driver: str, data_dir: Path | None
) -> dict[str, object]:
    x, y, source = load_mnist(data_dir)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(100).cache().prefetch(2)
    batches = [
        (tf.constant(x[i : i + 100]), tf.constant(y[i : i + 100])) for i in range(0, len(x), 100)
    ]
    models = {
        "SGD": paper_mlp(keras.optimizers.SGD(lr), jit),
        "PathNormSGD": paper_mlp(PathNormSGD(lr, lam=lam), jit),
    }

    def epoch(model: keras.Model) -> None:
        if driver == "fit":
            model.fit(dataset, epochs=1, verbose=0)
        else:  # the same 600 steps, one train_on_batch call each: no tf.data threads
            for xb, yb in batches:
                model.train_on_batch(xb, yb)

    for model in models.values():  # warm-up: tracing, compilation, dataset cache
        epoch(model)
    times: dict[str, list[float]] = {name: [] for name in models}
    cpu: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            t0, c0 = time.perf_counter(), time.process_time()
            epoch(model)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    sgd = statistics.median(times["SGD"])
    prox = statistics.median(times["PathNormSGD"])
    sgd_cpu = statistics.median(cpu["SGD"])
    prox_cpu = statistics.median(cpu["PathNormSGD"])
    kernel = models["PathNormSGD"].layers[0].kernel.numpy()
    result = {
        "data": source,
        "jit_compile": jit,
        "driver": driver,
        "SGD": sgd,
        "PathNormSGD": prox,
        "ratio": prox / sgd,
        "per_step_extra_ms": 1e3 * (prox - sgd) / 600,
        "SGD_cpu": sgd_cpu,
        "PathNormSGD_cpu": prox_cpu,
        "cpu_ratio": prox_cpu / sgd_cpu,
        "sparsity_first_kernel": float(np.mean(kernel == 0)),
    }
    print(
        f"epoch ({source}, jit_compile={jit}, {driver}): SGD {sgd:.2f} s, PathNormSGD {prox:.2f} s, "
        f"ratio {prox / sgd:.2f}x ({result['per_step_extra_ms']:.2f} ms extra per step); "
        f"process CPU time: SGD {sgd_cpu:.2f} s, PathNormSGD {prox_cpu:.2f} s, "
        f"ratio {prox_cpu / sgd_cpu:.2f}x",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jit", type=int, choices=[0, 1], default=1)
    parser.add_argument("--lam", type=float, default=1e-4)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=0, help="TF threads (0: default)")
    parser.add_argument(
        "--prox-lam", type=float, default=None, help="prox step of the prox timings (lam * lr)"
    )
    parser.add_argument("--methods", default="band,sort", help="prox methods to time")
    parser.add_argument(
        "--driver",
        choices=["fit", "train_on_batch"],
        default="fit",
        help="run an epoch by model.fit (tf.data) or by 600 train_on_batch calls",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(ENV_DATA) if ENV_DATA else None,
        help="folder holding mnist/*.gz (default: $PATHNORM_DATA_DIR)",
    )
    parser.add_argument("--skip-prox", action="store_true")
    parser.add_argument("--skip-epoch", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = parser.parse_args()
    if args.threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    threads = args.threads or os.cpu_count()
    prox_lam = args.lam * args.lr if args.prox_lam is None else args.prox_lam
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {threads} threads")
    print(f"pathnorm_tf from {Path(pathnorm_tf.__file__).parent}; prox step {prox_lam:g}")
    rows = [] if args.skip_prox else bench_prox(prox_lam, args.methods.split(","))
    epoch = (
        None
        if args.skip_epoch
        else bench_epoch(
            args.repeats, bool(args.jit), args.lam, args.lr, args.driver, args.data_dir
        )
    )
    if args.markdown:
        if rows:
            cols = ["eager", "tf.function", "xla", "xla (in loop)"]
            print("\n| shape (m-n-p) | method | " + " | ".join(f"{c} (ms)" for c in cols) + " |")
            print("|---|---|" + "---:|" * len(cols))
            for row in rows:
                cells = " | ".join(f"{1e3 * float(row[c]):.2f}" for c in cols)  # type: ignore[arg-type]
                print(f"| {row['shape']} | {row['method']} | {cells} |")
        if epoch:
            print("\n| optimizer | epoch (s) |\n|---|---:|")
            print(f"| keras.optimizers.SGD | {epoch['SGD']:.2f} |")
            print(f"| PathNormSGD | {epoch['PathNormSGD']:.2f} |")
            print(f"| ratio | {epoch['ratio']:.2f}x |")
            print(f"| ratio of process CPU times | {epoch['cpu_ratio']:.2f}x |")


if __name__ == "__main__":
    main()
