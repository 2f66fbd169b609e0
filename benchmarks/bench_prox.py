"""Prox cost on the paper's shapes, as ratios measured in one run.

For each shape (m-n-p: Linear(m, n) -> ELU -> Linear(n, p)) it times, in float32:
the prox (``pathnorm_lightning.prox_path_norm``: on CPU the compiled kernel; also the same
exact prox in torch tensor ops ("sort"), the fallback without numba; on CUDA the whole-row-sort algorithm
replayed as a CUDA graph, also with its finiteness check and without the graph), one SGD step of the same network
(forward + backward + update, batch 100), a full ``torch.sort`` of the rows of |w_in| and of
|w_out|, the authors'-style per-unit NumPy loop (paper's Algorithms 3 + 4), and the naive
exhaustive reference (timed on a few units and scaled to n, marked ``~``).

    python benchmarks/bench_prox.py [--device cuda] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from baselines import exhaustive_units, prox_per_unit_loop

from pathnorm_lightning import prox_path_norm

SHAPES = [(784, 200, 10), (784, 200, 1), (784, 1000, 10), (512, 512, 512)]


def timeit(fn: Callable[[], object], device: torch.device, min_time: float = 0.3) -> float:
    """Median seconds per call over repeated batches (after warm-up)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - t0, 1e-6)
    reps = max(1, min(200, int(0.05 / once)))
    samples = []
    deadline = time.perf_counter() + min_time
    while len(samples) < 5 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / reps)
        if len(samples) >= 50:
            break
    return statistics.median(samples)


def trained_like(m: int, n: int, p: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights as nn.Linear initialises them (the state the prox sees at the start of training)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(m, n), torch.nn.ELU(), torch.nn.Linear(n, p))
    return net[0].weight.detach().to(device), net[2].weight.detach().to(device)


