"""The Triton prox kernel (``pathnorm_lightning._triton``) against the exhaustive reference.

On a CUDA machine the kernel runs on the GPU. Without one it runs on CPU tensors in Triton's
interpreter, which has to be switched on before triton is first imported (triton builds its
language library for one mode at import): this module sets ``TRITON_INTERPRET=1`` when it is
imported first; in a whole-suite run an earlier module may already have imported triton (Lightning
does), and the tests then skip, saying so, unless ``tests/conftest.py`` sets the variable too.
The interpreter runs a program at a time in Python, so every test batches its units into a few
launches.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from pathnorm_lightning import _triton, _triton_kernels  # noqa: E402
from shared_spec import reference  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not _triton.available(),
    reason="no CUDA device, and triton was imported before TRITON_INTERPRET=1 was set "
    "(run this module alone, or set TRITON_INTERPRET=1 in the environment)",
)


def run(
    x: np.ndarray,
    y: np.ndarray,
    lam: float | torch.Tensor,
    dtype: torch.dtype = torch.float64,
    flag: torch.Tensor | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The kernel on a layer in neutral layout (``x`` (n, p) outgoing, ``y`` (n, m) incoming),
    in ``dtype``; returns ``(V, W)`` in neutral layout, float64."""
    w_in = torch.tensor(y, dtype=dtype, device=DEVICE)
    w_out = torch.tensor(np.ascontiguousarray(x.T), dtype=dtype, device=DEVICE)
    _triton.prox_inplace(w_in, w_out, lam, flag)
    return w_out.double().cpu().numpy().T, w_in.double().cpu().numpy()


def unit_objectives(v: np.ndarray, w: np.ndarray, x: np.ndarray, y: np.ndarray, lam: float):
    """The prox objective of every unit (rows), float64."""
    return (
        0.5 * ((v - x) ** 2).sum(1)
        + 0.5 * ((w - y) ** 2).sum(1)
        + lam * np.abs(v).sum(1) * np.abs(w).sum(1)
    )


def assert_exact(
    x: np.ndarray, y: np.ndarray, lam: float, v: np.ndarray, w: np.ndarray, rtol: float = 1e-9
) -> None:
    """Every unit's objective is the reference minimum (up to ``rtol`` of the unit's scale),
    signs are kept and zeros stay zero; where the reference's minimiser is unique at that level,
    the point is the reference's."""
    v_ref, w_ref = reference.prox_path_norm(x, y, lam)
    h = unit_objectives(v, w, x, y, lam)
    h_ref = unit_objectives(v_ref, w_ref, x, y, lam)
    scale = 1.0 + 0.5 * ((x**2).sum(1) + (y**2).sum(1))
    worse = np.nonzero(h > h_ref + rtol * scale)[0]
    assert worse.size == 0, [(x[i].tolist(), y[i].tolist(), lam, h[i], h_ref[i]) for i in worse]
    assert np.all(v * x >= 0) and np.all(w * y >= 0)
    assert np.all(v[x == 0] == 0) and np.all(w[y == 0] == 0)
    for i in range(x.shape[0]):
        _, spread = reference.minimiser_margin(x[i : i + 1], y[i : i + 1], lam, rtol)
        if spread == 0.0:
            tol = rtol * math.sqrt(scale[i])
            np.testing.assert_allclose(v[i], v_ref[i], atol=tol, rtol=0, err_msg=str(i))
            np.testing.assert_allclose(w[i], w_ref[i], atol=tol, rtol=0, err_msg=str(i))


def random_units(rng: np.random.Generator, n: int, p: int, m: int) -> tuple[np.ndarray, ...]:
    """``n`` units of one shape, each drawn from one of the hard styles: equal magnitudes,
    exact zeros and zero sides, a huge dynamic range, a coarse grid (ties everywhere, also at
    the threshold), plain normal."""
    x, y = rng.normal(size=(n, p)), rng.normal(size=(n, m))
    style = rng.integers(0, 5, size=n)
    for i in range(n):
        if style[i] == 0:
            x[i] = np.sign(x[i]) * rng.choice([0.5, 1.0], size=p)
            y[i] = np.sign(y[i]) * rng.choice([0.5, 1.0], size=m)
        elif style[i] == 1:
            x[i] *= rng.random(p) < 0.5
            y[i] *= rng.random(m) < 0.5
            if rng.random() < 0.3:
                (x if rng.random() < 0.5 else y)[i] = 0.0
        elif style[i] == 2:
            x[i] *= 10.0 ** rng.uniform(-6, 6, size=p)
            y[i] *= 10.0 ** rng.uniform(-6, 6, size=m)
        elif style[i] == 3:
            x[i], y[i] = np.round(x[i], 1), np.round(y[i], 1)
    return x, y


