"""PathNormSGD and ProxOptimizer: step semantics, pairing, serialization, distribution, errors."""

from __future__ import annotations

import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import collections
import functools
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from pathnorm_tf import (
    NonFiniteWeightsError,
    PathNormSGD,
    ProxOptimizer,
    layers,
    path_norm,
    prox_path_norm,
)
from pathnorm_tf.functional import project_linf_operator_norm, prox_l1
from shared_spec import reference as ref

X_DIM, CLASSES, SAMPLES = 6, 3, 16


pytestmark = pytest.mark.usefixtures("float64_keras")  # from conftest.py


def mlp(sizes: tuple[int, ...] = (5, CLASSES), seed: int = 0, names: bool = False) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers: list[Any] = [keras.Input((X_DIM,))]
    for i, units in enumerate(sizes):
        last = i == len(sizes) - 1
        layers.append(
            keras.layers.Dense(
                units, activation=None if last else "elu", name=f"d{i + 1}" if names else None
            )
        )
    return keras.Sequential(layers, name="net")


def data(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((SAMPLES, X_DIM)), rng.integers(0, CLASSES, SAMPLES)


def loss_fn() -> keras.losses.Loss:
    # Created per test, under float64 floatx (a loss built under float32 computes in float32).
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def grads_of(model: keras.Model, x: np.ndarray, y: np.ndarray) -> list[tf.Tensor]:
    with tf.GradientTape() as tape:
        loss = loss_fn()(y, model(x))
    return tape.gradient(loss, model.trainable_variables)


def kernels(model: keras.Model) -> list[np.ndarray]:
    return [layer.kernel.numpy() for layer in model.layers]


def prox_first_pair(model: keras.Model, step: float) -> None:
    """The prox with ``step`` on the model's first two Dense kernels, by hand."""
    k_in, k_out = model.layers[0].kernel, model.layers[1].kernel
    new_in, new_out = prox_path_norm(k_in, k_out, step)
    k_in.assign(new_in)
    k_out.assign(new_out)


def reference_prox(
    k_in: np.ndarray, k_out: np.ndarray, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    v, w = ref.prox_path_norm(k_out, k_in.T, lam)
    return w.T, v


# --- step semantics --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("momentum", "nesterov", "jit_compile"),
    [(0.0, False, False), (0.0, False, True), (0.9, False, False), (0.9, True, True)],
)
def test_one_fit_step_is_prox_of_the_sgd_step(
    momentum: float, nesterov: bool, jit_compile: bool
) -> None:
    x, y = data()
    lr, lam = 0.5, 0.3
    plain, prox = mlp(), mlp()
    plain.compile(keras.optimizers.SGD(lr, momentum, nesterov), loss_fn(), jit_compile=jit_compile)
    opt = PathNormSGD(lr, lam=lam, momentum=momentum, nesterov=nesterov)
    prox.compile(opt, loss_fn(), jit_compile=jit_compile)
    plain.fit(x, y, batch_size=SAMPLES, epochs=1, verbose=0, shuffle=False)
    prox.fit(x, y, batch_size=SAMPLES, epochs=1, verbose=0, shuffle=False)
    # Golden values: the exhaustive NumPy reference applied to the plain SGD step.
    exp_in, exp_out = reference_prox(*kernels(plain), lam * lr)
    got_in, got_out = kernels(prox)
    np.testing.assert_allclose(got_in, exp_in, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got_out, exp_out, rtol=1e-12, atol=1e-14)
    assert np.count_nonzero(got_in == 0) > 0  # lam * lr is large enough to zero entries
    np.testing.assert_array_equal(prox.layers[0].bias.numpy(), plain.layers[0].bias.numpy())
    assert int(opt.iterations) == 1


def test_short_trajectory_with_momentum_matches_manual_loop() -> None:
    x, y = data()
    lr, lam, steps = 0.2, 0.1, 6
    model, manual = mlp(), mlp()
    opt = PathNormSGD(lr, lam=lam, momentum=0.5)
    sgd = keras.optimizers.SGD(lr, momentum=0.5)
    for _ in range(steps):
        opt.apply(grads_of(model, x, y), model.trainable_variables)
        sgd.apply(grads_of(manual, x, y), manual.trainable_variables)
        prox_first_pair(manual, lam * lr)
    for got, want in zip(model.get_weights(), manual.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
        np.testing.assert_array_equal(got == 0, want == 0)


def test_learning_rate_schedule_sets_the_prox_step() -> None:
    x, y = data()
    lam = 0.2
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    model, manual = mlp(), mlp()
    opt = PathNormSGD(schedule, lam=lam)
    for step in range(3):
        opt.apply(grads_of(model, x, y), model.trainable_variables)
        lr = 0.5 * 0.5**step
        for g, v in zip(grads_of(manual, x, y), manual.trainable_variables, strict=True):
            v.assign(v - lr * g)
        k_in, k_out = manual.layers[0].kernel, manual.layers[1].kernel
        new_in, new_out = prox_path_norm(k_in, k_out, lam * lr)
        k_in.assign(new_in)
        k_out.assign(new_out)
        for got, want in zip(model.get_weights(), manual.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_prox_optimizer_uses_the_rate_of_the_step_just_taken(inner: str) -> None:
    # The twin of the PathNormSGD schedule test: reading the rate after the inner step (the
    # next step's rate, half of this one here) would fail it.
    x, y = data()
    lam = 0.6
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    make = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[inner]
    model, manual = mlp(), mlp()
    opt, plain = ProxOptimizer(make(schedule), lam=lam), make(schedule)
    zeros = 0
    for step in range(3):
        opt.apply(grads_of(model, x, y), model.trainable_variables)
        plain.apply(grads_of(manual, x, y), manual.trainable_variables)
        prox_first_pair(manual, lam * 0.5 * 0.5**step)
        for got, want in zip(model.get_weights(), manual.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
            np.testing.assert_array_equal(got == 0, want == 0)
        zeros += sum(np.count_nonzero(k == 0) for k in kernels(model))
    assert zeros > 0  # the prox did something at some step


def test_prox_optimizer_refuses_a_loss_scale_optimizer_inside() -> None:
    # It would apply the prox on the steps the loss scaler skips (inf gradients) and on every
    # micro-batch under accumulation; the error names the nesting that works.
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=re.escape("LossScaleOptimizer(ProxOptimizer(...))")):
        ProxOptimizer(inner, lam=0.1)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_loss_scale_around_prox_optimizer_proxes_real_steps_only(accumulate: int) -> None:
    x, y = data()
    lr, lam = 0.5, 0.3
    model = mlp()
    steps = {"gradient_accumulation_steps": accumulate} if accumulate > 1 else {}
    opt = keras.optimizers.LossScaleOptimizer(
        ProxOptimizer(keras.optimizers.SGD(lr, **steps), lam=lam)
    )
    w0 = model.get_weights()
    bad = [tf.fill(g.shape, tf.constant(np.inf, g.dtype)) for g in grads_of(model, x, y)]
    opt.apply(bad, model.trainable_variables)  # skipped by the loss scaler: no step, no prox
    for got, want in zip(model.get_weights(), w0, strict=True):
        np.testing.assert_array_equal(got, want)
    scale = float(opt.dynamic_scale)
    grads = [g * scale for g in grads_of(model, x, y)]  # as a scaled loss would give them
    for _ in range(accumulate):
        opt.apply(grads, model.trainable_variables)
    stepped = [w - lr * g.numpy() / scale for w, g in zip(w0, grads, strict=True)]
    exp_in, exp_out = reference_prox(stepped[0], stepped[2], lam * lr)
    got = model.get_weights()
    np.testing.assert_allclose(got[0], exp_in, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got[2], exp_out, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("wrapped", [False, True])
def test_gradient_accumulation_applies_the_prox_once_per_real_step(wrapped: bool) -> None:
    x, y = data()
    lr, lam = 0.5, 0.3
    model = mlp()
    if wrapped:
        opt: Any = ProxOptimizer(keras.optimizers.SGD(lr, gradient_accumulation_steps=2), lam=lam)
    else:
        opt = PathNormSGD(lr, lam=lam, gradient_accumulation_steps=2)
    w0 = model.get_weights()
    g1 = grads_of(model, x[:8], y[:8])
    opt.apply(g1, model.trainable_variables)
    for got, want in zip(model.get_weights(), w0, strict=True):  # accumulation only
        np.testing.assert_array_equal(got, want)
    g2 = grads_of(model, x[8:], y[8:])
    opt.apply(g2, model.trainable_variables)
    stepped = [w - lr * (a.numpy() + b.numpy()) / 2 for w, a, b in zip(w0, g1, g2, strict=True)]
    exp_in, exp_out = reference_prox(stepped[0], stepped[2], lam * lr)
    got = model.get_weights()
    np.testing.assert_allclose(got[0], exp_in, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got[2], exp_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got[1], stepped[1], rtol=1e-12)
    # A third micro-batch: accumulation again, the weights (and their zeros) stay put.
    opt.apply(grads_of(model, x[:8], y[:8]), model.trainable_variables)
    for a, b in zip(model.get_weights(), got, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(opt.iterations) == 1


def test_fit_with_accumulation_and_xla() -> None:
    x, y = data()
    a, b = mlp(), mlp()
    a.compile(PathNormSGD(0.5, lam=0.1, gradient_accumulation_steps=2), loss_fn(), jit_compile=True)
    b.compile(
        PathNormSGD(0.5, lam=0.1, gradient_accumulation_steps=2), loss_fn(), jit_compile=False
    )
    for m in (a, b):
        m.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    assert int(a.optimizer.iterations) == int(b.optimizer.iterations) == 2
    for u, v in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-10, atol=1e-13)


# The prox acts on the variables of *this* step: a layer frozen after the optimizer was built
# (then compile again, as Keras requires) is left alone, in every mode the step runs in. Two
# pairs (d1, d2), (d3, d4) where the step is cheap, else one pair (d1, d2), whose second step
# has no prox left to compile. The optimizer is built by a first fit (its step traced with
# every layer trained, then traced again after compile), or (PathNormSGD under XLA: no prox
# compile at all) by verify_pairs.
FROZEN_CASES = [
    ("PathNormSGD", "xla", (5, CLASSES), "build"),
    ("PathNormSGD", "eager", (5, 4, 5, CLASSES), "fit"),
    ("ProxOptimizer", "graph", (5, CLASSES), "fit"),
    ("ProxOptimizer", "eager", (5, 4, 5, CLASSES), "fit"),
    ("ProxOptimizer(l1)", "xla", (5, 4, 5, CLASSES), "fit"),
]


@pytest.mark.parametrize(("kind", "mode", "sizes", "first"), FROZEN_CASES)
def test_a_layer_frozen_after_build_is_left_alone(
    kind: str, mode: str, sizes: tuple[int, ...], first: str
) -> None:
    # Before, the prox acted on the variables the optimizer was built with: the frozen d1
    # (pair (d1, d2)) changed although plain SGD leaves it alone.
    x, y = data()
    lr, lam = 0.5, 0.3
    model, manual = mlp(sizes, names=True), mlp(sizes, names=True)
    inner = keras.optimizers.SGD(lr)
    opt: Any = {
        "PathNormSGD": lambda: PathNormSGD(lr, lam=lam),
        "ProxOptimizer": lambda: ProxOptimizer(inner, lam=lam),
        "ProxOptimizer(l1)": lambda: ProxOptimizer(inner, lam=lam, regularizer="l1"),
    }[kind]()
    how = {"run_eagerly": True} if mode == "eager" else {"jit_compile": mode == "xla"}
    if first == "fit":
        model.compile(opt, loss_fn(), **how)
        model.fit(x, y, batch_size=SAMPLES, epochs=1, verbose=0)
    else:
        opt.verify_pairs(model)
    for m in (model, manual):
        m.set_weights(model.get_weights())
        m.layers[0].trainable = False
    model.compile(opt, loss_fn(), **how)  # the same optimizer
    frozen = model.layers[0].get_weights()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=SAMPLES // 2, epochs=1, verbose=0, shuffle=False)
    for batch in (slice(0, SAMPLES // 2), slice(SAMPLES // 2, None)):  # the same two steps
        grads = grads_of(manual, x[batch], y[batch])
        for g, v in zip(grads, manual.trainable_variables, strict=True):
            v.assign(v - lr * g)
        if kind.endswith("(l1)"):
            for layer in manual.layers[1:]:
                layer.kernel.assign(prox_l1(layer.kernel, lam * lr))
        elif len(sizes) == 4:  # (d1, d2) is half frozen: skipped; (d3, d4) proxed
            k_in, k_out = manual.layers[2].kernel, manual.layers[3].kernel
            new_in, new_out = prox_path_norm(k_in, k_out, lam * lr)
            k_in.assign(new_in)
            k_out.assign(new_out)
    for got, want in zip(model.layers[0].get_weights(), frozen, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(model.get_weights(), manual.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
        np.testing.assert_array_equal(got == 0, want == 0)
    if len(sizes) == 4:
        assert np.count_nonzero(model.layers[2].kernel.numpy() == 0) > 0  # a prox that zeroes
    half = [str(w.message) for w in caught if "half frozen" in str(w.message)]
    if kind.endswith("(l1)"):
        assert half == []
    else:  # once, naming the pair, however many steps and traces
        assert len(half) == 1, half
        assert "pair ('net/d1', 'net/d2') is half frozen" in half[0]


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
def test_model_variables_are_not_optimizer_variables() -> None:
    x, y = data()
    model = mlp((5, 4, 4, CLASSES))
    opt = PathNormSGD(0.1, lam=0.01, momentum=0.9)
    plain = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(opt, loss_fn())
    model.fit(x, y, epochs=1, verbose=0)
    plain.build(model.trainable_variables)
    assert len(opt.variables) == len(plain.variables)
    model_ids = {id(v) for v in model.variables}
    assert not any(id(v) in model_ids for v in opt.variables)
    assert not any(v.path in {w.path for w in model.variables} for v in opt.variables)


# --- pairing -----------------------------------------------------------------------------------


def test_auto_pairs_consecutive_dense_layers_and_warns_for_the_last() -> None:
    model = mlp((5, 4, 4, CLASSES), names=True)
    opt = PathNormSGD(0.1, lam=0.01)
    opt.build(model.trainable_variables)
    assert opt.regularized_pairs == [
        ("net/d1/kernel", "net/d2/kernel"),
        ("net/d3/kernel", "net/d4/kernel"),
    ]
    odd = mlp((5, 4, CLASSES), names=True)
    with pytest.warns(UserWarning, match="last layer 'net/d3' has no partner"):
        PathNormSGD(0.1, lam=0.01).build(odd.trainable_variables)


def test_explicit_pairs_by_name_and_by_layer() -> None:
    model = mlp((5, 4, 4, CLASSES), names=True)
    opt = PathNormSGD(0.1, lam=0.01, pairs=[("d2", "net/d3")])
    opt.build(model.trainable_variables)
    assert opt.regularized_pairs == [("net/d2/kernel", "net/d3/kernel")]
    opt = PathNormSGD(0.1, lam=0.01, pairs=[(model.layers[0], model.layers[1])])
    assert opt.get_config()["pairs"] == [["d1", "d2"]]
    opt.build(model.trainable_variables)
    assert opt.regularized_pairs == [("net/d1/kernel", "net/d2/kernel")]
    # Only the named pair moves under the prox: d3 -> d4 keep their plain SGD values.
    x, y = data()
    before = model.get_weights()
    grads = grads_of(model, x, y)
    opt.apply(grads, model.trainable_variables)
    for i in (4, 6):
        np.testing.assert_allclose(model.get_weights()[i], before[i] - 0.1 * grads[i].numpy())


def _build(opt: Any, model: keras.Model) -> None:
    opt.build(model.trainable_variables)


def _conv_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 2)),
            keras.layers.Conv1D(4, 3, name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(5, name="d1"),
            keras.layers.Dense(3, name="d2"),
        ]
    )


def _branchy_model() -> keras.Model:
    inp = keras.Input((X_DIM,))
    a = keras.layers.Dense(5, name="a")(inp)
    b = keras.layers.Dense(4, name="b")(inp)
    return keras.Model(inp, keras.layers.Concatenate()([a, b]))


def _frozen_model() -> keras.Model:
    model = mlp((5, 4, CLASSES), names=True)
    model.layers[0].trainable = False
    return model


def _between_model(kind: str) -> keras.Model:
    """``d1 -> (something) -> d3`` whose Dense sizes chain, so only the layer between can tell
    "auto" that d1 and d3 are no shallow network."""
    keras.utils.set_random_seed(0)
    middle: Any = {
        "frozen dense": keras.layers.Dense(4, name="d2"),
        "frozen kernel": keras.layers.Dense(4, name="d2"),
        "batchnorm": keras.layers.BatchNormalization(name="bn"),
        "frozen batchnorm": keras.layers.BatchNormalization(name="bn"),
        "layernorm": keras.layers.LayerNormalization(name="ln"),
    }[kind]
    layers = [keras.layers.Dense(4, name="d1"), middle, keras.layers.Dense(4, name="d3")]
    model = keras.Sequential([keras.Input((X_DIM,)), *layers], name="net")
    if kind in ("frozen dense", "frozen batchnorm"):
        middle.trainable = False
    if kind == "frozen kernel":
        middle.kernel.trainable = False
    return model


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("frozen dense", "the frozen Dense 'd2' lies between them"),
        ("frozen kernel", r"the layer 'net/d2' \(it trains \['net/d2/bias'\]\) lies between"),
        ("batchnorm", r"the layer 'net/bn' \(it trains \['net/bn/gamma', 'net/bn/beta'\]\)"),
        ("frozen batchnorm", "the frozen BatchNormalization 'bn' lies between them"),
        ("layernorm", r"the layer 'net/ln' \(it trains"),
    ],
)
def test_auto_does_not_pair_across_a_layer_between(kind: str, match: str) -> None:
    # Before, "auto" paired d1 with d3 here: a frozen layer, or one whose maps are not Dense,
    # breaks the chain (as on the torch side). Explicit pairs stay the user's choice.
    x, y = data()
    model = _between_model(kind)
    model.compile(PathNormSGD(0.1, lam=0.1, model=model), loss_fn())
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, epochs=1, verbose=0)
    model = _between_model(kind)
    opt = PathNormSGD(0.1, lam=0.1, pairs=[("d1", "d3")])
    model.compile(opt, loss_fn())
    model.fit(x, y, epochs=1, verbose=0)
    assert opt.regularized_pairs == [("net/d1/kernel", "net/d3/kernel")]


class _CallOrder(keras.Model):
    """A subclassed model: no graph shows that ``call`` runs ``a`` then ``b``."""

    def __init__(self) -> None:
        super().__init__(name="net")
        self.a = keras.layers.Dense(4, name="a")
        self.b = keras.layers.Dense(CLASSES, name="b")

    def call(self, x: Any) -> Any:
        return self.b(self.a(x))


def _through(layer: keras.layers.Layer) -> keras.Model:
    inp = keras.Input((X_DIM,))
    out = keras.layers.Dense(CLASSES, name="b")(layer(keras.layers.Dense(4, name="a")(inp)))
    return keras.Model(inp, out, name="net")


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
@pytest.mark.parametrize(
    ("make", "confirmed"),
    [
        (lambda: mlp((4, CLASSES), names=True), True),
        (lambda: _through(keras.layers.Dropout(0.1)), True),
        (lambda: _through(keras.layers.Activation("elu")), True),
        (lambda: _through(keras.layers.Activation("softmax")), False),  # mixes the units
        (_CallOrder, False),
    ],
    ids=["sequential", "dropout", "elu", "softmax", "subclassed"],
)
def test_auto_warns_where_the_model_graph_does_not_confirm_a_pair(
    make: Any, confirmed: bool
) -> None:
    x, y = data()
    model = make()
    model.compile(PathNormSGD(0.1, lam=0.1, model=model), loss_fn())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, epochs=1, verbose=0)
    unconfirmed = [w for w in caught if "does not confirm them" in str(w.message)]
    assert len(unconfirmed) == (0 if confirmed else 1), [str(w.message) for w in caught]


def test_auto_refuses_a_pair_whose_first_layer_applies_softmax() -> None:
    # Before, Dense(activation="softmax") -> Dense was paired without a word (a Softmax layer
    # between them was not confirmed): the softmax mixes the units, no shallow network.
    inp = keras.Input((X_DIM,))
    hidden = keras.layers.Dense(4, activation="softmax", name="a")(inp)
    model = keras.Model(inp, keras.layers.Dense(CLASSES, name="b")(hidden))
    with pytest.raises(ValueError, match="'a' applies softmax to its outputs, which mixes"):
        model.compile(PathNormSGD(0.1, lam=0.1, model=model), loss_fn())
        model.fit(*data(), epochs=1, verbose=0)


def test_auto_refuses_a_pair_with_a_shared_layer() -> None:
    # Before, s1 -> s2 -> s1 (s1 called twice) was paired (s1, s2) without a word: s1 is also
    # the layer after s2, so the pair is no shallow network. A pair called together twice (a
    # Siamese encoder) is one, and stays accepted.
    inp = keras.Input((X_DIM,))
    s1, s2 = keras.layers.Dense(4, name="s1"), keras.layers.Dense(X_DIM, name="s2")
    shared = keras.Model(inp, s1(s2(s1(inp))), name="net")
    with pytest.raises(ValueError, match=r"'s1' is shared \(the model calls 's1' 2 times and"):
        PathNormSGD(0.1, lam=0.1).verify_pairs(shared)
    opt = PathNormSGD(0.1, lam=0.1, pairs=[("s1", "s2")])  # named: the user's choice
    opt.verify_pairs(shared)
    assert opt.regularized_pairs == [("s1/kernel", "s2/kernel")]
    left, right = keras.Input((X_DIM,)), keras.Input((X_DIM,))
    e1, e2 = keras.layers.Dense(4, name="e1"), keras.layers.Dense(2, name="e2")
    out = keras.layers.Add()([e2(e1(left)), e2(e1(right))])
    siamese = keras.Model([left, right], out, name="net")
    opt = PathNormSGD(0.1, lam=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.verify_pairs(siamese)
    assert opt.regularized_pairs == [("e1/kernel", "e2/kernel")]


def test_custom_loop_warns_unless_verify_pairs_shows_the_model() -> None:
    # The optimizer alone sees trained variables only: a frozen d2 between d1 and d3 is
    # invisible to it, so "auto" would pair d1 with d3. verify_pairs(model) shows the model.
    model = _between_model("frozen dense")
    unseen = PathNormSGD(0.1, lam=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # built unseen (as load_model builds): no warning yet
        unseen.build(model.trainable_variables)
    zeros = [tf.zeros_like(v) for v in model.trainable_variables]
    with pytest.warns(UserWarning, match=r"without seeing the model.*verify_pairs\(model\)"):
        unseen.apply(zeros, model.trainable_variables)  # the first step warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unseen.apply(zeros, model.trainable_variables)  # once
    shown = mlp((4, CLASSES), names=True)
    late = PathNormSGD(0.1, lam=0.1)
    late.build(shown.trainable_variables)
    late.verify_pairs(shown)  # shown after the build (a reloaded optimizer): no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        late.apply([tf.zeros_like(v) for v in shown.trainable_variables], shown.trainable_variables)
    with pytest.raises(ValueError, match="the frozen Dense 'd2' lies between them"):
        PathNormSGD(0.1, lam=0.1).verify_pairs(model)
    model = mlp((4, CLASSES), names=True)
    opt = PathNormSGD(0.1, lam=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.verify_pairs(model)
    assert opt.built and opt.regularized_pairs == [("net/d1/kernel", "net/d2/kernel")]
    with pytest.raises(TypeError, match=r"verify_pairs takes the keras\.Model"):
        opt.verify_pairs(model.trainable_variables)
    # model= at construction shows the model as verify_pairs does (no stack walk: explicit)
    frozen = _between_model("frozen dense")
    with pytest.raises(ValueError, match="the frozen Dense 'd2' lies between them"):
        PathNormSGD(0.1, lam=0.1, model=frozen).build(frozen.trainable_variables)
    with pytest.raises(ValueError, match=r"was given model 'net', but trains variables it does"):
        PathNormSGD(0.1, lam=0.1, model=mlp()).build(model.trainable_variables)
    with pytest.raises(TypeError, match=r"model must be the keras\.Model being trained"):
        PathNormSGD(0.1, lam=0.1, model=model.trainable_variables)


PAIRING_ERRORS = [
    (
        lambda: mlp(names=True),
        [("d1", "nope")],
        "no trained Dense/Conv1D/Conv2D layer named 'nope'",
    ),
    (
        _conv_model,
        [("conv", "d1")],
        r"'sequential.*/conv/kernel' \(3, 2, 4\) is a 3-D kernel.*"
        r"built without seeing the model. Call optimizer.verify_pairs\(model\)",
    ),
    (lambda: mlp((5, 4, CLASSES), names=True), [("d1", "d3")], "do not chain: 'd1' has 5 units"),
    (
        lambda: mlp((5, 5, 5, CLASSES), names=True),
        [("d1", "d2"), ("d2", "d3")],
        "layer 'd2' appears in two pairs",
    ),
    (_branchy_model, "auto", r"pairs=\"auto\": layers 'a' -> 'b' do not chain: 'a' has 5 units"),
    (lambda: mlp((CLASSES,)), "auto", "fewer than two trained Dense/Conv1D/Conv2D kernels"),
    (
        _frozen_model,
        [("d1", "d2")],
        "no trained Dense/Conv1D/Conv2D layer named 'd1'.*frozen layers",
    ),
]


@pytest.mark.parametrize(("make", "pairs", "match"), PAIRING_ERRORS)
def test_pairing_errors(make: Any, pairs: Any, match: str) -> None:
    model = make()
    with pytest.raises(ValueError, match=match):
        _build(PathNormSGD(0.1, lam=0.01, pairs=pairs), model)


def test_pairing_error_surfaces_in_fit() -> None:
    model = mlp(names=True)
    model.compile(PathNormSGD(0.1, lam=0.01, pairs=[("d1", "typo")]), loss_fn())
    with pytest.raises(ValueError, match="no trained Dense/Conv1D/Conv2D layer named 'typo'"):
        model.fit(*data(), epochs=1, verbose=0)


def test_ambiguous_name() -> None:
    inner = keras.Sequential([keras.Input((X_DIM,)), keras.layers.Dense(5, name="h")], name="enc")
    outer = keras.Sequential([keras.Input((X_DIM,)), inner, keras.layers.Dense(5, name="h")])
    names = [v.path for v in outer.trainable_variables if v.name == "kernel"]
    assert len(names) == 2
    with pytest.raises(ValueError, match="'h' is ambiguous"):
        _build(PathNormSGD(0.1, lam=0.01, pairs=[("h", "h")]), outer)


# --- recurrent and other non-Dense layers with a `kernel` variable ----------------------------

SEQ_LEN, SEQ_FEATURES = 3, 4


def _recurrent(kind: str, units: int = 5) -> keras.layers.Layer:
    layers = keras.layers
    make = {
        "SimpleRNN": lambda: layers.SimpleRNN(units, name="rnn"),
        "LSTM": lambda: layers.LSTM(units, name="rnn"),
        "GRU": lambda: layers.GRU(units, name="rnn"),
        "Bidirectional": lambda: layers.Bidirectional(layers.LSTM(units // 2 + 1), name="rnn"),
        "RNN(GRUCell)": lambda: layers.RNN(layers.GRUCell(units), name="rnn"),
        "StackedCells": lambda: layers.RNN(
            [layers.SimpleRNNCell(units), layers.LSTMCell(units)], name="rnn"
        ),
    }
    return make[kind]()


def rnn_mlp(kind: str, seed: int = 0) -> keras.Model:
    """``recurrent -> Dense d1 -> Dense d2``: the one Dense pair is (d1, d2)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((SEQ_LEN, SEQ_FEATURES)),
            _recurrent(kind),
            keras.layers.Dense(5, activation="elu", name="d1"),
            keras.layers.Dense(CLASSES, name="d2"),
        ],
        name="net",
    )


def rnn_kernels(model: keras.Model) -> list[np.ndarray]:
    return [v.numpy() for v in model.layers[0].trainable_variables if "kernel" in v.name]


RECURRENT_KINDS = ["SimpleRNN", "LSTM", "GRU", "Bidirectional", "RNN(GRUCell)", "StackedCells"]


@pytest.mark.parametrize("kind", RECURRENT_KINDS)
@pytest.mark.parametrize("wrapped", [False, True], ids=["PathNormSGD", "ProxOptimizer"])
def test_auto_pairs_skip_recurrent_layers(kind: str, wrapped: bool) -> None:
    model = rnn_mlp(kind)
    opt = ProxOptimizer(keras.optimizers.Adam(), lam=0.1) if wrapped else PathNormSGD(lam=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "has no partner" warning: d1 and d2 pair up
        opt.verify_pairs(model)
    assert opt.regularized_pairs == [("net/d1/kernel", "net/d2/kernel")]


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("kind", ["SimpleRNN", "LSTM", "GRU"])
def test_fit_proxes_the_dense_pair_and_never_the_recurrent_kernels(
    kind: str, jit_compile: bool
) -> None:
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((8, SEQ_LEN, SEQ_FEATURES)), rng.integers(0, CLASSES, 8)
    model = rnn_mlp(kind)
    before = rnn_kernels(model)
    # lam * lr = 5: every hidden unit of the Dense pair loses its column or its row (the
    # pair's path-norm becomes 0) in the first step.
    opt = PathNormSGD(0.5, lam=10.0)
    model.compile(opt, loss_fn(), jit_compile=jit_compile)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert opt.regularized_pairs == [("net/d1/kernel", "net/d2/kernel")]
    d1, d2 = model.get_layer("d1").kernel.numpy(), model.get_layer("d2").kernel.numpy()
    assert float(path_norm(d1, d2)) == 0
    assert np.all(np.all(d1 == 0, axis=0) | np.all(d2 == 0, axis=1))
    after = rnn_kernels(model)
    assert len(after) == 2  # kernel and recurrent_kernel
    for old, new in zip(before, after, strict=True):
        assert not np.array_equal(old, new)  # trained by SGD (the first step's gradient) ...
        assert np.count_nonzero(new) == new.size  # ... but never proxed: no exact zeros


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
def test_recurrent_model_saves_and_reloads_with_the_same_pairs(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((8, SEQ_LEN, SEQ_FEATURES)), rng.integers(0, CLASSES, 8)
    model = rnn_mlp("LSTM")
    model.compile(PathNormSGD(0.5, lam=10.0), loss_fn())
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    resumed = keras.models.load_model(tmp_path / "m.keras")
    # (A reloaded model's variable paths lose the model's name: "d1/kernel".)
    assert resumed.optimizer.regularized_pairs == [("d1/kernel", "d2/kernel")]
    resumed.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert all(np.count_nonzero(k) == k.size for k in rnn_kernels(resumed))


def _dense_rnn_dense() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((SEQ_LEN, SEQ_FEATURES)),
            keras.layers.Dense(5, name="d0"),
            keras.layers.SimpleRNN(5, name="rnn"),
            keras.layers.Dense(CLASSES, name="d1"),
        ],
        name="net",
    )


def test_auto_refuses_a_pair_across_a_recurrent_layer() -> None:
    # d0 (4, 5) and d1 (5, 3) chain by shape, but the RNN between them is no hidden layer.
    model = _dense_rnn_dense()
    with pytest.raises(
        ValueError,
        match=r"pairs=\"auto\": layers 'net/d0' -> 'net/d1' are not consecutive: the "
        r"recurrent layer 'net/rnn/simple_rnn_cell' lies between them.*pairs=\[\.\.\.\]",
    ):
        _build(PathNormSGD(0.1, lam=0.01), model)
    opt = PathNormSGD(0.1, lam=0.01, pairs=[("d0", "d1")])  # named explicitly: the user's choice
    opt.build(model.trainable_variables)
    assert opt.regularized_pairs == [("net/d0/kernel", "net/d1/kernel")]


@pytest.mark.parametrize(
    ("kind", "name", "match"),
    [
        ("SimpleRNN", "rnn", r"'rnn' is a SimpleRNN \(recurrent\) layer, not Dense/Conv1D/Conv2D"),
        ("LSTM", "rnn", r"'rnn' is an LSTM \(recurrent\) layer, not Dense/Conv1D/Conv2D"),
        ("GRU", "net/rnn", r"'net/rnn' is a GRU \(recurrent\) layer, not Dense/Conv1D/Conv2D"),
        (
            "Bidirectional",
            "rnn",
            r"'rnn' is an LSTM \(recurrent\) layer, not Dense/Conv1D/Conv2D: its cells",
        ),
        ("StackedCells", "rnn", r"'rnn' is a recurrent layer, not Dense/Conv1D/Conv2D: its cells"),
    ],
)
def test_naming_a_recurrent_layer_is_a_clear_error(kind: str, name: str, match: str) -> None:
    model = rnn_mlp(kind)
    full = match + r".*only Dense/Conv1D/Conv2D kernels can be regularized.*\['net/d1', 'net/d2'\]"
    with pytest.raises(ValueError, match=r"pairs: " + full):
        _build(PathNormSGD(0.1, lam=0.01, pairs=[(name, "d1")]), model)
    opt = ProxOptimizer(keras.optimizers.SGD(0.1), regularizer="l1", lam=0.1, layers=[name])
    with pytest.raises(ValueError, match=r"layers: " + full):
        opt.build(model.trainable_variables)


def test_unknown_name_lists_only_dense_layers() -> None:
    model = rnn_mlp("LSTM")
    with pytest.raises(
        ValueError, match=r"the ones this optimizer trains are \['net/d1', 'net/d2'\]\."
    ):
        _build(PathNormSGD(0.1, lam=0.01, pairs=[("d0", "d1")]), model)
    single = keras.Sequential(
        [keras.Input((SEQ_LEN, SEQ_FEATURES)), keras.layers.LSTM(4), keras.layers.Dense(3)]
    )
    with pytest.raises(
        ValueError, match=r"fewer than two trained Dense/Conv1D/Conv2D kernels .*recurrent"
    ):
        _build(PathNormSGD(0.1, lam=0.01), single)


def test_baselines_skip_recurrent_layers() -> None:
    model = rnn_mlp("GRU")
    opt = ProxOptimizer(keras.optimizers.SGD(0.5), regularizer="l1", lam=10.0)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, SEQ_LEN, SEQ_FEATURES)), rng.integers(0, CLASSES, 4)
    with tf.GradientTape() as tape:
        loss = loss_fn()(y, model(x))
    opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    assert opt.regularized_kernels == ["net/d1/kernel", "net/d2/kernel"]
    assert all(np.count_nonzero(k) == k.size for k in rnn_kernels(model))
    assert np.all(model.get_layer("d1").kernel.numpy() == 0)


def test_einsum_dense_with_a_2d_kernel_counts_as_dense() -> None:
    # The optimizer sees variables only: a 2-D EinsumDense kernel cannot be told from a Dense
    # one by name or shape, so it is paired (documented; for "ab,bc->ac" it *is* a Dense layer).
    model = keras.Sequential(
        [
            keras.Input((X_DIM,)),
            keras.layers.EinsumDense("ab,bc->ac", output_shape=5, name="e"),
            keras.layers.Dense(CLASSES, name="d"),
        ],
        name="net",
    )
    opt = PathNormSGD(0.1, lam=0.01)
    opt.build(model.trainable_variables)
    assert opt.regularized_pairs == [("net/e/kernel", "net/d/kernel")]
    with pytest.raises(
        ValueError, match="layer 'e' is a EinsumDense, not a Dense/Conv1D/Conv2D layer"
    ):
        PathNormSGD(0.1, lam=0.01, pairs=[(model.layers[0], "d")])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, TypeError, "PathNormSGD needs lam"),
        ({"lam": -1.0}, ValueError, "lam must be a finite number >= 0"),
        ({"lam": float("nan")}, ValueError, "lam must be a finite number >= 0"),
        ({"lam": "1e-3"}, TypeError, "lam must be a real number"),
        ({"lam": "a"}, TypeError, "lam must be a real number"),
        ({"lam": 1j}, TypeError, "lam must be a real number"),
        ({"lam": 0.1, "pairs": "all"}, ValueError, 'pairs must be "auto"'),
        ({"lam": 0.1, "pairs": []}, ValueError, "non-empty list"),
        ({"lam": 0.1, "pairs": [("a", "b", "c")]}, ValueError, r"\(first_layer, second_layer\)"),
        ({"lam": 0.1, "pairs": [("a", 3)]}, TypeError, "expected a layer name"),
        ({"lam": 0.1, "pairs": [("a", "")]}, ValueError, "must not be empty"),
        ({"lam": 0.1, "check_finite": 1}, TypeError, "check_finite must be a bool"),
        ({"lam": np.bool_(True)}, TypeError, "lam must be a real number"),
        ({"lam": tf.constant([0.1])}, ValueError, r"lam must be a scalar \(a number, or a 0-d"),
        ({"lam": np.float32("nan")}, ValueError, "lam must be a finite number >= 0"),
    ],
)
def test_constructor_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        PathNormSGD(0.1, **kwargs)


def test_layer_object_that_is_not_dense() -> None:
    with pytest.raises(ValueError, match="is a Conv1DTranspose, not a Dense/Conv1D/Conv2D"):
        PathNormSGD(0.1, lam=0.1, pairs=[(keras.layers.Conv1DTranspose(2, 2, name="c"), "d")])


@pytest.mark.parametrize(
    "lam", [np.float32(0.25), np.float64(0.25), np.int64(0), tf.constant(0.25), tf.constant(0)]
)
def test_numpy_and_tensor_scalars_are_accepted_as_floats(lam: Any) -> None:
    for opt in (PathNormSGD(0.1, lam=lam), ProxOptimizer(keras.optimizers.Adam(), lam=lam)):
        assert type(opt.lam) is float and opt.lam == float(lam)
        assert opt.get_config()["lam"] == float(lam)


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_check_finite_is_on_by_default_and_writes_nothing(mode: str) -> None:
    # As on the torch side: on by default, NonFiniteWeightsError, nothing written. In a graph
    # the runtime raises the assertion's InvalidArgumentError (the class is one too); XLA drops
    # assertions, so the step records it and check_weights (called when fit ends) raises.
    model = mlp(names=True)
    model.layers[0].kernel.assign(np.full((X_DIM, 5), np.nan))
    before = model.layers[1].kernel.numpy()
    opt = PathNormSGD(0.1, lam=0.1, model=model)
    opt.build(model.trainable_variables)
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    # (the graph runtime's message escapes the quotes)
    label = r"pair \(\\?'net/d1\\?', \\?'net/d2\\?'\) contains NaN or inf; the prox of non-fin"
    if mode == "eager":
        with pytest.raises(NonFiniteWeightsError, match=label) as caught:
            opt.apply(grads, model.trainable_variables)
        assert isinstance(caught.value, ValueError)
        assert isinstance(caught.value, tf.errors.InvalidArgumentError)
    elif mode == "graph":
        step = tf.function(lambda g: opt.apply(g, model.trainable_variables))
        with pytest.raises(tf.errors.InvalidArgumentError, match=label):
            step(grads)
    else:
        step = tf.function(lambda g: opt.apply(g, model.trainable_variables), jit_compile=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the check is enforced: nothing to warn about
            step(grads)
        with pytest.raises(NonFiniteWeightsError, match=label + ".*compiled by XLA"):
            opt.check_weights()
        opt.check_weights()  # read once
    np.testing.assert_array_equal(model.layers[1].kernel.numpy(), before)
    assert PathNormSGD(0.1, lam=0.1, check_finite=False).get_config()["check_finite"] is False


def test_xla_finiteness_verdict_from_the_prox_sums_proxes_overflow_and_refuses_nan_inf() -> None:
    # Under XLA the verdict is read off the prox's own per-unit sums; a sum that is not finite
    # is decided exactly: finite float32 entries whose sums of |.| (and squares) overflow are
    # proxed as usual, a NaN (long side, k_in) or an inf (short side, k_out) is refused.
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [keras.Input((X_DIM,))]
        + [keras.layers.Dense(u, name=f"d{i}", dtype="float32") for i, u in ((1, 5), (2, 3))],
        name="net",
    )
    lr, lam = 0.5, 0.2
    opt = PathNormSGD(lr, lam=lam, model=model)
    opt.build(model.trainable_variables)
    grads = [tf.zeros_like(v) for v in model.trainable_variables]  # the step is the prox alone
    step = tf.function(lambda g: opt.apply(g, model.trainable_variables), jit_compile=True)
    k_in, k_out = model.layers[0].kernel, model.layers[1].kernel
    base_in, base_out = k_in.numpy(), k_out.numpy()
    big = base_in.copy()
    big[:, 0] = np.where(np.arange(X_DIM) % 2 == 0, 3e38, -1e38)  # sum of |.|: 1.2e39
    assert np.abs(big[:, 0]).astype(np.float64).sum() > np.finfo(np.float32).max
    k_in.assign(big)
    step(grads)
    opt.check_weights()  # not flagged
    want_in, want_out = reference_prox(
        big.astype(np.float64), base_out.astype(np.float64), lam * lr
    )
    for got, want in ((k_in.numpy(), want_in), (k_out.numpy(), want_out)):
        np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-6, atol=1e-7)
        assert np.array_equal(got == 0, want == 0)
    assert not np.array_equal(k_out.numpy(), base_out) and (want_out == 0).any()
    label = r"pair \('net/d1', 'net/d2'\) contains NaN or inf"
    for kernel, index, value in ((k_in, (2, 1), np.nan), (k_out, (1, 2), -np.inf)):
        k_in.assign(base_in)
        k_out.assign(base_out)
        bad = kernel.numpy()
        bad[index] = value
        kernel.assign(bad)
        step(grads)
        with pytest.raises(NonFiniteWeightsError, match=label + ".*compiled by XLA"):
            opt.check_weights()
        for var, want in ((k_in, base_in), (k_out, base_out)):
            np.testing.assert_array_equal(var.numpy(), bad if var is kernel else want)


class _CountingNet(keras.Sequential):
    """Counts the traces of its train step (a Python side effect runs once per trace)."""

    traces = 0

    def train_step(self, data: Any) -> Any:
        type(self).traces += 1
        return super().train_step(data)


def _fit_traces(make_opt: Any, built: bool) -> int:
    """How many times ``fit`` (XLA) traces the train step of a fresh model with ``make_opt()``;
    ``built``: the optimizer built before ``fit`` (as verify_pairs, load_model or a strategy do)."""
    keras.utils.set_random_seed(0)
    model = _CountingNet(
        [keras.Input((X_DIM,)), keras.layers.Dense(5, activation="elu"), keras.layers.Dense(3)],
        name="net",
    )
    opt = make_opt(model)
    model.compile(opt, loss_fn(), jit_compile=True)
    if built:
        opt.build(model.trainable_variables)
    _CountingNet.traces = 0
    x, y = data()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    return _CountingNet.traces


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
@pytest.mark.parametrize(
    ("kind", "built"), [("PathNormSGD", True), ("PathNormSGD", False), ("ProxOptimizer", True)]
)
def test_fit_traces_the_step_as_often_as_the_plain_optimizer(kind: str, built: bool) -> None:
    # The XLA finiteness flag is made by build(), not in the first traced step: a variable
    # created while tf.function traces makes it trace (and the prox compile) once more.
    # (Unbuilt, Keras builds every optimizer inside the first trace, so plain SGD traces twice.)
    def plain(model: keras.Model) -> Any:
        return keras.optimizers.SGD(0.1, momentum=0.5)

    def regularized(model: keras.Model) -> Any:
        if kind == "PathNormSGD":
            return PathNormSGD(0.1, lam=0.1, momentum=0.5, model=model)
        return ProxOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), lam=0.1, model=model)

    assert PathNormSGD(0.1, lam=0.1).get_config()["check_finite"] is True  # the default
    assert _fit_traces(regularized, built) == _fit_traces(plain, built)


@pytest.mark.parametrize(
    ("kind", "check_finite"),
    [("PathNormSGD", True), ("PathNormSGD", False), ("ProxOptimizer", True)],
)
def test_the_finiteness_flag_is_made_by_build_and_is_not_optimizer_state(
    kind: str, check_finite: bool, tmp_path: Path
) -> None:
    # Made with the optimizer (check_finite only), kept out of its variables, checkpoint and
    # .keras file: saving and loading are those of the optimizer without it (plain SGD, or
    # for the wrapper, the wrapper without check_finite, which never makes it).
    def make(check: bool | None) -> Any:  # None: the reference
        if kind == "PathNormSGD":
            if check is None:
                return keras.optimizers.SGD(0.1, momentum=0.5)
            return PathNormSGD(0.1, lam=0.1, momentum=0.5, check_finite=check)
        inner = keras.optimizers.SGD(0.1, momentum=0.5)
        return ProxOptimizer(inner, lam=0.1, check_finite=bool(check))

    model = mlp()
    opt, plain = make(check_finite), make(None)
    assert opt._flag is None
    model.compile(opt, loss_fn())
    opt.build(model.trainable_variables)
    plain.build(model.trainable_variables)
    assert (opt._flag is not None) == check_finite
    assert [v.shape for v in opt.variables] == [v.shape for v in plain.variables]
    assert not any("nonfinite" in v.path for v in opt.variables)
    keys = {}
    for name, o in (("regularized", opt), ("plain", plain)):
        path = tf.train.Checkpoint(optimizer=o).write(str(tmp_path / name))
        keys[name] = {k for k, _ in tf.train.list_variables(path)}
    assert not any("nonfinite" in k for k in keys["regularized"])
    assert {k for k in keys["regularized"] if "_variables" in k} == {
        k for k in keys["plain"] if "_variables" in k
    }
    model.save(tmp_path / "m.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. Keras's "Skipping variable loading for optimizer"
        loaded = keras.models.load_model(tmp_path / "m.keras").optimizer
    assert loaded.built and (loaded._flag is not None) == check_finite
    assert len(loaded.variables) == len(opt.variables)


# --- convolution units: pairing, the prox on channels, the baselines ------------------------

CNN_SHAPE = (8, 9, 2)


def cnn(seed: int = 0) -> keras.Model:
    """``c1 -> pool -> c2 -> Flatten -> d1 -> d2``: auto pairs (c1, c2) and (d1, d2); the
    pair (c2, d1) reads 4 positions of 4 channels through the Flatten."""
    keras.utils.set_random_seed(seed)
    conv, dense = keras.layers.Conv2D, keras.layers.Dense
    return keras.Sequential(
        [
            keras.Input(CNN_SHAPE),
            conv(3, (2, 3), activation="elu", name="c1"),  # (7, 7, 3)
            keras.layers.MaxPooling2D(2),  # (3, 3, 3)
            conv(4, 2, name="c2"),  # (2, 2, 4)
            keras.layers.ReLU(),
            keras.layers.Flatten(),
            dense(5, activation="elu", name="d1"),
            dense(CLASSES, name="d2"),
        ],
        name="net",
    )


def cnn_functional() -> keras.Model:
    """A functional Conv1D -> pool -> Flatten -> Dense pair, then a Dense pair."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((9, 2))
    h = keras.layers.Conv1D(3, 3, name="c1")(inp)  # (7, 3)
    h = keras.layers.MaxPooling1D(2)(keras.layers.ReLU()(h))  # (3, 3)
    h = keras.layers.Dense(4, name="d1")(keras.layers.Flatten()(keras.layers.Dropout(0.1)(h)))
    out = keras.layers.Dense(CLASSES, name="d3")(keras.layers.Dense(5, name="d2")(h))
    return keras.Model(inp, out, name="net")


def unit_matrices(kernel_1: np.ndarray, kernel_2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(X, Y) of a Keras pair written out with NumPy indexing (not the seam): row ``c`` of
    ``Y`` is channel ``c``'s incoming kernel ``K1[..., c]``, row ``c`` of ``X`` its outgoing
    weights, ``K2[..., c, :]`` of a convolution or, after a channels-last Flatten, the Dense
    rows ``c, c + C, ...``."""
    n = kernel_1.shape[-1]
    y = np.stack([kernel_1[..., c].ravel() for c in range(n)])
    if kernel_2.ndim > 2:
        return np.stack([kernel_2[..., c, :].ravel() for c in range(n)]), y
    return np.stack([kernel_2[c::n].ravel() for c in range(n)]), y


def expected_kernels(
    kernel_1: np.ndarray, kernel_2: np.ndarray, step: float
) -> tuple[np.ndarray, np.ndarray]:
    """The exhaustive reference prox of each channel, written back by NumPy indexing."""
    v, w = ref.prox_path_norm(*unit_matrices(kernel_1, kernel_2), step)
    new_1, new_2 = np.empty_like(kernel_1), np.empty_like(kernel_2)
    n = kernel_1.shape[-1]
    for c in range(n):
        new_1[..., c] = w[c].reshape(kernel_1.shape[:-1])
        if kernel_2.ndim > 2:
            new_2[..., c, :] = v[c].reshape(*kernel_2.shape[:-2], kernel_2.shape[-1])
        else:
            new_2[c::n] = v[c].reshape(-1, kernel_2.shape[-1])
    return new_1, new_2


@pytest.mark.parametrize(
    ("make", "pairs", "flats", "unseen"),
    [
        (
            cnn,
            [("net/c1/kernel", "net/c2/kernel"), ("net/d1/kernel", "net/d2/kernel")],
            [None, None],
            r"'net/c1/kernel' \(2, 3, 2, 3\) is a 4-D kernel",
        ),
        (
            cnn_functional,
            [("c1/kernel", "d1/kernel"), ("d2/kernel", "d3/kernel")],
            [layers.Flat(3), None],
            r"'c1/kernel' \(3, 2, 3\) is a 3-D kernel",
        ),
    ],
    ids=["sequential", "functional"],
)
def test_auto_pairs_conv_layers_through_pooling_and_flatten(
    make: Any, pairs: list[tuple[str, str]], flats: list[Any], unseen: str
) -> None:
    model = make()
    opt = PathNormSGD(0.1, lam=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model's graph confirms every pair
        opt.verify_pairs(model)
    assert opt.regularized_pairs == pairs
    assert [p.layout.flat for p in opt._pairs] == flats
    # Built without the model (a custom loop without verify_pairs): a convolution is refused.
    with pytest.raises(ValueError, match=unseen + r".*Call optimizer.verify_pairs\(model\)"):
        PathNormSGD(0.1, lam=0.1).build(model.trainable_variables)


def test_explicit_conv_flatten_dense_pair_by_name_and_by_layer() -> None:
    model = cnn()
    opt = PathNormSGD(0.1, lam=0.1, pairs=[("c2", model.get_layer("d1"))])
    opt.verify_pairs(model)
    assert opt.regularized_pairs == [("net/c2/kernel", "net/d1/kernel")]
    assert opt._pairs[0].layout.flat == layers.Flat(4, channels_last=True)  # (2, 2) positions
    with pytest.raises(ValueError, match=r"'c1' -> 'd1' do not chain: .*16 inputs are not a whole"):
        PathNormSGD(0.1, lam=0.1, pairs=[("c1", "d1")]).verify_pairs(model)


def _conv_between(kind: str) -> keras.Model:
    """A functional model whose auto pair is two Conv1D layers ``a -> ... -> b`` (or a Dense
    ``b``), with ``kind`` between them or around them."""
    conv, L = keras.layers.Conv1D, keras.layers
    inp = keras.Input((9, 2))
    a, b = conv(3, 2, name="a"), conv(2, 2, name="b")
    middle = {
        "batchnorm": L.BatchNormalization(name="bn"),
        "layernorm": L.LayerNormalization(name="ln"),
        "frozen conv": conv(3, 1, name="frozen"),
        "upsampling": L.UpSampling1D(2),
    }
    if kind in middle:
        middle["frozen conv"].trainable = False
        out = b(middle[kind](a(inp)))
    elif kind == "shared":  # a -> b -> a: a is called twice
        out = a(conv(2, 2, name="b")(a(inp)))
    elif kind == "dense first":  # d -> a: a convolution reading a Dense layer's units
        out = b(a(L.Reshape((9, 1))(L.Dense(9, name="d")(L.Flatten()(inp)))))
    else:  # a Dense layer reading a convolution, with or without a Flatten
        h = a(inp)
        out = L.Dense(2, name="b")(L.Flatten()(h) if kind == "flatten" else h)
    return keras.Model(inp, out, name="net")


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("batchnorm", r"the layer 'bn' \(it trains \['bn/gamma', 'bn/beta'\]\) lies between"),
        ("layernorm", r"the layer 'ln' \(it trains"),
        ("frozen conv", "the frozen Conv1D 'frozen' lies between them"),
        ("shared", r"the layer 'a' is shared \(the model calls 'a' 2 times and 'b' 1 times\)"),
        ("dense first", "'d' -> 'a' do not chain: a convolution cannot read the units of a Dense"),
        ("no flatten", "the convolution's output needs a Flatten"),
    ],
)
def test_auto_conv_pairs_are_refused_with_their_cause(kind: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PathNormSGD(0.1, lam=0.1).verify_pairs(_conv_between(kind))


def test_auto_conv_pair_through_an_unknown_layer_is_warned_about() -> None:
    opt = PathNormSGD(0.1, lam=0.1)
    with pytest.warns(UserWarning, match=r"paired \[\('a', 'b'\)\] .*does not confirm them"):
        opt.verify_pairs(_conv_between("upsampling"))  # UpSampling1D: no role between a pair
    opt = PathNormSGD(0.1, lam=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.verify_pairs(_conv_between("flatten"))
    assert opt.regularized_pairs == [("a/kernel", "b/kernel")]
    assert opt._pairs[0].layout.flat == layers.Flat(8, channels_last=True)


CONV_PAIRS = {"auto": "auto", "conv-flatten-dense": [("c2", "d1")]}


@pytest.mark.parametrize(
    ("pairs", "method", "wrapped"),
    [
        ("auto", "band", False),
        ("auto", "sort", True),
        ("conv-flatten-dense", "band", True),
        ("conv-flatten-dense", "sort", False),
    ],
)
def test_one_step_on_conv_pairs_is_the_exhaustive_prox_of_each_channel(
    pairs: str, method: str, wrapped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A zero gradient leaves the SGD step out: the step is the prox alone, per channel
    # (PathNormSGD, or ProxOptimizer around SGD).
    from pathnorm_tf import optimizers

    monkeypatch.setattr(
        optimizers, "_prox_kernels", functools.partial(optimizers._prox_kernels, method=method)
    )
    model = cnn(seed=3)
    lr, lam = 0.5, 0.15
    if wrapped:
        opt: Any = ProxOptimizer(keras.optimizers.SGD(lr), lam=lam, pairs=CONV_PAIRS[pairs])
    else:
        opt = PathNormSGD(lr, lam=lam, pairs=CONV_PAIRS[pairs])
    opt.verify_pairs(model)
    before = {layer.name: layer.kernel.numpy() for layer in model.layers if layer.weights}
    names = [("c1", "c2"), ("d1", "d2")] if pairs == "auto" else [("c2", "d1")]
    variables = model.trainable_variables
    opt.apply([tf.zeros_like(v) for v in variables], variables)
    for first, second in names:
        want = expected_kernels(before[first], before[second], lam * lr)
        for name, kernel in zip((first, second), want, strict=True):
            np.testing.assert_allclose(model.get_layer(name).kernel.numpy(), kernel, 1e-12, 1e-14)
            assert np.array_equal(model.get_layer(name).kernel.numpy() == 0, kernel == 0)
        assert (want[0] == 0).any() and not np.array_equal(want[0], before[first])
    untouched = {"c1", "c2", "d1", "d2"} - {n for pair in names for n in pair}
    for name in untouched:
        np.testing.assert_array_equal(model.get_layer(name).kernel.numpy(), before[name])


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_on_a_cnn_in_graph_and_under_xla(
    jit_compile: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One fit step (tf.function, or XLA) equals the SGD step, then the reference prox of each
    channel of (c2, d1) by NumPy indexing; the layers outside the pair take the SGD step."""
    if jit_compile:  # the views are the same matrices for every method; "sort" compiles fast
        from pathnorm_tf import optimizers

        real = optimizers._prox_kernels
        monkeypatch.setattr(optimizers, "_prox_kernels", functools.partial(real, method="sort"))
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((SAMPLES, *CNN_SHAPE)), rng.integers(0, CLASSES, SAMPLES)
    lr, lam = 0.5, 0.15
    model, plain = cnn(seed=1), cnn(seed=1)
    grads = grads_of(plain, x, y)
    stepped = {
        v.path.split("/")[-2] + "/" + v.name: v.numpy() - lr * g.numpy()
        for v, g in zip(plain.trainable_variables, grads, strict=True)
    }
    opt = PathNormSGD(lr, lam=lam, pairs=[("c2", "d1")], model=model)
    model.compile(opt, loss_fn(), jit_compile=jit_compile)
    model.fit(x, y, batch_size=SAMPLES, epochs=1, verbose=0, shuffle=False)
    want = dict(
        zip(
            ("c2", "d1"),
            expected_kernels(stepped["c2/kernel"], stepped["d1/kernel"], lam * lr),
            strict=True,
        )
    )
    for v in model.trainable_variables:
        layer, name = v.path.split("/")[-2:]
        expected = want[layer] if name == "kernel" and layer in want else stepped[f"{layer}/{name}"]
        np.testing.assert_allclose(v.numpy(), expected, rtol=1e-10, atol=1e-12)
    out, inc = unit_matrices(want["c2"], want["d1"])
    alive = np.any(out != 0, axis=1) & np.any(inc != 0, axis=1)
    assert 0 < alive.sum() < 4, alive  # some channels die, not all


@pytest.mark.parametrize("regularizer", ["l1", "linf"])
def test_baselines_on_conv_kernels(regularizer: str) -> None:
    model = cnn(seed=2)
    strength = {"lam": 0.4} if regularizer == "l1" else {"radius": 0.7}
    opt = ProxOptimizer(keras.optimizers.SGD(0.5), regularizer=regularizer, **strength)
    opt.verify_pairs(model)
    assert opt.regularized_kernels == [f"net/{n}/kernel" for n in ("c1", "c2", "d1", "d2")]
    before = [layer.kernel.numpy() for layer in model.layers if layer.weights]
    variables = model.trainable_variables
    opt.apply([tf.zeros_like(v) for v in variables], variables)
    after = [layer.kernel.numpy() for layer in model.layers if layer.weights]
    for old, new in zip(before, after, strict=True):
        if regularizer == "l1":
            np.testing.assert_allclose(new, ref.prox_l1(old, 0.4 * 0.5), rtol=1e-12, atol=1e-14)
            continue
        # each output channel's (unit's) incoming weights, over every tap and input channel
        columns = old.reshape(-1, old.shape[-1])
        want = ref.project_rows_l1_ball(columns.T, 0.7).T.reshape(old.shape)
        np.testing.assert_allclose(new, want, rtol=1e-12, atol=1e-14)
        assert np.abs(new.reshape(-1, new.shape[-1])).sum(0).max() <= 0.7 + 1e-12
        assert np.abs(old.reshape(-1, old.shape[-1])).sum(0).max() > 0.7  # it projected


# --- serialization -----------------------------------------------------------------------------


def test_get_config_round_trip() -> None:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, 10, 0.9)
    opt = PathNormSGD(schedule, lam=0.02, momentum=0.5, nesterov=True, pairs=[("a", "b")])
    config = opt.get_config()
    assert config["lam"] == 0.02 and config["pairs"] == [["a", "b"]]
    json.dumps(keras.saving.serialize_keras_object(opt))
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert isinstance(clone, PathNormSGD)
    assert clone.get_config() == {**config, "name": clone.name}
    wrapper = ProxOptimizer(keras.optimizers.Adam(0.01), regularizer="l1", lam=0.1, layers=["d1"])
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(wrapper))
    assert isinstance(clone, ProxOptimizer) and isinstance(
        clone.inner_optimizer, keras.optimizers.Adam
    )
    assert clone.get_config() == {**wrapper.get_config(), "name": clone.name}


def _make_path_sgd() -> Any:
    return PathNormSGD(0.3, lam=0.05, momentum=0.9)


def _make_prox_adam() -> Any:
    return ProxOptimizer(keras.optimizers.Adam(0.05), lam=0.05)


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
@pytest.mark.parametrize("make_opt", [_make_path_sgd, _make_prox_adam], ids=["PathNormSGD", "Adam"])
def test_save_load_and_continue_is_identical(make_opt: Any, tmp_path: Path) -> None:
    x, y = data()
    straight = mlp()
    straight.compile(make_opt(), loss_fn())
    straight.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)

    first = mlp()
    first.compile(make_opt(), loss_fn())
    first.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    first.save(tmp_path / "m.keras")
    resumed = keras.models.load_model(tmp_path / "m.keras")
    assert type(resumed.optimizer) is type(straight.optimizer)
    assert resumed.optimizer.get_config()["lam"] == 0.05
    assert int(resumed.optimizer.iterations) == 4
    resumed.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    for got, want in zip(resumed.get_weights(), straight.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
        np.testing.assert_array_equal(got == 0, want == 0)


# --- names that survive save/load ---------------------------------------------------------------
# Keras puts an outer model's name in a variable path only when the layer was built inside it
# (a Sequential with an Input: "net/d1/kernel"); a reloaded model's paths are the bare layer
# names ("d1/kernel"), and same-named layers of nested models end up with the same path.


def _dense(units: int, name: str, last: bool = False) -> keras.layers.Dense:
    return keras.layers.Dense(units, activation=None if last else "elu", name=name)


def _sequential_net() -> keras.Model:  # paths net/d1, net/d2, net/d3
    return keras.Sequential(
        [keras.Input((X_DIM,)), _dense(5, "d1"), _dense(4, "d2"), _dense(CLASSES, "d3", True)],
        name="net",
    )


def _functional_net() -> keras.Model:  # paths d1, d2, d3 (never the model's name)
    inputs = keras.Input((X_DIM,))
    h = _dense(4, "d2")(_dense(5, "d1")(inputs))
    return keras.Model(inputs, _dense(CLASSES, "d3", True)(h), name="net")


def _nested_net() -> keras.Model:  # a Sequential in a functional model: enc/d1, enc/d2, d3
    enc = keras.Sequential([keras.Input((X_DIM,)), _dense(5, "d1"), _dense(4, "d2")], name="enc")
    inputs = keras.Input((X_DIM,))
    return keras.Model(inputs, _dense(CLASSES, "d3", True)(enc(inputs)), name="net")


def _same_names_net() -> keras.Model:  # enc/h, net/h, net/out; reloaded: h, h, out
    enc = keras.Sequential([keras.Input((X_DIM,)), _dense(5, "h")], name="enc")
    return keras.Sequential(
        [keras.Input((X_DIM,)), enc, _dense(4, "h"), _dense(CLASSES, "out", True)], name="net"
    )


# (model, the second and third Dense layers as a user names them in the model as built)
PREFIXED = {
    "Sequential": (_sequential_net, "net/d2", "net/d3"),
    "functional": (_functional_net, "net/d2", "net/d3"),
    "nested": (_nested_net, "enc/d2", "net/d3"),
    "same-names": (_same_names_net, "net/h", "net/out"),
}


def _prefixed_optimizer(kind: str, second: str, third: str) -> Any:
    if kind == "PathNormSGD":
        return PathNormSGD(0.5, lam=0.3, momentum=0.5, pairs=[(second, third)])
    return ProxOptimizer(keras.optimizers.Adam(0.05), regularizer="l1", lam=4.0, layers=[second])


def _regularized_positions(model: keras.Model) -> list[int]:
    """Positions in ``model.trainable_variables`` of the kernels its optimizer regularizes."""
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    chains = model.optimizer.regularized_chains(model.trainable_variables)
    return [position[id(v)] for chain in chains for v in chain]


@pytest.mark.usefixtures("sort_prox")  # (conftest.py: what is proxed, not how)
@pytest.mark.parametrize("kind", ["PathNormSGD", "ProxOptimizer(l1)"])
@pytest.mark.parametrize("net", list(PREFIXED))
def test_prefixed_names_survive_save_and_load(net: str, kind: str, tmp_path: Path) -> None:
    make, second, third = PREFIXED[net]
    x, y = data()
    keras.utils.set_random_seed(0)
    model = make()
    model.compile(_prefixed_optimizer(kind, second, third), loss_fn())
    model.fit(x, y, batch_size=SAMPLES, epochs=1, verbose=0)
    targets = [2, 4] if kind == "PathNormSGD" else [2]  # the 2nd (and 3rd) kernel
    assert _regularized_positions(model) == targets
    model.save(tmp_path / "m.keras")
    resumed = keras.models.load_model(tmp_path / "m.keras")
    assert _regularized_positions(resumed) == targets
    for m in (model, resumed):
        m.fit(x, y, batch_size=SAMPLES, epochs=1, verbose=0)
    weights = resumed.get_weights()
    for got, want in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
        np.testing.assert_array_equal(got == 0, want == 0)
    # The prox acted on the targets (exact zeros) and on nothing else.
    kernel_positions = [i for i, v in enumerate(resumed.trainable_variables) if v.name == "kernel"]
    for i in kernel_positions:
        assert (np.count_nonzero(weights[i] == 0) > 0) == (i in targets), i
    # Saved again, the reloaded model keeps its pairs.
    resumed.save(tmp_path / "m2.keras")
    assert _regularized_positions(keras.models.load_model(tmp_path / "m2.keras")) == targets


def test_names_without_the_prefixes_keras_dropped(tmp_path: Path) -> None:
    # A fresh optimizer (no record of an earlier build) on a reloaded model: "enc/d2" and
    # "net/d3" are looked up as "d2" and "d3", since neither "enc" nor "net" is in any path.
    model = _nested_net()
    model.save(tmp_path / "m.keras")
    reloaded = keras.models.load_model(tmp_path / "m.keras")
    assert [v.path for v in reloaded.trainable_variables if v.name == "kernel"] == [
        "d1/kernel",
        "d2/kernel",
        "d3/kernel",
    ]
    opt = PathNormSGD(0.1, lam=0.01, pairs=[("enc/d2", "net/d3")])
    opt.build(reloaded.trainable_variables)
    assert opt.regularized_pairs == [("d2/kernel", "d3/kernel")]
    l1 = ProxOptimizer(keras.optimizers.SGD(0.1), regularizer="l1", lam=0.1, layers=["net/enc/d1"])
    l1.build(reloaded.trainable_variables)
    assert l1.regularized_kernels == ["d1/kernel"]


def test_a_prefix_that_names_another_layer_is_not_dropped() -> None:
    # "enc" is in the model's paths, so "enc/d3" means a d3 inside enc: there is none.
    model = _nested_net()
    with pytest.raises(ValueError, match="no trained Dense/Conv1D/Conv2D layer named 'enc/d3'"):
        PathNormSGD(0.1, lam=0.01, pairs=[("enc/d2", "enc/d3")]).build(model.trainable_variables)


def test_same_names_after_reload_are_ambiguous_for_a_new_optimizer(tmp_path: Path) -> None:
    model = _same_names_net()
    model.save(tmp_path / "m.keras")
    reloaded = keras.models.load_model(tmp_path / "m.keras")
    opt = PathNormSGD(0.1, lam=0.01, pairs=[("net/h", "net/out")])
    match = r"'net/h' is ambiguous.*\['h/kernel' \(6, 5\), 'h/kernel' \(5, 4\)\]"
    with pytest.raises(ValueError, match=match):
        opt.build(reloaded.trainable_variables)
    # On the model as built the prefixes tell the two apart.
    opt = PathNormSGD(0.1, lam=0.01, pairs=[("net/h", "net/out")])
    opt.build(model.trainable_variables)
    assert opt.regularized_pairs == [("net/h/kernel", "net/out/kernel")]


def _renamed_net() -> keras.Model:  # d2 and d3 first, then a layer the record never saw
    return keras.Sequential(
        [keras.Input((X_DIM,)), _dense(4, "d2"), _dense(CLASSES, "d3"), _dense(3, "d9", True)]
    )


def test_the_record_applies_to_the_same_layers_only() -> None:
    # The config of a built optimizer records (d2, d3) as Dense kernels 1 and 2 of a model whose
    # Dense layers are d1, d2, d3; on a model with other Dense layers the names are resolved.
    opt = PathNormSGD(0.1, lam=0.01, pairs=[("net/d2", "net/d3")])
    opt.build(_sequential_net().trainable_variables)
    config = keras.saving.serialize_keras_object(opt)
    json.dumps(config)
    clone = keras.saving.deserialize_keras_object(config)
    assert clone.get_config() == {**opt.get_config(), "name": clone.name}
    other = _renamed_net()
    clone.build(other.trainable_variables)
    assert clone.regularized_pairs == [(other.layers[0].kernel.path, other.layers[1].kernel.path)]


def test_a_record_for_other_names_is_not_used(tmp_path: Path) -> None:
    # A config whose pairs were edited after the record was written: the names are resolved,
    # and on the reloaded same-names model "enc/h" is ambiguous (the record would pick net/h).
    model = _same_names_net()
    opt = PathNormSGD(0.1, lam=0.01, pairs=[("net/h", "net/out")])
    opt.build(model.trainable_variables)
    model.save(tmp_path / "m.keras")
    reloaded = keras.models.load_model(tmp_path / "m.keras")
    edited = PathNormSGD.from_config({**opt.get_config(), "pairs": [["enc/h", "net/out"]]})
    with pytest.raises(ValueError, match=r"'enc/h' is ambiguous"):
        edited.build(reloaded.trainable_variables)
    kept = PathNormSGD.from_config(opt.get_config())
    kept.build(reloaded.trainable_variables)
    assert kept.regularized_chains([])[0][0] is reloaded.trainable_variables[2]


@pytest.mark.parametrize(
    "resolved",
    [
        [0, 1],
        {"kernels": [["d1", [6, 5]]], "targets": [0]},
        {"names": ["d1"], "kernels": [["d1", [6, 5]], ["d2", [5, 3]]], "targets": [2]},
        {"names": ["d1"], "kernels": [["d1", [6, 5.0]]], "targets": [0]},
        {"names": ["d1", "d2"], "kernels": [["d1", [6, 5]]], "targets": [0]},
    ],
)
@pytest.mark.parametrize("cls", [PathNormSGD, ProxOptimizer])
def test_a_malformed_record_is_a_clear_error(cls: Any, resolved: Any) -> None:
    if cls is PathNormSGD:
        opt = PathNormSGD(0.1, lam=0.01, pairs=[("d1", "d2")])
    else:
        opt = ProxOptimizer(keras.optimizers.SGD(0.1), regularizer="l1", lam=0.1, layers=["d1"])
    config = {**keras.saving.serialize_keras_object(opt)["config"], "resolved": resolved}
    with pytest.raises(ValueError, match="resolved: expected what get_config writes after build"):
        cls.from_config(config)


# --- any optimizer: the wrapper and the baselines ---------------------------------------------


@pytest.mark.parametrize("jit_compile", [False, True])
def test_wrapper_around_adam_is_prox_of_the_adam_step(jit_compile: bool) -> None:
    x, y = data()
    lr, lam = 0.05, 2.0
    plain, prox = mlp(), mlp()
    plain.compile(keras.optimizers.Adam(lr), loss_fn(), jit_compile=jit_compile)
    opt = ProxOptimizer(keras.optimizers.Adam(lr), lam=lam)
    prox.compile(opt, loss_fn(), jit_compile=jit_compile)
    for m in (plain, prox):
        m.fit(x, y, batch_size=SAMPLES, epochs=1, verbose=0)
    exp_in, exp_out = reference_prox(*kernels(plain), lam * lr)
    got_in, got_out = kernels(prox)
    np.testing.assert_allclose(got_in, exp_in, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got_out, exp_out, rtol=1e-12, atol=1e-14)
    assert np.count_nonzero(got_in == 0) > 0
    assert int(opt.iterations) == 1
    assert float(opt.learning_rate) == pytest.approx(lr)
    opt.learning_rate = 0.01
    assert float(opt.inner_optimizer.learning_rate) == pytest.approx(0.01)
    assert len(opt.variables) == len(opt.inner_optimizer.variables) + 2


@pytest.mark.parametrize("regularizer", ["l1", "linf"])
def test_baselines_after_an_sgd_step(regularizer: str) -> None:
    x, y = data()
    lr, strength = 0.5, 0.2
    plain, prox = mlp(), mlp()
    kwargs = {"lam": strength} if regularizer == "l1" else {"radius": 1.0}
    opt = ProxOptimizer(keras.optimizers.SGD(lr), regularizer=regularizer, **kwargs)
    for m, o in ((plain, keras.optimizers.SGD(lr)), (prox, opt)):
        o.apply(grads_of(m, x, y), m.trainable_variables)
    assert opt.regularized_kernels == [
        v.path for v in prox.trainable_variables if v.name == "kernel"
    ]
    for got, stepped in zip(kernels(prox), kernels(plain), strict=True):
        if regularizer == "l1":
            want = ref.prox_l1(stepped, strength * lr)
        else:
            want = ref.project_rows_l1_ball(stepped.T, 1.0).T  # columns of a Dense kernel
            assert np.abs(got).sum(0).max() <= 1.0 + 1e-12
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(
        prox_l1(tf.constant(1.0, tf.float64), 0.5).numpy(), 0.5
    )  # the functional form users call by hand
    assert project_linf_operator_norm(np.ones((2, 2)), 1.0).shape == (2, 2)


def test_baseline_on_chosen_layers_only() -> None:
    x, y = data()
    model = mlp((5, 4, CLASSES), names=True)
    opt = ProxOptimizer(keras.optimizers.SGD(0.5), regularizer="l1", lam=10.0, layers=["d2"])
    opt.apply(grads_of(model, x, y), model.trainable_variables)
    assert np.all(model.layers[1].kernel.numpy() == 0)  # 10 * 0.5 thresholds everything
    assert np.count_nonzero(model.layers[0].kernel.numpy()) == X_DIM * 5


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((), {"lam": 0.1}, TypeError, "inner_optimizer must be a keras.optimizers.Optimizer"),
        ((keras.optimizers.SGD(0.1),), {}, TypeError, "ProxOptimizer needs lam"),
        ((keras.optimizers.SGD(0.1),), {"lam": 0.1, "regularizer": "l2"}, ValueError, "one of"),
        ((keras.optimizers.SGD(0.1),), {"regularizer": "linf"}, TypeError, "needs radius"),
        (
            (keras.optimizers.SGD(0.1),),
            {"regularizer": "linf", "radius": "1"},
            TypeError,
            "radius must be a real number",
        ),
        (
            (keras.optimizers.SGD(0.1),),
            {"regularizer": "linf", "lam": 0.1},
            ValueError,
            "pass radius=..., not lam",
        ),
        ((keras.optimizers.SGD(0.1),), {"lam": 0.1, "radius": 1.0}, ValueError, "radius applies"),
        ((keras.optimizers.SGD(0.1),), {"lam": 0.1, "layers": ["d1"]}, ValueError, "use pairs"),
        (
            (keras.optimizers.SGD(0.1),),
            {"lam": 0.1, "regularizer": "l1", "pairs": [("a", "b")]},
            ValueError,
            "use layers",
        ),
        (
            (keras.optimizers.SGD(0.1),),
            {"lam": 0.1, "clipnorm": 1.0},
            ValueError,
            "inner optimizer",
        ),
        ((PathNormSGD(0.1, lam=0.1),), {"lam": 0.1}, ValueError, "already applies a prox"),
        (
            (keras.optimizers.SGD(0.1, use_ema=True),),
            {"lam": 0.1},
            ValueError,
            "use_ema=True: its average would be taken before the prox",
        ),
    ],
)
def test_wrapper_errors(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    if not args:
        args = ("sgd",)
    with pytest.raises(error, match=match):
        ProxOptimizer(*args, **kwargs)


def test_baseline_layer_errors() -> None:
    model = _conv_model()
    opt = ProxOptimizer(keras.optimizers.SGD(0.1), regularizer="l1", lam=0.1, layers=["conv"])
    with pytest.raises(ValueError, match=r"layers: .*/conv/kernel' \(3, 2, 4\) is a 3-D kernel"):
        opt.build(model.trainable_variables)  # the model not seen: a convolution is refused
    opt = ProxOptimizer(keras.optimizers.SGD(0.1), regularizer="l1", lam=0.1, layers=["d1", "d1"])
    with pytest.raises(ValueError, match="listed twice"):
        opt.build(model.trainable_variables)


# --- distribution ------------------------------------------------------------------------------

MIRRORED = textwrap.dedent(
    """
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import json, sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    import keras
    from pathnorm_tf import PathNormSGD

    keras.config.set_floatx("float64")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 6))
    y = rng.integers(0, 3, 32)
    jit = sys.argv[1] == "1"

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="elu"),
                                  keras.layers.Dense(3)])
        model.compile(PathNormSGD(0.5, lam=0.1, momentum=0.5),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit)
        return model

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        dist = build()
    dist.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    single = build()
    single.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    replicas = [[np.asarray(c).tolist() for c in v.value.values] for v in dist.trainable_variables]
    print(json.dumps({
        "n_replicas": strategy.num_replicas_in_sync,
        "replicas": replicas,
        "single": [w.tolist() for w in single.get_weights()],
        "zeros": int(np.sum(dist.layers[0].kernel.numpy() == 0)),
    }))
    """
)


# jit_compile=False only: XLA cannot compile a step whose MirroredStrategy variables live on two
# CPU devices (plain keras.optimizers.SGD fails the same way: "Trying to access resource ...
# located in device CPU:1 from device CPU:0"); on GPUs each replica compiles on its own device.
@pytest.mark.parametrize("jit_compile", [False])
def test_mirrored_strategy_keeps_replicas_identical(jit_compile: bool) -> None:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-c", MIRRORED, "1" if jit_compile else "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["n_replicas"] == 2
    assert result["zeros"] > 0
    for per_replica, single in zip(result["replicas"], result["single"], strict=True):
        first, second = (np.asarray(r) for r in per_replica)
        np.testing.assert_array_equal(first, second)  # replicas bit-identical
        # and equal to single-device training on the same global batches
        np.testing.assert_allclose(first, np.asarray(single), rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(first == 0, np.asarray(single) == 0)


def test_not_warning_on_plain_use() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PathNormSGD(0.1, lam=0.1).verify_pairs(mlp())


# --- the compiled step: no host round trip, nothing per unit ----------------------------------


def _compiled_step_ops(n: int) -> collections.Counter[str]:
    """HLO instruction names of one PathNormSGD update of a 64-n-10 pair, as XLA compiles it."""
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(n, activation="relu"), keras.layers.Dense(10)]
    )
    opt = PathNormSGD(0.1, lam=1e-3, momentum=0.9)
    opt.build(model.trainable_variables)
    grads = [tf.fill(v.shape, tf.constant(1e-3, v.dtype)) for v in model.trainable_variables]
    step = tf.function(lambda: opt.apply(grads, model.trainable_variables), jit_compile=True)
    hlo = step.experimental_get_compiler_ir()(stage="hlo")
    return collections.Counter(re.findall(r"[\s}\]] ?([a-z][\w-]*)\(", hlo))


def test_compiled_step_has_no_host_transfer_and_nothing_per_unit() -> None:
    # The XLA program of one step, whatever the device: no loop, no transfer to or from the
    # host (send/recv, in/outfeed, host callbacks: the only custom call is XLA's TopK) and a
    # fixed handful of conditionals (the band tiers). Its shape-dependent choices (one-shot
    # pair tables or bisection) are made by static sizes: once every table is over its limit
    # (n p > 2^15), doubling the hidden units leaves the program's instructions unchanged.
    counts = {n: _compiled_step_ops(n) for n in (200, 4000, 8000)}
    for n, ops in counts.items():
        assert ops["while"] == 0, n
        for op in ("send", "recv", "send-done", "recv-done", "infeed", "outfeed"):
            assert ops[op] == 0, (n, op)
        assert ops["custom-call"] <= 1, n  # the band block's TopK
        assert 1 <= ops["conditional"] <= 16, (n, ops["conditional"])
    assert counts[4000] == counts[8000]