def bench_shape(m: int, n: int, p: int, lam: float, device: torch.device, naive: bool) -> dict:
    w_in, w_out = trained_like(m, n, p, device)
    cuda = device.type == "cuda"
    reserved = torch.cuda.memory_reserved(device) if cuda else 0
    t_prox = timeit(lambda: prox_path_norm(w_in, w_out, lam, check_finite=False), device)
    extra = {}
    if cuda:  # what the cached CUDA graph of this shape keeps (its buffers and intermediates)
        extra["graph_mib"] = (torch.cuda.memory_reserved(device) - reserved) / 2**20
        os.environ["PATHNORM_CUDA_GRAPHS"] = "0"
        extra["eager"] = timeit(
            lambda: prox_path_norm(w_in, w_out, lam, check_finite=False), device
        )
        os.environ.pop("PATHNORM_CUDA_GRAPHS")
        extra["checked"] = timeit(lambda: prox_path_norm(w_in, w_out, lam), device)

    net = torch.nn.Sequential(torch.nn.Linear(m, n), torch.nn.ELU(), torch.nn.Linear(n, p)).to(
        device
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    xb = torch.rand(100, m, device=device)
    yb = torch.randint(0, max(p, 2), (100,), device=device) % p

    def sgd_step() -> None:
        opt.zero_grad(set_to_none=True)
        out = net(xb)
        loss = torch.nn.functional.cross_entropy(out, yb) if p > 1 else out.square().mean()
        loss.backward()
        opt.step()

    t_sgd = timeit(sgd_step, device)
    t_sort = timeit(
        lambda: (
            torch.sort(w_in.abs(), dim=1, descending=True),
            torch.sort(w_out.abs(), dim=0, descending=True),
        ),
        device,
    )
    row = {"shape": f"{m}-{n}-{p}", "prox": t_prox, "sgd": t_sgd, "sort": t_sort, **extra}
    if device.type == "cpu":  # what "auto" runs without numba
        row["ops"] = timeit(
            lambda: prox_path_norm(w_in, w_out, lam, check_finite=False, method="sort"), device
        )
    if naive:
        a, b = w_in.double().cpu().numpy(), w_out.double().cpu().numpy()
        t_loop = timeit(lambda: prox_per_unit_loop(a, b, lam), torch.device("cpu"), 0.0)
        units = max(1, min(n, 4 if p * m > 5000 else 16))
        t_ex = timeit(lambda: exhaustive_units(a, b, lam, units), torch.device("cpu"), 0.0)
        row["loop"] = t_loop
        row["naive"] = t_ex * n / units
    return row


def growth(device: torch.device, lam: float) -> None:
    """Prox time as n, m and p double (from 784-200-10): time ratio per doubling."""
    print(f"# growth of prox_path_norm time, float32, lam={lam} (ratio to the previous size)")
    print("| varied | sizes (m-n-p) | prox ms | ratio per doubling |")
    print("|---|---|---|---|")
    for name, shapes in [
        ("n", [(784, 200 * 2**i, 10) for i in range(4)]),
        ("m", [(392 * 2**i, 200, 10) for i in range(4)]),
        ("p", [(784, 200, 10 * 2**i) for i in range(4)]),
    ]:
        prev = None
        for m, n, p in shapes:
            w_in, w_out = trained_like(m, n, p, device)
            t = timeit(
                lambda a=w_in, b=w_out: prox_path_norm(a, b, lam, check_finite=False), device
            )
            ratio = "" if prev is None else f"{t / prev:.2f}"
            print(f"| {name} | {m}-{n}-{p} | {t * 1e3:.3f} | {ratio} |")
            prev = t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lam", type=float, default=1e-3, help="prox step (lr * lambda)")
    ap.add_argument("--shapes", default=None, help="comma list like 784-200-10,4096-4096-10")
    ap.add_argument("--no-naive", action="store_true", help="skip the slow NumPy baselines")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    ap.add_argument("--growth", action="store_true", help="also time doublings of n, m and p")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = ap.parse_args()
    given = None
    if args.shapes:
        given = [tuple(int(v) for v in s.split("-")) for s in args.shapes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = given or SHAPES
    rows = [bench_shape(m, n, p, args.lam, device, not args.no_naive) for m, n, p in shapes]

    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU x{torch.get_num_threads()} threads"
    )
    print(f"# prox_path_norm, float32, lam={args.lam}, device: {name}, torch {torch.__version__}")
    cols = ["shape", "prox ms", "SGD step ms", "sort ms", "prox/SGD", "prox/sort"]
    if device.type == "cpu":
        cols += ["tensor-op prox ms"]
    else:
        cols += ["with check_finite ms", "without CUDA graph ms", "graph MiB"]
    if not args.no_naive:
        cols += ["per-unit loop ms", "loop/prox", "exhaustive ms", "exhaustive/prox"]
    lines = []
    for r in rows:
        vals = [
            r["shape"],
            f"{r['prox'] * 1e3:.3f}",
            f"{r['sgd'] * 1e3:.3f}",
            f"{r['sort'] * 1e3:.3f}",
            f"{r['prox'] / r['sgd']:.2f}",
            f"{r['prox'] / r['sort']:.2f}",
        ]
        if "ops" in r:
            vals += [f"{r['ops'] * 1e3:.3f}"]
        if "eager" in r:
            vals += [
                f"{r['checked'] * 1e3:.3f}",
                f"{r['eager'] * 1e3:.3f}",
                f"{r['graph_mib']:.0f}",
            ]
        if "loop" in r:
            vals += [
                f"{r['loop'] * 1e3:.1f}",
                f"{r['loop'] / r['prox']:.0f}x",
                f"~{r['naive'] * 1e3:.0f}",
                f"~{r['naive'] / r['prox']:.0f}x",
            ]
        lines.append(vals)
    if args.markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for v in lines:
            print("| " + " | ".join(v) + " |")
    else:
        print("  ".join(f"{c:>16}" for c in cols))
        for v in lines:
            print("  ".join(f"{c:>16}" for c in v))
    if args.growth:
        growth(device, args.lam)


if __name__ == "__main__":
    main()
