"""Convolutional pairs end to end in torch: pairing (auto, explicit, the forward check), the hook
(one step against the exhaustive reference, every CPU method; views planned once; copies
written back), the baselines, the metrics and bounds (against numerical Lipschitz estimates),
and compaction."""

from __future__ import annotations

import copy
import functools
import io
import math
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import pathnorm_lightning
from pathnorm_lightning import (
    L1Prox,
    LayerwiseLinfProjection,
    PathNormBound,
    ProductBound,
    Sparsity,
    StepHook,
    _target,
    attach,
    compact,
    hook,
    layers,
    path_norm,
    resolve_pairs,
)
from pathnorm_lightning._common import optional_module
from pathnorm_lightning.functional import METHODS, prox_path_norm_
from shared_spec import reference


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny convolutions are far slower when two threads contend for a busy core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cpu_methods() -> list[str]:
    triton = optional_module("pathnorm_lightning._triton")
    runs = triton is not None and triton.available()
    return [m for m in METHODS if m != "auto" and (m != "triton" or runs)]


def _cnn(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    """Conv2d(2, 4, 3) -> ELU -> MaxPool2d(2) -> Flatten -> Linear(4 * 9, 3): one pair with a
    Flatten of 9 positions per channel (inputs 2 x 8 x 8)."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.ELU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 9, 3)
    )
    with torch.no_grad():
        net[0].bias.uniform_(-1.0, 1.0)
    return net.to(dtype)


def _conv_conv(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    """Conv1d(2, 3, 3) -> ReLU -> Conv1d(3, 2, 2, stride 2, padding 1): a fully convolutional
    pair (inputs 2 x 9)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv1d(2, 3, 3), nn.ReLU(), nn.Conv1d(3, 2, 2, stride=2, padding=1)).to(
        dtype
    )


def _with_grads(net: nn.Module, lr: float, seed: int = 0) -> torch.optim.Optimizer:
    """An SGD optimizer of ``net`` whose parameters hold seeded gradients (no forward pass:
    the same gradients whatever the weights' memory layout)."""
    g = torch.Generator().manual_seed(seed)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g)
    return torch.optim.SGD(net.parameters(), lr=lr)


# --- pairing ---------------------------------------------------------------------------------


def test_auto_pairs_conv_layers_in_a_sequential() -> None:
    net = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Dropout2d(0.1), nn.Conv2d(4, 5, 3), nn.ELU(),
        nn.AvgPool2d(2), nn.Flatten(), nn.Linear(5 * 4, 6), nn.ReLU(), nn.Linear(6, 2),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pairs = resolve_pairs(net)
    assert [(p.first_name, p.second_name, p.verified, p.flatten) for p in pairs] == [
        ("0", "3", True, None),
        ("7", "9", True, None),
    ]
    (pair,) = resolve_pairs(_cnn())
    assert (pair.first_name, pair.second_name, pair.verified, pair.flatten) == ("0", "4", True, 9)
    explicit = resolve_pairs(net, [("3", "7")])  # by name: Conv -> pool -> Flatten -> Linear
    assert explicit[0].flatten == 4 and explicit[0].second is net[7]


