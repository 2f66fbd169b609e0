"""PathNormMetrics: values equal direct computation (and the torch metrics), reach History/CSV."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import csv
import warnings
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from pathnorm_tf import (
    PathNormMetrics,
    PathNormSGD,
    ProxOptimizer,
    metric_values,
    path_norm,
    product_bound,
)


def mlp(sizes: tuple[int, ...], seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers: list[Any] = [keras.Input((6,))]
    layers += [
        keras.layers.Dense(u, activation="elu", name=f"d{i + 1}") for i, u in enumerate(sizes)
    ]
    return keras.Sequential(layers, name="net")


def direct(kernels: list[np.ndarray], pairs: list[tuple[int, int]]) -> dict[str, float]:
    """The definitions, written out in NumPy (float64)."""
    ks = [k.astype(np.float64) for k in kernels]
    chosen = [ks[i] for pair in pairs for i in pair]
    zeros = sum(int(np.sum(k == 0)) for k in chosen)
    total = sum(k.size for k in chosen)
    alive = [
        np.any(ks[i] != 0, axis=0) & np.any(ks[j] != 0, axis=1) for i, j in pairs
    ]  # unit j: incoming column, outgoing row
    v = np.ones(ks[0].shape[0])
    for k in ks:
        v = v @ np.abs(k)
    prod = np.abs(ks[-1]).sum()
    for k in ks[:-1]:
        prod *= np.abs(k).sum(0).max()
    return {
        "pathnorm/sparsity": zeros / total,
        "pathnorm/alive_units": float(np.concatenate(alive).mean()),
        "pathnorm/path_norm_bound": float(v.sum()),
        "pathnorm/product_bound": float(prod),
    }


def sparsify(model: keras.Model, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        k = layer.kernel.numpy()
        k[rng.random(k.shape) < 0.4] = 0.0
        layer.kernel.assign(k)
    k = model.layers[0].kernel.numpy()
    k[:, 1] = 0.0  # unit 1 of the first pair has no incoming weight: dead
    model.layers[0].kernel.assign(k)


@pytest.mark.parametrize(
    ("sizes", "pairs", "idx"),
    [
        ((5, 3), "auto", [(0, 1)]),
        ((5, 4, 4, 3), "auto", [(0, 1), (2, 3)]),
        ((5, 4, 3), [("d2", "d3")], [(1, 2)]),
    ],
)
def test_values_equal_direct_computation(sizes: tuple[int, ...], pairs: Any, idx: Any) -> None:
    model = mlp(sizes)
    sparsify(model)
    got = metric_values(model, pairs)
    want = direct([layer.kernel.numpy() for layer in model.layers], idx)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key
    assert got["pathnorm/alive_units"] < 1.0 or idx != [(0, 1)]
    assert got["pathnorm/product_bound"] >= got["pathnorm/path_norm_bound"]


def test_one_pair_bounds_equal_the_functional_ones() -> None:
    model = mlp((5, 3))
    k_in, k_out = model.layers[0].kernel, model.layers[1].kernel
    got = metric_values(model)
    assert got["pathnorm/path_norm_bound"] == pytest.approx(float(path_norm(k_in, k_out)), rel=1e-6)
    assert got["pathnorm/product_bound"] == pytest.approx(
        float(product_bound(k_in, k_out)), rel=1e-6
    )


def test_same_values_as_the_torch_metrics() -> None:
    torch = pytest.importorskip("torch")
    metrics = pytest.importorskip("pathnorm_lightning.metrics")
    model = mlp((5, 4, 3))
    sparsify(model, seed=3)
    weights = [
        torch.from_numpy(layer.kernel.numpy().T.astype(np.float64)) for layer in model.layers
    ]
    sparsity = metrics.Sparsity()
    sparsity.update(weights[:2])  # the auto pair (d1, d2); d3 is unpaired
    bound, prod = metrics.PathNormBound(), metrics.ProductBound()
    bound.update(weights)
    prod.update(weights)
    with pytest.warns(UserWarning, match="no partner"):
        got = metric_values(model)
    want = sparsity.compute()
    assert got["pathnorm/sparsity"] == pytest.approx(float(want["sparsity"]), rel=1e-12)
    assert got["pathnorm/alive_units"] == pytest.approx(float(want["alive_units"]), rel=1e-12)
    assert got["pathnorm/path_norm_bound"] == pytest.approx(float(bound.compute()), rel=1e-6)
    assert got["pathnorm/product_bound"] == pytest.approx(float(prod.compute()), rel=1e-6)


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
def test_logs_reach_history_and_csv_logger(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((20, 6)), rng.integers(0, 3, 20)
    model = mlp((5, 3))
    model.compile(
        PathNormSGD(0.5, lam=0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    csv_path = tmp_path / "log.csv"
    history = model.fit(
        x,
        y,
        epochs=2,
        verbose=0,
        callbacks=[PathNormMetrics(), keras.callbacks.CSVLogger(str(csv_path))],
    )
    final = metric_values(model)
    assert len(final) == 4
    for key, value in final.items():  # the documented way to read them: Python floats
        assert len(history.history[key]) == 2
        assert all(type(v) is float for v in history.history[key])
        assert type(value) is float and history.history[key][-1] == pytest.approx(value)
    assert history.history["pathnorm/sparsity"][-1] > 0  # the prox zeroed weights
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert float(rows[-1]["pathnorm/sparsity"]) == pytest.approx(final["pathnorm/sparsity"])


def _fit_dead(optimizer: Any, callbacks: list[Any], kill: bool = False) -> list[str]:
    """Two eager epochs of a 6-5-3 model; the warnings about dead pairs they gave."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((20, 6)), rng.integers(0, 3, 20)
    model = mlp((5, 3))
    if kill:  # every hidden unit loses its incoming weights
        model.layers[0].kernel.assign(np.zeros((6, 5)))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer, loss, run_eagerly=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, epochs=2, batch_size=10, verbose=0, callbacks=callbacks)
    return [str(w.message) for w in caught if "no alive hidden unit" in str(w.message)]


