"""What the prox adds to a training step, as a median with a 95% confidence interval.

The paper's network (784-200-10, ELU, SGD, batch 100; MNIST's 60,000 training images from
``--data-dir``, default ``$PATHNORM_DATA_DIR``, read by the checked loader of
``pathnorm_experiments.data``, or random data of that shape, said so in the output) trains
twice in one process and one thread, as two greenlets: a plain run and a run with the prox.
They take turns in short windows of ``--window`` steps, the order swapped every pair; each run
keeps its own data order, the same in both. Each window is timed from the moment its
run resumes to the end of its last step's ``on_train_batch_end``: exactly ``--window`` full
cycles of the training loop (data, step, callbacks, the loop's own work), no hand-off and no
per-``fit`` cost counted. Wall and process CPU time are read for every window.

* ``--backend lightning``: two ``Trainer.fit`` runs of the same ``LightningModule`` (same
  seed); the plain one has only the window callback (in both), the other adds
  ``PathNormProx(lam)`` with its defaults (``check_finite=True``, metrics logged at the
  trainer's ``log_every_n_steps``). The plain window is plain Lightning training: nothing of
  the prox is registered in its trainer or on its optimizer.
* ``--backend keras``: two compiled models (``jit_compile=True``), ``keras.optimizers.SGD``
  and ``PathNormSGD(lam)`` (its defaults), each in one ``model.fit`` on a repeated tf.data
  pipeline (the headline, ``--driver fit``); with ``--driver both`` (the default) the same
  models then also take turns by ``train_on_batch`` on prepared batches, which shows the
  step without tf.data's thread hand-offs. The window callback's ``on_train_batch_end`` makes
  Keras dispatch callbacks synchronously, in both runs alike.

The prox's own time: for torch, every call of the planned prox the hook makes (the numba
kernel with its finiteness check, as ``functional.planned_prox`` gives it) is timed inside the
prox run's steps, its mean per window; for Keras, between pairs, with both runs paused, the
prox alone on the prox run's current weights moved by the last gradient:
``_prox_kernels`` (what ``PathNormSGD`` runs) per call inside one XLA loop for Keras (the
loop's fixed cost removed by timing two loop lengths). Per pair: the extra per step
``(with - without) / window`` and the ratio ``with / without`` (an epoch's ratio: an epoch is
600 such steps); the hook's own cost is the extra per step less the prox's time. Medians over
pairs, with 95% bootstrap intervals (pairs resampled, ``--bootstrap`` times).

    python benchmarks/bench_overhead.py --backend lightning|keras [--pairs 200] [--window 50]
        [--warmup 10] [--threads N] [--lam 1e-4] [--lr 0.1] [--driver fit|train_on_batch|both]
        [--markdown]

Run each backend in its own process (their thread pools would fight over the cores).
``--threads N`` sets torch's (or TensorFlow's) thread pools; by default they are left alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import logging
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

try:
    import greenlet
except ModuleNotFoundError as err:  # the "bench" extra
    raise SystemExit(
        "bench_overhead.py needs greenlet (its two runs share one thread): "
        'pip install -e ".[bench]" (or pip install greenlet)'
    ) from err

ENV_DATA = os.environ.get("PATHNORM_DATA_DIR")
BATCH = 100
EPOCH_STEPS = 600


# --- two runs taking turns -------------------------------------------------------------------
class Lane:
    """One training run in a greenlet, paused between windows of ``window`` steps.

    The run's callback calls :meth:`begin` before its first step and :meth:`batch_end` after
    every step; the caller's :meth:`run_window` switches to the run until its window ends. A
    window's clock starts when the run resumes and stops at the end of its ``window``-th step.

    Greenlets, not threads: both runs then train in the process's one OS thread, as a user's
    ``fit`` does. A second OS thread that calls torch starts a second OpenMP team; with more
    OpenMP threads than cores, GNU OpenMP stops spinning between parallel regions, every region
    wakes a sleeping worker, and the plain Lightning step of this benchmark took 2.3 ms instead
    of 1.2 ms (which made the prox's share look smaller than it is).
    """

    def __init__(self, name: str, window: int, train: Callable[[Lane], object]) -> None:
        self.name, self.window = name, window
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.stop = False
        self.error: BaseException | None = None
        self._count = 0
        self._t0 = self._c0 = 0.0
        self._caller = greenlet.getcurrent()
        self._run = greenlet.greenlet(self._main)
        self._run.switch(train)  # returns when the run pauses before its first step
        self._check()

    def begin(self) -> None:
        self._pause()

    def batch_end(self) -> bool:
        """Count a step; at a window's end record it and pause. True: stop training now."""
        self._count += 1
        if self._count % self.window:
            return False
        self.wall.append(time.perf_counter() - self._t0)
        self.cpu.append(time.process_time() - self._c0)
        return self._pause()

    def run_window(self) -> None:
        self._run.switch()
        self._check()

    def finish(self) -> None:
        self.stop = True
        if not self._run.dead:
            self._run.switch()
        if self.error is not None:
            raise self.error

    def _pause(self) -> bool:
        self._caller.switch()
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        return self.stop

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the {self.name} run failed: {self.error!r}") from self.error
        if self._run.dead:
            raise RuntimeError(f"the {self.name} run ended before its windows were done")

    def _main(self, train: Callable[[Lane], object]) -> None:
        try:
            train(self)
        except BaseException as err:  # reported by the caller
            self.error = err


@dataclass
class Result:
    """Per pair: seconds per window with and without the prox, and seconds per prox call."""

    label: str
    window: int
    on: list[float] = field(default_factory=list)
    off: list[float] = field(default_factory=list)
    on_cpu: list[float] = field(default_factory=list)
    off_cpu: list[float] = field(default_factory=list)
    prox: list[float] = field(default_factory=list)


def interleave(
    label: str,
    on: Lane,
    off: Lane,
    pairs: int,
    warmup: int,
    prox_time: Callable[[], float],
) -> Result:
    """Run ``warmup + pairs`` pairs of windows (order swapped every pair), timing the prox
    between pairs; the warm-up pairs are dropped."""
    prox: list[float] = []
    try:
        for i in range(warmup + pairs):
            for lane in (on, off) if i % 2 == 0 else (off, on):
                lane.run_window()
            if i >= warmup:
                prox.append(prox_time())
    finally:
        for lane in (on, off):
            lane.finish()
    w = slice(warmup, warmup + pairs)
    return Result(label, on.window, on.wall[w], off.wall[w], on.cpu[w], off.cpu[w], prox)


# --- statistics ----------------------------------------------------------------------------
def bootstrap(
    stat: Callable[[np.ndarray], np.ndarray], columns: np.ndarray, n: int, seed: int = 0
) -> tuple[float, float, float]:
    """``stat`` of the pairs (rows of ``columns``) and its 95% percentile bootstrap interval;
    ``stat`` maps a (resamples, pairs, columns) array to one value per resample."""
    rng = np.random.default_rng(seed)
    value = float(stat(columns[None])[0])
    idx = rng.integers(0, len(columns), (n, len(columns)))
    dist = stat(columns[idx])
    lo, hi = np.percentile(dist, [2.5, 97.5])
    return value, float(lo), float(hi)


def summarize(r: Result, n_boot: int) -> dict[str, tuple[float, float, float]]:
    """Each reported measure as (median estimate, low, high)."""
    cols = np.column_stack([r.on, r.off, r.on_cpu, r.off_cpu, r.prox]).astype(np.float64)
    w = r.window
    per_step = 1e3 / w  # seconds per window -> ms per step

    def med(f: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
        return lambda a: np.median(f(a), axis=1)

    return {
        "plain step (ms)": bootstrap(med(lambda a: a[..., 1] * per_step), cols, n_boot),
        "step with the prox (ms)": bootstrap(med(lambda a: a[..., 0] * per_step), cols, n_boot),
        "extra per step (ms)": bootstrap(
            med(lambda a: (a[..., 0] - a[..., 1]) * per_step), cols, n_boot
        ),
        "epoch ratio, wall": bootstrap(med(lambda a: a[..., 0] / a[..., 1]), cols, n_boot),
        "epoch ratio, process CPU": bootstrap(med(lambda a: a[..., 2] / a[..., 3]), cols, n_boot),
        "epoch ratio, total time": bootstrap(
            lambda a: a[..., 0].sum(axis=1) / a[..., 1].sum(axis=1), cols, n_boot
        ),
        "prox alone (ms)": bootstrap(med(lambda a: a[..., 4] * 1e3), cols, n_boot),
        "hook's own cost (ms)": bootstrap(
            lambda a: (
                np.median((a[..., 0] - a[..., 1]) * per_step, axis=1)
                - np.median(a[..., 4] * 1e3, axis=1)
            ),
            cols,
            n_boot,
        ),
        "hook's own cost / prox (%)": bootstrap(
            lambda a: (
                100
                * (
                    np.median((a[..., 0] - a[..., 1]) * per_step, axis=1)
                    / np.median(a[..., 4] * 1e3, axis=1)
                    - 1
                )
            ),
            cols,
            n_boot,
        ),
    }


def fmt(name: str, v: tuple[float, float, float]) -> tuple[str, str]:
    digits = 3
    unit = "x" if name.startswith("epoch ratio") else ""
    if name.endswith("(%)"):
        digits = 0
    return (
        f"{v[0]:.{digits}f}{unit}",
        f"[{v[1]:.{digits}f}{unit}, {v[2]:.{digits}f}{unit}]",
    )


def report(results: Sequence[Result], n_boot: int, setup: list[str], markdown: bool) -> None:
    for r in results:
        s = summarize(r, n_boot)
        print(f"\n{r.label}: {len(r.on)} pairs of {r.window}-step windows")
        ratio = s["epoch ratio, wall"]
        print(
            f"  epoch ratio (with / without): {ratio[0]:.3f}x, 95% CI [{ratio[1]:.3f}x, "
            f"{ratio[2]:.3f}x]"
        )
        for name, v in s.items():
            value, ci = fmt(name, v)
            print(f"  {name:28s} {value:>10s}  95% CI {ci}")
        if markdown:
            print(f"\n# {r.label}: medians over {len(r.on)} pairs of {r.window}-step windows")
            print("\n| measure | median | 95% CI |\n|---|---:|---:|")
            for name, v in s.items():
                value, ci = fmt(name, v)
                print(f"| {name} | {value} | {ci} |")
            print()
    if markdown:
        print("\n".join(f"# {line}" for line in setup))


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


# --- Lightning -----------------------------------------------------------------------------
def run_lightning(args: argparse.Namespace) -> tuple[list[Result], list[str]]:
    import lightning.pytorch as pl
    import numba
    import torch
    from bench_lightning_epoch import PaperMLP, load_mnist_train
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset
    from typing_extensions import override

    from pathnorm_lightning import PathNormProx, _kernel, prox_path_norm

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no banners per Trainer
    data = load_mnist_train(args.data_dir)
    source = f"MNIST train ({len(data[0]):,} images)" if data is not None else ""
    if data is None:  # random data of MNIST's shape, said so in the output
        source = "SYNTHETIC random data of MNIST's shape (60,000; the MNIST files were not found)"
        gen = torch.Generator().manual_seed(0)
        data = torch.rand((60000, 784), generator=gen), torch.randint(10, (60000,), generator=gen)
    dataset = TensorDataset(*data)

    class Windows(pl.Callback):
        def __init__(self, lane: Lane) -> None:
            self.lane = lane

        @override
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.lane.begin()

        @override
        def on_train_batch_end(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, *rest: Any
        ) -> None:
            if self.lane.batch_end():
                trainer.should_stop = True

    models: dict[str, PaperMLP] = {}

    def train(prox: bool) -> Callable[[Lane], object]:
        torch.manual_seed(0)
        model = models["on" if prox else "off"] = PaperMLP(args.lr)
        # Whole-batch indexing, as bench_lightning_epoch.py; the same order in both runs.
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(0))
        loader = DataLoader(
            dataset, sampler=BatchSampler(sampler, BATCH, drop_last=False), batch_size=None
        )

        def fit(lane: Lane) -> None:
            callbacks: list[pl.Callback] = [PathNormProx(lam=args.lam)] if prox else []
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=1,
                max_epochs=-1,
                logger=False,
                enable_progress_bar=False,
                enable_checkpointing=False,
                enable_model_summary=False,
                callbacks=[*callbacks, Windows(lane)],  # the window closes after the prox's
            )
            trainer.fit(model, loader)

        return fit

    t0 = time.perf_counter()
    prox_path_norm(torch.zeros(200, 784), torch.zeros(10, 200), 1e-3)
    kernel_load = time.perf_counter() - t0
    on = Lane("PathNormProx", args.window, train(True))
    off = Lane("plain", args.window, train(False))

    # The prox's own time is read inside the prox run's steps: every call of the planned prox
    # (the kernel as the hook runs it, its finiteness check included) is timed where it runs,
    # so the in-training kernel (slower than back to back: its data left the caches during
    # the forward and backward pass) is not charged to the hook.
    in_step: list[float] = []
    planned_call = _kernel.PlannedProx.__call__

    def timed(self: Any, lam: float, check_finite: bool) -> bool:
        t = time.perf_counter()
        done = planned_call(self, lam, check_finite)
        in_step.append(time.perf_counter() - t)
        return bool(done)

    def prox_time() -> float:
        calls = in_step[-args.window :]
        if len(in_step) % args.window or not calls:
            raise RuntimeError(
                f"the prox run's windows made {len(in_step)} planned prox calls, not "
                f"{args.window} per window: the hook no longer runs the planned prox"
            )
        in_step.clear()
        return statistics.mean(calls)

    _kernel.PlannedProx.__call__ = timed  # type: ignore[method-assign]
    try:
        result = interleave("Lightning, Trainer.fit", on, off, args.pairs, args.warmup, prox_time)
    finally:
        _kernel.PlannedProx.__call__ = planned_call  # type: ignore[method-assign]
    setup = [
        f"data: {source}; 784-200-10 ELU, SGD lr={args.lr}, batch {BATCH}; lam {args.lam}",
        f"torch {torch.__version__}, lightning {pl.__version__}, numba {numba.__version__}, "
        f"Python {platform.python_version()}; torch threads {torch.get_num_threads()} "
        f"({'set by --threads' if args.threads else 'default'}), {os.cpu_count()} cores",
        f"first prox call of the process (kernel load): {kernel_load:.2f} s",
    ]
    return [result], setup