# (p, m): outgoing and incoming side lengths; p > m runs the kernel with the roles swapped.
SHAPES = [(1, 1), (1, 7), (3, 9), (6, 9), (4, 4), (9, 3), (7, 1), (2, 17), (20, 5)]


@pytest.fixture
def search(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``"full"``: every long side sorted whole; ``"band"``: the band search tried on every
    layer, with 16 columns (wider bands fall back to the full search)."""
    monkeypatch.setattr(_triton, "_BAND", 16 if request.param == "band" else 0)
    monkeypatch.setattr(_triton, "_BAND_MIN_BLOCK", 0)


@pytest.mark.parametrize("search", ["full", "band"], indirect=True)
@pytest.mark.parametrize(("p", "m"), SHAPES, ids=lambda v: str(v))
def test_exact_on_random_units(p: int, m: int, search: None) -> None:
    rng = np.random.default_rng(1000 * p + m)
    lams = [float(10 ** rng.uniform(-3, 0.5)) for _ in range(2)] + [1e-3]
    k, l = int(rng.integers(1, p + 1)), int(rng.integers(1, m + 1))
    # k l lam^2 next to 1: d = 1 - k l lam^2 tiny, a and b amplified by 1 / d
    lams += [(1 + e) / math.sqrt(k * l) for e in (-1e-9, -1e-6, 0.0, 1e-6)]
    for lam in lams:
        x, y = random_units(rng, 40, p, m)
        v, w = run(x, y, lam)
        assert_exact(x, y, lam, v, w)


def test_band_search_where_the_band_fits_else_the_full_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A small lam leaves a handful of entries at or below lam ||x||_1 (the band): the band
    # search (16 columns) runs. A large one puts most entries there: the full search runs.
    monkeypatch.setattr(_triton, "_BAND", 16)
    monkeypatch.setattr(_triton, "_BAND_MIN_BLOCK", 0)
    seen: list[int] = []
    if not CUDA:  # the interpreter looks the helper up at every call: record what runs
        _triton._kernel()
        real = _triton_kernels._search

        def spy(*args: object) -> object:
            seen.append(int(args[14]))  # NCOL: the columns searched
            return real(*args)

        monkeypatch.setattr(_triton_kernels, "_search", spy)
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(24, 3)), rng.normal(size=(24, 40))
    y[:, :5] = 0.0  # zeros are never in the band
    y[:, 5] = 1e-3 * np.abs(x).sum(1)  # an entry at the band's top, and one just above
    y[:, 6] = np.nextafter(y[:, 5] * (1 + 2.0**-16), 1.0)
    for lam, ncol in ((1e-3, 16), (0.5, 64)):
        seen.clear()
        assert_exact(x, y, lam, *run(x, y, lam))
        if not CUDA:
            assert seen and set(seen) == {ncol}, (lam, seen)
    # One unit per program, every other unit with a wide band (its incoming weights all at or
    # below lam ||x||_1): one launch solves half the units by the band search and leaves the
    # others to the second, which walks all units and solves only those.
    real_shape = _triton._launch_shape
    monkeypatch.setattr(_triton, "_launch_shape", lambda *a: (1, *real_shape(*a)[1:]))
    y[::2] *= 1e-6
    seen.clear()
    assert_exact(x, y, 1e-3, *run(x, y, 1e-3))
    if not CUDA:
        assert seen.count(16) == 12 and seen.count(64) == 12, seen


def test_tiny_huge_and_zero_lam() -> None:
    rng = np.random.default_rng(5)
    x, y = random_units(rng, 64, 4, 6)
    for lam in (1e-300, 1e-12, 3.0, 1e30):
        assert_exact(x, y, lam, *run(x, y, lam))
    for dtype in (torch.float64, torch.float32):
        xd, yd = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
        v, w = run(xd, yd, 0.0, dtype)
        assert np.array_equal(v, xd) and np.array_equal(w, yd)  # the identity, to the bit


def test_lam_from_a_device_tensor_equals_the_number() -> None:
    rng = np.random.default_rng(6)
    x, y = random_units(rng, 32, 5, 8)
    for lam in (1e-3, 0.07, 0.4):
        want = run(x, y, lam)
        for dt in (torch.float64, torch.float32):
            lam_t = torch.tensor(lam, dtype=dt, device=DEVICE)
            got = run(x, y, lam_t)
            exact = run(x, y, float(lam_t))  # a float32 lam rounds as the tensor holds it
            assert all(np.array_equal(g, e) for g, e in zip(got, exact, strict=True))
            if dt == torch.float64:
                assert all(np.array_equal(g, e) for g, e in zip(got, want, strict=True))


def test_first_minimum_wins_in_the_references_order() -> None:
    # ||x|| = ||y|| and lam >= 1 (no support pair is feasible): (x, 0) and (0, y) tie exactly,
    # and (x, 0) comes first; with either side the shorter one (the kernel swaps roles).
    for x, y in (([3.0, 4.0], [5.0, 0.0, 0.0]), ([1.0, 1.0, 1.0, 1.0], [2.0]), ([2.0], [2.0])):
        xa, ya = np.array([x]), np.array([y])
        v, w = run(xa, ya, 1.5)
        v_ref, w_ref, _ = reference.prox_unit(xa[0], ya[0], 1.5)
        assert np.array_equal(v[0], v_ref) and np.array_equal(w[0], w_ref)
        assert np.array_equal(v, xa) and not w.any()
    # A strictly better (0, y) is taken.
    v, w = run(np.array([[1.0, 1.0]]), np.array([[2.0, 0.0, 0.0]]), 1.5)
    assert not v.any() and np.array_equal(w, [[2.0, 0.0, 0.0]])


def test_float32_is_the_rounding_of_the_float64_computation() -> None:
    # The kernel works in float64 whatever the weights' dtype: on float32 (or half precision)
    # weights the result is the rounding of the float64 result on the same values, to the bit
    # (half precision rounds through float32, as torch converts float64).
    rng = np.random.default_rng(7)
    x, y = random_units(rng, 64, 6, 11)
    for lam in (2e-3, 0.05, 0.3):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xd = torch.tensor(x).to(dtype).double().numpy()
            yd = torch.tensor(y).to(dtype).double().numpy()
            finite = np.isfinite(xd).all(1) & np.isfinite(yd).all(1)  # float16 tops at 65504
            assert finite.sum() >= 48
            xd, yd = xd[finite], yd[finite]
            want = run(xd, yd, lam)
            got = run(xd, yd, lam, dtype)
            for g, f in zip(got, want, strict=True):
                assert np.array_equal(g, torch.tensor(f).to(dtype).double().numpy()), dtype


def test_float32_extreme_magnitudes() -> None:
    # Entries from 1e-30 to 1e30 within a unit, and whole units at 1e+-30: the per-unit power
    # of two keeps every square in range (float32 squares alone would overflow or vanish).
    rng = np.random.default_rng(8)
    n, p, m = 96, 5, 7
    x = np.sign(rng.normal(size=(n, p))) * 10.0 ** rng.uniform(-30, 30, size=(n, p))
    y = np.sign(rng.normal(size=(n, m))) * 10.0 ** rng.uniform(-30, 30, size=(n, m))
    x[:32] = rng.normal(size=(32, p)) * 1e30
    y[:32] = rng.normal(size=(32, m)) * 1e30
    x[32:64] = rng.normal(size=(32, p)) * 1e-30
    y[32:64] = rng.normal(size=(32, m)) * 1e-30
    x, y = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
    for lam in (1e-3, 0.1, 0.6):
        v, w = run(x, y, lam, torch.float32)
        v_ref, w_ref = reference.prox_path_norm(x, y, lam)
        h = unit_objectives(v, w, x, y, lam)
        h_ref = unit_objectives(v_ref, w_ref, x, y, lam)
        scale = 0.5 * ((x**2).sum(1) + (y**2).sum(1))
        assert np.all(h <= h_ref + 1e-6 * scale), np.max((h - h_ref) / scale)
        assert np.all(v * x >= 0) and np.all(w * y >= 0)


@pytest.mark.parametrize(
    ("dtype", "powers"), [(torch.float32, (-100, -40, 60, 100)), (torch.float64, (-900, 900))]
)
def test_scale_equivariance_to_the_bit(dtype: torch.dtype, powers: tuple[int, ...]) -> None:
    # prox_lam(s x, s y) = s prox_lam(x, y): the kernel scales each unit by a power of two
    # before anything else, so a power-of-two rescaling of the weights changes no bit.
    rng = np.random.default_rng(9)
    x, y = rng.normal(size=(40, 4)), rng.normal(size=(40, 9))
    x, y = (torch.tensor(a).to(dtype).double().numpy() for a in (x, y))
    for lam in (0.01, 0.2):
        v, w = run(x, y, lam, dtype)
        for e in powers:
            s = 2.0**e
            vs, ws = run(x * s, y * s, lam, dtype)
            assert np.array_equal(vs, v * s) and np.array_equal(ws, w * s), (e, lam)


def test_non_finite_weights_set_the_flag_and_leave_other_units_exact() -> None:
    rng = np.random.default_rng(10)
    x, y = rng.normal(size=(12, 3)), rng.normal(size=(12, 8))
    lam = 0.05
    v_ref, w_ref = run(x, y, lam)
    for where, bit in (("y", 1), ("x", 2)):
        for bad in (math.nan, math.inf, -math.inf):
            xb, yb = x.copy(), y.copy()
            (yb if where == "y" else xb)[4, 1] = bad
            flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
            with np.errstate(invalid="ignore"):  # the interpreter computes with the NaN
                v, w = run(xb, yb, lam, flag=flag)
            assert int(flag.item()) == bit, (where, bad)
            keep = np.arange(12) != 4
            assert np.array_equal(v[keep], v_ref[keep]) and np.array_equal(w[keep], w_ref[keep])
    # Both matrices, swapped roles (p > m): both bits; a flag is never cleared, only ORed.
    flag = torch.full((1,), 4, dtype=torch.int32, device=DEVICE)
    xb, yb = rng.normal(size=(5, 9)), rng.normal(size=(5, 2))
    xb[0, 0], yb[3, 1] = math.nan, math.inf
    with np.errstate(invalid="ignore"):
        run(xb, yb, lam, flag=flag)
    assert int(flag.item()) == 7
    flag.zero_()
    run(x, y, lam, flag=flag)  # finite weights: untouched
    assert int(flag.item()) == 0


def test_strided_views_and_long_sides_equal_the_cpu_prox() -> None:
    # Non-contiguous weights (the transposed storage of both), a long side past one tile of
    # k (several k blocks), and p > m, against the package's default CPU prox (float64).
    from pathnorm_lightning import prox_path_norm

    g = torch.Generator().manual_seed(11)
    for n, m, p, lam in ((6, 300, 40, 2e-3), (5, 2000, 3, 1e-3), (7, 12, 70, 0.01)):
        w_in = torch.randn(n, m, generator=g, dtype=torch.float64) / m**0.5
        w_out = torch.randn(p, n, generator=g, dtype=torch.float64) / n**0.5
        want_in, want_out = prox_path_norm(w_in, w_out, lam)
        assert (want_in == 0).any() or (want_out == 0).any()
        a = w_in.t().contiguous().t().to(DEVICE)  # strides (1, n)
        b = w_out.t().contiguous().t().to(DEVICE)
        assert not a.is_contiguous() and not b.is_contiguous()
        _triton.prox_inplace(a, b, lam)
        torch.testing.assert_close(a.cpu(), want_in, atol=1e-12, rtol=0)
        torch.testing.assert_close(b.cpu(), want_out, atol=1e-12, rtol=0)


def test_spec_vectors() -> None:
    pytest.importorskip("jsonschema", reason="the spec vectors are validated with jsonschema")
    from shared_spec import iter_cases

    cases = [c for c in iter_cases() if c.kind == "path_norm_prox"]
    assert len(cases) >= 30
    for case in cases:
        w_in_np, w_out_np = case.torch_layout()
        dtype = getattr(torch, case.dtype)
        w_in = torch.tensor(w_in_np, dtype=dtype, device=DEVICE)
        w_out = torch.tensor(w_out_np, dtype=dtype, device=DEVICE)
        if not _triton.supports(w_in, w_out):
            assert max(w_in_np.shape[1], w_out_np.shape[0]) > _triton.MAX_SIDE, case.id
            continue
        assert case.lam is not None
        _triton.prox_inplace(w_in, w_out, case.lam)
        case.check(w_out.double().cpu().numpy().T, w_in.double().cpu().numpy())


def test_supports_and_clear_errors() -> None:
    w_in, w_out = torch.zeros(3, 4, device=DEVICE), torch.zeros(2, 3, device=DEVICE)
    assert _triton.supports(w_in, w_out)
    assert not _triton.supports(w_in, w_out.double())
    assert not _triton.supports(w_in.long(), w_out.long())
    assert not _triton.supports(w_in, torch.zeros(2, 5, device=DEVICE))
    assert not _triton.supports(w_in[None], w_out)
    long_side = _triton.MAX_SIDE + 1
    assert not _triton.supports(torch.zeros(3, long_side, device=DEVICE), w_out)
    assert not _triton.supports(torch.zeros(3, 1, device=DEVICE).expand(3, 4), w_out)
    with pytest.raises(ValueError, match=r"does not handle this pair.*method='sort'"):
        _triton.prox_inplace(w_in, w_out.double(), 0.1)
    for lam in (-1.0, math.nan, math.inf, "0.1", True):
        with pytest.raises(ValueError, match="lam must be"):
            _triton.prox_inplace(w_in, w_out, lam)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lam must be a one-element floating tensor"):
        _triton.prox_inplace(w_in, w_out, torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="flag must be an int32 tensor"):
        _triton.prox_inplace(w_in, w_out, 0.1, torch.zeros(1, device=DEVICE))
    empty = torch.zeros(0, 4, device=DEVICE), torch.zeros(2, 0, device=DEVICE)
    _triton.prox_inplace(*empty, 0.1)  # no units: nothing to do


@pytest.mark.skipif(not CUDA, reason="CUDA graphs and host synchronisation need a CUDA device")
def test_cuda_graph_replay_without_host_sync_equals_eager() -> None:
    g = torch.Generator().manual_seed(12)
    w_in = (torch.randn(200, 784, generator=g) / 28).cuda()
    w_out = (torch.randn(10, 200, generator=g) / 14).cuda()
    lam = torch.zeros((), dtype=torch.float64, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    a, b = w_in.clone(), w_out.clone()
    _triton.prox_inplace(a, b, 1e-3, flag)  # compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    buf_in, buf_out = w_in.clone(), w_out.clone()
    with torch.cuda.graph(graph):
        _triton.prox_inplace(buf_in, buf_out, lam, flag)
    for value in (1e-3, 3e-2, 0.0):
        want_in, want_out = w_in.clone(), w_out.clone()
        _triton.prox_inplace(want_in, want_out, value)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any device-to-host wait raises
        try:
            lam.fill_(value)
            buf_in.copy_(w_in)
            buf_out.copy_(w_out)
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(buf_in, want_in) and torch.equal(buf_out, want_out), value
    assert int(flag.item()) == 0


@pytest.mark.skipif(not CUDA, reason="the paper's shapes at full size need a GPU")
@pytest.mark.parametrize("shape", [(784, 200, 10), (784, 1000, 10), (4096, 4096, 10)], ids=str)
def test_paper_shapes_on_the_gpu_equal_the_cpu_prox(shape: tuple[int, int, int]) -> None:
    from pathnorm_lightning import prox_path_norm

    m, n, p = shape
    g = torch.Generator().manual_seed(m + n + p)
    w_in = torch.randn(n, m, generator=g, dtype=torch.float64) / m**0.5
    w_out = torch.randn(p, n, generator=g, dtype=torch.float64) / n**0.5
    for lam in (1e-4, 1e-3, 3e-2):
        want_in, want_out = prox_path_norm(w_in, w_out, lam)
        a, b = w_in.cuda(), w_out.cuda()
        _triton.prox_inplace(a, b, lam)
        torch.testing.assert_close(a.cpu(), want_in, atol=1e-12, rtol=0)
        torch.testing.assert_close(b.cpu(), want_out, atol=1e-12, rtol=0)
        a, b = w_in.float().cuda(), w_out.float().cuda()
        _triton.prox_inplace(a, b, lam)
        torch.testing.assert_close(a.double().cpu(), want_in, atol=2e-6, rtol=0)
        torch.testing.assert_close(b.double().cpu(), want_out, atol=2e-6, rtol=0)