@pytest.mark.parametrize(
    ("make", "callbacks", "kill", "advice"),
    [
        (lambda: PathNormSGD(0.5, lam=50.0), [PathNormMetrics], False, "lam=50.0 is too large"),
        (lambda: PathNormSGD(0.5, lam=50.0), [], False, "lam=50.0 is too large"),  # fit's end
        (
            lambda: ProxOptimizer(keras.optimizers.SGD(0.5), regularizer="linf", radius=0.0),
            [PathNormMetrics],
            False,
            "radius=0.0 is too small",
        ),
        (lambda: keras.optimizers.SGD(0.0), [PathNormMetrics], True, "try a smaller lam"),
    ],
    ids=["metrics", "fit-end", "linf", "plain-sgd"],
)
def test_a_pair_that_lost_every_unit_is_warned_about_once(
    make: Any, callbacks: list[Any], kill: bool, advice: str
) -> None:
    # Before, a lam too large for the layers' sizes zeroed the network without a word. (No
    # warning while units live: test_frozen_first_layer_reports_the_optimizers_pair.)
    messages = _fit_dead(make(), [cb() for cb in callbacks], kill)
    assert len(messages) == 1, messages  # once, over 2 epochs (and at fit's end)
    assert "pair ('net/d1', 'net/d2') has no alive hidden unit" in messages[0]
    assert advice in messages[0] and "Choosing lam" in messages[0]


def test_batch_logs_every_n_batches() -> None:
    seen: list[bool] = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            seen.append("pathnorm/sparsity" in (logs or {}))

    rng = np.random.default_rng(0)
    model = mlp((5, 3))
    model.compile("sgd", "mse")
    model.fit(
        rng.standard_normal((8, 6)),
        rng.standard_normal((8, 3)),
        batch_size=2,
        verbose=0,
        callbacks=[PathNormMetrics(every_n_batches=2), Probe()],
    )
    assert seen == [False, True, False, True]


def test_non_chaining_model_reports_sparsity_only() -> None:
    inp = keras.Input((6,))
    a = keras.layers.Dense(5, name="a")(inp)
    b = keras.layers.Dense(4, name="b")(a)
    c = keras.layers.Dense(4, name="c")(inp)
    model = keras.Model(inp, keras.layers.Concatenate()([b, c]))
    got = metric_values(model, pairs=[("a", "b")])
    assert set(got) == {"pathnorm/sparsity", "pathnorm/alive_units"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_batches": 0}, "every_n_batches must be None or an int >= 1"),
        ({"every_n_batches": 1.5}, "every_n_batches must be None or an int >= 1"),
        ({"pairs": "first"}, 'pairs must be "auto"'),
    ],
)
def test_constructor_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PathNormMetrics(**kwargs)


