"""The main job's two backends train the same network: the same initial draw, the same
minibatch order, the same step; they differ only by floating-point rounding."""

from __future__ import annotations

import numpy as np
import pytest

from pathnorm_experiments.data import load_dataset
from pathnorm_experiments.draws import initial_layer_weights, initial_weights, shuffle_orders
from pathnorm_experiments.settings import TrainConfig

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
# Lightning before TensorFlow: the other order aborts in torch's triton import
from pathnorm_experiments.engine import train_loop  # noqa: E402
from pathnorm_experiments.lightning_module import train_lightning  # noqa: E402
from pathnorm_experiments.torch_backend import (  # noqa: E402
    build_model,
    build_network,
    linear_layers,
    weight_layers,
)

pytest.importorskip("tensorflow")
from pathnorm_experiments import tf_backend  # noqa: E402
from pathnorm_experiments.tf_backend import build_model as keras_model  # noqa: E402
from pathnorm_experiments.tf_backend import train_keras  # noqa: E402


def test_initial_draw_is_pytorchs_default_distribution() -> None:
    layers = initial_weights((784, 200, 10), seed=0)
    assert [(w.shape, b.shape) for w, b in layers] == [((200, 784), (200,)), ((10, 200), (10,))]
    for (w, b), fan_in in zip(layers, (784, 200), strict=True):
        bound = 1 / np.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) and nn.Linear's bias
        for a in (w, b):
            assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound
        assert w.std() == pytest.approx(bound / np.sqrt(3), rel=0.02)  # uniform's std
    again = initial_weights((784, 200, 10), seed=0)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(layers, again, strict=True))
    other = initial_weights((784, 200, 10), seed=1)
    assert not np.array_equal(layers[0][0], other[0][0])


def test_both_backends_build_the_same_initial_network() -> None:
    cfg = TrainConfig(seed=3)
    torch_w = [
        lin.weight.detach().numpy() for lin in linear_layers(build_model(cfg.widths, seed=3))
    ]
    keras_w = [np.asarray(k).T for k in (layer.kernel for layer in keras_model(cfg).layers)]
    for t, k, (w, _) in zip(torch_w, keras_w, initial_weights(cfg.widths, 3), strict=True):
        np.testing.assert_array_equal(t, w.astype(np.float32))
        np.testing.assert_array_equal(k, t)


def test_shuffle_orders_are_permutations() -> None:
    orders = shuffle_orders(50, 3, seed=0)
    assert orders.shape == (3, 50)
    for o in orders:
        np.testing.assert_array_equal(np.sort(o), np.arange(50))
    assert not np.array_equal(orders[0], orders[1])


def _weights(model: torch.nn.Module) -> list[np.ndarray]:
    return [lin.weight.detach().numpy() for lin in linear_layers(model)]


@pytest.mark.parametrize(("dtype", "atol"), [("float64", 1e-9), ("float32", 2e-5)])
def test_torch_and_keras_agree_over_the_first_epoch(dtype: str, atol: float) -> None:
    # the default job (path prox, lam 1e-3, lr 0.1, batch 100) on the whole embedded training
    # set: 50 steps, each with the prox zeroing weights, so a wrong step or order shows
    data = load_dataset("embedded").subset(None, 100)
    cfg = TrainConfig(epochs=1, dtype=dtype, eval_train_samples=1000)
    torch.set_num_threads(1)
    loop, res_loop = train_loop(cfg, data, progress=False, evaluate_model=False)
    _, res_keras = train_keras(cfg, data, progress=False, evaluate_model=False, threads=1)
    w_torch, w_keras = _weights(loop), res_keras["weights"]
    assert w_torch[0].dtype == w_keras[0].dtype == np.dtype(dtype)
    init = initial_weights(cfg.widths, cfg.seed)
    for t, k, (w0, _) in zip(w_torch, w_keras, init, strict=True):
        assert np.abs(t - w0).max() > 1e-3  # trained
        np.testing.assert_allclose(k, t, rtol=0, atol=atol)
        assert abs(np.count_nonzero(k) - np.count_nonzero(t)) <= (0 if dtype == "float64" else 5)
    assert (w_torch[0] == 0).mean() > 0.01  # the prox zeroed weights on the way
    (obj_torch,), (obj_keras,) = (
        res_loop["history"].epoch_objective,
        res_keras["history"].epoch_objective,
    )
    assert obj_keras == pytest.approx(obj_torch, rel=1e-12 if dtype == "float64" else 1e-5)
    if dtype == "float32":  # the CLI's default engine: Lightning and the loop, bit for bit
        module, _ = train_lightning(cfg, data, progress=False, evaluate_model=False)
        for a, b in zip(_weights(module.net), w_torch, strict=True):
            np.testing.assert_array_equal(a, b)