# --- Keras ---------------------------------------------------------------------------------
def run_keras(args: argparse.Namespace) -> tuple[list[Result], list[str]]:
    import keras
    import tensorflow as tf
    from bench_tf import load_mnist, paper_mlp

    from pathnorm_tf import PathNormSGD
    from pathnorm_tf.functional import _prox_kernels

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    x, y, source = load_mnist(args.data_dir)
    if source.startswith("random"):
        source = "SYNTHETIC " + source + " (the MNIST files were not found)"
    models = {
        "off": paper_mlp(keras.optimizers.SGD(args.lr), True),
        "on": paper_mlp(PathNormSGD(args.lr, lam=args.lam), True),
    }
    batches = [
        (tf.constant(x[i : i + BATCH]), tf.constant(y[i : i + BATCH]))
        for i in range(0, len(x), BATCH)
    ]

    class Windows(keras.callbacks.Callback):
        def __init__(self, lane: Lane) -> None:
            super().__init__()
            self.lane = lane

        def on_train_begin(self, logs: Any = None) -> None:
            self.lane.begin()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self.lane.batch_end():
                self.model.stop_training = True

    # the prox alone: per call inside one XLA loop, as inside a compiled train step
    @tf.function(jit_compile=True)
    def compiled(a: tf.Tensor, b: tf.Tensor, t: tf.Tensor, calls: tf.Tensor) -> tf.Tensor:
        out = (tf.zeros_like(a), tf.zeros_like(b))  # kept as loop state: written out
        for i in tf.range(calls):
            tiny = tf.cast(i, a.dtype) * 1e-30  # below rounding: nothing is hoisted
            out = _prox_kernels(a + tiny, b + tiny, t)
        return out[0][0, 0] + out[1][0, 0]

    step_t = tf.constant(args.lam, tf.float64) * tf.constant(args.lr, tf.float64)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    cursor = [0]

    def prox_time() -> float:
        model = models["on"]
        kernels = [model.layers[0].kernel, model.layers[1].kernel]
        xb, yb = batches[cursor[0] % len(batches)]
        cursor[0] += 1
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, kernels)
        a, b = (tf.convert_to_tensor(k) - args.lr * g for k, g in zip(kernels, grads, strict=True))
        times = {}
        for calls in (4, 4 + args.prox_reps * 8):
            t = time.perf_counter()
            compiled(a, b, step_t, tf.constant(calls)).numpy()
            times[calls] = time.perf_counter() - t
        short, long_ = sorted(times)
        return (times[long_] - times[short]) / (long_ - short)

    t0 = time.perf_counter()
    for model in models.values():
        model.train_on_batch(*batches[0])  # trace and compile the step
    compiled(*[k.value for k in (models["on"].layers[0].kernel, models["on"].layers[1].kernel)],
             step_t, tf.constant(4)).numpy()  # fmt: skip
    compile_s = time.perf_counter() - t0
    results = []
    if args.driver in ("fit", "both"):
        total = (args.warmup + args.pairs + 1) * args.window + 1

        def train(model: keras.Model) -> Callable[[Lane], object]:
            # whole batches (60,000 = 600 x 100): the shapes the step was compiled for
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
            ds = ds.cache().repeat().prefetch(2)
            return lambda lane: model.fit(
                ds, steps_per_epoch=total, epochs=1, verbose=0, callbacks=[Windows(lane)]
            )

        on = Lane("PathNormSGD", args.window, train(models["on"]))
        off = Lane("SGD", args.window, train(models["off"]))
        results.append(
            interleave("Keras, model.fit (XLA)", on, off, args.pairs, args.warmup, prox_time)
        )
    if args.driver in ("train_on_batch", "both"):
        results.append(tob_interleave(models, batches, args, prox_time))
    setup = [
        f"data: {source}; 784-200-10 ELU, SGD lr={args.lr}, batch {BATCH}; lam {args.lam}",
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, Python "
        f"{platform.python_version()}; TF threads "
        f"{args.threads if args.threads else 'default'}, {os.cpu_count()} cores",
        f"tracing and XLA compilation before timing: {compile_s:.1f} s",
    ]
    return results, setup


