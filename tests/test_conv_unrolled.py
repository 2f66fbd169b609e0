"""The maths of conv units (docs/conv_units.md), checked on the unrolled networks.

A convolution is a linear map; applied to the basis vectors of a small input it gives its
unrolled dense matrix. For a shallow network ``second(pool(act(conv(u))))`` the unrolled hidden
units are (channel, position) pairs, and the 1-path-norm of the unrolled network is
``sum_j ||B[:, j]||_1 ||V[j, :]||_1`` with ``V`` the unrolled first layer and ``B`` the unrolled
rest (pooling, then the second layer). Per config: the seam's ``R`` (the path norm of the
channel views) and its factor ``s`` (``reuse``) must satisfy ``unrolled <= s R``, with equality
where the docs state it, ``s`` must be what a one-tap second layer reads, and ``s R`` must bound
numerical lower estimates of the network's (l_inf, l_1) Lipschitz constant.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pathnorm_lightning import layers
from pathnorm_lightning.functional import path_norm

VARIANTS = ("linear", "conv", "avg-linear", "max-linear", "avg-conv", "max-conv")


@pytest.fixture(autouse=True, scope="module")
def _float64_one_thread() -> Iterator[None]:
    """float64 modules and tensors; one thread (these tiny convolutions are 1000x slower when
    two threads contend for a busy core)."""
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)


@dataclass
class Net:
    """A random shallow network ``second(pool(elu(conv(u))))``, its flags and its input shape."""

    conv: nn.Module
    pool: nn.Module | None
    second: nn.Module
    in_shape: tuple[int, ...]  # (C_in, *spatial)
    variant: str
    equal: bool  # the docs say unrolled == s R for this config

    def hidden(self, u: Tensor) -> Tensor:
        h = F.elu(self.conv(u))
        return h if self.pool is None else self.pool(h)

    def __call__(self, u: Tensor) -> Tensor:
        h = self.hidden(u)
        return self.second(h.flatten(1) if isinstance(self.second, nn.Linear) else h)


def _unrolled(op: object, in_shape: tuple[int, ...]) -> Tensor:
    """The matrix (outputs, inputs) of the linear map ``op`` on inputs of ``in_shape``."""
    n = math.prod(in_shape)
    basis = torch.eye(n).reshape(n, *in_shape)
    with torch.no_grad():
        out = op(basis)  # type: ignore[operator]
    return out.reshape(n, -1).T


def _no_bias(conv: nn.Module) -> object:
    return lambda u: conv._conv_forward(u, conv.weight, None)  # type: ignore[operator]


def _randomize(layer: nn.Module, rng: np.random.Generator) -> None:
    w = rng.standard_normal(tuple(layer.weight.shape))
    w[rng.random(w.shape) < 0.15] = 0.0
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))


def _sample(rng: np.random.Generator, variant: str) -> Net | None:
    """A random config of ``variant`` (None when its shapes leave no output)."""
    dims = int(rng.integers(1, 3))
    conv_t, avg_t, max_t = (
        (nn.Conv1d, nn.AvgPool1d, nn.MaxPool1d)
        if dims == 1
        else (nn.Conv2d, nn.AvgPool2d, nn.MaxPool2d)
    )
    size = 9 if dims == 1 else 6
    c_in, c = int(rng.integers(1, 3)), int(rng.integers(2, 5))
    k1, stride1 = int(rng.integers(2, 4)), int(rng.integers(1, 3))
    dilation1 = 2 if rng.random() < 0.15 else 1
    pad1: int | str = int(rng.choice([0, 0, 1]))
    if stride1 == 1 and rng.random() < 0.15:
        pad1 = "same"
    mode = "zeros" if pad1 == 0 or rng.random() < 0.7 else str(rng.choice(["reflect", "circular"]))
    conv = conv_t(c_in, c, k1, stride=stride1, padding=pad1, dilation=dilation1, padding_mode=mode)
    in_shape = (c_in, *([size] * dims))
    spatial = conv(torch.zeros(1, *in_shape)).shape[2:]
    pool: nn.Module | None = None
    overlapping = False
    if variant.startswith(("avg", "max")):
        pk, ps = 2, int(rng.integers(1, 3))
        overlapping = ps < pk
        pp = int(rng.integers(0, 2)) if variant.startswith("avg") else 0
        if variant.startswith("avg"):
            pool = avg_t(pk, ps, padding=pp, count_include_pad=bool(rng.random() < 0.5))
            overlapping = overlapping or pp > 0
        else:
            pool = max_t(pk, ps)
        if min(spatial) < pk:
            return None
        spatial = pool(torch.zeros(1, c, *spatial)).shape[2:]
    if variant.endswith("linear"):
        second: nn.Module = nn.Linear(c * math.prod(spatial), int(rng.integers(1, 4)))
        full_rows = pad1 == 0
        equal = full_rows and (pool is None or (variant == "avg-linear" and not overlapping))
    else:
        k2, stride2, pad2 = (
            int(rng.integers(2, 4)),
            int(rng.integers(1, 3)),
            int(rng.choice([0, 1])),
        )
        if min(spatial) + 2 * pad2 < k2:
            return None
        second = conv_t(c, int(rng.integers(1, 4)), k2, stride=stride2, padding=pad2)
        equal = pad1 == 0 and pad2 == 0 and pool is None
    for layer in (conv, second):
        _randomize(layer, rng)
    return Net(conv, pool, second, in_shape, variant, equal)


def _flatten(net: Net) -> int | None:
    return layers.flatten_positions(net.conv, net.second)


def _hidden_shape(net: Net) -> tuple[int, ...]:
    return tuple(net.hidden(torch.zeros(1, *net.in_shape)).shape[1:])


def _pooling_matrices(net: Net, rng: np.random.Generator) -> list[Tensor]:
    """The hidden -> pooled matrices: the average itself, or, for max pooling, selections
    (one position of each window; every difference of max-pooled values is a convex
    combination of such selections, so the bound must hold for each)."""
    conv_shape = tuple(net.conv(torch.zeros(1, *net.in_shape)).shape[1:])
    if net.pool is None:
        return [torch.eye(math.prod(conv_shape))]
    if isinstance(net.pool, (nn.AvgPool1d, nn.AvgPool2d)):
        return [_unrolled(net.pool, conv_shape)]
    windows = _unrolled(
        (nn.AvgPool1d if len(conv_shape) == 2 else nn.AvgPool2d)(
            net.pool.kernel_size, net.pool.stride
        ),
        conv_shape,
    )
    selections = []
    for _ in range(3):
        pick = torch.zeros_like(windows)
        for g in range(windows.shape[0]):
            members = torch.nonzero(windows[g]).flatten().tolist()
            pick[g, members[int(rng.integers(len(members)))]] = 1.0
        selections.append(pick)
    return selections


def _second_unrolled(net: Net, pooled_shape: tuple[int, ...]) -> Tensor:
    if isinstance(net.second, nn.Linear):
        return net.second.weight.detach()
    return _unrolled(_no_bias(net.second), pooled_shape)


def _unrolled_path_norm(first: Tensor, second: Tensor) -> float:
    return float((second.abs().sum(0) * first.abs().sum(1)).sum())


def _tap_reads(net: Net, pooled_shape: tuple[int, ...]) -> int:
    """The largest ``sum_q ||U_(c,q)||_1`` of a second conv with a single weight 1 at one
    tap: how many output positions read that tap (the definition of ``s``)."""
    second = net.second
    best = 0
    for tap in np.ndindex(*second.kernel_size):
        probe = type(second)(
            second.in_channels,
            1,
            second.kernel_size,
            stride=second.stride,
            padding=second.padding,
            dilation=second.dilation,
            padding_mode=second.padding_mode,
        )
        with torch.no_grad():
            probe.weight.zero_()
            probe.weight[(0, 0, *tap)] = 1.0
        best = max(best, int(_unrolled(_no_bias(probe), pooled_shape).abs().sum()))
    return best


def _lipschitz_lower(net: Net, rng: np.random.Generator) -> float:
    """Lower estimates of the (l_inf, l_1) Lipschitz constant: ``u^T J v`` over sign vectors
    (alternating, from random signs) at random points, and difference quotients along ``v``."""
    best = 0.0
    for _ in range(2):
        a = torch.from_numpy(rng.standard_normal((1, *net.in_shape)))
        jac = torch.autograd.functional.jacobian(net, a).reshape(-1, a.numel())
        u = torch.from_numpy(rng.choice([-1.0, 1.0], jac.shape[0]))
        for _ in range(4):
            v = torch.sign(jac.T @ u)
            v[v == 0] = 1.0
            u = torch.sign(jac @ v)
            u[u == 0] = 1.0
        best = max(best, float(u @ jac @ v))
        with torch.no_grad():
            b = a + 1e-4 * v.reshape(a.shape)
            best = max(best, float((net(a) - net(b)).abs().sum()) / 1e-4)
    return best


@pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")
def test_unrolled_path_norm_is_bounded_by_s_times_r_on_random_conv_layers() -> None:
    rng = np.random.default_rng(2024)
    counts = dict.fromkeys(VARIANTS, 0)
    equalities = dict.fromkeys(VARIANTS, 0)
    padded = strided = lipschitz = 0
    for index in range(264):
        variant = VARIANTS[index % len(VARIANTS)]
        net = _sample(rng, variant)
        if net is None:
            continue
        counts[variant] += 1
        conv_shape = tuple(net.conv(torch.zeros(1, *net.in_shape)).shape[1:])
        pooled_shape = _hidden_shape(net)
        flatten = _flatten(net)
        with torch.no_grad():
            r = float(
                path_norm(
                    layers.in_view(net.conv),
                    layers.out_view(net.second, net.conv.out_channels, flatten),
                )
            )
        s = layers.entry_of(net.second).reuse(net.second, pooled_shape[1:])
        if isinstance(net.second, nn.Linear):
            assert s == 1
        else:
            assert s == _tap_reads(net, pooled_shape), (variant, net.second, pooled_shape)
        first = _unrolled(_no_bias(net.conv), net.in_shape)
        second = _second_unrolled(net, pooled_shape)
        for pooling in _pooling_matrices(net, rng):
            assert pooling.shape[1] == math.prod(conv_shape)
            unrolled = _unrolled_path_norm(first, second @ pooling)
            assert unrolled <= s * r * (1 + 1e-12), (variant, unrolled, s, r)
            if net.equal:
                assert math.isclose(unrolled, s * r, rel_tol=1e-12), (variant, unrolled, s * r)
        equalities[variant] += net.equal
        padded += net.conv.padding not in ((0,), (0, 0))
        strided += net.conv.stride[0] > 1
        if index % 3 == 0:  # (the Jacobians are the slow part)
            lower = _lipschitz_lower(net, rng)
            assert 0 < lower <= s * r * (1 + 1e-9), (variant, lower, s * r)
            lipschitz += 1
    assert sum(counts.values()) >= 200, counts
    assert min(counts.values()) >= 25, counts
    for variant in ("linear", "conv", "avg-linear"):
        assert equalities[variant] >= 5, equalities
    assert padded >= 40 and strided >= 40 and lipschitz >= 80, (padded, strided, lipschitz)


def test_s_is_tight_and_the_bound_is_strict_with_padding() -> None:
    """A second conv with one weight at a tap read by every output position reaches ``s R``;
    with zero padding on the first conv a border row loses taps and the bound is strict."""
    conv = nn.Conv2d(1, 2, 3, padding=1)
    second = nn.Conv2d(2, 1, 2)
    with torch.no_grad():
        conv.weight.fill_(1.0)
        second.weight.zero_()
        second.weight[0, :, 0, 0] = 1.0
    pooled = (2, 5, 5)
    s = layers.entry_of(second).reuse(second, pooled[1:])
    assert s == 16  # 4 x 4 output positions
    with torch.no_grad():
        r = float(path_norm(layers.in_view(conv), layers.out_view(second, 2)))
    assert r == 2 * 9.0
    unrolled = _unrolled_path_norm(
        _unrolled(_no_bias(conv), (1, 5, 5)), _unrolled(_no_bias(second), pooled)
    )
    # tap (0, 0) reads hidden rows 0..3 and columns 0..3; rows and columns 0 lose 3 taps each
    # of the 3 x 3 kernel at the border: 9 interior positions of 9 taps, 6 of 6, 1 of 4
    assert unrolled == 2 * (9 * 9 + 6 * 6 + 1 * 4)
    assert unrolled < s * r