# --- the conv network ---------------------------------------------------------------------


def test_both_backends_build_the_same_initial_conv_network() -> None:
    # the kernels are one draw in two layouts (Keras's Dense rows permuted: its Flatten is
    # channels last), so the two networks compute the same function
    cfg = TrainConfig(model="conv", hidden=(6,), kernel_size=5, stride=2, dtype="float64", seed=2)
    net, kmodel = build_network(cfg), keras_model(cfg)
    draw = initial_layer_weights(cfg.weight_shapes, 2)
    assert [w.shape for w, _ in draw] == [(6, 1, 5, 5), (10, 6 * 12 * 12)]
    for layer, k, (w, _) in zip(
        weight_layers(net), tf_backend.torch_weights(kmodel), draw, strict=True
    ):
        np.testing.assert_array_equal(layer.weight.detach().numpy(), w)
        np.testing.assert_array_equal(k, w)
    assert kmodel.layers[-1].kernel.shape == (12 * 12 * 6, 10)
    # Keras row q * C + c is torch column c * P + q (channel c at position q)
    np.testing.assert_array_equal(
        np.asarray(kmodel.layers[-1].kernel)[1 * 6 + 4], draw[1][0][:, 4 * 144 + 1]
    )
    x = load_dataset("embedded").x_test[:64].astype(np.float64)
    with torch.no_grad():
        z_torch = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(kmodel(x)), z_torch, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("regularizer", "lam"), [("path", 1e-3), ("linf", 0.5)])
def test_torch_and_keras_agree_on_the_conv_network(regularizer: str, lam: float) -> None:
    # one epoch of the conv network's prox-SGD (the library's seams on both sides), float64;
    # then the evaluation: the certificates through each backend's convolution agree
    data = load_dataset("embedded").subset(600, 100)
    cfg = TrainConfig(
        model="conv", hidden=(6,), regularizer=regularizer, lam=lam, epochs=1, dtype="float64",
        eval_train_samples=600, eps=(0.01, 0.1), pgd_steps=2, pgd_samples=100,
    )  # fmt: skip
    torch.set_num_threads(1)
    loop, res_loop = train_loop(cfg, data, progress=False)
    kmodel, res_keras = train_keras(cfg, data, progress=False, threads=1)
    for t, k, (w0, _) in zip(
        [w.detach().numpy() for w in (layer.weight for layer in weight_layers(loop))],
        tf_backend.torch_weights(kmodel),
        initial_layer_weights(cfg.weight_shapes, cfg.seed),
        strict=True,
    ):
        assert np.abs(t - w0).max() > 1e-3  # trained
        np.testing.assert_allclose(k, t, rtol=0, atol=1e-12)
        assert np.count_nonzero(k) == np.count_nonzero(t)
    assert res_keras["nonzero_weights_pct"] < 99  # the prox / the projection zeroed weights
    assert res_keras["nonzero_weights_pct"] == res_loop["nonzero_weights_pct"]
    for key in ("clean_error", "certified_error", "certified_error_interval"):
        assert res_keras[key] == res_loop[key], key
    for key in ("path_norm_bound", "product_bound", "final_regularized_loss"):
        assert res_keras[key] == pytest.approx(res_loop[key], rel=1e-12), key
    np.testing.assert_allclose(res_keras["layer_linf_norms"], res_loop["layer_linf_norms"])
    assert res_keras["history"]["epoch_objective"] == pytest.approx(
        res_loop["history"]["epoch_objective"], rel=1e-12
    )