@pytest.mark.parametrize(
    ("net", "pairs", "match"),
    [
        (
            nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1)),
            "auto",
            r"would pair '0' with '3', but '1' \(a BatchNorm2d with parameters or buffers\)",
        ),
        (
            nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Linear(4, 2)),
            "auto",
            r"would pair '0' with '2', but .* needs an nn.Flatten before it",
        ),
        (
            nn.Sequential(nn.Linear(4, 3), nn.Conv1d(3, 2, 1)),
            "auto",
            r"would pair '0' with '1', but a Conv1d cannot read the units of a Linear",
        ),
        (
            nn.Sequential(
                nn.Conv2d(1, 4, 3), nn.AvgPool2d(2, divisor_override=1), nn.Conv2d(4, 2, 1)
            ),
            "auto",
            r"divisor_override=1\) scales the window sums",
        ),
        (
            nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.ReLU(), nn.Conv2d(4, 2, 1)),
            "auto",
            r"layer '0': Conv2d with groups=2: grouped and depthwise convolutions are not",
        ),
        (
            nn.Sequential(nn.Conv2d(1, 3, 3), nn.Flatten(), nn.Linear(10, 2)),
            [("0", "2")],
            r"'0' and '2' do not chain: a Linear with 10 inputs cannot read the 3 channels",
        ),
        (
            nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)),
            [("0", "2")],
            r"'0' \(3 outputs\) and '2' \(4 inputs\) do not chain",
        ),
    ],
    ids=["batchnorm", "no-flatten", "linear-then-conv", "divisor", "grouped", "flatten", "width"],
)
def test_conv_pairs_are_refused_with_their_cause(net: nn.Module, pairs: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_pairs(net, pairs)  # type: ignore[arg-type]


def test_tied_and_parametrized_conv_weights_are_refused() -> None:
    net = nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU(), nn.Conv2d(3, 3, 1))
    net[2].weight = net[0].weight
    with pytest.raises(ValueError, match=r"share one weight \(tied weights\)"):
        resolve_pairs(net)
    net = _cnn()
    torch.nn.utils.parametrizations.weight_norm(net[0])
    with pytest.raises(ValueError, match=r"layer '0' is parametrized \(_WeightNorm\)"):
        resolve_pairs(net)


class _Attributes(nn.Module):
    """A conv pair as attributes, wired in ``forward`` with functions; ``layout`` changes how
    the hidden channels reach the Linear layer."""

    def __init__(self, layout: str = "flatten") -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.head = nn.Linear(3 * 4, 2)
        self.layout = layout

    def forward(self, x: Tensor) -> Tensor:
        h = F.max_pool2d(F.relu(self.conv(x)), 2)  # (N, 3, 2, 2) from 6 x 6 inputs
        if self.layout == "channels-last":
            h = h.permute(0, 2, 3, 1)
        elif self.layout == "padded":
            h = F.pad(h, (0, 0, 0, 0))
        elif self.layout == "channel-softmax":  # mixes the channels, the pair's units
            h = h.softmax(1)
        return self.head(h.reshape(h.shape[0], -1))