def test_model_without_dense_layers() -> None:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Flatten()])
    with pytest.raises(ValueError, match="no built Dense/Conv1D/Conv2D layer"):
        metric_values(model)


# --- the metrics report on what the optimizer regularizes --------------------------------------


def frozen_first(seed: int = 0) -> keras.Model:
    """``a -> b -> c`` with ``a`` frozen: the optimizer's one pair is (b, c)."""
    model = mlp((8, 8, 3), seed)
    model.layers[0].trainable = False
    return model


def optimizer_of(kind: str, model: keras.Model | None = None) -> Any:
    """``kind``; ``model``: shown to the path-norm optimizers (``model=``)."""
    if kind == "PathNormSGD":
        return PathNormSGD(0.5, lam=0.4, model=model)
    if kind == "ProxOptimizer":
        return ProxOptimizer(keras.optimizers.Adam(0.05), lam=4.0, model=model)
    if kind == "LossScale(PathNormSGD)":
        return keras.optimizers.LossScaleOptimizer(PathNormSGD(0.5, lam=0.4, model=model))
    return keras.optimizers.SGD(0.5)  # no path-norm optimizer: resolved like one would


def fit_once(model: keras.Model, opt: Any, callbacks: list[Any], x_shape: tuple[int, ...]) -> Any:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, *x_shape)), rng.integers(0, 3, 16)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)


def pair_values(k_in: np.ndarray, k_out: np.ndarray) -> tuple[float, float]:
    zeros = int(np.sum(k_in == 0) + np.sum(k_out == 0))
    alive = np.any(k_in != 0, axis=0) & np.any(k_out != 0, axis=1)
    return zeros / (k_in.size + k_out.size), float(alive.mean())


OPTIMIZERS = ["PathNormSGD", "ProxOptimizer", "LossScale(PathNormSGD)", "SGD"]


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_frozen_first_layer_reports_the_optimizers_pair(kind: str) -> None:
    model = frozen_first()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit_once(model, optimizer_of(kind, model), [PathNormMetrics()], (6,))
        got = metric_values(model)
    b, c = (model.get_layer(n).kernel.numpy() for n in ("d2", "d3"))
    sparsity, alive = pair_values(b, c)
    # No "no partner" warning at any epoch end; the pair the prox kills (Adam with lam = 4) is
    # warned about once (the callback, the end of fit and metric_values share the record).
    messages = [str(w.message) for w in caught]
    dead = [m for m in messages if "pair ('net/d2', 'net/d3') has no alive hidden unit" in m]
    assert messages == dead and len(dead) == (kind == "ProxOptimizer"), messages
    assert (alive == 0) == (kind == "ProxOptimizer")
    if kind != "SGD":
        assert model.optimizer is not None
        assert sparsity > 0  # the prox zeroed entries of (b, c) ...
        assert np.count_nonzero(model.get_layer("d1").kernel.numpy()) == 6 * 8  # ... not of a
    assert got["pathnorm/sparsity"] == pytest.approx(sparsity, rel=1e-12)
    assert got["pathnorm/alive_units"] == pytest.approx(alive, rel=1e-12)
    assert history.history["pathnorm/sparsity"][-1] == pytest.approx(sparsity, rel=1e-12)
    # The bounds still cover the whole Dense chain, the frozen layer included.
    want = direct([layer.kernel.numpy() for layer in model.layers], [(1, 2)])
    assert got["pathnorm/path_norm_bound"] == pytest.approx(want["pathnorm/path_norm_bound"])
    assert got["pathnorm/product_bound"] == pytest.approx(want["pathnorm/product_bound"])


