"""``pathnorm_lightning.compact``: dead hidden units removed, the same function, the input kept."""

from __future__ import annotations

import copy
import importlib.util
import io
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from pathnorm_lightning import attach
from pathnorm_lightning.compact import CompactionReport, compact

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _kill(first: nn.Linear, second: nn.Linear, dead_in: list[int], dead_out: list[int]) -> None:
    """Zero the incoming weights of units ``dead_in`` and the outgoing ones of ``dead_out``."""
    with torch.no_grad():
        first.weight[dead_in] = 0
        second.weight[:, dead_out] = 0


def _net(
    dtype: torch.dtype, between: Callable[[], list[nn.Module]], seed: int = 0
) -> nn.Sequential:
    """12 -> 10 -> 9 -> 8 -> 3 with two pairs, ``between()`` inside each, and biases far from
    zero (so that folded constants matter)."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(12, 10), *between(), nn.Linear(10, 9), nn.Tanh(),
        nn.Linear(9, 8), *between(), nn.Linear(8, 3),
    ).to(dtype)  # fmt: skip
    with torch.no_grad():
        for layer in net:
            if isinstance(layer, nn.Linear):
                layer.bias.uniform_(-1.0, 1.0)
    return net.eval()


def _linears(net: nn.Module) -> list[nn.Linear]:
    return [m for m in net.modules() if isinstance(m, nn.Linear)]


def _max_diff(a: nn.Module, b: nn.Module, dtype: torch.dtype, m: int = 12) -> float:
    x = torch.randn(1000, m, dtype=dtype, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max())


BETWEEN: dict[str, Callable[[], list[nn.Module]]] = {
    "elu": lambda: [nn.ELU()],
    "relu+dropout": lambda: [nn.ReLU(), nn.Dropout(0.5)],
    "sigmoid+identity": lambda: [nn.Sigmoid(), nn.Identity()],
    "prelu": lambda: [nn.PReLU()],
    "none (linear)": lambda: [],
}

# (dead incoming, dead outgoing) units of the first pair (10 units) and the second (8 units).
CASES = {
    "mixed": (([1, 4, 6], [4, 7, 8]), ([0], [2, 5])),
    "all dead": (([0, 2], list(range(10))), (list(range(8)), [])),
    "none dead": (([], []), ([], [])),
    "all folded": ((list(range(10)), []), ([3], [3])),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("between", list(BETWEEN))
def test_same_function_and_counts(dtype: torch.dtype, case: str, between: str) -> None:
    net = _net(dtype, BETWEEN[between])
    layers = _linears(net)
    for (first, second), (dead_in, dead_out) in zip(
        [(layers[0], layers[1]), (layers[2], layers[3])], CASES[case], strict=True
    ):
        _kill(first, second, dead_in, dead_out)
    names = [name for name, m in net.named_children() if isinstance(m, nn.Linear)]
    small, report = compact(net, pairs=[(names[0], names[1]), (names[2], names[3])])
    assert _max_diff(small, net, dtype) <= TOL[dtype]
    for p, (dead_in, dead_out), units in zip(report.pairs, CASES[case], (10, 8), strict=True):
        live = units - len(set(dead_in) | set(dead_out))
        assert (p.units_before, p.units_after) == (units, max(live, 1))
        assert (p.removed, p.folded) == (len(dead_out), len(set(dead_in) - set(dead_out)))
    new_layers = _linears(small)
    assert [lin.out_features for lin in new_layers] == [
        report.pairs[0].units_after,
        9,
        report.pairs[1].units_after,
        3,
    ]
    assert report.params_after == sum(p.numel() for p in small.parameters())
    assert report.params_before == sum(p.numel() for p in net.parameters())
    assert all(p.dtype == dtype for p in small.parameters())


def test_input_model_unchanged_and_rng_untouched() -> None:
    net = _net(torch.float64, BETWEEN["relu+dropout"]).train()
    _kill(*_linears(net)[:2], [1, 2], [3])
    before = copy.deepcopy(net.state_dict())
    rng = torch.get_rng_state()
    small, _ = compact(net)
    assert torch.equal(torch.get_rng_state(), rng)
    assert net.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert net.training and small.training  # modes kept, on both
    assert _linears(net)[0].out_features == 10 and _linears(small)[0].out_features == 7
    assert all(p.requires_grad for p in small.parameters())


def test_a_steep_activation_does_not_warn() -> None:
    """Its slope loosens the logged bounds (pairing warns so), not what compact keeps."""
    net = nn.Sequential(nn.Linear(12, 10), nn.GELU(), nn.Linear(10, 3)).double()
    _kill(*_linears(net), [1, 2], [3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        small, report = compact(net)
    assert report.pairs[0].units_after == 7 and _max_diff(small, net, torch.float64) <= 1e-12


def test_folding_creates_a_bias_where_the_second_layer_has_none() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 6), nn.ELU(), nn.Linear(6, 2, bias=False)).double()
    with torch.no_grad():
        net[0].bias.fill_(0.5)  # elu(0.5) = 0.5: the dead units output a nonzero constant
    _kill(net[0], net[2], [0, 3], [])
    small, report = compact(net)
    assert small[2].bias is not None and report.pairs[0].folded == 2
    assert _max_diff(small, net, torch.float64, m=5) <= 1e-12
    # a constant that is zero (relu of a negative bias) needs no bias
    net[1] = nn.ReLU()
    with torch.no_grad():
        net[0].bias.fill_(-0.5)
    small, _ = compact(net)
    assert small[2].bias is None and small[0].out_features == 4


def test_trained_network() -> None:
    """A few proximal steps with a large lam kill units; the compacted net matches."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 32), nn.ELU(), nn.Dropout(0.2), nn.Linear(32, 4)).double()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    handle = attach(optimizer, net, lam=0.05)
    x, y = torch.randn(200, 20, dtype=torch.float64), torch.randint(0, 4, (200,))
    for _ in range(10):
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
    handle.remove()
    net.eval()
    dead = int(((net[0].weight == 0).all(1) | (net[3].weight == 0).all(0)).sum())
    assert 0 < dead < 32  # the test means something
    small, report = compact(net)
    assert report.pairs[0].units_after == 32 - dead
    assert _max_diff(small, net, torch.float64, m=20) <= 1e-12


