"""The Triton prox on CUDA against the sort prox and one SGD step, as ratios from one run.

For each shape (m-n-p: Linear(m, n) -> ELU -> Linear(n, p)), float32, weights as nn.Linear
initialises them, it times per call (median over batches, after warm-up and compilation):

* ``triton``: ``pathnorm_lightning._triton.prox_inplace`` launched from Python;
* ``triton graph``: the same kernel replayed from a CUDA graph (no launch overhead);
* ``sort graph``: ``prox_path_norm_(method="sort")``, replayed from its CUDA graph;
* ``auto``: ``prox_path_norm_(method="auto")``, what PathNormProx runs on CUDA;
* ``SGD``: one SGD step of the network (forward, backward, update) at batch 100.

Every prox call first restores the original weights (one device copy per matrix, timed with
it), so each call sees the same input. Also printed: the largest difference between the Triton
and the sort results (float32), and the kernel's launch configuration.

    python benchmarks/bench_triton.py [--shapes 784-200-10,784-1000-10,4096-4096-10] [--lam 1e-3]
    python benchmarks/bench_triton.py --compile-only [--arch 90]   # no GPU needed

``--compile-only`` compiles the kernel's launches for those shapes (float32, with the
non-finite flag) ahead of time for a CUDA architecture with Triton's own compiler and ptxas,
and prints the compile time (0 when Triton's cache holds it) and each launch's registers and
spills: it catches compile errors and register spills on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from pathnorm_lightning import _triton, prox_path_norm_


def timeit(fn: Callable[[], object], min_time: float = 0.3) -> float:
    """Median seconds per call over batches of calls (after warm-up), synchronised per batch."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    reps = max(1, min(200, int(0.02 / max(time.perf_counter() - t0, 1e-6))))
    samples: list[float] = []
    deadline = time.perf_counter() + min_time
    while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 40):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def bench_shape(m: int, n: int, p: int, lam: float) -> dict[str, float | str]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(m, n), torch.nn.ELU(), torch.nn.Linear(n, p)).cuda()
    w_in0, w_out0 = net[0].weight.detach().clone(), net[2].weight.detach().clone()
    w_in, w_out = w_in0.clone(), w_out0.clone()

    def restore() -> None:
        w_in.copy_(w_in0)
        w_out.copy_(w_out0)

    def triton_call() -> None:
        restore()
        _triton.prox_inplace(w_in, w_out, lam)

    row: dict[str, float | str] = {"shape": f"{m}-{n}-{p}"}
    t0 = time.perf_counter()
    triton_call()
    torch.cuda.synchronize()
    row["compile_s"] = time.perf_counter() - t0
    got_in, got_out = w_in.clone(), w_out.clone()
    row["triton"] = timeit(triton_call)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_call()
    row["triton_graph"] = timeit(graph.replay)

    def sort_call() -> None:
        restore()
        prox_path_norm_(w_in, w_out, lam, check_finite=False, method="sort")

    for _ in range(2):  # the second call with a shape captures its CUDA graph
        sort_call()
    row["diff"] = max(
        float((w_in - got_in).abs().max()), float((w_out - got_out).abs().max())
    )  # the sort prox's result (left by the last call) against the Triton one
    row["sort_graph"] = timeit(sort_call)
    row["copies"] = timeit(restore)

    def auto_call() -> None:
        restore()
        prox_path_norm_(w_in, w_out, lam, check_finite=False)

    row["auto"] = timeit(auto_call)

    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    xb = torch.rand(100, m, device="cuda")
    yb = torch.randint(0, p, (100,), device="cuda")

    def sgd_step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(xb), yb).backward()
        opt.step()

    row["sgd"] = timeit(sgd_step)
    units, block_k, warps = _triton._launch_shape(
        n, _triton._block(min(m, p)), _triton._block(max(m, p))
    )
    row["config"] = f"units {units}, k-block {block_k}, warps {warps}"
    return row


