"""Epoch time of the paper's MLP in a Lightning Trainer, with and without PathNormProx.

The network is 784-200-10 with ELU, trained with SGD at batch size 100 on the 60,000 MNIST
training images (``--data-dir``, default ``$PATHNORM_DATA_DIR``, read by the checked loader
of ``pathnorm_experiments.data``; random tensors of the same shape when the files are absent).
Plain and PathNormProx epochs alternate in one process, so both see the same machine load; the script prints the median epoch times and their ratio.

    python benchmarks/bench_lightning_epoch.py [--repeats 3] [--lam 1e-4] [--lr 0.1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from pathnorm_experiments.data import DataError, load_dataset
from pathnorm_lightning import PathNormProx, prox_path_norm

# The project's shared data folder when the repository sits beside it (as on the dev machines).
ENV_DATA = os.environ.get("PATHNORM_DATA_DIR")


def load_mnist_train(data_dir: Path | None) -> tuple[Tensor, Tensor] | None:
    """MNIST training set through the project's checked loader, or None when it is absent."""
    try:
        d = load_dataset("mnist", data_dir)
    except DataError:
        return None
    return torch.from_numpy(d.x_train), torch.from_numpy(d.y_train.astype(np.int64))


class PaperMLP(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 200), nn.ELU(), nn.Linear(200, 10))
        self.lr = lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class EpochTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.times.append(time.perf_counter() - self._start)


def epoch_time(
    loader: DataLoader, lr: float, prox: PathNormProx | None, seed: int, accelerator: str = "cpu"
) -> tuple[float, PaperMLP]:
    torch.manual_seed(seed)
    model = PaperMLP(lr)
    timer = EpochTimer()
    callbacks: list[pl.Callback] = [timer] + ([prox] if prox is not None else [])
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, loader)
    return timer.times[0], model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(ENV_DATA) if ENV_DATA else None,
        help="folder holding mnist/*.gz (default: $PATHNORM_DATA_DIR)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="epochs per configuration")
    parser.add_argument("--lam", type=float, default=1e-4)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--accelerator", default="cpu", help='Lightning accelerator ("cpu", "gpu")')
    parser.add_argument(
        "--no-check-finite", action="store_true", help="PathNormProx(check_finite=False)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")

    data = load_mnist_train(args.data_dir)
    source = "MNIST train (60,000 images)"
    if data is None:
        g = torch.Generator().manual_seed(0)
        data = (torch.rand(60000, 784, generator=g), torch.randint(0, 10, (60000,), generator=g))
        source = "synthetic (60000 x 784, MNIST files not found)"
    dataset = TensorDataset(*data)
    # Whole-batch indexing: per-sample collation would dominate the epoch and hide the prox.
    sampler = BatchSampler(RandomSampler(dataset), batch_size=100, drop_last=False)
    loader = DataLoader(dataset, sampler=sampler, batch_size=None)

    print(
        f"data: {source}; 784-200-10 ELU, SGD lr={args.lr}, batch 100, {len(sampler)} steps/epoch"
    )
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, lam {args.lam}, "
        f"accelerator {args.accelerator}, check_finite {not args.no_check_finite}"
    )
    # Warm-up (imports, allocator, first-call costs: loading the compiled prox kernel from
    # numba's cache, or compiling it on a new machine, is timed apart).
    t0 = time.perf_counter()
    prox_path_norm(torch.zeros(200, 784), torch.zeros(10, 200), 1e-3)
    print(f"first prox call of the process (kernel load): {time.perf_counter() - t0:.2f} s")
    epoch_time(loader, args.lr, None, seed=0, accelerator=args.accelerator)
    epoch_time(loader, args.lr, PathNormProx(lam=args.lam), seed=0, accelerator=args.accelerator)
    plain, prox = [], []
    final = None
    for r in range(args.repeats):
        plain.append(epoch_time(loader, args.lr, None, seed=r, accelerator=args.accelerator)[0])
        # defaults: metrics logged every 50 steps
        callback = PathNormProx(lam=args.lam, check_finite=not args.no_check_finite)
        t, final = epoch_time(loader, args.lr, callback, seed=r, accelerator=args.accelerator)
        prox.append(t)
        print(f"  repeat {r}: plain {plain[-1]:.3f} s, PathNormProx {prox[-1]:.3f} s")
    p, q = statistics.median(plain), statistics.median(prox)
    steps = len(sampler)
    print(f"median epoch: plain {p:.3f} s, PathNormProx {q:.3f} s")
    print(f"ratio PathNormProx / plain: {q / p:.3f}  (+{(q - p) / steps * 1e3:.3f} ms per step)")
    if final is not None:
        # The prox alone on the trained weights, to split the overhead into prox and callback.
        # (Lightning hands the model back on the CPU: move it to where it trained.)
        dev = torch.device("cpu" if args.accelerator == "cpu" else "cuda")
        w_in, w_out = final.net[0].weight.detach().to(dev), final.net[2].weight.detach().to(dev)
        step = args.lam * args.lr
        prox_path_norm(w_in, w_out, step)
        reps = 100
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            prox_path_norm(w_in, w_out, step, check_finite=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        per_call = (time.perf_counter() - t0) / reps
        print(
            f"prox_path_norm alone: {per_call * 1e3:.3f} ms per call; plain step {p / steps * 1e3:.3f} ms"
        )

        w_in, w_out = final.net[0].weight, final.net[2].weight
        zero = float(((w_in == 0).sum() + (w_out == 0).sum()) / (w_in.numel() + w_out.numel()))
        print(f"after one prox epoch: {zero:.1%} of the weights are exactly zero")


if __name__ == "__main__":
    main()
