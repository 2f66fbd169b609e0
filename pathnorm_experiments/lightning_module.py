"""Lightning side of the main job (``pathnorm-train --engine lightning``): a
``LightningDataModule`` over the NumPy arrays and the paper's classifier as a
``LightningModule``; the prox is the library's callbacks. The network, the penalty, the curve
and the evaluation are :mod:`~pathnorm_experiments.engine`'s; only the loop is Lightning's.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, Sampler, TensorDataset
from typing_extensions import override

from pathnorm_experiments.data import DATASET_NAMES, Dataset, load_dataset
from pathnorm_experiments.engine import TORCH, epoch_objective, penalty, record_sparsity
from pathnorm_experiments.results import History
from pathnorm_experiments.settings import TrainConfig
from pathnorm_experiments.torch_backend import build_network, evaluate, torch_dtype, weight_layers

__all__ = [
    "ArrayDataModule",
    "EpochOrderSampler",
    "ImageDataModule",
    "PaperMLP",
    "regularizer_callbacks",
    "train_lightning",
]


class EpochOrderSampler(Sampler[int]):
    """Each epoch's order as :func:`~pathnorm_experiments.draws.shuffle_orders` draws it (as the
    plain loop and the Keras backend train), one per ``iter()``."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self._rng = np.random.default_rng((seed, 1))  # shuffle_orders' generator

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(self._rng.permutation(self.n).tolist())


class ArrayDataModule(pl.LightningDataModule):
    """Train/test loaders over a :class:`~pathnorm_experiments.data.Dataset` (float32 in [0, 1]),
    the training set shuffled with ``seed`` and cut to its first ``n_train`` (``None``: all)."""

    def __init__(
        self, data: Dataset, batch_size: int = 100, seed: int = 0, n_train: int | None = None
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if n_train is not None and n_train < 1:
            raise ValueError(f"n_train must be >= 1, or None for all, got {n_train}")
        self.data: Dataset | None = data
        self.batch_size = batch_size
        self.seed = seed
        self.n_train = n_train

    def _arrays(self) -> Dataset:
        if self.data is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before the dataloaders")
        return self.data

    @override
    def train_dataloader(self) -> DataLoader:
        data = self._arrays()
        x = torch.from_numpy(data.x_train[: self.n_train])
        y = torch.from_numpy(data.y_train[: self.n_train])
        sampler = EpochOrderSampler(x.shape[0], self.seed)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, sampler=sampler)

    @override
    def test_dataloader(self) -> DataLoader:
        data = self._arrays()
        ds = TensorDataset(torch.from_numpy(data.x_test), torch.from_numpy(data.y_test))
        return DataLoader(ds, batch_size=1000)


class ImageDataModule(ArrayDataModule):
    """MNIST, Fashion-MNIST, KMNIST or the embedded MNIST subset, read in ``setup`` from their
    standard files (checked; nothing is downloaded), pixels in [0, 1], images flattened to 784.

    Every argument is a plain typed value, so LightningCLI configures it
    (``--data pathnorm_experiments.lightning_module.ImageDataModule --data.dataset mnist``).

    Args:
        dataset: ``"embedded"`` (shipped with the package), ``"mnist"``, ``"fashion-mnist"``
            or ``"kmnist"``.
        data_dir: directory holding ``<dataset>/<file>``; ``None``: ``$PATHNORM_DATA_DIR``, else
            :func:`pathnorm_experiments.data.default_data_dir`.
        batch_size, seed, n_train: as for :class:`ArrayDataModule`.
        allow_partial: accept KMNIST's truncated training-image file (with a warning).
        verify: check the SHA-256 of the files whose original checksum is known.
    """

    def __init__(
        self,
        dataset: str = "embedded",
        data_dir: str | None = None,
        batch_size: int = 100,
        seed: int = 0,
        n_train: int | None = None,
        allow_partial: bool = False,
        verify: bool = True,
    ) -> None:
        if dataset not in DATASET_NAMES:
            raise ValueError(
                f"unknown dataset {dataset!r}; choose one of {', '.join(DATASET_NAMES)}"
            )
        super().__init__(None, batch_size, seed, n_train)  # type: ignore[arg-type]
        self.save_hyperparameters()
        self.dataset = dataset
        self.data_dir = data_dir
        self.allow_partial = allow_partial
        self.verify = verify

    @override
    def setup(self, stage: str) -> None:
        if self.data is None:
            self.data = load_dataset(
                self.dataset, self.data_dir, allow_partial=self.allow_partial, verify=self.verify
            )


