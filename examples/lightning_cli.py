"""Configure PathNormProx from the command line or a YAML file with LightningCLI.

    .venv/bin/python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    .venv/bin/python examples/lightning_cli.py fit --trainer.max_epochs=1 \
        --trainer.callbacks+=pathnorm_lightning.PathNormProx --trainer.callbacks.lam=1e-3
    .venv/bin/python examples/lightning_cli.py fit --config examples/lightning_cli.yaml \
        --print_config          # the full resolved configuration

The callbacks take plain typed arguments, so every option (``lam``, ``pairs``,
``log_every_n_steps``, ``prog_bar``, ...) is a CLI flag / YAML key; the baselines
``pathnorm_lightning.L1Prox`` and ``pathnorm_lightning.LayerwiseLinfProjection`` work the same
way. The data module reads the embedded MNIST subset by default, or a real dataset
(``--data.dataset mnist --data.data_dir DATA_DIR``, DATA_DIR holding ``mnist/*.gz``). Needs
``jsonargparse[signatures]`` (in the ``torch`` extra; else
``pip install "jsonargparse[signatures]"``).
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI
from lightning_quickstart import MLP

from pathnorm_experiments.lightning_module import ImageDataModule


def main() -> None:
    LightningCLI(MLP, ImageDataModule, seed_everything_default=0)


if __name__ == "__main__":
    main()