def test_explicit_metric_pairs_resolve_over_trained_layers() -> None:
    model = frozen_first()
    with pytest.raises(
        ValueError, match=r"no trained Dense/Conv1D/Conv2D layer named 'd1'.*frozen layers"
    ):
        metric_values(model, pairs=[("d1", "d2")])
    got = metric_values(model, pairs=[("d2", "d3")])
    b, c = (model.get_layer(n).kernel.numpy() for n in ("d2", "d3"))
    assert got["pathnorm/sparsity"] == pytest.approx(pair_values(b, c)[0], rel=1e-12)


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
@pytest.mark.parametrize("kind", ["SimpleRNN", "LSTM", "GRU"])
@pytest.mark.parametrize("optimizer", ["PathNormSGD", "SGD"])
def test_recurrent_model_reports_the_dense_pair(kind: str, optimizer: str) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3, 4)),
            getattr(keras.layers, kind)(5, name="rnn"),
            keras.layers.Dense(5, activation="elu", name="d1"),
            keras.layers.Dense(3, name="d2"),
        ],
        name="net",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_once(model, optimizer_of(optimizer, model), [], (3, 4))
        got = metric_values(model)
    if optimizer == "PathNormSGD":
        assert model.optimizer.regularized_pairs == [("net/d1/kernel", "net/d2/kernel")]
    d1, d2 = (model.get_layer(n).kernel.numpy() for n in ("d1", "d2"))
    sparsity, alive = pair_values(d1, d2)
    assert got["pathnorm/sparsity"] == pytest.approx(sparsity, rel=1e-12)
    assert got["pathnorm/alive_units"] == pytest.approx(alive, rel=1e-12)
    assert (sparsity > 0) == (optimizer == "PathNormSGD")


