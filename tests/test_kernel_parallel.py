"""The compiled CPU prox on several threads: the same result to the bit as on one, the same
error, and the cases where it must stay on one thread (small layers, one torch thread, a pool
that is not thread-safe, a process forked after the pool started)."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from pathnorm_lightning import _kernel as K
from pathnorm_lightning import prox_path_norm

pytestmark = pytest.mark.skipif(
    not K._PARALLEL_OK, reason="numba has no thread-safe pool (TBB or OpenMP) on this machine"
)


def _layer(
    rng: np.random.Generator, n: int, m: int, p: int, dtype: type, fortran: bool
) -> tuple[np.ndarray, np.ndarray]:
    long = (rng.standard_normal((n, m)) * (rng.random((n, m)) < 0.7)).astype(dtype)
    short = rng.standard_normal((n, p)).astype(dtype)
    return (np.asfortranarray(short) if fortran else short), long


@pytest.mark.parametrize("threads", [2, 3, 7])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_parallel_kernel_is_bit_identical_to_serial(
    monkeypatch: pytest.MonkeyPatch, threads: int, dtype: type
) -> None:
    monkeypatch.setattr(K, "_PARALLEL_MIN_SIZE", 0)
    rng = np.random.default_rng(threads)
    for case in range(60):
        n = int(rng.integers(1, 120))
        m = int(rng.integers(1, 300))
        p = int(rng.integers(1, 40))  # beyond 16: presorted by numpy
        p, m = min(p, m), max(p, m)
        short, long = _layer(rng, n, m, p, dtype, fortran=case % 2 == 0)
        lam = float(10 ** rng.uniform(-4, -0.5))
        s1, l1 = short.copy(order="K"), long.copy()
        s2, l2 = short.copy(order="K"), long.copy()
        assert K.prox_inplace(s1, l1, lam, True, 1) == -1
        assert K.prox_inplace(s2, l2, lam, True, threads) == -1
        np.testing.assert_array_equal(s2, s1)
        np.testing.assert_array_equal(l2, l1)


@pytest.mark.parametrize("units", [[5], [37, 11], [0, 38], [39]])
def test_parallel_kernel_reports_the_first_non_finite_unit_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, units: list[int]
) -> None:
    monkeypatch.setattr(K, "_PARALLEL_MIN_SIZE", 0)
    rng = np.random.default_rng(1)
    short, long = _layer(rng, 40, 50, 3, np.float32, fortran=True)
    for i, unit in enumerate(units):
        (long if i % 2 == 0 else short)[unit, 1] = np.nan if i % 2 == 0 else np.inf
    s0, l0 = short.copy(order="K"), long.copy()
    assert K.prox_inplace(short, long, 1e-2, True, 4) == min(units)
    np.testing.assert_array_equal(short, s0)
    np.testing.assert_array_equal(long, l0)


def test_torch_threads_decide_and_the_result_does_not_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(0)
    w_in, w_out = torch.randn(200, 784, generator=g), torch.randn(10, 200, generator=g)
    used: list[int] = []
    real = K._use_parallel

    def spy(size: int, threads: int) -> int:
        used.append(real(size, threads))
        return used[-1]

    monkeypatch.setattr(K, "_use_parallel", spy)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = prox_path_norm(w_in, w_out, 1e-3, method="kernel")
        torch.set_num_threads(2)
        threaded = prox_path_norm(w_in, w_out, 1e-3, method="kernel")
    finally:
        torch.set_num_threads(before)
    assert used == [1, min(2, K.numba.config.NUMBA_NUM_THREADS)]
    for a, b in zip(serial, threaded, strict=True):
        assert torch.equal(a, b)


def test_numba_thread_setting_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(K, "_PARALLEL_MIN_SIZE", 0)
    K.numba.set_num_threads(1)
    try:
        short, long = _layer(np.random.default_rng(2), 30, 40, 2, np.float64, fortran=False)
        K.prox_inplace(short, long, 1e-2, True, 2)
        assert K.numba.get_num_threads() == 1
    finally:
        K.numba.set_num_threads(K.numba.config.NUMBA_NUM_THREADS)


def test_when_the_kernel_stays_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    big = K._PARALLEL_MIN_SIZE
    assert K._use_parallel(big, 1) == 1  # torch runs on one thread
    assert K._use_parallel(big - 1, 8) == 1  # too small to pay for waking threads
    assert K._use_parallel(big, 2) == min(2, K.numba.config.NUMBA_NUM_THREADS)
    monkeypatch.setattr(K, "_parallel_pid", os.getpid() + 1)  # forked after the pool started
    assert K._use_parallel(big, 2) == 1
    monkeypatch.setattr(K, "_parallel_pid", None)
    monkeypatch.setattr(K, "_PARALLEL_OK", False)
    assert K._use_parallel(big, 2) == 1
    # numba's fallback pool is neither fast enough nor safe for concurrent callers
    monkeypatch.setattr(K.numba.config, "THREADING_LAYER", "workqueue")
    assert not K._parallel_layer()
    monkeypatch.setattr(K.numba.config, "THREADING_LAYER", "no-such-layer")
    assert K._parallel_layer()  # the default order: TBB, then OpenMP


def _prox_in_child(short: np.ndarray, long: np.ndarray, queue: multiprocessing.Queue) -> None:
    K.prox_inplace(short, long, 1e-3, True, 2)
    queue.put((short, long))


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
def test_a_process_forked_after_the_pool_started_runs_the_serial_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With GNU OpenMP, numba terminates a forked child that starts a parallel region once the
    # parent has used the pool; the kernel goes serial there instead (same result).
    monkeypatch.setattr(K, "_PARALLEL_MIN_SIZE", 0)
    short, long = _layer(np.random.default_rng(3), 50, 60, 4, np.float32, fortran=False)
    expect_s, expect_l = short.copy(), long.copy()
    K.prox_inplace(expect_s, expect_l, 1e-3, True, 2)  # the parent starts the pool
    assert K._parallel_pid == os.getpid()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_prox_in_child, args=(short, long, queue))
    child.start()
    got_s, got_l = queue.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0
    np.testing.assert_array_equal(got_s, expect_s)
    np.testing.assert_array_equal(got_l, expect_l)
