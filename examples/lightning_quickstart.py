"""Quick start: proximal SGD on the 1-path-norm of a Lightning MLP with one callback.

Trains the paper's 784-200-10 ELU network for three epochs on the MNIST subset embedded in
the package (5,000 training images, 1,000 test images), with and without
PathNormProx, and prints the test accuracy, the sparsity and both Lipschitz bounds.

    .venv/bin/python examples/lightning_quickstart.py
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from pathnorm_experiments.data import load_embedded
from pathnorm_lightning import PathNormProx


class MLP(pl.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 200), nn.ELU(), nn.Linear(200, 10))
        self.lr = lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """The embedded MNIST subset, shipped with the package (no download)."""
    d = load_embedded()
    train = TensorDataset(torch.from_numpy(d.x_train), torch.from_numpy(d.y_train))
    test = TensorDataset(torch.from_numpy(d.x_test), torch.from_numpy(d.y_test))
    return train, test


def main() -> None:
    train, test = load_data()
    for lam in (0.0, 1e-3):
        pl.seed_everything(0, verbose=False)
        model = MLP()

        # --- the callback is the whole change --------------------------------------
        prox = PathNormProx(lam=lam)  # prox step lam * lr after every optimizer step
        trainer = pl.Trainer(max_epochs=3, callbacks=[prox], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)  # fmt: skip
        trainer.fit(model, DataLoader(train, batch_size=100, shuffle=True))
        # -----------------------------------------------------------------------------

        metrics = {k.split("/")[1]: round(float(v), 4) for k, v in prox.metric_values().items()}
        x, y = test.tensors
        with torch.no_grad():
            accuracy = (model.net(x).argmax(1) == y).float().mean().item()
        print(f"lam={lam:g}: test accuracy {accuracy:.3f}, {metrics}")


if __name__ == "__main__":
    main()
