"""Certificates and bounds: hand-computed values, exactness on a linear model, and soundness:
strong PGD never breaks a certified example; certified >= robust >= clean error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pathnorm_experiments import certify as C
from pathnorm_experiments.attacks_torch import robust_error
from pathnorm_experiments.data import Dataset, load_dataset
from pathnorm_experiments.engine import train_loop
from pathnorm_experiments.settings import TrainConfig
from pathnorm_experiments.torch_backend import linear_layers

# hand example: W (2 hidden x 2 inputs), V (2 outputs x 2 hidden)
W = np.array([[1.0, -2.0], [0.5, 0.5]])  # row l1 norms 3, 1
V = np.array([[1.0, -1.0], [2.0, 1.0]])  # |V_0 - V_1| = [1, 2]


def test_hand_computed_bounds() -> None:
    lip = C.lipschitz_matrix([W, V])
    np.testing.assert_allclose(lip, [[0.0, 5.0], [5.0, 0.0]])  # 1*3 + 2*1
    assert C.path_norm_bound([W, V]) == pytest.approx(3 * 3 + 2 * 1)  # sum_i ||V_:i|| ||W_i||
    assert C.product_bound([W, V]) == pytest.approx(5 * 3)  # sum|V| * max row sum of W
    assert C.regularizer_value([W, V], "path") == pytest.approx(11.0)
    assert C.regularizer_value([W, V], "l1") == pytest.approx(3 + 1 + 5)
    assert C.regularizer_value([W, V], "linf") == 0.0


def test_effective_nonzero_counts_only_live_paths() -> None:
    w = np.ones((3, 4))
    v = np.ones((2, 3))
    v[:, 0] = 0  # unit 0: incoming weights but no outgoing ones
    w[1] = 0  # unit 1: outgoing weights but no incoming ones
    assert C.nonzero_fraction([w, v]) == pytest.approx((8 + 4) / 18)
    assert C.effective_nonzero_fraction([w, v]) == pytest.approx(6 / 18)  # unit 2 only


def test_certified_mask_hand_example() -> None:
    b = [np.zeros(2), np.zeros(2)]
    x = np.array([[1.0, 0.0]])  # hidden pre-act [1, 0.5] -> relu [1, 0.5] -> logits [0.5, 2.5]
    z = C.forward([W, V], b, x, "relu")
    np.testing.assert_allclose(z, [[0.5, 2.5]])
    # class 1, margin 2.0, L = 5: certified iff eps < 0.4
    assert C.certified_mask([W, V], b, x, np.array([1]), 0.39, "relu")[0]
    assert not C.certified_mask([W, V], b, x, np.array([1]), 0.4, "relu")[0]
    assert not C.certified_mask([W, V], b, x, np.array([0]), 0.0, "relu")[0]  # misclassified


def test_deep_bound_is_product_of_abs_matrices() -> None:
    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(5, 4)), rng.normal(size=(6, 5)), rng.normal(size=(3, 6))]
    r = np.abs(ws[1]) @ np.abs(ws[0]) @ np.ones(4)
    lip = C.lipschitz_matrix(ws)
    assert lip[0, 2] == pytest.approx(np.abs(ws[2][0] - ws[2][2]) @ r)
    assert C.path_norm_bound(ws) == pytest.approx(np.ones(3) @ np.abs(ws[2]) @ r)
    assert lip.max() <= 2 * C.path_norm_bound(ws)


@pytest.mark.parametrize("activation", ["elu", "relu", "tanh"])
def test_lipschitz_bound_holds_on_random_perturbations(activation: str) -> None:
    rng = np.random.default_rng(1)
    ws = [rng.normal(size=(20, 8)), rng.normal(size=(4, 20))]
    bs = [rng.normal(size=20), rng.normal(size=4)]
    lip = C.lipschitz_matrix(ws)
    x = rng.uniform(size=(500, 8))
    d = rng.uniform(-1, 1, size=(500, 8)) * rng.uniform(0, 0.5, size=(500, 1))
    f0, f1 = C.forward(ws, bs, x, activation), C.forward(ws, bs, x + d, activation)
    dn = np.abs(d).max(1)
    for y in range(4):
        for j in range(4):
            change = np.abs((f1[:, y] - f1[:, j]) - (f0[:, y] - f0[:, j]))
            assert np.all(change <= lip[y, j] * dn + 1e-9)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="does not follow"):
        C.lipschitz_matrix([np.ones((3, 4)), np.ones((2, 5))])
    with pytest.raises(ValueError, match="activation must be elu, relu or tanh"):
        C.forward([W, V], [np.zeros(2), np.zeros(2)], np.ones((1, 2)), "gelu")
    with pytest.raises(ValueError, match="eps must be >= 0"):
        C.certified_mask([W, V], [np.zeros(2)] * 2, np.ones((1, 2)), np.array([0]), -1.0, "elu")
    with pytest.raises(ValueError, match="even number"):
        C.regularizer_value([W, V, V], "path")


@pytest.fixture(scope="module")
def data() -> Dataset:
    return load_dataset("embedded").subset(3000, 400)


@pytest.fixture(scope="module")
def robust_model(data: Dataset) -> torch.nn.Module:
    """A path-norm-regularized net: small Lipschitz bounds, so many examples certify."""
    torch.set_num_threads(1)
    cfg = TrainConfig(regularizer="path", lam=1e-3, epochs=4, log_every=100)
    model, _ = train_loop(cfg, data, progress=False, evaluate_model=False)
    return model.eval()


def _np(model: torch.nn.Module) -> tuple[list[np.ndarray], list[np.ndarray]]:
    lins = linear_layers(model)
    return [m.weight.detach().numpy() for m in lins], [m.bias.detach().numpy() for m in lins]


def test_certificate_exact_on_linear_model(data: Dataset) -> None:
    """For f = A x + b (no box), L_{y,j} = ||a_y - a_j||_1 is attained: certified <=> robust."""
    cfg = TrainConfig(regularizer="none", epochs=2, hidden=(), lr=0.05, log_every=100)
    model, _ = train_loop(cfg, data, progress=False, evaluate_model=False)
    ws, bs = _np(model)
    a, b = ws[0].astype(np.float64), bs[0].astype(np.float64)
    x, y = data.x_test.astype(np.float64), data.y_test
    eps = 0.02
    robust = np.ones(x.shape[0], dtype=bool)
    for j in range(10):
        c = a[y] - a[j]
        worst = ((x - eps * np.sign(c)) * c).sum(1) + b[y] - b[j]  # optimal unboxed attack
        robust &= (worst > 0) | (y == j)
    cert = C.certified_mask(ws, bs, data.x_test, y, eps, "elu")
    np.testing.assert_array_equal(cert, robust)
    assert 0.1 < cert.mean() < 0.95


def test_no_attack_breaks_a_certified_example(robust_model: torch.nn.Module, data: Dataset) -> None:
    ws, bs = _np(robust_model)
    x, y = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    n_checked = 0
    for eps in (0.01, 0.03, 0.05):
        cert = C.certified_mask(ws, bs, data.x_test, data.y_test, eps, "elu")
        idx = torch.from_numpy(np.flatnonzero(cert))
        if idx.numel() == 0:
            continue
        n_checked += idx.numel()
        for loss in ("ce", "margin"):
            broken = robust_error(
                robust_model,
                x[idx],
                y[idx],
                eps,
                steps=100,
                restarts=3,
                loss=loss,
                return_mask=True,
            )
            assert not bool(broken.any()), (
                f"PGD broke {int(broken.sum())} certified examples at eps {eps}"
            )
    assert n_checked >= 100  # the test is not vacuous


def test_error_ordering(robust_model: torch.nn.Module, data: Dataset) -> None:
    """clean <= PGD-robust <= certified error, and all grow with eps."""
    ws, bs = _np(robust_model)
    x, y = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    eps_list = (0.0, 0.01, 0.02, 0.05, 0.1)
    cert = C.certified_error(ws, bs, data.x_test, data.y_test, eps_list, "elu")
    rob = [robust_error(robust_model, x, y, e, steps=40) for e in eps_list]
    with torch.no_grad():
        clean = float((robust_model(x).argmax(1) != y).float().mean())
    assert cert["0"] == pytest.approx(clean, abs=1e-6)
    for e, r in zip(eps_list, rob, strict=True):
        assert clean - 1e-6 <= r <= cert[f"{e:g}"] + 1e-6, (e, clean, r, cert)
    cs = [cert[f"{e:g}"] for e in eps_list]
    assert cs == sorted(cs) and rob == sorted(rob)
    assert cert["0.01"] < 0.5  # the regularized net certifies most examples at eps 0.01


# --- interval bound propagation ----------------------------------------------------------


def test_interval_hand_example() -> None:
    b = [np.zeros(2), np.zeros(2)]
    x = np.array([[1.0, 0.0]])  # box [0.9, 1] x [0, 0.1] at eps 0.1 (clipped to [0, 1])
    # hidden pre-activations: W[0] = [1, -2] -> [0.7, 1.0]; W[1] = [.5, .5] -> [0.45, 0.55]
    # relu keeps them; margin f_1 - f_0 = (V_1 - V_0) h = [1, 2] h >= 0.7 + 0.9 = 1.6
    bounds = C.interval_margin_bounds([W, V], b, x, np.array([1]), 0.1, "relu")
    np.testing.assert_allclose(bounds, [[1.6, np.inf]])
    assert C.interval_certified_mask([W, V], b, x, np.array([1]), 0.1, "relu")[0]
    assert not C.interval_certified_mask([W, V], b, x, np.array([0]), 0.0, "relu")[0]


@pytest.mark.parametrize("activation", ["elu", "relu", "tanh"])
def test_interval_bound_holds_on_random_points_of_the_box(activation: str) -> None:
    rng = np.random.default_rng(2)
    ws = [rng.normal(size=(12, 6)), rng.normal(size=(9, 12)), rng.normal(size=(4, 9))]
    bs = [rng.normal(size=12), rng.normal(size=9), rng.normal(size=4)]
    x = rng.uniform(size=(40, 6))
    y = rng.integers(0, 4, 40)
    eps = 0.2
    bounds = C.interval_margin_bounds(ws, bs, x, y, eps, activation)
    for i in range(40):
        lo, hi = np.clip(x[i] - eps, 0, 1), np.clip(x[i] + eps, 0, 1)
        pts = rng.uniform(lo, hi, size=(2000, 6))
        pts[:64] = np.where(rng.random((64, 6)) < 0.5, lo, hi)  # corners too
        z = C.forward(ws, bs, pts, activation)
        worst = (z[:, y[i]][:, None] - z).min(0)
        worst[y[i]] = np.inf
        assert np.all(bounds[i] <= worst + 1e-9), (i, bounds[i], worst)


def test_interval_is_exact_on_a_linear_model(data: Dataset) -> None:
    """For f = A x + b the least margin over the [0, 1]-clipped box is at a corner: IBP's
    bound is that value, so certified <=> the optimal boxed attack fails."""
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(10, 784)) * 0.05, rng.normal(size=10)
    x, y = data.x_test[:200].astype(np.float64), data.y_test[:200]
    eps = 0.05
    lo, hi = np.clip(x - eps, 0, 1), np.clip(x + eps, 0, 1)
    bounds = C.interval_margin_bounds([a], [b], x, y, eps, "elu")
    for j in range(10):
        c = a[y] - a[j]
        worst = np.minimum(c * lo, c * hi).sum(1) + b[y] - b[j]
        keep = y != j
        np.testing.assert_allclose(bounds[keep, j], worst[keep], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("regularizer", "lam"), [("none", 0.0), ("l1", 3e-3), ("path", 2e-3), ("linf", 0.2)]
)
def test_no_attack_breaks_an_example_either_certificate_certifies(
    data: Dataset, regularizer: str, lam: float
) -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(regularizer=regularizer, lam=lam, epochs=2, log_every=100)
    model, _ = train_loop(cfg, data, progress=False, evaluate_model=False)
    model.eval()
    ws, bs = _np(model)
    x, y = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    checked = {"Lipschitz": 0, "interval": 0}
    for eps in (0.01, 0.03, 0.1):
        masks = {
            "Lipschitz": C.certified_mask(ws, bs, data.x_test, data.y_test, eps, "elu"),
            "interval": C.interval_certified_mask(ws, bs, data.x_test, data.y_test, eps, "elu"),
        }
        for kind, cert in masks.items():
            idx = torch.from_numpy(np.flatnonzero(cert))
            checked[kind] += idx.numel()
            if idx.numel() == 0:
                continue
            for loss in ("ce", "margin"):
                broken = robust_error(
                    model, x[idx], y[idx], eps, steps=50, restarts=2, loss=loss, return_mask=True
                )
                assert not bool(broken.any()), (
                    f"PGD ({loss}) broke {int(broken.sum())} {kind}-certified examples at {eps}"
                )
    assert checked["interval"] >= 100, checked  # not vacuous


# --- convolutions ------------------------------------------------------------------------

CONV_CASES = [  # (in_shape, channels, kernel, stride, padding)
    ((1, 7, 7), 3, 3, 1, 0),
    ((1, 8, 8), 2, 3, 2, 0),
    ((2, 6, 5), 3, 2, (2, 1), 1),
    ((1, 9, 9), 4, 5, 2, (1, 0)),
]


def _random_conv_net(
    rng: np.random.Generator, case: tuple
) -> tuple[list[C.Layer], list[np.ndarray]]:
    in_shape, channels, kernel, stride, padding = case
    conv = C.ConvLayer(
        rng.normal(size=(channels, in_shape[0], kernel, kernel)), in_shape, stride, padding
    )
    last = rng.normal(size=(4, conv.shape[0]))
    return [conv, last], [rng.normal(size=channels), rng.normal(size=4)]


def _unroll(
    layers: list[C.Layer], biases: list[np.ndarray]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    ws = [w.unrolled() if isinstance(w, C.ConvLayer) else w for w in layers]
    bs = [
        np.repeat(b, w.shape[0] // b.shape[0]) for w, b in zip(ws, biases, strict=True)
    ]  # a channel's bias at each of its positions (channels first)
    return ws, bs


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_layer_is_torch_conv2d(case: tuple) -> None:
    rng = np.random.default_rng(4)
    (conv, _), _ = _random_conv_net(rng, case)
    x = rng.uniform(size=(5, conv.shape[1]))
    want = torch.nn.functional.conv2d(
        torch.from_numpy(x).reshape(5, *conv.in_shape),
        torch.from_numpy(conv.weight),
        stride=conv.stride,
        padding=conv.padding,
    )
    assert conv.out_shape == tuple(want.shape[1:])
    np.testing.assert_allclose(conv.apply(x), want.reshape(5, -1).numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(conv.unrolled() @ x.T, conv.apply(x).T, rtol=0, atol=1e-12)
    v = conv.unrolled()
    np.testing.assert_allclose(conv.apply(x, absolute=True), x @ np.abs(v).T, atol=1e-12)
    assert C.layer_linf_norm(conv) == pytest.approx(np.abs(v).sum(1).max(), rel=1e-12)


@pytest.mark.parametrize("activation", ["elu", "relu", "tanh"])
def test_interval_and_bounds_through_a_conv_equal_the_unrolled_network(activation: str) -> None:
    rng = np.random.default_rng(5)
    for case in CONV_CASES * 3:
        layers, biases = _random_conv_net(rng, case)
        ws, bs = _unroll(layers, biases)
        x = rng.uniform(size=(20, layers[0].shape[1]))
        y = rng.integers(0, 4, 20)
        for eps in (0.0, 0.05, 0.3):
            np.testing.assert_allclose(
                C.interval_margin_bounds(layers, biases, x, y, eps, activation),
                C.interval_margin_bounds(ws, bs, x, y, eps, activation),
                rtol=0,
                atol=1e-10,
            )
        np.testing.assert_allclose(
            C.forward(layers, biases, x, activation), C.forward(ws, bs, x, activation), atol=1e-10
        )
        np.testing.assert_allclose(C.lipschitz_matrix(layers), C.lipschitz_matrix(ws), rtol=1e-12)
        assert C.path_norm_bound(layers) == pytest.approx(C.path_norm_bound(ws), rel=1e-12)
        assert C.product_bound(layers) == pytest.approx(C.product_bound(ws), rel=1e-12)


def test_a_valid_conv_nets_path_norm_bound_is_R_and_the_seams_bound() -> None:
    """Valid Conv -> Flatten -> Linear: the unrolled path norm is R (the factor s = 1), the
    value the library's PathNormBound logs for the pair; padding makes it strictly less."""
    from pathnorm_experiments.torch_backend import build_conv_model, numpy_layers
    from pathnorm_lightning.metrics import PathNormBound

    model = build_conv_model(5, kernel_size=4, stride=3, seed=0, dtype=torch.float64)
    layers, _ = numpy_layers(model)
    assert isinstance(layers[0], C.ConvLayer) and layers[0].out_shape == (5, 9, 9)
    r = C.regularizer_value(layers, "path")
    metric = PathNormBound()
    metric.update([model[1].weight, model[4].weight])
    assert C.path_norm_bound(layers) == pytest.approx(r, rel=1e-12)
    assert float(metric.compute()) == pytest.approx(r, rel=1e-12)
    padded = C.ConvLayer(layers[0].weight, (1, 28, 28), 3, 1)  # 9 x 9 positions
    last = np.random.default_rng(6).normal(size=(10, 5 * 81))
    assert C.path_norm_bound([padded, last]) < C.regularizer_value([padded, last], "path")


