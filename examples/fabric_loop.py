"""Proximal SGD on the 1-path-norm in a Lightning Fabric loop: one ``attach`` call.

Fabric wraps the model and the optimizer; ``attach`` takes the wrapped objects (it hooks the
optimizer inside the wrapper), so the prox follows every real step, also under mixed precision
or several devices.

    .venv/bin/python examples/fabric_loop.py
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pathnorm_lightning
from pathnorm_experiments.data import load_embedded


def main(epochs: int = 3, lam: float = 1e-3) -> dict[str, float]:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    fabric.seed_everything(0)
    d = load_embedded()
    train = TensorDataset(torch.from_numpy(d.x_train), torch.from_numpy(d.y_train))
    model = nn.Sequential(nn.Linear(784, 200), nn.ELU(), nn.Linear(200, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(train, batch_size=100, shuffle=True))

    handle = pathnorm_lightning.attach(optimizer, model, lam=lam)
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            fabric.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
    handle.remove()

    x, y = (torch.from_numpy(a) for a in (d.x_test, d.y_test))
    with torch.no_grad():
        correct = int((model(x).argmax(1) == y).sum())
    metrics = {name: float(value) for name, value in handle.metrics().items()}
    fabric.print(f"test accuracy {correct / len(y):.3f};", metrics)
    return {"accuracy": correct / len(y), **metrics}


if __name__ == "__main__":
    main()
