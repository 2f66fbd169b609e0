"""Train, then ``compact``: the dead hidden units go, the function stays.

Trains the paper's 784-200-10 ELU network with proximal SGD on the 1-path-norm (``attach``) on
the MNIST subset embedded in the package, then compacts it: every hidden unit the prox killed
is removed. Prints the report, checks that the compacted network gives the same outputs on the
test images, and saves and reloads it (a compacted model has another architecture, so it is
saved whole).

    .venv/bin/python examples/compact_torch.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

import pathnorm_lightning
from pathnorm_experiments.data import load_embedded


def train(x: torch.Tensor, y: torch.Tensor, epochs: int, lam: float) -> nn.Module:
    """Proximal SGD (batch 100, lr 0.1) with the prox attached to the optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 200), nn.ELU(), nn.Linear(200, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = pathnorm_lightning.attach(optimizer, model, lam=lam)
    for _ in range(epochs):
        for batch in torch.randperm(len(x)).split(100):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    handle.remove()
    return model.eval()


def main(epochs: int = 5, lam: float = 2e-3) -> dict[str, float]:
    d = load_embedded()
    model = train(torch.from_numpy(d.x_train), torch.from_numpy(d.y_train), epochs, lam)

    # --- the recipe: train (above), then compact --------------------------------------------
    small, report = pathnorm_lightning.compact(model)
    print(report)
    # -----------------------------------------------------------------------------------------

    x, y = torch.from_numpy(d.x_test), torch.from_numpy(d.y_test)
    with torch.no_grad():
        before, after = model(x), small(x)
    diff = float((after - before).abs().max())
    if diff > 1e-5 or not torch.equal(before.argmax(1), after.argmax(1)):
        raise AssertionError(f"the compacted network differs from the trained one by {diff}")
    with tempfile.TemporaryDirectory() as tmp:  # saved whole: its architecture changed
        torch.save(small, Path(tmp) / "compact.pt")
        reloaded = torch.load(Path(tmp) / "compact.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(reloaded(x), after)
    accuracy = float((after.argmax(1) == y).float().mean())
    print(f"test accuracy {accuracy:.3f}, the same before and after (outputs within {diff:.0e})")
    return {"accuracy": accuracy, "max_diff": diff, "hidden_after": report.units_after}


if __name__ == "__main__":
    main()