@pytest.mark.parametrize("layout", ["flatten", "channels-last", "padded", "channel-softmax"])
def test_the_forward_pass_verifies_attribute_conv_pairs(layout: str) -> None:
    model = _Attributes(layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = attach(optimizer, model, lam=0.01, pairs="auto")
    (target,) = handle.targets
    assert target.name == "pair ('conv', 'head')"
    x = torch.randn(4, 1, 6, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    unverified = [w for w in caught if "could not be verified" in str(w.message)]
    assert len(unverified) == (layout != "flatten"), [str(w.message) for w in caught]
    handle.remove()


class _GlobalPool(nn.Module):
    """Conv -> ReLU -> adaptive average pooling to one position (a mean) -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 3, 3), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1), 1))


def test_the_forward_pass_verifies_a_conv_pair_through_global_average_pooling() -> None:
    model = _GlobalPool()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = attach(optimizer, model, lam=0.01, pairs="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.zero_grad()
        model(torch.randn(4, 1, 6, 6)).sum().backward()
        optimizer.step()
    assert handle.num_steps == 1
    handle.remove()


class _Between(nn.Module):
    """Conv -> ``between`` -> Linear (or, with ``conv``, a second convolution), layers kept as
    attributes: only the forward pass shows what stands between them."""

    def __init__(self, between: Callable[[Tensor], Tensor], head: int, conv: bool = False):
        super().__init__()
        self.between, self.conv = between, nn.Conv2d(1, 3, 3)
        self.head = nn.Conv2d(3, 2, 2) if conv else nn.Linear(head, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.between(F.relu(self.conv(x))))


_SHALLOW = {  # (between, the Linear's inputs or 0 for a second conv): a shallow pair
    "mean over positions": (lambda h: h.mean((2, 3)), 3),
    "mean over positions, keepdim, flatten": (lambda h: h.mean((-1, -2), True).flatten(1), 3),
    "average pooling": (lambda h: F.avg_pool2d(h, 2).flatten(1), 12),
}
_NOT_SHALLOW = {  # not a shallow pair, or its path norm does not bound it
    "divisor_override": (lambda h: F.avg_pool2d(h, 2, divisor_override=1).flatten(1), 12),
    "Lp pooling (a sum of the window)": (lambda h: F.lp_pool2d(h, 1, 2).flatten(1), 12),
    "mean over the channels": (lambda h: h - h.mean(1, keepdim=True), 0),
    "mean over every axis": (lambda h: h - h.mean(), 0),
}


@pytest.mark.parametrize("case", [*_SHALLOW, *_NOT_SHALLOW])
def test_the_forward_pass_tells_pooling_from_scaling_and_mixing(case: str) -> None:
    """Pooling keeps a pair shallow only when it averages (or takes maxima) over the positions
    of each channel: a window sum, or a mean over the channels, is not verified (its bounds
    would be below the network's Lipschitz constant)."""
    between, head = {**_SHALLOW, **_NOT_SHALLOW}[case]
    torch.manual_seed(0)
    model = _Between(between, head, conv=head == 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = attach(optimizer, model, lam=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.zero_grad()
        model(torch.randn(4, 1, 6, 6)).sum().backward()
        optimizer.step()
    unverified = [w for w in caught if "could not be verified" in str(w.message)]
    bounds = {"path_norm_bound", "product_bound"} & set(handle.metrics())
    if case in _SHALLOW:
        assert not unverified and bounds, [str(w.message) for w in caught]
    else:
        assert unverified and not bounds
    handle.remove()


# --- the hook: one step against the exhaustive reference -------------------------------------


def _unit_matrices(first: nn.Module, second: nn.Module) -> tuple[np.ndarray, np.ndarray]:
    """The neutral (X, Y) of a pair: rows are units (outgoing, incoming), float64."""
    n, flatten = layers.entry_of(first).units_out(first), layers.flatten_positions(first, second)
    with torch.no_grad():
        y = layers.in_view(first).double().numpy()
        x = layers.out_view(second, n, flatten).double().numpy().T
    return x.copy(), y.copy()


@pytest.mark.parametrize("method", _cpu_methods())
@pytest.mark.parametrize("build", [_cnn, _conv_conv], ids=["conv-flatten-linear", "conv-conv"])
def test_one_hook_step_is_the_exact_prox_of_each_channel(
    build: Callable[..., nn.Sequential], method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attach's step = SGD, then per channel the exhaustive reference's prox of lam * lr."""
    monkeypatch.setattr(hook, "prox_path_norm_", functools.partial(prox_path_norm_, method=method))
    if method != "kernel":  # the planned prox runs the kernel: leave the pair to `method`
        monkeypatch.setattr(_target, "planned_prox", lambda *_: None)
    net = build()
    first, second = net[0], net[-1]
    lam, lr = LAM[build.__name__], 0.1
    plain = copy.deepcopy(net)
    _with_grads(plain, lr).step()
    X, Y = _unit_matrices(plain[0], plain[-1])
    assert reference.minimiser_margin(X, Y, lam * lr, 1e-12)[1] == 0.0  # a unique minimiser
    V, W = reference.prox_path_norm(X, Y, lam * lr)
    dead = (V == 0).all(1) | (W == 0).all(1)
    assert 0 < dead.sum() < len(dead)  # some channels die, some live: the step means it
    assert ((V != X).any(1) | (W != Y).any(1)).all()  # every channel moves

    optimizer = _with_grads(net, lr)
    handle = attach(optimizer, net, lam=lam)
    optimizer.step()
    assert handle.num_steps == 1
    got_v, got_w = _unit_matrices(first, second)
    np.testing.assert_allclose(got_v, V, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got_w, W, rtol=1e-12, atol=1e-14)
    assert np.array_equal(got_v == 0, V == 0) and np.array_equal(got_w == 0, W == 0)
    assert torch.equal(first.bias, plain[0].bias)  # biases: the SGD step's alone
    handle.remove()


LAM = {"_cnn": 1.0, "_conv_conv": 3.0}  # some channels die, some live


def test_views_are_planned_once_and_copies_are_written_back() -> None:
    net = _cnn()
    twin = copy.deepcopy(net)
    twin[0].to(memory_format=torch.channels_last)  # its in_view cannot be a view: a copy
    assert not twin[0].weight.is_contiguous()
    handles = []
    for model in (net, twin):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        handles.append((attach(optimizer, model, lam=1.0), optimizer))
    views = handles[0][0]._plan[id(handles[0][1])][0].target.views
    assert views is not None
    w_in, w_out = views.cached
    assert w_in is not None and w_in.data_ptr() == net[0].weight.data_ptr()  # a view
    assert w_out is None  # a Linear after a Flatten: (p * P, C) has no strided view
    twin_views = handles[1][0]._plan[id(handles[1][1])][0].target.views
    assert twin_views is not None and twin_views.cached == (None, None)
    plan = handles[0][0]._plan
    for step in range(3):
        for model, (_, optimizer) in zip((net, twin), handles, strict=True):
            _with_grads(model, 0.0, seed=step)  # the same gradients, in any layout
            optimizer.step()
    assert handles[0][0]._plan is plan  # not re-planned at each step
    assert handles[0][0]._plan[id(handles[0][1])][0].target.views.cached[0] is w_in
    assert not twin[0].weight.is_contiguous()  # written back in its own layout
    assert (net[0].weight == 0).any() or (net[4].weight == 0).any()
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)  # views and copies: the same prox, to the bit
    for handle, _ in handles:
        handle.remove()


def test_a_frozen_conv_layer_skips_its_pair_with_a_warning() -> None:
    net = _cnn()
    net[0].weight.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    with pytest.warns(UserWarning, match=r"pair \('0', '4'\) is half frozen"):
        handle = attach(optimizer, net, lam=1.0)
    before = net[4].weight.detach().clone()
    optimizer.zero_grad()
    net(torch.randn(2, 2, 8, 8, dtype=torch.float64)).sum().backward()
    optimizer.step()
    assert handle.num_steps == 0 and not torch.equal(net[4].weight, before)  # SGD alone
    assert not (net[4].weight == 0).any()
    handle.remove()


def test_a_conv_pair_that_loses_every_channel_is_warned_about() -> None:
    net = _conv_conv()
    optimizer = _with_grads(net, 0.1)
    handle = attach(optimizer, net, lam=1e6)
    with pytest.warns(UserWarning, match=r"pair \('0', '2'\) has no hidden unit left"):
        optimizer.step()
    assert handle.metrics()["alive_units"] == 0.0
    handle.remove()


# --- the baselines on convolutions -----------------------------------------------------------


def _baseline_step(callback: L1Prox | LayerwiseLinfProjection, net: nn.Module, lr: float) -> None:
    """One SGD step with the callback's update, through the hook (no Trainer needed)."""
    targets = callback.resolve_targets(net)  # type: ignore[arg-type]
    assert [t.name for t in targets] == ["layer '0'", "layer '4'"]
    optimizer = _with_grads(net, lr)
    step = StepHook([optimizer], targets, callback.apply, owner=type(callback).__name__)
    optimizer.step()
    assert step.num_steps == 1
    step.remove()


def _unrolled(conv: nn.Module, in_shape: tuple[int, ...]) -> Tensor:
    """The dense (outputs, inputs) matrix of ``conv`` without its bias."""
    n = math.prod(in_shape)
    basis = torch.eye(n, dtype=conv.weight.dtype).reshape(n, *in_shape)
    with torch.no_grad():
        out = conv._conv_forward(basis, conv.weight, None)  # type: ignore[operator]
    return out.reshape(n, -1).T


def test_linf_projection_bounds_each_channel_row_and_the_unrolled_conv() -> None:
    net, radius, lr = _cnn(), 0.4, 0.1
    plain = copy.deepcopy(net)
    _with_grads(plain, lr).step()
    _baseline_step(LayerwiseLinfProjection(radius), net, lr)
    expected = pathnorm_lightning.project_rows_l1_ball(layers.in_view(plain[0]), radius)
    rows = layers.in_view(net[0]).detach()
    assert torch.equal(rows, expected)
    assert float(rows.abs().sum(1).max()) == pytest.approx(radius, rel=1e-12)
    unrolled = _unrolled(net[0], (2, 8, 8))
    assert float(unrolled.abs().sum(1).max()) <= radius * (1 + 1e-12)
    assert float(net[4].weight.detach().abs().sum(1).max()) <= radius * (1 + 1e-12)
    padded = nn.Conv2d(2, 4, 3, padding=1).double()
    with torch.no_grad():
        padded.weight.copy_(net[0].weight)
    assert float(_unrolled(padded, (2, 5, 5)).abs().sum(1).max()) <= radius * (1 + 1e-12)


def test_l1_prox_soft_thresholds_conv_weights() -> None:
    net, lr, lam = _cnn(), 0.1, 0.5
    plain = copy.deepcopy(net)
    _with_grads(plain, lr).step()
    _baseline_step(L1Prox(lam), net, lr)
    assert (net[0].weight == 0).any()
    for layer, ref in ((net[0], plain[0]), (net[4], plain[4])):
        expected = torch.sign(ref.weight) * (ref.weight.abs() - lam * lr).clamp_min(0)
        assert torch.equal(layer.weight, expected)


# --- metrics and bounds ----------------------------------------------------------------------


def test_sparsity_counts_channels() -> None:
    conv = torch.ones(4, 2, 3, 3)
    conv[1] = 0.0  # channel 1: no incoming weights
    linear = torch.ones(3, 4 * 5)
    linear[:, 10:15] = 0.0  # channel 2: no outgoing weights (its 5 positions)
    linear[:, 3] = 0.0  # one weight of channel 0: still alive
    metric = Sparsity()
    metric.update([conv, linear])
    out = metric.compute()
    assert out["alive_units"].item() == pytest.approx(2 / 4)
    assert out["sparsity"].item() == pytest.approx((18 + 15 + 3) / (72 + 60))
    second = torch.ones(2, 4, 2)
    second[:, 3] = 0.0  # conv -> conv: channel 3 has no outgoing weights
    metric.reset()
    metric.update([conv[:, :, 0], second])
    assert metric.compute()["alive_units"].item() == pytest.approx(2 / 4)


def test_bounds_of_conv_chains_are_s_times_the_views() -> None:
    net = _cnn()
    w_in, w_out = layers.in_view(net[0]), layers.out_view(net[4], 4, 9)
    bound, product = PathNormBound(), ProductBound()
    bound.update([net[0].weight, net[4].weight])
    product.update([net[0].weight, net[4].weight])
    assert bound.compute().item() == pytest.approx(float(path_norm(w_in, w_out)), rel=1e-12)
    expected = float(w_out.abs().sum() * w_in.abs().sum(1).max())
    assert product.compute().item() == pytest.approx(expected, rel=1e-12)
    conv = _conv_conv()
    s = layers.entry_of(conv[2]).reuse(conv[2], (7,))
    assert s == 4  # 7 positions, padding 1, stride 2: each tap is read at 4 output positions
    r = float(path_norm(layers.in_view(conv[0]), layers.out_view(conv[2], 3)))
    with pytest.raises(ValueError, match=r"ends with a convolution weight .* pass reuse=s"):
        PathNormBound().update([conv[0].weight, conv[2].weight])
    bound = PathNormBound()
    bound.update([conv[0].weight, conv[2].weight], reuse=s)
    assert bound.compute().item() == pytest.approx(s * r, rel=1e-12)
    with pytest.raises(ValueError, match=r"reuse must be a positive int, got 0"):
        bound.update([conv[0].weight, conv[2].weight], reuse=0)


def _lipschitz_lower(net: nn.Module, in_shape: tuple[int, ...], seed: int) -> float:
    """Lower estimates of the (l_inf, l_1) Lipschitz constant: ``||J^T u||_1`` for sign vectors
    ``u`` (alternating from random signs) at random points, and ``||f(a) - f(b)||_1 / ||a -
    b||_inf`` for random pairs and for steps along the sign of ``J^T u``."""
    g = torch.Generator().manual_seed(seed)
    best = 0.0
    for _ in range(3):
        a = torch.randn(1, *in_shape, dtype=torch.float64, generator=g)
        jac = torch.autograd.functional.jacobian(net, a).reshape(-1, a.numel())
        u = torch.randint(0, 2, (jac.shape[0],), generator=g).double() * 2 - 1
        for _ in range(4):
            v = torch.where(jac.T @ u >= 0, 1.0, -1.0).double()
            u = torch.where(jac @ v >= 0, 1.0, -1.0).double()
        best = max(best, float((jac.T @ u).abs().sum()))
        with torch.no_grad():
            b = torch.randn(1, *in_shape, dtype=torch.float64, generator=g)
            best = max(best, float((net(a) - net(b)).abs().sum() / (a - b).abs().max()))
            step = a + 1e-5 * v.reshape(a.shape)
            best = max(best, float((net(a) - net(step)).abs().sum()) / 1e-5)
    return best


@pytest.mark.parametrize(
    "kind", ["conv-pool-linear-linear", "conv-conv", "conv-conv-padded-linear"]
)
def test_logged_bounds_are_never_below_the_lipschitz_constant(kind: str) -> None:
    torch.manual_seed(11)
    if kind == "conv-pool-linear-linear":
        net = nn.Sequential(
            nn.Conv2d(1, 3, 3, stride=2), nn.ELU(), nn.AvgPool2d(2), nn.Flatten(),
            nn.Linear(3 * 16, 5), nn.ReLU(), nn.Linear(5, 2),
        ).double()  # fmt: skip
        in_shape: tuple[int, ...] = (1, 19, 19)
    elif kind == "conv-conv":
        net, in_shape = _conv_conv(), (2, 9)
    else:
        net = nn.Sequential(
            nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 2), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2 * 16, 2),
        ).double()  # fmt: skip
        in_shape = (1, 10, 10)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "pairs='auto'")  # the last Linear is not paired
        handle = attach(torch.optim.SGD(net.parameters(), lr=0.1), net, lam=0.0)
    if kind == "conv-conv":
        assert "path_norm_bound" not in handle.metrics()  # s needs the positions it reads
    with torch.no_grad():
        net(torch.zeros(1, *in_shape, dtype=torch.float64))  # the pre-hook records them
    values = handle.metrics()
    lower = _lipschitz_lower(net, in_shape, seed=3)
    assert 0 < lower <= values["path_norm_bound"] * (1 + 1e-9), (lower, values)
    assert values["path_norm_bound"] <= values["product_bound"] * (1 + 1e-12)
    if kind == "conv-conv":
        s = handle.reuse()
        assert s == 4
        r = float(path_norm(layers.in_view(net[0]), layers.out_view(net[2], 3)))
        assert values["path_norm_bound"] == pytest.approx(s * r, rel=1e-12)
    handle.remove()
    assert not net[-1]._forward_pre_hooks  # the recorder goes with the hook


# --- compaction ------------------------------------------------------------------------------

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _max_diff(a: nn.Module, b: nn.Module, in_shape: tuple[int, ...], dtype: torch.dtype) -> float:
    x = torch.randn(200, *in_shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compact_removes_dead_channels_and_folds_constant_ones(dtype: torch.dtype) -> None:
    net = _cnn(dtype).eval()
    with torch.no_grad():
        net[0].weight[[1, 3]] = 0.0  # constant channels: elu(bias), folded into the Linear bias
        net[4].weight.view(3, 4, 9)[:, 2] = 0.0  # channel 2 reads into nothing: removed
    before = copy.deepcopy(net.state_dict())
    small, report = compact(net)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())  # input kept
    (pair,) = report.pairs
    assert (pair.units_before, pair.units_after, pair.removed, pair.folded) == (4, 1, 1, 2)
    assert pair.constant_kept == 0
    assert small[0].out_channels == 1 and small[0].weight.shape == (1, 2, 3, 3)
    assert small[4].in_features == 9 and small[4].weight.shape == (3, 9)
    assert torch.equal(small[4].weight, net[4].weight.view(3, 4, 9)[:, 0])
    assert _max_diff(small, net, (2, 8, 8), dtype) <= TOL[dtype]


@pytest.mark.parametrize(
    ("second", "pool", "kept"),
    [
        (lambda: nn.Conv1d(4, 2, 3), None, 0),  # valid: every tap reads a real position
        (lambda: nn.Conv1d(4, 2, 3, padding=1, padding_mode="circular"), None, 0),
        (lambda: nn.Conv1d(4, 2, 3, padding=1), None, 2),  # zero padding: not constant
        (lambda: nn.Conv1d(4, 2, 2), lambda: nn.AvgPool1d(2, padding=1), 2),
        (
            lambda: nn.Conv1d(4, 2, 2),
            lambda: nn.AvgPool1d(2, padding=1, count_include_pad=False),
            0,
        ),
        (lambda: nn.Conv1d(4, 2, 2, stride=2), lambda: nn.MaxPool1d(2, padding=1), 0),
    ],
    ids=["valid", "circular", "zero-padded", "avg-pad", "avg-no-pad-count", "max-pad"],
)
def test_compact_conv_conv_folds_only_where_exact(
    second: Callable[[], nn.Module], pool: Callable[[], nn.Module] | None, kept: int
) -> None:
    torch.manual_seed(2)
    net = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ELU(), *([pool()] if pool else []), second())
    net = net.double().eval()
    with torch.no_grad():
        net[0].bias.uniform_(0.5, 1.0)
        net[0].weight[[0, 2]] = 0.0
        net[-1].weight[:, 3] = 0.0
    small, report = compact(net)
    (pair,) = report.pairs
    assert (pair.removed, pair.folded, pair.constant_kept) == (1, 2 - kept, kept)
    assert small[0].out_channels == 1 + kept and small[-1].in_channels == 1 + kept
    assert _max_diff(small, net, (2, 12), torch.float64) <= 1e-12
    assert ("kept (their constant output" in str(report)) == bool(kept)


class _FunctionalCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 4, 3), nn.Linear(4 * 16, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = F.avg_pool2d(F.dropout(torch.tanh(self.conv(x)), 0.2, self.training), 2)
        return self.fc(torch.flatten(h, 1))


def test_compact_a_functional_cnn_then_save_load_and_export() -> None:
    torch.manual_seed(4)
    net = _FunctionalCNN().float().eval()
    with torch.no_grad():
        net.conv.weight[[0]] = 0.0
        net.fc.weight.view(2, 4, 16)[:, 1] = 0.0
    small, report = compact(net)
    assert (report.pairs[0].removed, report.pairs[0].folded) == (1, 1)
    assert small.conv.out_channels == 2 and small.fc.in_features == 2 * 16
    assert _max_diff(small, net, (1, 10, 10), torch.float32) <= 1e-5
    x = torch.randn(5, 1, 10, 10)
    expected = small(x).detach()
    buffer = io.BytesIO()
    torch.save(small, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(x), expected)
    exported = torch.export.export(small, (x,))
    torch.testing.assert_close(exported.module()(x), expected)


def test_trained_cnn_compacts_to_the_same_function() -> None:
    """A few proximal steps kill channels; the hook's metrics count them; compact matches."""
    net = _cnn(seed=5)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    handle = attach(optimizer, net, lam=0.1)
    x = torch.randn(16, 2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
    alive = handle.metrics()["alive_units"]
    handle.remove()
    net.eval()
    small, report = compact(net)
    assert 0 < alive < 1 and report.pairs[0].units_after == round(alive * 4)
    assert _max_diff(small, net, (2, 8, 8), torch.float64) <= 1e-12