class _Functional(nn.Module):
    """A pair wired in forward() with functions, not an nn.Sequential (found by torch.fx)."""

    def __init__(self, residual: bool = False, twice: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 7), nn.Linear(7, 2)
        self.residual, self.twice = residual, twice

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        z = F.dropout(F.elu(h), 0.3, self.training).tanh()
        if self.residual:
            z = z + h
        out = self.b(z)
        return out + self.b(z) if self.twice else out


def test_pairs_wired_in_forward() -> None:
    net = _Functional().double().eval()
    with torch.no_grad():
        net.a.bias.fill_(0.7)
    _kill(net.a, net.b, [0, 5], [2])
    small, report = compact(net)
    assert isinstance(small, _Functional) and small.a.out_features == 4
    assert report.pairs[0].folded == 2
    assert _max_diff(small, net, torch.float64, m=6) <= 1e-12


@pytest.mark.parametrize(
    ("net", "pairs", "match"),
    [
        (_Functional(residual=True), "auto", "feed"),
        (_Functional(twice=True), "auto", "runs 2 times"),
        (
            nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 2)),
            [("0", "2")],
            "LayerNorm|'1'",
        ),
        (nn.Sequential(nn.Linear(4, 5), nn.Softmax(-1), nn.Linear(5, 2)), "auto", "'1'"),
        (nn.Sequential(nn.Linear(4, 5), nn.PReLU(5), nn.Linear(5, 2)), [("0", "2")], "'1'"),
        (nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)), [("2", "0")], "feed|chain"),
    ],
    ids=["residual", "called twice", "layernorm", "softmax", "prelu per unit", "reversed"],
)
def test_refuses_pairs_whose_units_reach_more_than_the_second_layer(
    net: nn.Module, pairs: object, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        compact(net, pairs=pairs)  # type: ignore[arg-type]


def test_refuses_other_layer_types() -> None:
    class MyLinear(nn.Linear):
        pass

    net = nn.Sequential(MyLinear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    with pytest.raises(ValueError, match=r"MyLinear.*exact types"):
        compact(net)
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    torch.nn.utils.prune.l1_unstructured(net[0], "weight", amount=0.5)
    with pytest.raises(ValueError, match=r"prune.remove"):
        compact(net)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        compact("net")  # type: ignore[arg-type]


class _Branch(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def forward(self, x: Tensor) -> Tensor:
        return x if x.sum() > 0 else -x


class _Untraceable(nn.Module):
    """An nn.Sequential pair whose hidden units forward() also reads; fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))

    def forward(self, x: Tensor) -> Tensor:
        h = self.net[1](self.net[0](x))
        return _Branch()(self.net(x)) + h.sum(1, keepdim=True)


def test_untraceable_model_must_be_the_sequential() -> None:
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2), _Branch()).double().eval()
    _kill(net[0], net[2], [1], [2, 3])
    small, _ = compact(net, pairs=[("0", "2")])
    assert small[0].out_features == 3
    assert _max_diff(small, net, torch.float64, m=4) <= 1e-12
    reads = _Untraceable().double().eval()
    _kill(reads.net[0], reads.net[2], [], [0])  # dead for net.2, not for h.sum
    with pytest.raises(
        ValueError, match=r"trace _Untraceable\.forward.*compact the nn\.Sequential"
    ):
        compact(reads, pairs=[("net.0", "net.2")])


class _Reads(nn.Module):
    """A pair whose weights (``read``) or, in one mode only (``mode``), hidden units forward()
    also reads."""

    def __init__(self, read: str = "", mode: str = "") -> None:
        super().__init__()
        self.fc1, self.fc2, self.aux = nn.Linear(6, 10), nn.Linear(10, 3), nn.Linear(10, 3)
        self.read, self.mode = read, mode

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.fc1(x))
        out = self.fc2(h)
        if self.read:  # fc1.weight, fc1.bias or fc2.weight
            w = getattr(getattr(self, self.read[:3]), self.read[4:])
            return out @ w if self.read == "fc2.weight" else out + w.sum()
        if self.mode == "eval" and not self.training:
            return out + h.sum(1, keepdim=True)
        return out + self.aux(h) if self.mode == "train" and self.training else out


@pytest.mark.parametrize("read", ["fc1.weight", "fc1.bias", "fc2.weight"])
def test_refuses_forward_reading_the_pair_weights(read: str) -> None:
    with pytest.raises(ValueError, match=rf"forward\(\) reads '{read}' outside the calls"):
        compact(_Reads(read=read), pairs=[("fc1", "fc2")])


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("training", [True, False])
def test_checks_the_flow_in_train_and_eval_mode(mode: str, training: bool) -> None:
    net = _Reads(mode=mode).train(training)
    with pytest.raises(ValueError, match=rf"feed .*(\.sum\(\)|'aux').*\(in {mode} mode"):
        compact(net, pairs=[("fc1", "fc2")])
    assert all(m.training is training for m in net.modules())
    ok = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Dropout(), nn.Linear(6, 2)).train()
    ok[2].eval()  # every module's mode comes back as it was
    assert [m.training for m in compact(ok)[0].modules()] == [True, True, True, False, True]


@pytest.mark.parametrize("reused", [0, 2, "nested"])
def test_untraceable_sequential_refuses_a_reused_layer(reused: int | str) -> None:
    a, b = nn.Linear(6, 6), nn.Linear(6, 6)
    again = nn.Sequential(b) if reused == "nested" else (a, b)[int(reused) // 2]
    net = nn.Sequential(a, nn.Tanh(), b, nn.Tanh(), again, _Branch())
    _kill(a, b, [], [2, 3])
    name = 2 if reused == "nested" else reused
    with pytest.raises(ValueError, match=rf"layer '{name}' appears more than once"):
        compact(net, pairs=[("0", "2")])


class _FlipReLU(nn.ReLU):
    """Not entry-wise: reverses the units (a subclass of an allowed type)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(x).flip(-1)


def test_untraceable_sequential_refuses_subclasses_between() -> None:
    net = nn.Sequential(nn.Linear(6, 8), _FlipReLU(), nn.Linear(8, 3), _Branch())
    _kill(net[0], net[2], [], [0, 1])
    with pytest.raises(ValueError, match=r"_FlipReLU subclasses ReLU: .*exact types"):
        compact(net, pairs=[("0", "2")])


def _scale_input(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return (args[0] * 2,)


def _flip_output(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> Tensor:
    return out.flip(-1)


@pytest.mark.parametrize(
    ("at", "hook"),
    [(2, _scale_input), (0, _flip_output), (1, _flip_output)],
    ids=["pre-hook on second", "hook on first", "hook between"],
)
@pytest.mark.parametrize("traced", [True, False])
def test_refuses_forward_hooks_on_the_pair(at: int, hook: Callable, traced: bool) -> None:
    tail = [] if traced else [_Branch()]  # fx cannot trace it: the nn.Sequential fallback
    net = nn.Sequential(nn.Linear(4, 6), nn.Sigmoid(), nn.Linear(6, 3), *tail)
    _kill(net[0], net[2], [1], [0])
    pre = hook is _scale_input
    (net[at].register_forward_pre_hook if pre else net[at].register_forward_hook)(hook)
    kind = "pre-hook" if pre else "hook"
    with pytest.raises(ValueError, match=rf"module '{at}' .* forward {kind}.*Remove the hook"):
        compact(net)


@pytest.mark.parametrize(
    "conv",
    [
        lambda: nn.Conv1d(2, 4, 1, padding=1, padding_mode="reflect"),
        lambda: nn.Conv2d(2, 4, 3, padding=3, padding_mode="reflect"),
        lambda: nn.Conv2d(2, 4, 1, padding=2, padding_mode="circular"),
    ],
    ids=["reflect 1d", "reflect 2d", "circular"],
)
def test_first_conv_padding_wider_than_its_kernel(conv: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    first = conv().double()
    second = (nn.Conv1d if isinstance(first, nn.Conv1d) else nn.Conv2d)(4, 3, 2).double()
    net = nn.Sequential(first, nn.ReLU(), second).eval()
    with torch.no_grad():
        first.weight[1] = 0
        first.bias[1] = 0.5
    small, report = compact(net)
    assert report.pairs[0].folded == 1
    x = torch.randn(8, 2, *[9] * (first.weight.dim() - 2), dtype=torch.float64)
    with torch.no_grad():
        assert float((small(x) - net(x)).abs().max()) <= 1e-12


def test_lightning_module_copy_leaves_the_trainer_behind() -> None:
    from test_callbacks import MLP

    torch.manual_seed(0)
    model = MLP(sizes=(20, 16, 4))
    sentinel = object()
    model._trainer = sentinel  # type: ignore[assignment]  # as a Trainer attaches itself
    _kill(*_linears(model), [0], [1])
    small, report = compact(model)
    assert small._trainer is None and model._trainer is sentinel
    assert type(small) is type(model) and report.units_after == 14


def test_report_table() -> None:
    net = _net(torch.float64, BETWEEN["elu"])
    _kill(*_linears(net)[:2], [1], [2, 3])
    _, report = compact(net)
    assert isinstance(report, CompactionReport)
    assert (report.units_before, report.units_after) == (18, 15)
    text = str(report).splitlines()
    assert text[0].split() == ["pair", "units", "removed", "folded", "pair", "params"]
    assert text[1].split()[:8] == ["0", "->", "2", "10", "->", "7", "2", "1"]
    assert text[-1].startswith(f"model parameters {report.params_before:,} -> ")


def test_save_load_and_export() -> None:
    net = _net(torch.float32, BETWEEN["relu+dropout"])
    _kill(*_linears(net)[:2], [0, 1], [5])
    small, _ = compact(net)
    x = torch.randn(1000, 12)
    expected = small(x).detach()
    buffer = io.BytesIO()
    torch.save(small, buffer)  # the whole module: the architecture changed
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), expected)
    # a state dict loads into the compacted architecture (not into the original one)
    twin = copy.deepcopy(small)
    for p in twin.parameters():
        p.data.zero_()
    twin.load_state_dict(small.state_dict())
    assert torch.equal(twin(x), expected)
    with pytest.raises(RuntimeError, match="size mismatch"):
        copy.deepcopy(net).load_state_dict(small.state_dict())
    exported = torch.export.export(small, (x[:7],))
    assert torch.allclose(exported.module()(x[:7]), expected[:7], atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="onnx is not installed")
def test_onnx_export() -> None:  # pragma: no cover - only where onnx is installed
    net = _net(torch.float32, BETWEEN["elu"])
    _kill(*_linears(net)[:2], [0], [5])
    small, _ = compact(net)
    torch.onnx.export(small, (torch.randn(3, 12),), io.BytesIO())
