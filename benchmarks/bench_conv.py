"""The prox on the conv pair of the main job against one SGD step of that network, on CPU.

The network is ``pathnorm-train --model conv``'s (``Conv2d(1, 32, 5, stride=2)`` without
padding -> ELU -> Flatten -> ``Linear(32 * 12 * 12, 10)``, float32,
``pathnorm_experiments.torch_backend.build_conv_model``), in two states: its seeded initial
weights, and after one epoch of the main job's proximal SGD on the 1-path-norm (lam 1e-4, lr
0.1, the embedded MNIST subset: 50 steps of batch 100), where the prox has begun to zero
weights. In each state it times, in turns in one process (the order reversed every other
turn, medians of the samples, ``pathnorm_experiments.compaction.time_calls``):

* the prox as the step hook runs it, ``pathnorm_lightning.layers.prox_pair_`` in place (the
  seam's views of the pair, the exact prox with step ``lr * lam = 1e-5``, the write-back of
  the Linear weight's view), with ``method="auto"`` (the compiled kernel) and ``"sort"`` (tensor
  ops, what runs without numba). Each call first restores the state's weights, so every call
  sees the same weights; the restore is timed on its own too and is included in the prox times;
* one SGD step of the network: forward, cross-entropy, backward and update on a batch of 100
  MNIST images.

    python benchmarks/bench_conv.py [--markdown] [--threads 1] [--repeats 15]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from pathnorm_experiments.compaction import time_calls
from pathnorm_experiments.data import load_embedded
from pathnorm_experiments.engine import train_loop
from pathnorm_experiments.settings import TrainConfig
from pathnorm_experiments.torch_backend import build_network, weight_layers
from pathnorm_lightning.functional import Method
from pathnorm_lightning.layers import prox_pair_

LAM, LR = 1e-4, 0.1
CFG = TrainConfig(model="conv", hidden=(32,), regularizer="path", lam=LAM, lr=LR, epochs=1)


def states() -> dict[str, nn.Module]:
    """The network at its initial weights and after one epoch of path-prox training."""
    data = load_embedded()
    trained, _ = train_loop(CFG, data, progress=False, evaluate_model=False)
    return {"initial": build_network(CFG), "after 1 epoch of prox-SGD": trained}


def calls(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The timed functions on ``model`` (its weights restored before every prox)."""
    conv, linear = weight_layers(model)
    saved = [conv.weight.detach().clone(), linear.weight.detach().clone()]
    step = LR * LAM

    def restore() -> None:
        with torch.no_grad():
            conv.weight.copy_(saved[0])
            linear.weight.copy_(saved[1])

    def prox(method: Method) -> Callable[[], object]:
        def run() -> None:
            restore()
            prox_pair_(conv, linear, step, method=method, check_finite=False)

        return run

    sgd_model = build_network(CFG)
    sgd_model.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(sgd_model.parameters(), lr=LR)

    def sgd_step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(sgd_model(x), y).backward()
        opt.step()

    return {
        "prox": prox("auto"),
        "prox (sort)": prox("sort"),
        "restore": restore,
        "SGD step": sgd_step,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--repeats", type=int, default=15, help="timed samples of each function")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = load_embedded()
    x, y = torch.from_numpy(data.x_train[:100]), torch.from_numpy(data.y_train[:100])
    rows = []
    for state, model in states().items():
        conv, linear = weight_layers(model)
        zeros = float((conv.weight == 0).float().mean()), float((linear.weight == 0).float().mean())
        times, _ = time_calls(calls(model, x, y), args.repeats)
        rows.append((state, zeros, times))
        print(
            f"{state}: prox {1e3 * times['prox']:.3f} ms (sort {1e3 * times['prox (sort)']:.3f} "
            f"ms, restore {1e3 * times['restore']:.3f} ms), SGD step {1e3 * times['SGD step']:.3f}"
            f" ms; prox/SGD {times['prox'] / times['SGD step']:.2f}; zero weights: conv "
            f"{100 * zeros[0]:.1f}%, linear {100 * zeros[1]:.1f}%"
        )
    if args.markdown:
        print(
            f"\n# Conv2d(1, 32, 5, stride 2) -> ELU -> Flatten -> Linear(4608, 10), float32, "
            f"{args.threads} thread(s), step lr * lam = {LR * LAM:g}, medians of {args.repeats} "
            "interleaved samples\n"
        )
        print("| state | prox ms | sort prox ms | restore ms | SGD step ms | prox/SGD | sort/SGD |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for state, _, t in rows:
            sgd = t["SGD step"]
            print(
                f"| {state} | {1e3 * t['prox']:.3f} | {1e3 * t['prox (sort)']:.3f} | "
                f"{1e3 * t['restore']:.3f} | {1e3 * sgd:.3f} | {t['prox'] / sgd:.2f}x | "
                f"{t['prox (sort)'] / sgd:.2f}x |"
            )


if __name__ == "__main__":
    main()
