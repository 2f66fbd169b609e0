"""Interval bound propagation: hand-computed bounds, exactness on a linear model, and soundness
of both certificates (IBP and the per-pair Lipschitz one) against PGD on trained models of every
regularizer."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from pathnorm_experiments import certify, ibp
from pathnorm_experiments.config import TrainConfig
from pathnorm_experiments.data import load_embedded
from pathnorm_experiments.torch_backend import linear_layers, pgd_attack, train_loop

# 2 inputs -> 2 hidden (ELU) -> 2 classes
W1 = torch.tensor([[1.0, -2.0], [0.5, 0.5]], dtype=torch.float64)
B1 = torch.tensor([0.0, 0.0], dtype=torch.float64)
W2 = torch.tensor([[1.0, -1.0], [2.0, 1.0]], dtype=torch.float64)
B2 = torch.tensor([0.0, 0.1], dtype=torch.float64)


def test_hand_computed_bounds() -> None:
    x = torch.tensor([[0.5, 0.5], [0.0, 1.0]], dtype=torch.float64)
    lo, hi = ibp.interval_bounds([W1, W2], [B1, B2], x, 0.1)
    # x0 in [0.4, 0.6]^2: z0 = x_0 - 2 x_1 in [-0.8, -0.2], z1 = (x_0 + x_1) / 2 in [0.4, 0.6].
    # x1: the box clips to [0, 0.1] x [0.9, 1]: z0 in [-2, -1.7], z1 in [0.45, 0.55].
    e = math.expm1
    np.testing.assert_allclose(lo.numpy(), [[e(-0.8), 0.4], [e(-2.0), 0.45]], rtol=1e-14)
    np.testing.assert_allclose(hi.numpy(), [[e(-0.2), 0.6], [e(-1.7), 0.55]], rtol=1e-14)
    y = torch.tensor([1, 1])
    low = ibp.margin_lower_bounds([W1, W2], [B1, B2], x, y, 0.1)
    # f1 - f0 = h0 + 2 h1 + 0.1 >= lo0 + 2 lo1 + 0.1
    np.testing.assert_allclose(
        low[:, 0].numpy(), [e(-0.8) + 0.9, e(-2.0) + 1.0], rtol=1e-14, atol=1e-15
    )
    assert torch.isinf(low[:, 1]).all()
    assert ibp.certified_mask([W1, W2], [B1, B2], x, y, 0.1).tolist() == [True, True]
    # bounding f1 from below and f0 from above separately would give
    # 2 lo0 + lo1 + 0.1 - (hi0 - lo1) = 2 e^-0.8 - 2 + 0.9 - e^-0.2 + 1 = -0.02 < 0:
    # the exact difference certifies what the naive bound does not
    naive = 2 * e(-0.8) + 0.4 + 0.1 - (e(-0.2) - 0.4)
    assert naive < 0 < float(low[0, 0])
    # label 0 is not certified (f0 - f1 >= -(hi0 + 2 hi1) - 0.1 < 0), nor at eps 0 (misclassified)
    y0 = torch.tensor([0, 0])
    assert ibp.certified_mask([W1, W2], [B1, B2], x, y0, 0.1).tolist() == [False, False]
    assert ibp.certified_mask([W1, W2], [B1, B2], x, y0, 0.0).tolist() == [False, False]
    # a larger ball: x0 in [0.1, 0.9]^2, z0 in [-1.7, 0.7]: f1 - f0 >= e^-1.7 - 1 + 0.2 + 0.1
    low = ibp.margin_lower_bounds([W1, W2], [B1, B2], x[:1], y[:1], 0.4)
    assert float(low[0, 0]) == pytest.approx(e(-1.7) + 0.3, rel=1e-14)
    assert not ibp.certified_mask([W1, W2], [B1, B2], x[:1], y[:1], 0.4)[0]


def test_exact_on_a_linear_model() -> None:
    # no hidden layer: the last-layer difference over the clipped box is the exact minimum
    rng = np.random.default_rng(0)
    w = torch.from_numpy(rng.normal(size=(3, 5)))
    b = torch.from_numpy(rng.normal(size=3))
    x = torch.from_numpy(rng.uniform(size=(50, 5)))
    y = torch.from_numpy(rng.integers(0, 3, 50))
    eps = 0.2
    low = ibp.margin_lower_bounds([w], [b], x, y, eps)
    lo, hi = (x - eps).clamp(0, 1), (x + eps).clamp(0, 1)
    for n in range(50):
        for j in range(3):
            if j == int(y[n]):
                continue
            d = w[y[n]] - w[j]
            best = torch.where(d > 0, lo[n], hi[n])  # the minimising corner
            assert float(low[n, j]) == pytest.approx(float(d @ best + b[y[n]] - b[j]), abs=1e-12)


@pytest.mark.parametrize("activation", ["elu", "relu", "tanh"])
def test_bounds_hold_at_random_points_of_a_deep_net(activation: str) -> None:
    rng = np.random.default_rng(1)
    widths = (6, 8, 7, 4)
    ws = [torch.from_numpy(rng.normal(size=(o, i))) for i, o in itertools.pairwise(widths)]
    bs = [torch.from_numpy(rng.normal(size=o)) for o in widths[1:]]
    x = torch.from_numpy(rng.uniform(size=(40, 6)))
    y = torch.from_numpy(rng.integers(0, 4, 40))
    eps = 0.15
    low = ibp.margin_lower_bounds(ws, bs, x, y, eps, activation)
    act = {"elu": torch.nn.functional.elu, "relu": torch.relu, "tanh": torch.tanh}[activation]
    for _ in range(50):
        d = torch.from_numpy(rng.uniform(-eps, eps, size=(40, 6)))
        h = (x + d).clamp(0, 1)
        for w, b in zip(ws[:-1], bs[:-1], strict=True):
            h = act(h @ w.T + b)
        z = h @ ws[-1].T + bs[-1]
        margin = (z.gather(1, y[:, None]) - z).scatter(1, y[:, None], math.inf)
        assert bool((margin >= low - 1e-12).all())


def test_bad_inputs() -> None:
    x = torch.full((1, 2), 0.5, dtype=torch.float64)
    y = torch.tensor([0])
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        ibp.certified_mask([W1, W2], [B1, B2], x, y, -0.1)
    with pytest.raises(ValueError, match="pixel box"):
        ibp.certified_mask([W1, W2], [B1, B2], x + 1, y, 0.1)
    with pytest.raises(ValueError, match="does not follow"):
        ibp.certified_mask([W1, torch.ones(2, 3)], [B1, B2], x, y, 0.1)
    with pytest.raises(ValueError, match="labels in"):
        ibp.certified_mask([W1, W2], [B1, B2], x, torch.tensor([2]), 0.1)
    with pytest.raises(ValueError, match="monotone"):
        ibp.certified_mask([W1, W2], [B1, B2], x, y, 0.1, "gelu")


@pytest.fixture(scope="module")
def trained_models() -> dict[str, torch.nn.Module]:
    torch.set_num_threads(1)
    data = load_embedded().subset(2000)
    models = {}
    for reg, lam in (("none", 0.0), ("l1", 1e-3), ("path", 1e-3), ("linf", 0.2)):
        cfg = TrainConfig(regularizer=reg, lam=lam, lr=0.2, epochs=2, seed=0)
        models[reg], _ = train_loop(cfg, data, progress=False, evaluate_model=False)
    return models


@pytest.mark.parametrize("reg", ["none", "l1", "path", "linf"])
def test_no_attack_breaks_a_certified_example(
    trained_models: dict[str, torch.nn.Module], reg: str
) -> None:
    """Both certificates against the union of CE-PGD and margin-PGD with restarts."""
    model = trained_models[reg].eval()
    data = load_embedded()
    x, y = torch.from_numpy(data.x_test[:300]), torch.from_numpy(data.y_test[:300])
    layers = linear_layers(model)
    ws = [lin.weight.detach() for lin in layers]
    bs = [lin.bias.detach() for lin in layers]
    ws_np, bs_np = [w.numpy() for w in ws], [b.numpy() for b in bs]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        wrong_clean = model(x).argmax(1) != y
    for eps in (0.01, 0.03, 0.1):
        broken = wrong_clean.clone()
        low = ibp.margin_lower_bounds(ws, bs, x, y, eps)
        for loss, restarts in (("ce", 1), ("margin", 2)):
            for _ in range(restarts):
                xa = pgd_attack(model, x, y, eps, steps=40, loss=loss, generator=gen)
                assert float((xa - x).abs().max()) <= eps + 1e-6
                with torch.no_grad():
                    z = model(xa).double()
                broken |= z.argmax(1) != y
                # the IBP bound holds at the attack points themselves (float32 forward pass)
                margin = (z.gather(1, y[:, None]) - z).scatter(1, y[:, None], math.inf)
                assert bool((margin >= low - 1e-4).all())
        cert_ibp = ibp.certified_mask(ws, bs, x, y, eps)
        cert_lip = torch.from_numpy(
            certify.certified_mask(ws_np, bs_np, x.numpy(), y.numpy(), eps, "elu")
        )
        assert not bool((cert_ibp & broken).any()), f"{reg} eps {eps}: IBP certified a broken one"
        assert not bool((cert_lip & broken).any()), (
            f"{reg} eps {eps}: Lipschitz certified a broken one"
        )
        if eps == 0.01:  # the test has teeth: both certify examples, the attack breaks some
            assert int(cert_ibp.sum()) > 100 and int(cert_lip.sum()) > 0
        if eps == 0.1:
            assert int(broken.sum()) > int(wrong_clean.sum())