def compile_only(shapes: list[tuple[int, int, int]], arch: int) -> None:
    """Compile the launches of ``prox_inplace`` for these shapes for ``sm_<arch>`` (no GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = _triton._kernel()
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    print(f"# ahead-of-time compilation for sm_{arch}, triton {triton.__version__}, float32")
    for m, n, p in shapes:
        block_p, block_m = _triton._block(min(m, p)), _triton._block(max(m, p))
        units, block_k, warps = _triton._launch_shape(n, block_p, block_m)
        band = _triton._BAND if block_m >= _triton._BAND_MIN_BLOCK else 0
        consts = {
            "LAM_FROM_PTR": False,
            "HAS_FLAG": True,
            "SWAPPED": p > m,
            "WIDE": False,
            "BF16": False,
            "UNITS": units,
            "BLOCK_P": block_p,
            "BLOCK_M": block_m,
            "BLOCK_K": block_k,
            "BAND": max(band, 1),
            "BAND_K": max(1, min(block_p, _triton._TILE // max(band, 1))),
            "LOG_U": units.bit_length() - 1,
            "LOG_P": block_p.bit_length() - 1,
            "LOG_M": block_m.bit_length() - 1,
            "LOG_BAND": max(band, 1).bit_length() - 1,
        }
        sig = {name: "i32" for name in ("s_unit", "s_elem", "P", "l_unit", "l_elem", "M", "N")}
        sig |= {"s_ptr": "*fp32", "l_ptr": "*fp32", "lam_ptr": "*fp32", "lam_bits": "i64"}
        sig |= {"flag_ptr": "*i32", "band_ptr": "*fp64", "need_ptr": "*i32", "R": "i32"}
        full = _triton._full_warps(warps)
        for mode, w in ((1, warps), (2, full)) if band else ((0, full),):
            cs = {"MODE": mode, **consts}
            signature = {a: sig.get(a, "constexpr") for a in kernel.arg_names}
            src = ASTSource(
                fn=kernel,
                signature=signature,
                constexprs={(kernel.arg_names.index(c),): v for c, v in cs.items()},
            )
            t0 = time.perf_counter()
            compiled = triton.compile(
                src, target=GPUTarget("cuda", arch, 32), options={"num_warps": w}
            )
            seconds = time.perf_counter() - t0
            cubin = f"/tmp/pathnorm_triton_{os.getpid()}.cubin"
            with open(cubin, "wb") as f:
                f.write(compiled.asm["cubin"])
            usage = subprocess.run(
                [os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", cubin],
                capture_output=True,
                text=True,
            ).stdout
            os.remove(cubin)
            regs = [
                line.split("CONSTANT")[0].strip() for line in usage.splitlines() if "REG" in line
            ]
            print(f"{m}-{n}-{p} mode {mode}, {w} warps: {seconds:.1f} s, {' '.join(regs)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default="784-200-10,784-1000-10,4096-4096-10")
    ap.add_argument("--lam", type=float, default=1e-3, help="prox step (lr * lambda)")
    ap.add_argument("--compile-only", action="store_true", help="compile ahead of time only")
    ap.add_argument("--arch", type=int, default=90, help="CUDA architecture for --compile-only")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("-")) for s in args.shapes.split(",")]
    if args.compile_only:
        compile_only(shapes, args.arch)  # type: ignore[arg-type]
        return
    if not torch.cuda.is_available() or not _triton.available():
        raise SystemExit("needs a CUDA device and triton")
    rows = [bench_shape(m, n, p, args.lam) for m, n, p in shapes]
    import triton

    print(
        f"# prox on CUDA, float32, lam={args.lam}: {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, triton {triton.__version__}"
    )
    print(
        "(ms per call; every prox call includes restoring the weights, `copies` ms; "
        "ratios are to one SGD step at batch 100, same run)"
    )
    cols = [
        "shape",
        "triton ms",
        "triton graph ms",
        "sort graph ms",
        "auto ms",
        "SGD step ms",
        "triton/SGD",
        "triton graph/SGD",
        "sort graph/SGD",
        "auto/SGD",
        "sort/triton",
        "copies ms",
        "max |triton - sort|",
        "first call s",
        "launch",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        ms = {k: float(r[k]) * 1e3 for k in ("triton", "triton_graph", "sort_graph", "auto", "sgd")}
        vals = [
            str(r["shape"]),
            *(f"{ms[k]:.3f}" for k in ("triton", "triton_graph", "sort_graph", "auto", "sgd")),
            *(f"{ms[k] / ms['sgd']:.2f}" for k in ("triton", "triton_graph", "sort_graph", "auto")),
            f"{ms['sort_graph'] / ms['triton']:.1f}",
            f"{float(r['copies']) * 1e3:.3f}",
            f"{float(r['diff']):.1e}",
            f"{float(r['compile_s']):.1f}",
            str(r["config"]),
        ]
        print("| " + " | ".join(vals) + " |")


if __name__ == "__main__":
    main()
