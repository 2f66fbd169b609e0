"""The torch prox, its metrics and PathNormProx on a CUDA device (skipped without one).

On CUDA ``method="auto"`` is the Triton kernel where Triton runs, else the whole-row-sort
algorithm in tensor ops (replayed as a CUDA graph); these tests hold them against the exhaustive reference and the CPU kernel, check that
the prox makes no host synchronisation, and train through Lightning on the GPU.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from test_callbacks import MLP, assert_same_weights, loader, make_data, reference_prox_sgd, trainer
from test_prox_methods import _random_case
from test_prox_safety import TIES

import pathnorm_lightning._cuda_graph as G
import pathnorm_lightning.functional as F
from pathnorm_lightning import (
    L1Prox,
    NonFiniteWeightsError,
    PathNormBound,
    PathNormProx,
    Sparsity,
    path_norm,
    product_bound,
    prox_path_norm,
    prox_path_norm_,
)
from pathnorm_lightning._sort import prox_rows
from pathnorm_lightning.hook import StepTarget, SyncCheck
from shared_spec import reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: these tests run the prox on a GPU"
)


def test_auto_is_triton_or_sort_on_cuda() -> None:
    w_in, w_out = torch.randn(200, 784, device="cuda"), torch.randn(10, 200, device="cuda")
    want = "triton" if F._triton_module() is not None else "sort"
    assert F._resolve_method("auto", w_in, w_out) == want


@pytest.mark.parametrize(
    ("method", "graphs"),
    [("sort", "1"), ("sort", "0"), ("auto", "1"), ("triton", "0")],
    ids=["graph", "sort", "auto", "triton"],
)
def test_exact_on_random_corner_cases_on_cuda(
    method: str, graphs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATHNORM_CUDA_GRAPHS", graphs)
    if method == "triton" and F._triton_module() is None:
        pytest.skip("Triton is not installed")
    rng = np.random.default_rng(20261126)
    for _ in range(600):
        x, y, lam = _random_case(rng)
        new_in, new_out = prox_path_norm(
            torch.tensor(y, device="cuda"),
            torch.tensor(x.T, device="cuda"),
            lam,
            method=method,  # type: ignore[arg-type]
        )
        assert new_in.device.type == "cuda" and new_out.device.type == "cuda"
        w, v = new_in.cpu().numpy(), new_out.cpu().numpy().T
        v_ref, w_ref = reference.prox_path_norm(x, y, lam)
        h_ref = reference.path_norm_objective(v_ref, w_ref, x, y, lam)
        h = reference.path_norm_objective(v, w, x, y, lam)
        assert h <= h_ref + 1e-9 * max(1.0, abs(h_ref)), (x.tolist(), y.tolist(), lam, h, h_ref)
        assert np.all(w * y >= 0) and np.all(v * x >= 0)
        assert np.all(w[y == 0] == 0) and np.all(v[x == 0] == 0)


@pytest.mark.parametrize("shape", [(784, 200, 10), (784, 1000, 10), (512, 512, 512)], ids=str)
@pytest.mark.parametrize("lam", [1e-4, 1e-3, 3e-2])
def test_cuda_equals_the_cpu_kernel_on_paper_shapes(
    shape: tuple[int, int, int], lam: float
) -> None:
    m, n, p = shape
    g = torch.Generator().manual_seed(m + n + p)
    w_in = torch.randn(n, m, generator=g, dtype=torch.float64) / m**0.5
    w_out = torch.randn(p, n, generator=g, dtype=torch.float64) / n**0.5
    ref_in, ref_out = prox_path_norm(w_in, w_out, lam, method="kernel")
    assert (ref_in == 0).any() or (ref_out == 0).any()
    got_in, got_out = prox_path_norm(w_in.cuda(), w_out.cuda(), lam)
    torch.testing.assert_close(got_in.cpu(), ref_in, atol=1e-12, rtol=0)
    torch.testing.assert_close(got_out.cpu(), ref_out, atol=1e-12, rtol=0)
    # float32 on the GPU: float32 rounding of the same thresholds.
    got_in, got_out = prox_path_norm(w_in.float().cuda(), w_out.float().cuda(), lam)
    torch.testing.assert_close(got_in.double().cpu(), ref_in, atol=2e-6, rtol=0)
    torch.testing.assert_close(got_out.double().cpu(), ref_out, atol=2e-6, rtol=0)


def _layer(n: int, m: int, p: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple:
    g = torch.Generator().manual_seed(seed)
    w_in = (torch.randn(n, m, generator=g, dtype=torch.float64) / m**0.5).to(dtype).cuda()
    w_out = (torch.randn(p, n, generator=g, dtype=torch.float64) / n**0.5).to(dtype).cuda()
    return w_in, w_out


def test_prox_makes_no_host_synchronisation_and_check_finite_one() -> None:
    w_in, w_out = _layer(1000, 784, 10, 0)
    want_in, want_out = prox_path_norm(w_in.cpu(), w_out.cpu(), 1e-3)
    for _ in range(2):  # the second call with a shape captures its CUDA graph (one sync)
        prox_path_norm(w_in, w_out, 1e-3, method="sort")
    assert G.cached_graph(w_in, w_out, prox_rows) is not None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host wait raises
    try:
        got_in, got_out = prox_path_norm(w_in, w_out, 1e-3, check_finite=False, method="sort")
        prox_path_norm_(w_in, w_out, 1e-3, check_finite=False, method="sort")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, want in ((got_in, want_in), (got_out, want_out), (w_in, want_in), (w_out, want_out)):
        torch.testing.assert_close(got.cpu(), want, atol=2e-6, rtol=0)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning, match="synchroniz") as record:
            prox_path_norm(w_in, w_out, 1e-3, check_finite=True, method="sort")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum("synchroniz" in str(r.message) for r in record) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cuda_graph_replays_equal_the_eager_kernels(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    G._GRAPHS.clear()
    shape = (300, 120, 7)
    first = G.cached_graph(*_layer(*shape, 0, dtype), prox_rows)
    assert first is None  # the first call runs eagerly
    second = G.cached_graph(*_layer(*shape, 0, dtype), prox_rows)
    assert second is not None, "capture failed on this GPU"
    results = []
    for seed, lam in enumerate([1e-4, 3e-3, 0.05, 0.3, 1e-3]):  # new weights and lam each call
        w_in, w_out = _layer(*shape, seed, dtype)
        w_out = w_out.t().contiguous().t()  # a non-contiguous input goes through too
        got = prox_path_norm(w_in, w_out, lam, method="sort")
        assert got[0].is_contiguous() and got[1].is_contiguous()
        results.append((w_in, w_out, lam, got))
    monkeypatch.setenv("PATHNORM_CUDA_GRAPHS", "0")
    for w_in, w_out, lam, (got_in, got_out) in results:  # earlier outputs were not overwritten
        want_in, want_out = prox_path_norm(w_in, w_out, lam, method="sort")
        assert torch.equal(got_in, want_in) and torch.equal(got_out, want_out), lam
        in_place = (w_in.clone(), w_out.clone())
        monkeypatch.setenv("PATHNORM_CUDA_GRAPHS", "1")
        prox_path_norm_(*in_place, lam, method="sort")
        monkeypatch.setenv("PATHNORM_CUDA_GRAPHS", "0")
        assert torch.equal(in_place[0], want_in) and torch.equal(in_place[1], want_out), lam


@pytest.mark.parametrize("where", ["w_in", "w_out"])
def test_cuda_graph_reports_non_finite_weights_and_writes_nothing(where: str) -> None:
    w_in, w_out = _layer(64, 50, 5, 1)
    for _ in range(2):
        prox_path_norm(w_in, w_out, 0.01, method="sort")  # captured
    assert G.cached_graph(w_in, w_out, prox_rows) is not None
    bad = w_in if where == "w_in" else w_out
    bad[3, 2] = float("nan")
    before = (w_in.clone(), w_out.clone())
    with pytest.raises(NonFiniteWeightsError, match=f"{where} contains NaN or inf"):
        prox_path_norm_(w_in, w_out, 0.01, method="sort")
    assert torch.equal(w_in.isnan(), before[0].isnan())
    assert torch.equal(w_in.nan_to_num(), before[0].nan_to_num())
    assert torch.equal(w_out.nan_to_num(), before[1].nan_to_num())


def test_cuda_graph_cache_keeps_the_most_recent_shapes() -> None:
    G._GRAPHS.clear()
    for n in range(1, G._GRAPHS_MAX + 3):
        w_in, w_out = _layer(n, 9, 4, n)
        want = prox_path_norm(w_in.cpu(), w_out.cpu(), 0.02)
        for _ in range(2):  # eager, then captured and replayed
            got = prox_path_norm(w_in, w_out, 0.02, method="sort")
            torch.testing.assert_close(got[0].cpu(), want[0], atol=1e-6, rtol=0)
            torch.testing.assert_close(got[1].cpu(), want[1], atol=1e-6, rtol=0)
    assert len(G._GRAPHS) == G._GRAPHS_MAX
    assert [k[4][0] for k in G._GRAPHS] == list(range(3, G._GRAPHS_MAX + 3))


def test_lightning_fit_on_the_gpu_matches_the_float64_cpu_reference(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    ds = make_data()
    ref = reference_prox_sgd(model, list(loader(ds)), 0.05, pairs=[(0, 1)], dtype=torch.float64)
    cb = PathNormProx(lam=0.05)
    tr = trainer(
        accelerator="gpu",
        deterministic=False,
        max_epochs=1,
        precision="64-true",
        callbacks=[cb],
        logger=CSVLogger(tmp_path, name="run"),
        log_every_n_steps=2,
    )
    tr.fit(model, loader(ds))
    assert cb.num_steps == len(ds) // 8
    assert tr.strategy.root_device.type == "cuda"
    w_in, w_out = model.net[0].weight.detach(), model.net[2].weight.detach()
    # The metrics were computed on the GPU, from the final weights (the last step logs), and
    # logged as float32, as Lightning logs values.
    assert float(tr.callback_metrics["pathnorm/path_norm_bound"]) == pytest.approx(
        float(path_norm(w_in, w_out)), rel=1e-6
    )
    assert float(tr.callback_metrics["pathnorm/product_bound"]) == pytest.approx(
        float(product_bound(w_in, w_out)), rel=1e-6
    )
    assert_same_weights(model.cpu(), ref, atol=1e-10)


def test_metrics_on_cuda() -> None:
    w_in = torch.tensor([[0.0, 1.0], [0.0, 0.0], [2.0, -0.0]], device="cuda")
    w_out = torch.tensor([[1.0, 3.0, 0.0]], device="cuda")
    sparsity, bound = Sparsity().cuda(), PathNormBound().cuda()
    sparsity.update([w_in, w_out])
    bound.update([w_in, w_out])
    out = sparsity.compute()
    assert out["sparsity"].device.type == "cuda"
    assert float(out["sparsity"]) == pytest.approx(5 / 9)
    assert float(out["alive_units"]) == pytest.approx(1 / 3)  # only unit 0 has both sides
    assert float(bound.compute()) == pytest.approx(1.0 * 1.0)  # unit 0: |1| * |1|


@pytest.mark.parametrize(
    "make_cb", [lambda: PathNormProx(lam=0.01), lambda: L1Prox(lam=0.01)], ids=["path", "l1"]
)
def test_non_finite_weights_on_the_gpu_are_reported_with_their_step(make_cb: Any) -> None:
    torch.manual_seed(0)
    model = MLP(poison_batch=2)  # an inf loss at the third batch: NaN/inf weights after step 3
    tr = trainer(accelerator="gpu", deterministic=False, max_epochs=1, callbacks=[make_cb()])
    with pytest.raises(ValueError, match=r"NaN or inf after optimizer step 3 \(on CUDA"):
        tr.fit(model, loader(make_data()))


def test_callbacks_do_not_stall_the_gpu_at_every_step() -> None:
    def pathnorm_syncs(record: list[warnings.WarningMessage]) -> int:
        return sum(
            "synchroniz" in str(r.message) and "pathnorm_lightning" in r.filename for r in record
        )

    torch.manual_seed(0)
    model = MLP()
    for _ in range(2):  # capture the prox's CUDA graph for these shapes before the fit
        prox_path_norm(torch.ones(16, 20, device="cuda"), torch.ones(4, 16, device="cuda"), 0.1)
    steps = 20
    cb = PathNormProx(lam=0.01, log_metrics=False)
    tr = trainer(accelerator="gpu", deterministic=False, max_epochs=1, callbacks=[cb])
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            SyncCheck()(StepTarget("t", (torch.ones(3, device="cuda"),)))  # a pathnorm sync
            assert pathnorm_syncs(record) == 1
            record.clear()
            tr.fit(model, loader(make_data(n=steps * 8)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cb.num_steps == steps
    # At most the waits for the last flags at the end of the epoch and of the fit.
    assert pathnorm_syncs(record) <= 2


@pytest.mark.parametrize("method", ["sort", "triton"])
def test_ties_and_extreme_magnitudes_on_cuda(method: str) -> None:
    # The tie rule and the exactness at every magnitude hold on the GPU methods too.
    if method == "triton" and F._triton_module() is None:
        pytest.skip("Triton is not installed")
    for x, y, lam in TIES:
        xa, ya = np.array(x), np.array(y)
        v_ref, w_ref = reference.prox_path_norm(xa, ya, lam)
        for dtype in (torch.float32, torch.float64):
            new_in, new_out = prox_path_norm(
                torch.tensor(ya, dtype=dtype, device="cuda"),
                torch.tensor(xa.T, dtype=dtype, device="cuda"),
                lam,
                method=method,  # type: ignore[arg-type]
            )
            assert np.array_equal(new_out.double().cpu().numpy().T, v_ref), (x, y, dtype)
            assert np.array_equal(new_in.double().cpu().numpy(), w_ref), (x, y, dtype)
    w_in, w_out = _layer(200, 50, 10, 7, torch.float64)
    want = prox_path_norm(w_in.cpu(), w_out.cpu(), 0.01, method="kernel")
    for scale in (2.0**-990, 2.0**990):
        got = prox_path_norm(w_in * scale, w_out * scale, 0.01, method=method)  # type: ignore[arg-type]
        torch.testing.assert_close(got[0].cpu() / scale, want[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[1].cpu() / scale, want[1], rtol=0, atol=1e-12)
