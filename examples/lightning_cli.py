"""Configure PathNormProx from the command line or a YAML file with LightningCLI.

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit --trainer.max_epochs=1 \
        --trainer.callbacks+=pathnorm_lightning.PathNormProx --trainer.callbacks.lam=1e-3
    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml \
        --print_config          # the full resolved configuration

The callbacks take plain typed arguments, so every option (``lam``, ``pairs``,
``log_every_n_steps``, ``prog_bar``, ...) is a CLI flag / YAML key; the baselines
``pathnorm_lightning.L1Prox`` and ``pathnorm_lightning.LayerwiseLinfProjection`` work the same
way. Needs ``jsonargparse[signatures]`` (``pip install "jsonargparse[signatures]"``).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI
from lightning_quickstart import MLP, load_data
from torch.utils.data import DataLoader


class EmbeddedMNIST(pl.LightningDataModule):
    """The package's embedded MNIST subset (random tensors if it is unavailable)."""

    def __init__(self, batch_size: int = 100) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        self.train, self.test, _ = load_data()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)


def main() -> None:
    LightningCLI(MLP, EmbeddedMNIST, seed_everything_default=0)


if __name__ == "__main__":
    main()