def tob_interleave(
    models: dict[str, Any], batches: list[Any], args: argparse.Namespace, prox_time: Any
) -> Result:
    """The same pairs of windows by ``train_on_batch`` calls in the main thread."""
    result = Result("Keras, train_on_batch (XLA)", args.window)
    cursors = {"on": 0, "off": 0}
    for i in range(args.warmup + args.pairs):
        times = {}
        for name in ("on", "off") if i % 2 == 0 else ("off", "on"):
            model, start = models[name], cursors[name]
            chunk = [batches[(start + k) % len(batches)] for k in range(args.window)]
            cursors[name] = start + args.window
            t, c = time.perf_counter(), time.process_time()
            for xb, yb in chunk:
                model.train_on_batch(xb, yb)
            times[name] = (time.perf_counter() - t, time.process_time() - c)
        if i >= args.warmup:
            result.on.append(times["on"][0])
            result.off.append(times["off"][0])
            result.on_cpu.append(times["on"][1])
            result.off_cpu.append(times["off"][1])
            result.prox.append(prox_time())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["lightning", "keras"], required=True)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(ENV_DATA) if ENV_DATA else None,
        help="folder holding mnist/*.gz (default: $PATHNORM_DATA_DIR)",
    )
    parser.add_argument("--pairs", type=int, default=200, help="timed pairs of windows")
    parser.add_argument("--window", type=int, default=50, help="steps per window")
    parser.add_argument("--warmup", type=int, default=10, help="pairs run first and dropped")
    parser.add_argument(
        "--prox-reps",
        type=int,
        default=5,
        help="Keras: prox timings per pair, 8 loop iterations each (torch: every call in step)",
    )
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--threads", type=int, default=0, help="thread pools (0: default)")
    parser.add_argument("--lam", type=float, default=1e-4)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument(
        "--driver",
        choices=["fit", "train_on_batch", "both"],
        default="both",
        help="Keras: fit (the headline), train_on_batch, or both",
    )
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = parser.parse_args()
    if min(args.pairs, args.window, args.prox_reps, args.bootstrap) < 1 or args.warmup < 0:
        parser.error("--pairs, --window, --prox-reps, --bootstrap must be >= 1, --warmup >= 0")
    if args.threads < 0:
        parser.error("--threads must be >= 0 (0: the library's default)")
    warnings.filterwarnings("ignore")
    load_before, cpu0, t0 = loadavg(), time.process_time(), time.perf_counter()
    run = run_lightning if args.backend == "lightning" else run_keras
    results, setup = run(args)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    setup.append(
        f"load average (1, 5, 15 min): {load_before} before, {loadavg()} after; whole run "
        f"{elapsed:.0f} s wall, {cpu:.0f} s process CPU"
    )
    print("\n".join(setup))
    report(results, args.bootstrap, setup, args.markdown)


if __name__ == "__main__":
    main()