class PaperMLP(pl.LightningModule):
    """``cfg``'s network trained with constant-lr SGD on ``CE + lam * g`` (``method="penalty"``)
    or on the CE, a callback of :func:`regularizer_callbacks` applying the prox (``"prox"``)."""

    def __init__(
        self, cfg: TrainConfig, x_eval: Tensor | None = None, y_eval: Tensor | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        # in the run's dtype: Lightning's "64-true" would otherwise upcast float32 weights
        self.net = build_network(cfg)
        self.history = History()
        self._acc, self._acc_n = 0.0, 0
        self._x_eval, self._y_eval = x_eval, y_eval

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        ce = F.cross_entropy(self.net(x), y)
        reg = penalty(weight_layers(self.net), self.cfg.regularizer)
        obj = ce + self.cfg.lam * reg
        self._acc += float(obj.detach())
        self._acc_n += 1
        self.log("objective", obj.detach(), prog_bar=True, on_step=True, on_epoch=False)
        return obj if self.cfg.method == "penalty" else ce

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self.global_step  # optimizer steps so far (the prox has run for this one)
        if step % self.cfg.log_every == 0 and self._acc_n:
            self.history.iteration.append(step)
            self.history.batch_objective.append(self._acc / self._acc_n)
            record_sparsity(self.history, weight_layers(self.net))
            self._acc, self._acc_n = 0.0, 0

    @override
    def on_train_epoch_end(self) -> None:
        if self._x_eval is not None and self._y_eval is not None:
            obj = epoch_objective(self.net, self.cfg, self._x_eval, self._y_eval)
            self.history.epoch_objective.append(obj)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.cfg.lr)


def regularizer_callbacks(cfg: TrainConfig, *, prog_bar: bool = True) -> list[Callback]:
    """The library callback that implements ``cfg``'s proximal step (empty for penalty/none)."""
    make = TORCH[cfg.regularizer].callback
    if cfg.method != "prox" or make is None or cfg.lam == 0:
        return []
    return [make(cfg.lam, prog_bar)]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's chatter off in the main job, which prints its own summary: its INFO lines
    (devices, a litlogger tip) and the warning of its own use of torch's deprecated ``LeafSpec``."""
    log = logging.getLogger("lightning.pytorch")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
            yield
    finally:
        log.setLevel(level)


def train_lightning(
    cfg: TrainConfig, data: Dataset, *, progress: bool = True, evaluate_model: bool = True
) -> tuple[PaperMLP, dict[str, Any]]:
    """Train with ``lightning.Trainer`` + the library callbacks; returns (module, result)."""
    pl.seed_everything(cfg.seed, verbose=False)
    dtype = torch_dtype(cfg.dtype)
    x_eval = torch.from_numpy(data.x_train[: cfg.eval_train_samples]).to(dtype)
    y_eval = torch.from_numpy(data.y_train[: cfg.eval_train_samples])
    module = PaperMLP(cfg, x_eval, y_eval)
    with _quiet():
        trainer = pl.Trainer(
            max_epochs=cfg.epochs,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=progress,
            callbacks=regularizer_callbacks(cfg, prog_bar=False),
            log_every_n_steps=cfg.log_every,
            precision="64-true" if cfg.dtype == "float64" else "32-true",
        )
        t0 = time.perf_counter()
        trainer.fit(module, datamodule=ArrayDataModule(data, cfg.batch_size, cfg.seed))
    timings = {"train_s": time.perf_counter() - t0, "iterations": float(trainer.global_step)}
    if not all(bool(torch.isfinite(p).all()) for p in module.parameters()):
        raise FloatingPointError("training diverged (NaN/inf weights); lower --lr or --lam")
    if not evaluate_model:
        return module, {"history": module.history, "timings": timings}
    return module, evaluate(module.net, cfg, data, module.history, timings)