def test_a_conv_nets_kernel_weights_count_once() -> None:
    conv = np.zeros((3, 1, 2, 2))
    conv[0] = 1.0  # channel 0: 4 weights, read by no output
    conv[1, 0, 0, 0] = -2.0  # channel 1: 1 weight, read by output 0
    # channel 2: no incoming weights, read by output 1 at both its positions
    last = np.zeros((2, 3 * 2))  # channels first: columns 2c, 2c + 1
    last[0, 2] = 0.5
    last[1, 4:6] = [1.0, -1.0]
    layers: list[C.Layer] = [C.ConvLayer(conv, (1, 2, 3)), last]  # 1 x 2 positions
    assert C.regularizer_value(layers, "l1") == pytest.approx(4 + 2 + 0.5 + 2)
    assert C.regularizer_value(layers, "path") == pytest.approx(4 * 0 + 2 * 0.5 + 0 * 2)
    assert C.nonzero_fraction(layers) == pytest.approx((5 + 3) / (12 + 12))
    assert C.effective_nonzero_fraction(layers) == pytest.approx((1 + 1) / 24)  # channel 1
    assert C.nonzero_fraction([conv, last]) == C.nonzero_fraction(layers)  # native arrays
    assert C.path_norm_bound(layers) == pytest.approx(2 * 0.5)