def test_baseline_optimizer_reports_its_kernels() -> None:
    # l1 on d2 and d3 only: sparsity over those two kernels, alive units of the d2 -> d3 units.
    model = mlp((8, 8, 3))
    opt = ProxOptimizer(keras.optimizers.SGD(0.5), regularizer="l1", lam=0.3, layers=["d2", "d3"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_once(model, opt, [], (6,))
        got = metric_values(model)
    b, c = (model.get_layer(n).kernel.numpy() for n in ("d2", "d3"))
    sparsity, alive = pair_values(b, c)
    assert sparsity > 0
    assert got["pathnorm/sparsity"] == pytest.approx(sparsity, rel=1e-12)
    assert got["pathnorm/alive_units"] == pytest.approx(alive, rel=1e-12)


def test_baseline_on_layers_that_are_not_adjacent_has_no_hidden_units() -> None:
    # d1 (6, 8) and d3 (8, 3) chain by shape, but d2 lies between them: no units to count.
    model = mlp((8, 8, 3))
    sparsify(model)
    model.compile(
        ProxOptimizer(keras.optimizers.SGD(0.1), regularizer="l1", lam=0.1, layers=["d3", "d1"]),
        "mse",
    )
    got = metric_values(model)
    a, c = (model.get_layer(n).kernel.numpy() for n in ("d1", "d3"))
    assert "pathnorm/alive_units" not in got
    want = (np.sum(a == 0) + np.sum(c == 0)) / (a.size + c.size)
    assert got["pathnorm/sparsity"] == pytest.approx(want, rel=1e-12)


def test_metrics_before_the_optimizer_is_built_resolve_as_it_will() -> None:
    model = frozen_first()
    sparsify(model)  # zeros in every kernel, unit 1 of the frozen d1 dead
    model.compile(PathNormSGD(0.1, lam=0.1), "mse")
    assert not model.optimizer.built
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = metric_values(model)
    b, c = (model.get_layer(n).kernel.numpy() for n in ("d2", "d3"))
    sparsity, alive = pair_values(b, c)
    assert got["pathnorm/sparsity"] == pytest.approx(sparsity, rel=1e-12)
    assert got["pathnorm/alive_units"] == pytest.approx(alive, rel=1e-12)
    a = model.get_layer("d1").kernel.numpy()
    assert pair_values(a, b) != (sparsity, alive)  # the frozen pair would read differently


# --- explicit names on a reloaded model (its variable paths lose the outer model names) --------


def _reloaded(model: keras.Model, opt: Any, path: Path) -> keras.Model:
    fit_once(model, opt, [], (6,))
    model.save(path)
    return keras.models.load_model(path)


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
@pytest.mark.parametrize("optimizer", ["PathNormSGD", "SGD"])
def test_prefixed_metric_pairs_after_save_and_load(optimizer: str, tmp_path: Path) -> None:
    model = mlp((8, 8, 3))  # paths net/d1, net/d2, net/d3; reloaded: d1, d2, d3
    resumed = _reloaded(model, optimizer_of(optimizer), tmp_path / "m.keras")
    assert resumed.get_layer("d2").kernel.path == "d2/kernel"  # not "net/d2/kernel"
    rng = np.random.default_rng(1)
    history = resumed.fit(
        rng.standard_normal((8, 6)),
        rng.integers(0, 3, 8),
        verbose=0,
        callbacks=[PathNormMetrics(pairs=[("net/d2", "net/d3")])],
    )
    b, c = (resumed.get_layer(n).kernel.numpy() for n in ("d2", "d3"))
    sparsity, alive = pair_values(b, c)
    assert history.history["pathnorm/sparsity"][-1] == pytest.approx(sparsity, rel=1e-12)
    assert history.history["pathnorm/alive_units"][-1] == pytest.approx(alive, rel=1e-12)
    assert (sparsity > 0) == (optimizer == "PathNormSGD")


def _same_names() -> keras.Model:  # enc/h, net/h, net/out; reloaded: h, h, out
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense
    enc = keras.Sequential([keras.Input((6,)), dense(8, name="h")], name="enc")
    return keras.Sequential(
        [keras.Input((6,)), enc, dense(8, name="h"), dense(3, name="out")], name="net"
    )


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
def test_metric_pairs_of_the_optimizer_on_a_reloaded_model_with_same_names(
    tmp_path: Path,
) -> None:
    # After reload both "h" layers have the path "h/kernel": "net/h" alone is ambiguous, but
    # the metrics take the optimizer's pairs when they are the optimizer's names.
    pairs = [("net/h", "net/out")]
    model = _same_names()
    resumed = _reloaded(model, PathNormSGD(0.5, lam=0.4, pairs=pairs), tmp_path / "m.keras")
    got = metric_values(resumed, pairs=pairs)
    h, out = resumed.layers[1].kernel.numpy(), resumed.layers[2].kernel.numpy()
    sparsity, alive = pair_values(h, out)
    assert sparsity > 0
    assert got["pathnorm/sparsity"] == pytest.approx(sparsity, rel=1e-12)
    assert got["pathnorm/alive_units"] == pytest.approx(alive, rel=1e-12)
    with pytest.raises(ValueError, match=r"'net/h' is ambiguous"):
        metric_values(resumed, pairs=[("net/h", "out")])


# --- convolution units: the same values as the torch metrics, from the same weights ----------


def _cnn(head: bool) -> keras.Model:
    """``c1 -> pool -> c2 (-> Flatten -> d1 -> d2)`` in float64, weights with zeros; channel 1
    of ``c1`` has no incoming weight (dead). Without the head the chain ends with ``c2``."""
    keras.utils.set_random_seed(5)
    layers: list[Any] = [
        keras.Input((8, 9, 2)),
        keras.layers.Conv2D(3, (2, 3), activation="elu", name="c1", dtype="float64"),
        keras.layers.MaxPooling2D(2, dtype="float64"),  # (3, 3, 3)
        keras.layers.Conv2D(4, 2, padding="same", name="c2", dtype="float64"),  # s = 9
    ]
    if head:
        layers += [
            keras.layers.Flatten(dtype="float64"),
            keras.layers.Dense(5, name="d1", dtype="float64"),
            keras.layers.Dense(3, name="d2", dtype="float64"),
        ]
    model = keras.Sequential(layers, name="net")
    rng = np.random.default_rng(7)
    for layer in model.layers:
        if layer.weights:
            k = rng.normal(size=tuple(layer.kernel.shape))
            k[rng.random(k.shape) < 0.3] = 0.0
            layer.kernel.assign(k)
    k = model.get_layer("c1").kernel.numpy()
    k[..., 1] = 0.0
    model.get_layer("c1").kernel.assign(k)
    return model


def _torch_weight(kernel: np.ndarray, channels: int = 0) -> Any:
    """A Keras kernel in torch layout: a convolution's (C_out, C_in, *k); a Dense kernel's
    transpose, after a channels-last Flatten of ``channels`` channels with its columns in
    torch's channels-first order."""
    torch = pytest.importorskip("torch")
    if kernel.ndim > 2:
        w = np.moveaxis(kernel, (-1, -2), (0, 1))
    elif channels:
        w = (
            kernel.reshape(-1, channels, kernel.shape[1])
            .transpose(2, 1, 0)
            .reshape(kernel.shape[1], -1)
        )
    else:
        w = kernel.T
    return torch.from_numpy(np.ascontiguousarray(w))


@pytest.mark.parametrize("head", [True, False], ids=["conv-flatten-dense", "ends-with-conv"])
def test_conv_values_equal_the_torch_metrics_from_the_same_weights(head: bool) -> None:
    metrics = pytest.importorskip("pathnorm_lightning.metrics")
    torch_layers = pytest.importorskip("pathnorm_lightning.layers")
    torch = pytest.importorskip("torch")
    model = _cnn(head)
    names = ["c1", "c2", "d1", "d2"] if head else ["c1", "c2"]
    kernels = [model.get_layer(n).kernel.numpy() for n in names]
    weights = [_torch_weight(k, 4 if n == "d1" else 0) for n, k in zip(names, kernels, strict=True)]
    conv = torch.nn.Conv2d(3, 4, 2, padding="same")
    reuse = 1 if head else torch_layers.entry_of(conv).reuse(conv, (3, 3))
    sparsity, bound, prod = metrics.Sparsity(), metrics.PathNormBound(), metrics.ProductBound()
    for pair in (weights[:2], weights[2:]) if head else (weights,):
        sparsity.update(pair)
    bound.update(weights, reuse=reuse)
    prod.update(weights, reuse=reuse)
    got = metric_values(model)
    want = sparsity.compute()
    assert reuse == (1 if head else 9)  # "same" pads at the end: tap 0 reads 3 x 3 outputs
    assert got["pathnorm/sparsity"] == pytest.approx(float(want["sparsity"]), rel=1e-12)
    assert got["pathnorm/alive_units"] == pytest.approx(float(want["alive_units"]), rel=1e-12)
    assert got["pathnorm/alive_units"] < 1.0  # channel 1 of c1 is dead
    assert got["pathnorm/path_norm_bound"] == pytest.approx(float(bound.compute()), rel=1e-12)
    assert got["pathnorm/product_bound"] == pytest.approx(float(prod.compute()), rel=1e-12)
    assert got["pathnorm/product_bound"] > got["pathnorm/path_norm_bound"] > 0


# --- the network bounds only where the model's graph confirms the chain -----------------------


class _CreatedOutOfOrder(keras.Model):  # layers created in another order than call() runs them
    def __init__(self) -> None:
        super().__init__()
        self.out_layer, self.hidden = keras.layers.Dense(4), keras.layers.Dense(8)

    def call(self, x: Any) -> Any:
        return self.out_layer(self.hidden(x))


def _not_a_chain(case: str) -> keras.Model:
    """Networks whose Dense layers chain by shape and layer order, but not in the graph."""
    keras.utils.set_random_seed(0)
    dense, inp = keras.layers.Dense, keras.Input((4,))
    if case == "residual":  # d1 -> d2, + the input, -> d3
        h = dense(4, name="d2")(dense(4, name="d1")(inp))
        return keras.Model(inp, dense(1, name="d3")(keras.layers.Add()([h, inp])))
    if case == "branches":  # a(x) + b(x) -> c
        a, b = dense(4, name="a")(inp), dense(4, name="b")(inp)
        return keras.Model(inp, dense(1, name="c")(keras.layers.Add()([a, b])))
    if case == "shared":  # s -> t -> s -> o
        s, t = dense(4, name="s"), dense(4, name="t")
        return keras.Model(inp, dense(1, name="o")(s(t(s(inp)))))
    model = _CreatedOutOfOrder()
    model(np.zeros((1, 4), "float32"))
    return model


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("residual", "the graph does not show 'd3' reading exactly the outputs of 'd2'"),
        ("branches", "the graph does not show 'b' reading exactly the outputs of 'a'"),
        ("shared", "the model calls 's' 2 times (a shared layer)"),
        ("subclassed", "the model has no graph (a subclassed model)"),
    ],
)
def test_network_bounds_only_where_the_graph_confirms_the_chain(case: str, why: str) -> None:
    # Before, these networks' bounds were reported from the layer order and the shapes alone,
    # below their Lipschitz constants (residual: 0.24 vs 3.25), without a word.
    model, callback, logs = _not_a_chain(case), PathNormMetrics(every_n_batches=1), {}
    callback.set_model(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = metric_values(model)
        for epoch in range(2):  # the callback warns once, not every epoch (nor batch)
            callback.on_train_batch_end(0, logs)
            callback.on_epoch_end(epoch, logs)
    assert set(got) == set(logs) == {"pathnorm/sparsity", "pathnorm/alive_units"}
    messages = [str(w.message) for w in caught if "do not form a chain" in str(w.message)]
    assert len(messages) == 2 and messages[0] == messages[1], messages
    assert why in messages[0], messages[0]
    assert "path_norm_bound and pathnorm/product_bound are not reported" in messages[0]


@pytest.mark.parametrize("flatten", ["GlobalAveragePooling2D", "Flatten"])
def test_chain_with_dropout_and_flatten_keeps_its_bounds(flatten: str) -> None:
    # c -> Dropout -> flatten -> d1 -> Dropout -> d2: bounds as before, without a warning.
    keras.utils.set_random_seed(2)
    conv, dense, drop = keras.layers.Conv2D, keras.layers.Dense, keras.layers.Dropout
    flat = getattr(keras.layers, flatten)()
    head = [flat, dense(6, activation="relu", name="d1"), drop(0.5), dense(2, name="d2")]
    model = keras.Sequential(
        [keras.Input((5, 5, 2)), conv(3, 2, activation="relu", name="c"), drop(0.5), *head]
    )  # c's output: (4, 4, 3)
    c, d1, d2 = (np.abs(model.get_layer(n).kernel.numpy()).astype(float) for n in ("c", "d1", "d2"))
    per_channel = c.reshape(-1, 3).sum(0)  # ||y_c||_1 over the taps and input channels
    d1_units = d1.reshape(-1, 3, 6).sum(0)  # d1 reads 16 positions per channel (GAP: 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = metric_values(model, pairs=[("d1", "d2")])  # (an odd "auto" chain warns)
    want_path = (per_channel @ d1_units @ d2).sum()
    want_prod = d2.sum() * per_channel.max() * d1.sum(0).max()
    assert got["pathnorm/path_norm_bound"] == pytest.approx(want_path, rel=1e-6)
    assert got["pathnorm/product_bound"] == pytest.approx(want_prod, rel=1e-6)


def _my_relu(x: Any) -> Any:
    return keras.ops.relu(x)


@pytest.mark.parametrize(
    ("where", "activation"),
    [
        ("own", lambda x: 4.0 * x),  # slope 4: the bound would be 4x too small
        ("own", lambda x: keras.ops.softmax(x, axis=-1)),  # mixes the units
        ("own", _my_relu),  # harmless, but not known to be
        ("layer", lambda x: 4.0 * x),
    ],
    ids=["own-scaled", "own-softmax", "own-user-function", "Activation-layer-scaled"],
)
def test_an_activation_that_is_not_a_keras_built_in_is_warned_and_drops_the_bounds(
    where: str, activation: Any
) -> None:
    # Before, any activation not named on a list counted as entry-wise of slope <= 1: a
    # lambda 4 * x gave a path_norm_bound of 57 for a network whose Lipschitz constant is 152.
    dense = keras.layers.Dense
    own = activation if where == "own" else None
    between = [keras.layers.Activation(activation)] if where == "layer" else []
    model = keras.Sequential(
        [keras.Input((6,)), dense(4, activation=own, name="a"), *between, dense(2, name="b")]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PathNormSGD(0.1, lam=1e-3, model=model).build(model.trainable_variables)
        got = metric_values(model)
    pairing = [str(w.message) for w in caught if "is not a Keras built-in" in str(w.message)]
    assert pairing and "The pair is proxed as if it did" in pairing[0], pairing
    assert set(got) == {"pathnorm/sparsity", "pathnorm/alive_units"}


@pytest.mark.parametrize("activation", ["relu", "swish", keras.activations.tanh, "linear"])
def test_built_in_activations_keep_the_bounds_without_that_warning(activation: Any) -> None:
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(4, activation=activation), keras.layers.Dense(2)]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PathNormSGD(0.1, lam=1e-3, model=model).build(model.trainable_variables)
        got = metric_values(model)
    assert not [w for w in caught if "is not a Keras built-in" in str(w.message)]
    assert "pathnorm/path_norm_bound" in got


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"), reason="keras.optimizers.MultiOptimizer is new"
)
def test_the_metrics_measure_what_a_path_norm_sgd_inside_a_multi_optimizer_regularizes() -> None:
    # PathNormSGD on d1 -> d2, Adam on d3 and d4: before, the callback did not look inside the
    # MultiOptimizer and paired the whole model (0.103 where the pair's sparsity was 0.16).
    keras.utils.set_random_seed(1)
    dense = keras.layers.Dense
    layers = [dense(8, "elu", name="d1"), dense(4, "elu", name="d2"), dense(4, "elu", name="d3")]
    model = keras.Sequential([keras.Input((6,)), *layers, dense(2, name="d4")], name="net")
    path_sgd = PathNormSGD(0.1, lam=0.5, model=model)
    mapping = keras.optimizers.OptimizerMap(keras.optimizers.Adam(0.01), {"net/d[12]/.*": path_sgd})
    model.compile(optimizer=keras.optimizers.MultiOptimizer(mapping), loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(32, 6)), rng.normal(size=(32, 2)), batch_size=8, verbose=0)
    k1, k2 = (model.get_layer(n).kernel.numpy() for n in ("d1", "d2"))
    assert (k1 == 0).any()  # the prox acted
    want = ((k1 == 0).sum() + (k2 == 0).sum()) / (k1.size + k2.size)
    assert metric_values(model)["pathnorm/sparsity"] == pytest.approx(want, rel=1e-12)


