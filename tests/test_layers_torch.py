"""The torch layer seam (``pathnorm_lightning.layers``): which weight is which unit's, the
prox through the seam against the exhaustive reference, and the checks of pairs and of what
stands between their layers."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from pathnorm_lightning import layers
from pathnorm_lightning._common import optional_module
from pathnorm_lightning.functional import METHODS
from shared_spec import reference

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _triton_runs() -> bool:
    """Whether ``method="triton"`` runs here (CUDA, or Triton's interpreter on CPU)."""
    triton = optional_module("pathnorm_lightning._triton")
    return triton is not None and triton.available()


def _pairs() -> dict[str, tuple[nn.Module, nn.Module, tuple[int, ...]]]:
    """Named pairs ``(first, second, input shape)``: every entry, as first and as second
    (non-square kernels, so that a swap of the two kernel axes shows)."""
    torch.manual_seed(0)
    return {
        "linear-linear": (nn.Linear(5, 4), nn.Linear(4, 3), (5,)),
        "conv1d-conv1d": (nn.Conv1d(2, 3, 3), nn.Conv1d(3, 2, 2, stride=2), (2, 9)),
        "conv2d-conv2d": (nn.Conv2d(2, 3, (2, 3)), nn.Conv2d(3, 2, (3, 2), padding=1), (2, 5, 6)),
        "conv1d-linear": (nn.Conv1d(2, 3, 2), nn.Linear(3 * 4, 2), (2, 5)),
        "conv2d-linear": (nn.Conv2d(1, 3, (2, 3)), nn.Linear(3 * 2 * 3, 2), (1, 3, 5)),
        "conv2d-linear-pooled": (nn.Conv2d(1, 2, 2), nn.Linear(2 * 2 * 2, 3), (1, 5, 5)),
    }


def _between(first: nn.Module, second: nn.Module, name: str) -> list[nn.Module]:
    if not isinstance(second, nn.Linear) or isinstance(first, nn.Linear):
        return [nn.ELU()]
    pool = [nn.MaxPool2d(2)] if name.endswith("pooled") else []
    return [nn.ELU(), *pool, nn.Flatten()]


def _hidden(first: nn.Module, shape: tuple[int, ...], name: str) -> torch.Size:
    """The shape of what the second layer reads (after pooling, before any Flatten)."""
    h = first(torch.zeros(1, *shape))
    if name.endswith("pooled"):
        h = nn.MaxPool2d(2)(h)
    return h.shape[1:]


def _read(second: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return second(h.flatten(1) if isinstance(second, nn.Linear) else h)


@pytest.mark.parametrize("name", list(_pairs()))
def test_each_view_row_and_column_is_the_weights_of_one_unit(name: str) -> None:
    """Changing unit c's incoming row changes output channel c only; changing its outgoing
    column changes how the second layer reads channel c only, and nothing else."""
    first, second, shape = _pairs()[name]
    n = layers.entry_of(first).units_out(first)
    flatten = layers.flatten_positions(first, second)
    between = layers.check_between(first, second, _between(first, second, name))
    assert (between.flatten is not None) == (flatten is not None)
    u = torch.randn(4, *shape)
    hidden = _hidden(first, shape, name)
    for c in range(n):
        probe = copy.deepcopy(first)
        rows = layers.in_view(probe).detach().clone()
        rows[c] += 1.0
        layers.write_in(probe, rows)
        changed = (probe(u) - first(u)).abs().flatten(2).sum((0, 2)) if len(shape) > 1 else None
        if changed is None:
            changed = (probe(u) - first(u)).abs().sum(0)
        assert changed[c] > 0 and changed.sum() == changed[c]

        probe = copy.deepcopy(second)
        cols = layers.out_view(probe, n, flatten).detach().clone()
        cols[:, c] += 1.0
        layers.write_out(probe, cols, flatten)
        only_c = torch.zeros(3, *hidden)
        only_c[:, c] = torch.rand(3, *hidden[1:]) + 0.5
        others = torch.randn(3, *hidden)
        others[:, c] = 0.0
        with torch.no_grad():
            assert not torch.allclose(_read(probe, only_c), _read(second, only_c))
            torch.testing.assert_close(_read(probe, others), _read(second, others))


@pytest.mark.parametrize("name", list(_pairs()))
def test_views_round_trip_and_write_back_in_place(name: str) -> None:
    first, second, _ = _pairs()[name]
    entry_first, entry_second = layers.entry_of(first), layers.entry_of(second)
    n, flatten = entry_first.units_out(first), layers.flatten_positions(first, second)
    view_in = entry_first.in_view(first.weight.detach())
    view_out = entry_second.out_view(second.weight.detach(), n, flatten)
    assert view_in.shape[0] == n and view_out.shape[1] == n
    assert view_in.numel() == first.weight.numel() and view_out.numel() == second.weight.numel()
    assert view_in.data_ptr() == first.weight.data_ptr()  # the incoming side is always a view
    torch.testing.assert_close(entry_first.in_native(view_in, first.weight.shape), first.weight)
    torch.testing.assert_close(
        entry_second.out_native(view_out, second.weight.shape, flatten), second.weight
    )
    # every weight stands in exactly one unit, once
    for view, weight in ((view_in, first.weight), (view_out, second.weight)):
        assert torch.equal(view.flatten().sort().values, weight.flatten().sort().values)
    weight, version, doubled = second.weight, second.weight._version, view_out * 2.0
    layers.write_out(second, doubled, flatten)
    assert second.weight is weight and second.weight._version > version
    assert torch.equal(layers.out_view(second, n, flatten), doubled)


def test_a_channels_last_weight_is_written_back_through_a_copy() -> None:
    torch.manual_seed(2)
    conv, second = nn.Conv2d(3, 4, 2).double(), nn.Conv2d(4, 2, 2).double()
    plain, plain_second = copy.deepcopy(conv), copy.deepcopy(second)
    conv = conv.to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    assert layers.in_view(conv).data_ptr() != conv.weight.data_ptr()  # no view has that shape
    layers.prox_pair_(conv, second, 0.05)
    layers.prox_pair_(plain, plain_second, 0.05)
    assert not conv.weight.is_contiguous()  # written in place, in its own layout
    assert torch.equal(conv.weight, plain.weight) and torch.equal(
        second.weight, plain_second.weight
    )
    assert (conv.weight == 0).any()


# --- the prox through the seam, against the exhaustive reference ----------------------------


def _random_pair(rng: np.random.Generator) -> tuple[nn.Module, nn.Module]:
    """A small random pair of any type combination (the reference is exhaustive: few weights)."""
    kind = rng.choice(["linear-linear", "conv1d-conv1d", "conv2d-conv2d", "conv1d-linear",
                       "conv2d-linear"])  # fmt: skip
    c_in, c = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    out = int(rng.integers(1, 3))
    if kind == "linear-linear":
        return nn.Linear(int(rng.integers(1, 7)), c), nn.Linear(c, int(rng.integers(1, 6)))
    if kind.startswith("conv1d"):
        first: nn.Module = nn.Conv1d(c_in, c, int(rng.integers(1, 4)))
        second_conv: Callable[..., nn.Module] = nn.Conv1d
        k2: int | tuple[int, int] = int(rng.integers(1, 4))
    else:
        first = nn.Conv2d(c_in, c, (int(rng.integers(1, 3)), int(rng.integers(1, 3))))
        second_conv = nn.Conv2d
        k2 = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
    if kind.endswith("linear"):
        return first, nn.Linear(c * int(rng.integers(1, 5)), out)
    return first, second_conv(c, out, k2)


def _fill(layer: nn.Module, rng: np.random.Generator, style: int) -> None:
    w = rng.normal(size=tuple(layer.weight.shape))
    if style == 0:  # ties: two magnitudes
        w = np.sign(w) * rng.choice([0.5, 1.0], size=w.shape)
    elif style == 1:  # zeros, and a dead unit
        w *= rng.random(w.shape) < 0.5
        w.reshape(w.shape[0], -1)[0] = 0.0
    elif style == 2:  # huge dynamic range
        w *= 10.0 ** rng.uniform(-6, 6, size=w.shape)
    elif style == 3:  # a coarse grid: ties everywhere
        w = np.round(w, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))


def _lam(rng: np.random.Generator, style: int, p: int, m: int) -> float:
    if style == 4:  # k l lam^2 next to 1
        k, l_ = int(rng.integers(1, p + 1)), int(rng.integers(1, m + 1))
        return float((1 + rng.choice([-1e-9, 0.0, 1e-6])) / np.sqrt(k * l_))
    return float(rng.choice([1e-8, 10 ** rng.uniform(-3, 0.5), 10 ** rng.uniform(-3, 0.5), 1e6]))


def _units(first: nn.Module, second: nn.Module) -> tuple[np.ndarray, np.ndarray]:
    """The neutral (X, Y) of a pair: rows are units (outgoing, incoming)."""
    n, flatten = layers.entry_of(first).units_out(first), layers.flatten_positions(first, second)
    with torch.no_grad():
        y = layers.in_view(first).double().cpu().numpy()
        x = layers.out_view(second, n, flatten).double().cpu().numpy().T
    return x, y


@pytest.mark.parametrize("device", DEVICES)
def test_prox_through_the_seam_is_the_exact_prox_of_each_unit(device: str) -> None:
    """Random pairs of every type, ties, zeros, dead units, huge ranges and lam from 1e-8 to
    1e6 (and next to k l lam^2 = 1), every method: per unit the objective is the reference's
    minimum, and where the minimiser is unique, the point is the reference's."""
    rng = np.random.default_rng(25)
    methods = [m for m in METHODS if m != "kernel" or device == "cpu"]
    if not _triton_runs():
        methods.remove("triton")
    unique = 0
    for index in range(160):
        first, second = (layer.double().to(device) for layer in _random_pair(rng))
        style = int(rng.integers(0, 6))
        _fill(first, rng, style)
        _fill(second, rng, int(rng.integers(0, 6)) if style != 0 else 0)
        x, y = _units(first, second)
        lam = _lam(rng, style, x.shape[1], y.shape[1])
        v_ref, w_ref = reference.prox_path_norm(x, y, lam)
        is_unique = reference.minimiser_margin(x, y, lam, 1e-12)[1] == 0.0
        unique += is_unique
        for method in methods if index % 12 == 0 else [m for m in methods if m != "triton"]:
            a, b = copy.deepcopy(first), copy.deepcopy(second)
            ids = (id(a.weight), id(b.weight))
            out = layers.prox_pair_(a, b, lam, method=method)
            assert out[0] is a.weight and out[1] is b.weight and ids == (id(a.weight), id(b.weight))
            v, w = _units(a, b)
            for i in range(x.shape[0]):
                h = reference.objective(v[i], w[i], x[i], y[i], lam)
                h_ref = reference.objective(v_ref[i], w_ref[i], x[i], y[i], lam)
                assert h <= h_ref + 1e-9 * max(1.0, h_ref), (method, lam, x[i], y[i], h, h_ref)
            assert np.all(v * x >= 0) and np.all(w * y >= 0)  # signs kept
            assert np.all(v[x == 0] == 0) and np.all(w[y == 0] == 0)  # zeros stay zero
            if is_unique:
                np.testing.assert_allclose(v, v_ref, rtol=1e-9, atol=1e-12)
                np.testing.assert_allclose(w, w_ref, rtol=1e-9, atol=1e-12)
                assert np.array_equal(v == 0, v_ref == 0) and np.array_equal(w == 0, w_ref == 0)
    assert unique >= 100


def test_prox_pair_keeps_autograd_working_and_moves_the_version_counters() -> None:
    torch.manual_seed(1)
    conv, lin = nn.Conv2d(1, 3, 2), nn.Linear(3 * 4 * 4, 2)
    x = torch.randn(2, 1, 5, 5)
    loss = lin(torch.relu(conv(x)).flatten(1)).sum()
    versions = (conv.weight._version, lin.weight._version)
    layers.prox_pair_(conv, lin, 0.01)
    assert conv.weight._version > versions[0] and lin.weight._version > versions[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # the graph saved the old weights
    lin(torch.relu(conv(x)).flatten(1)).sum().backward()
    assert conv.weight.grad is not None and conv.weight.requires_grad


def test_bad_arguments_and_non_finite_weights_are_refused_and_nothing_is_written() -> None:
    first, second = nn.Conv1d(2, 3, 2).double(), nn.Conv1d(3, 2, 2).double()
    with torch.no_grad():
        second.weight[0, 0, 0] = float("nan")
    before = (first.weight.detach().clone(), second.weight.detach().clone())
    with pytest.raises(ValueError, match="method must be one of"):
        layers.prox_pair_(first, second, 0.1, method="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lam must be a finite number >= 0"):
        layers.prox_pair_(first, second, -1.0)
    for method in ("kernel", "sort"):
        with pytest.raises(ValueError, match="w_out contains NaN or inf"):
            layers.prox_pair_(first, second, 0.1, method=method)
        assert torch.equal(first.weight, before[0])
        assert torch.equal(torch.nan_to_num(second.weight), torch.nan_to_num(before[1]))


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        (nn.Conv3d(1, 2, 2), nn.Conv3d(2, 1, 2), "a Conv3d has no hidden units.*Conv1d, Conv2d, Linear"),
        (nn.Conv2d(2, 4, 2, groups=2), nn.Conv2d(4, 1, 2), "groups=2: grouped and depthwise"),
        (nn.LazyLinear(3), nn.Linear(3, 1), "not materialized yet"),
        (nn.Linear(4, 3), nn.Conv1d(3, 1, 2), "a Conv1d cannot read the units of a Linear"),
        (nn.Linear(4, 3), nn.Linear(2, 1), "a Linear with 3 outputs and a Linear with 2 inputs"),
        (nn.Conv1d(1, 3, 2), nn.Conv1d(2, 1, 2), "a Conv1d with 3 outputs and a Conv1d with 2"),
        (nn.Conv1d(1, 3, 2), nn.Linear(7, 1), "7 is not a multiple of 3"),
        (nn.ConvTranspose2d(1, 2, 2), nn.Conv2d(2, 1, 2), "a ConvTranspose2d has no hidden"),
    ],
)  # fmt: skip
def test_unsupported_pairs_are_refused(first: nn.Module, second: nn.Module, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layers.prox_pair_(first, second, 0.1)


def test_a_layer_cannot_pair_with_itself() -> None:
    conv = nn.Conv1d(2, 2, 1)
    with pytest.raises(ValueError, match="cannot pair with itself"):
        layers.prox_pair_(conv, conv, 0.1)


_CONV, _LIN = nn.Conv2d(1, 2, 2), nn.Linear(8, 1)


@pytest.mark.parametrize(
    ("first", "second", "between", "message"),
    [
        (_CONV, _LIN, [nn.ReLU(), nn.BatchNorm2d(2), nn.Flatten()], "a BatchNorm2d is neither"),
        (_CONV, _LIN, [nn.ReLU()], "needs an nn.Flatten before it"),
        (_CONV, _LIN, [nn.Flatten(), nn.Flatten()], "a Flatten may stand only once"),
        (_CONV, _LIN, [nn.Flatten(2)], r"Flatten\(start_dim=2, end_dim=-1\) must flatten"),
        (_CONV, _LIN, [nn.Flatten(), nn.MaxPool1d(2)], "pools positions, but there are none"),
        (_CONV, _LIN, [nn.AvgPool2d(2, divisor_override=1), nn.Flatten()], "divisor_override=1"),
        (nn.Linear(3, 2), nn.Linear(2, 1), [nn.MaxPool1d(2)], "pools positions"),
        (nn.Linear(3, 2), nn.Linear(2, 1), [nn.Flatten()], "only once, after a convolution"),
        (_CONV, nn.Conv2d(2, 1, 1), [nn.Flatten()], "only once, after a convolution"),
        (nn.Linear(3, 2), nn.Linear(2, 1), [nn.LayerNorm(2)], "a LayerNorm is neither"),
        (nn.Linear(3, 2), nn.Linear(2, 1), [nn.PReLU()], "a PReLU is neither"),
        (nn.Linear(3, 2), nn.Conv1d(2, 1, 1), [nn.ReLU()], "cannot read the units of a Linear"),
    ],
)  # fmt: skip
def test_check_between_refuses(
    first: nn.Module, second: nn.Module, between: list[nn.Module], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        layers.check_between(first, second, between)


def test_check_between_accepts_and_reports_pools_and_flatten() -> None:
    pool, flat = nn.AvgPool2d(2, 1), nn.Flatten()
    found = layers.check_between(
        _CONV, _LIN, [nn.ELU(), nn.Dropout2d(), pool, nn.MaxPool2d(2), flat, nn.Dropout()]
    )
    assert found.pools == (pool, found.pools[1]) and found.flatten is flat
    assert layers.check_between(nn.Linear(3, 2), nn.Linear(2, 1), []) == layers.Between((), None)
    assert layers.role_of(nn.AdaptiveAvgPool2d(1)) is layers.Role.POOL
    assert layers.role_of(nn.Softmax(1)) is None  # mixes entries


_POINTWISE = [m for m, role in layers.BETWEEN.items() if role is layers.Role.POINTWISE]


@pytest.mark.parametrize(
    "module",
    [cls() for cls in _POINTWISE if "Dropout" not in cls.__name__]
    + [nn.ELU(alpha=2.5), nn.LeakyReLU(-1.5), nn.CELU(alpha=0.3), nn.GELU("tanh")],
    ids=repr,
)
def test_max_slope_is_the_sup_of_the_derivative(module: nn.Module) -> None:
    x = torch.linspace(-12, 12, 480_001, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(module(x).sum(), x)
    sup = float(grad.abs().max())
    # never below the true slope (the warning must fire when it exceeds 1), at most 1e-3 above
    assert sup <= layers.max_slope(module) + 1e-9
    assert layers.max_slope(module) - max(sup, 1.0) < 1e-3


@pytest.mark.parametrize(
    ("module", "warns"),
    [(nn.GELU(), True), (nn.SiLU(), True), (nn.Hardswish(), True), (nn.ELU(alpha=2.0), True),
     (nn.ELU(), False), (nn.ReLU(), False), (nn.Tanh(), False), (nn.LeakyReLU(0.2), False)],
    ids=repr,
)  # fmt: skip
def test_an_activation_steeper_than_one_warns_that_the_bounds_do_not_hold(
    module: nn.Module, warns: bool
) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        layers.check_between(nn.Linear(3, 2), nn.Linear(2, 1), [module])
    steep = [w for w in seen if "path_norm_bound" in str(w.message)]
    assert len(steep) == int(warns)
    if warns:
        assert type(module).__name__ in str(steep[0].message)


def test_reuse_counts_output_positions_per_tap() -> None:
    linear = nn.Linear(4, 2)
    assert layers.entry_of(linear).reuse(linear) == 1
    conv = nn.Conv2d(2, 1, (3, 2), stride=(1, 2), padding="valid")
    assert layers.entry_of(conv).reuse(conv, (5, 6)) == 3 * 3  # (5-3+1) x ((6-2)//2+1)
    padded = nn.Conv1d(2, 1, 3, padding=1)
    # 6 outputs; tap 0 reads position r - 1 (r = 1..5), tap 1 all six, tap 2 r + 1 (r = 0..4)
    assert layers.entry_of(padded).reuse(padded, (6,)) == 6
    reflect = nn.Conv1d(2, 1, 3, padding=2, padding_mode="reflect")
    assert layers.entry_of(reflect).reuse(reflect, (6,)) == 8
    zero = nn.Conv1d(2, 1, 3, padding=2)
    assert layers.entry_of(zero).reuse(zero, (6,)) == 6  # each tap meets 2 padded positions
    with pytest.raises(ValueError, match="grid of 1 spatial dimensions"):
        layers.entry_of(zero).reuse(zero, (6, 6))


def test_register_adds_a_layer_type() -> None:
    class Dense(nn.Module):  # a layer the registry does not know, computing x @ weight.T
        def __init__(self, m: int, n: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n, m, dtype=torch.float64))

    first, second = Dense(4, 3), nn.Linear(3, 2).double()
    with pytest.raises(ValueError, match="a Dense has no hidden units"):
        layers.prox_pair_(first, second, 0.1)
    layers.register(Dense, layers.LinearEntry())
    try:
        x, y = _units(first, second)
        v_ref, w_ref = reference.prox_path_norm(x, y, 0.1)
        layers.prox_pair_(first, second, 0.1)
        v, w = _units(first, second)
        np.testing.assert_allclose(v, v_ref, atol=1e-12)
        np.testing.assert_allclose(w, w_ref, atol=1e-12)
    finally:
        del layers.ENTRIES[Dense]
    with pytest.raises(TypeError, match=r"nn\.Module subclass"):
        layers.register(int, layers.LinearEntry())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="entry must be a LayerEntry"):
        layers.register(Dense, object())  # type: ignore[arg-type]
