"""Proximal SGD on the 1-path-norm in a plain PyTorch loop: one ``attach`` call.

Trains the paper's 784-200-10 ELU network for three epochs on the MNIST subset embedded in
the package, and prints the test accuracy, the sparsity and both Lipschitz bounds.

    .venv/bin/python examples/torch_loop.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pathnorm_lightning
from pathnorm_experiments.data import load_embedded


def main(epochs: int = 3, lam: float = 1e-3) -> dict[str, float]:
    torch.manual_seed(0)
    d = load_embedded()
    train = TensorDataset(torch.from_numpy(d.x_train), torch.from_numpy(d.y_train))
    model = nn.Sequential(nn.Linear(784, 200), nn.ELU(), nn.Linear(200, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    # The prox with step lam * lr runs after every optimizer.step(), until handle.remove().
    handle = pathnorm_lightning.attach(optimizer, model, lam=lam)
    for _ in range(epochs):
        for x, y in DataLoader(train, batch_size=100, shuffle=True):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    handle.remove()

    with torch.no_grad():
        x, y = torch.from_numpy(d.x_test), torch.from_numpy(d.y_test)
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    result = {"accuracy": accuracy, **{k: float(v) for k, v in handle.metrics().items()}}
    print({k: round(v, 4) for k, v in result.items()})
    return result


if __name__ == "__main__":
    main()