def _ema_fit(wrap: str, callbacks: list[Any]) -> tuple[keras.Model, Any, list[str]]:
    """Three epochs of a 6-8-3 model under ``PathNormSGD(use_ema=True)``; the warnings given."""
    model = mlp((8, 3))
    opt: Any = PathNormSGD(0.5, lam=0.1, model=model, use_ema=True, ema_momentum=0.9)
    if wrap == "LossScale":
        opt = keras.optimizers.LossScaleOptimizer(opt)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((32, 6)), rng.integers(0, 3, 32)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=callbacks)
    return model, history, [str(w.message) for w in caught if "use_ema" in str(w.message)]


def _listed(values: dict[str, float]) -> str:
    return ", ".join(f"{key}={value:.6g}" for key, value in values.items())


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
@pytest.mark.parametrize("wrap", ["none", "LossScale"])
def test_use_ema_warns_that_fit_returns_the_average_with_its_values(wrap: str) -> None:
    # Before: not a word, while the History's last entry (the proxed weights) was not the
    # model fit() returned (the average; the probe's 6-8-3 model: path-norm bound 0.404 and
    # sparsity 0.333 logged, 4.02 and 0.042 returned).
    callback = PathNormMetrics()
    model, history, messages = _ema_fit(wrap, [callback])
    last = {key: values[-1] for key, values in history.history.items() if "pathnorm/" in key}
    final = metric_values(model)
    assert final["pathnorm/sparsity"] < last["pathnorm/sparsity"] / 2  # the zeros are gone
    assert final["pathnorm/path_norm_bound"] > 2 * last["pathnorm/path_norm_bound"]
    assert len(messages) == 1, messages
    assert "fit() ended by writing the moving average of the weights into the model" in messages[0]
    assert f"The model fit() returns has {_listed(final)} " in messages[0]
    assert f"(the History's last entry: {_listed(last)});" in messages[0]
    assert "metric_values(model) gives these values" in messages[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(np.zeros((8, 6)), np.zeros(8), verbose=0, callbacks=[callback])
    assert metric_values(model) != callback._logged  # the average again, but warned once
    assert not [w for w in caught if "use_ema" in str(w.message)]


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
def test_use_ema_with_swapped_weights_logs_the_average_without_a_warning() -> None:
    # SwapEMAWeights(swap_on_epoch=True) before the callback: it logs the average fit returns.
    swap = keras.callbacks.SwapEMAWeights(swap_on_epoch=True)
    model, history, messages = _ema_fit("none", [swap, PathNormMetrics()])
    assert not messages
    for key, value in metric_values(model).items():
        assert history.history[key][-1] == value