def test_conv_bad_inputs() -> None:
    with pytest.raises(ValueError, match="4-D array"):
        C.ConvLayer(np.ones((2, 3)), (1, 4, 4))
    with pytest.raises(ValueError, match=r"in_channels = weight\.shape"):
        C.ConvLayer(np.ones((2, 3, 2, 2)), (1, 4, 4))
    with pytest.raises(ValueError, match="does not fit"):
        C.ConvLayer(np.ones((2, 1, 5, 5)), (1, 4, 4))
    conv = C.ConvLayer(np.ones((2, 1, 3, 3)), (1, 4, 4))
    with pytest.raises(ValueError, match="last layer must be a matrix"):
        C.path_norm_bound([np.ones((16, 4)), conv])
    with pytest.raises(ValueError, match="does not follow"):
        C.lipschitz_matrix([conv, np.ones((3, 9))])  # 2 channels x 4 positions = 8 inputs
    with pytest.raises(ValueError, match="a ConvLayer's: \\(channels,\\)"):
        C.forward([conv, np.ones((3, 8))], [np.zeros(8), np.zeros(3)], np.ones((1, 16)), "elu")


def test_no_attack_breaks_a_certified_conv_example(data: Dataset) -> None:
    """The conv network of the main job, path-regularized: neither certificate (Lipschitz,
    IBP through the convolution) certifies an example that PGD breaks. (PGD through a
    one-channel convolution is slow on CPU: 150 test images, one restart per loss.)"""
    from pathnorm_experiments.torch_backend import numpy_layers

    torch.set_num_threads(1)
    cfg = TrainConfig(model="conv", hidden=(4,), lam=1e-3, epochs=2, log_every=100)
    model, _ = train_loop(cfg, data.subset(1000, 150), progress=False, evaluate_model=False)
    model.eval()
    ws, bs = numpy_layers(model)
    x_np, y_np = data.x_test[:150], data.y_test[:150]
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    checked = {"Lipschitz": 0, "interval": 0}
    for eps in (0.01, 0.1):
        masks = {
            "Lipschitz": C.certified_mask(ws, bs, x_np, y_np, eps, "elu"),
            "interval": C.interval_certified_mask(ws, bs, x_np, y_np, eps, "elu"),
        }
        for kind, cert in masks.items():
            checked[kind] += int(cert.sum())
        idx = torch.from_numpy(np.flatnonzero(masks["Lipschitz"] | masks["interval"]))
        for loss in ("ce", "margin"):
            broken = robust_error(model, x[idx], y[idx], eps, steps=30, loss=loss, return_mask=True)
            assert not bool(broken.any()), (eps, loss, int(broken.sum()))
    assert checked["interval"] >= 50 and checked["Lipschitz"] >= 20, checked  # not vacuous


def test_interval_bounds_refuse_inputs_outside_the_unit_box() -> None:
    # clip(x +- eps, 0, 1) would not contain x = 1.2: a misclassified x was certified
    w1, w2 = np.array([[1.0]]), np.array([[-1.0], [1.0]])
    b1, b2 = np.zeros(1), np.array([0.9, -0.9])
    x, y = np.array([[1.2]]), np.array([0])
    with pytest.raises(ValueError, match=r"x must lie in \[0, 1\]"):
        C.interval_certified_mask([w1, w2], [b1, b2], x, y, 0.1, "relu")
    assert C.interval_certified_mask([w1, w2], [b1, b2], x / 2, y, 0.1, "relu").shape == (1,)
