"""``pathnorm_tf.compact``: dead hidden units removed from Dense pairs, the same function."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import warnings
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from pathnorm_tf import PathNormSGD
from pathnorm_tf.compact import CompactionReport, _keeps_constants, compact

TOL = {"float64": 1e-12, "float32": 1e-5}

# (dead incoming, dead outgoing) units of the first pair (10 units) and the second (8 units).
CASES = {
    "mixed": (([1, 4, 6], [4, 7, 8]), ([0], [2, 5])),
    "all dead": (([0, 2], list(range(10))), (list(range(8)), [])),
    "none dead": (([], []), ([], [])),
    "all folded": ((list(range(10)), []), ([3], [3])),
}


@pytest.fixture(params=["float32", "float64"])
def dtype(request: pytest.FixtureRequest) -> str:
    if request.param == "float64":
        request.getfixturevalue("float64_keras")  # Keras in float64 for this test
    return str(request.param)


def _dense(units: int, name: str, **kwargs: Any) -> keras.layers.Dense:
    return keras.layers.Dense(units, name=name, bias_initializer="random_uniform", **kwargs)


def _sequential() -> keras.Model:
    """12 -> 10 -> 9 -> 8 -> 3: pairs (a, b) and (c, d), pointwise layers inside each."""
    return keras.Sequential(
        [
            keras.Input((12,)),
            _dense(10, "a", activation="elu"),
            keras.layers.Dropout(0.5),
            _dense(9, "b", activation="tanh"),
            _dense(8, "c"),
            keras.layers.LeakyReLU(0.2),
            keras.layers.GaussianNoise(0.1),
            _dense(3, "d"),
        ]
    )


def _functional() -> keras.Model:
    """The same shapes as a functional model; the second pair inside a nested Sequential."""
    x = keras.Input((12,))
    h = _dense(10, "a")(x)
    h = keras.layers.Activation("sigmoid")(h)
    h = _dense(9, "b")(keras.layers.ReLU()(h))
    inner = keras.Sequential(
        [keras.Input((9,)), _dense(8, "c", activation="relu"), _dense(3, "d", use_bias=False)]
    )
    return keras.Model(x, inner(h))


def _kill(model: keras.Model, first: str, second: str, dead: tuple[list[int], list[int]]) -> None:
    for name, index, axis in ((first, dead[0], 1), (second, dead[1], 0)):
        layer = _find(model, name)
        kernel = np.array(layer.kernel)
        np.moveaxis(kernel, axis, 0)[index] = 0
        layer.kernel.assign(kernel)


def _find(model: keras.Model, name: str) -> Any:
    return next(x for x in model._flatten_layers(recursive=True) if x.name == name)


def _max_diff(a: keras.Model, b: keras.Model, dtype: str, m: int = 12) -> float:
    x = np.random.default_rng(1).standard_normal((1000, m)).astype(dtype)
    return float(np.max(np.abs(np.asarray(a(x)) - np.asarray(b(x)))))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_same_function_and_counts(dtype: str, case: str, kind: str) -> None:
    keras.utils.set_random_seed(0)
    model = _sequential() if kind == "sequential" else _functional()
    for (first, second), dead in zip([("a", "b"), ("c", "d")], CASES[case], strict=True):
        _kill(model, first, second, dead)
    small, report = compact(model)
    assert type(small) is type(model)
    assert _max_diff(small, model, dtype) <= TOL[dtype]
    for p, (dead_in, dead_out), units in zip(report.pairs, CASES[case], (10, 8), strict=True):
        live = units - len(set(dead_in) | set(dead_out))
        assert (p.units_before, p.units_after) == (units, max(live, 1))
        assert (p.removed, p.folded) == (len(dead_out), len(set(dead_in) - set(dead_out)))
        assert _find(small, p.first).units == p.units_after
    assert report.params_after == small.count_params() < report.params_before or case == "none dead"
    assert all(w.dtype == dtype for w in small.weights)


def test_input_model_unchanged_and_nothing_shared() -> None:
    keras.utils.set_random_seed(0)
    model = _functional()
    _kill(model, "a", "b", ([1, 2], [3]))
    before = [np.array(w) for w in model.weights]
    small, _ = compact(model)
    assert all(np.array_equal(np.array(w), b) for w, b in zip(model.weights, before, strict=True))
    assert model.get_layer("a").units == 10 and small.get_layer("a").units == 7
    old = {id(x) for x in model._flatten_layers(recursive=True)}
    assert not any(id(x) in old for x in small._flatten_layers(recursive=True))
    assert not {id(w) for w in model.weights} & {id(w) for w in small.weights}


def test_a_steep_activation_does_not_warn() -> None:
    """Its slope loosens the logged bounds (pairing warns so), not what compact keeps."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((12,)), _dense(10, "a", activation="gelu"), _dense(3, "b")]
    )
    _kill(model, "a", "b", ([1, 2], [3]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        small, report = compact(model)
    assert report.pairs[0].units_after == 7 and _max_diff(small, model, "float32") <= 1e-5


def test_folding_turns_on_the_bias(float64_keras: None) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((5,)), _dense(6, "a", activation="elu"), _dense(2, "b", use_bias=False)]
    )
    model.get_layer("a").bias.assign(np.full(6, 0.5))
    _kill(model, "a", "b", ([0, 3], []))
    small, report = compact(model)
    assert small.get_layer("b").use_bias and report.pairs[0].folded == 2
    assert _max_diff(small, model, "float64", m=5) <= 1e-12


def test_trained_network() -> None:
    """A short fit with a large lam kills units; the compacted model matches."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((20,)), keras.layers.Dense(32, activation="elu"), keras.layers.Dense(4)]
    )
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((200, 20)).astype("float32"), rng.integers(0, 4, 200)
    model.compile(PathNormSGD(learning_rate=0.1, lam=0.3), "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    k_in, k_out = (np.array(layer.kernel) for layer in model.layers)
    dead = int(np.sum(np.all(k_in == 0, 0) | np.all(k_out == 0, 1)))
    assert 0 < dead < 32  # the test means something
    small, report = compact(model)
    assert report.pairs[0].units_after == 32 - dead and report.pairs[0].folded > 0
    assert _max_diff(small, model, "float32", m=20) <= 1e-5
    assert small.compiled and isinstance(small.optimizer, PathNormSGD)


def test_sequential_built_by_calling() -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([_dense(6, "a", activation="relu"), _dense(2, "b")])
    model(np.zeros((1, 4), "float32"))
    _kill(model, "a", "b", ([0], [1, 2]))
    small, report = compact(model)
    assert report.units_after == 3
    assert _max_diff(small, model, "float32", m=4) <= 1e-5


def _refused() -> dict[str, tuple[Any, Any, str]]:
    x = keras.Input((4,))
    h = _dense(4, "a")(x)
    residual = keras.Model(x, _dense(2, "b")(keras.layers.Add()([h, x])))
    both = keras.Model(x, [_dense(2, "b")(h), h])
    shared = keras.layers.ReLU()
    y = keras.Input((4,))
    reuse = _dense(5, "a")
    twice = keras.Model(y, _dense(2, "b")(shared(reuse(shared(reuse(shared(y)))[:, :4]))))
    shared_a = _dense(4, "a", activation="sigmoid")
    twice_seq = keras.Sequential([keras.Input((4,)), shared_a, _dense(4, "b"), shared_a])

    def seq(*layers: Any) -> keras.Model:
        return keras.Sequential([keras.Input((4,)), _dense(5, "a"), *layers, _dense(2, "b")])

    class Sub(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = _dense(5, "a"), _dense(2, "b")

        def call(self, x: Any) -> Any:
            return self.b(self.a(x))

    sub = Sub()
    sub(np.zeros((1, 4), "float32"))
    softmax = keras.Sequential(
        [keras.Input((4,)), _dense(5, "a", activation="softmax"), _dense(2, "b")]
    )
    sparsemax, glu = (
        keras.Sequential([keras.Input((4,)), _dense(6, "a", activation=f), _dense(2, "b")])
        for f in ("sparsemax", "glu")
    )
    custom = keras.Sequential(
        [keras.Input((4,)), _dense(5, "a", activation=lambda t: t * t), _dense(2, "b")]
    )
    einsum = keras.Sequential(
        [keras.Input((4,)), keras.layers.EinsumDense("ab,bc->ac", 5), _dense(2, "b")]
    )
    return {
        "residual": (residual, "auto", "Add .* takes other inputs"),
        "hidden is an output": (both, "auto", "model output"),
        "called twice": (twice, [("a", "b")], "called 2 times"),
        "called twice, Sequential": (twice_seq, [("a", "b")], "'a' is called 2 times"),
        "batchnorm": (seq(keras.layers.BatchNormalization()), [("a", "b")], "BatchNormalization"),
        "softmax layer": (seq(keras.layers.Softmax()), "auto", "Softmax"),
        "softmax activation": (softmax, "auto", "applies softmax to its outputs"),
        "softmax activation, explicit": (softmax, [("a", "b")], "not a built-in entry-wise"),
        "sparsemax activation": (sparsemax, "auto", "applies sparsemax to its outputs"),
        "sparsemax activation, explicit": (sparsemax, [("a", "b")], "not a built-in entry-wise"),
        "sparsemax layer": (seq(keras.layers.Activation("sparsemax")), [("a", "b")], "Activation"),
        "glu activation": (glu, [("a", "b")], "not a built-in entry-wise"),
        "custom activation": (custom, "auto", "not a built-in entry-wise"),
        "subclassed": (sub, "auto", "subclassed"),
        "einsum": (einsum, "auto", "EinsumDense"),
        "unbuilt": (keras.Sequential([_dense(5, "a"), _dense(2, "b")]), "auto", "not built"),
    }


def test_refusals() -> None:
    for what, (model, pairs, match) in _refused().items():
        with pytest.raises(ValueError, match=match):
            compact(model, pairs=pairs)
            pytest.fail(what)
    with pytest.raises(TypeError, match=r"keras\.Model"):
        compact("model")


def test_probe_leaves_no_activity_regularizer_loss() -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), _dense(6, "a", activity_regularizer="l2"), _dense(2, "b")]
    )
    _kill(model, "a", "b", ([1], [0]))
    assert compact(model)[1].pairs[0].folded == 1 and not model.losses


def test_save_load_and_report(tmp_path: Path) -> None:
    keras.utils.set_random_seed(0)
    model = _sequential()
    _kill(model, "a", "b", ([1], [2, 3]))
    model.compile("sgd", "mse")
    small, report = compact(model)
    path = tmp_path / "small.keras"
    small.save(path)
    loaded = keras.models.load_model(path)
    x = np.random.default_rng(0).standard_normal((50, 12)).astype("float32")
    assert np.array_equal(np.asarray(loaded(x)), np.asarray(small(x)))
    assert loaded.get_layer("a").units == 7 and loaded.compiled
    _, again = compact(loaded)  # a reloaded model compacts too; nothing is left to remove
    assert again.units_after == again.units_before == 15
    assert isinstance(report, CompactionReport)
    assert (report.units_before, report.units_after) == (18, 15)
    lines = str(report).splitlines()
    assert lines[1].split()[:8] == ["a", "->", "b", "10", "->", "7", "2", "1"]
    assert lines[-1].startswith(f"model parameters {model.count_params():,} -> ")


# --- convolution pairs: dead channels -----------------------------------------------------------


def _conv_conv(padding: str = "valid") -> keras.Model:
    """``c1 (5 channels) -> pool -> c2 -> Flatten -> d1 -> d2``: pairs (c1, c2) and (d1, d2)."""
    conv = keras.layers.Conv2D
    return keras.Sequential(
        [
            keras.Input((9, 10, 2)),
            conv(5, 3, activation="elu", name="c1", bias_initializer="random_uniform"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Dropout(0.5),
            conv(4, 2, padding=padding, name="c2", bias_initializer="random_uniform"),
            keras.layers.ReLU(),
            keras.layers.Flatten(),
            _dense(6, "d1", activation="tanh"),
            _dense(3, "d2"),
        ]
    )


def _conv_dense() -> keras.Model:
    """Functional ``c1 (Conv1D, 5 channels) -> pool -> Flatten -> d1``, then ``d2 -> d3``."""
    x = keras.Input((11, 3))
    h = keras.layers.Conv1D(5, 3, name="c1", bias_initializer="random_uniform")(x)  # (9, 5)
    h = keras.layers.AveragePooling1D(2, padding="same")(keras.layers.LeakyReLU(0.2)(h))
    h = _dense(4, "d1", activation="relu")(keras.layers.Flatten()(h))  # reads 5 x 5
    return keras.Model(x, _dense(3, "d3")(_dense(4, "d2", activation="elu")(h)))


def _kill_channels(
    model: keras.Model, first: str, second: str, dead: tuple[list[int], list[int]]
) -> None:
    """Zero the incoming weights of channels ``dead[0]`` and the outgoing ones of ``dead[1]``
    (a Dense second layer reads each channel at every position: rows ``c, c + C, ...``)."""
    a, b = _find(model, first), _find(model, second)
    k1, k2 = np.array(a.kernel), np.array(b.kernel)
    k1[..., dead[0]] = 0
    channels = k1.shape[-1]
    for c in dead[1]:
        if k2.ndim > 2:
            k2[..., c, :] = 0
        else:
            k2[c::channels] = 0
    a.kernel.assign(k1)
    b.kernel.assign(k2)


CONV_MODELS = {
    "conv-pool-conv": (_conv_conv, (9, 10, 2)),
    "conv-pool-flatten-dense": (_conv_dense, (11, 3)),
}


@pytest.mark.parametrize("kind", list(CONV_MODELS))
def test_conv_pairs_lose_dead_channels_and_keep_the_function(dtype: str, kind: str) -> None:
    keras.utils.set_random_seed(0)
    make, shape = CONV_MODELS[kind]
    model = make()
    _kill_channels(model, "c1", "c2" if kind == "conv-pool-conv" else "d1", ([0, 2, 3], [3, 4]))
    before = [np.array(w) for w in model.weights]
    small, report = compact(model)
    x = np.random.default_rng(1).standard_normal((64, *shape)).astype(dtype)
    assert np.max(np.abs(np.asarray(small(x)) - np.asarray(model(x)))) <= TOL[dtype]
    assert all(np.array_equal(np.array(w), b) for w, b in zip(model.weights, before, strict=True))
    conv = report.pairs[0]
    # channels 3, 4: no outgoing weights (removed); 0, 2: no incoming ones (folded)
    assert (conv.units_before, conv.units_after, conv.removed, conv.folded) == (5, 1, 2, 2)
    assert conv.constant_kept == 0 and small.get_layer("c1").filters == 1
    assert report.params_after == small.count_params() < report.params_before
    assert all(w.dtype == dtype for w in small.weights)


def test_zero_padded_second_conv_keeps_constant_channels(tmp_path: Path) -> None:
    # With padding="same" c2 reads a constant channel through fewer taps at the borders: its
    # constant is no bias, so the channel stays (constant_kept); dead outgoing ones still go.
    keras.utils.set_random_seed(0)
    model = _conv_conv(padding="same")
    _kill_channels(model, "c1", "c2", ([0, 2], [4]))
    model.compile(PathNormSGD(0.1, lam=0.01), "mse")
    small, report = compact(model)
    conv = report.pairs[0]
    assert (conv.units_after, conv.removed, conv.folded, conv.constant_kept) == (4, 1, 0, 2)
    assert "c1 -> c2: 2 unit(s) with zero incoming weights kept" in str(report)
    x = np.random.default_rng(1).standard_normal((64, 9, 10, 2)).astype("float32")
    assert np.max(np.abs(np.asarray(small(x)) - np.asarray(model(x)))) <= 1e-5
    path = tmp_path / "small_cnn.keras"
    small.save(path)
    loaded = keras.models.load_model(path)
    assert np.array_equal(np.asarray(loaded(x)), np.asarray(small(x)))
    # A reloaded Sequential's layers list extra calls of their own; "auto" still pairs them.
    loaded.optimizer.verify_pairs(loaded)
    assert loaded.optimizer.regularized_pairs == [
        ("c1/kernel", "c2/kernel"),
        ("d1/kernel", "d2/kernel"),
    ]


@pytest.mark.parametrize("pool", ["max", "average"])
def test_channels_first_pooling_between_convs(pool: str) -> None:
    # The pooling probe is laid out in the pooling layer's data_format (channels_last crashed).
    keras.utils.set_random_seed(0)
    layer = {"max": keras.layers.MaxPooling2D, "average": keras.layers.AveragePooling2D}[pool]
    conv = keras.layers.Conv2D
    model = keras.Sequential(
        [
            keras.Input((2, 12, 12)),  # no filters == width (Keras then adds a bias wrong)
            conv(4, 3, activation="relu", name="c1", data_format="channels_first"),
            layer(2, data_format="channels_first"),
            conv(3, 2, name="c2", data_format="channels_first"),
        ]
    )
    model.get_layer("c1").bias.assign(np.full(4, 0.5))
    _kill_channels(model, "c1", "c2", ([1], [2]))
    small, report = compact(model)
    assert (report.pairs[0].removed, report.pairs[0].folded) == (1, 1)
    x = np.random.default_rng(1).standard_normal((8, 2, 12, 12)).astype("float32")
    assert np.max(np.abs(np.asarray(small(x)) - np.asarray(model(x)))) <= 1e-5


def test_a_pooling_probe_without_output_shows_nothing() -> None:
    class Empty(keras.layers.Layer):
        data_format = "channels_last"

        def call(self, x: Any) -> Any:
            return x[:, :0]

    assert not _keeps_constants(Empty(), keras.ops.ones((1, 5, 3)))


def test_a_compacted_model_that_computes_something_else_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Keras 3.15 adds a channels_first conv's bias along the last axis when it is as long as
    # the bias: here 4 -> 3 filters on a 3-wide output. Either refused, or the same function.
    L = keras.layers
    x = np.random.default_rng(0).standard_normal((16, 2, 5, 5)).astype("float32")
    model = keras.Sequential([keras.Input((2, 5, 5)), L.Conv2D(4, 3, data_format="channels_first")])
    model.add(L.Flatten())
    model.add(L.Dense(3))
    conv, _, dense = model.layers
    conv.bias.assign(np.array([0.5, -1.0, 2.0, 0.3], "float32"))
    kernel = dense.kernel.numpy()
    kernel[9:18] = 0  # channel 1 has no outgoing weight
    dense.kernel.assign(kernel)
    try:
        small, _ = compact(model)
    except ValueError as err:
        assert "outputs differ from the model's by up to" in str(err)
    else:
        np.testing.assert_allclose(small(x), model(x), rtol=1e-5, atol=1e-5)
    # the check itself: a compacted model whose weights were written wrong
    set_weights = keras.layers.Dense.set_weights
    monkeypatch.setattr(
        keras.layers.Dense, "set_weights", lambda self, w: set_weights(self, [2 * a for a in w])
    )
    mlp = keras.Sequential([keras.Input((4,)), _dense(5, "a"), _dense(3, "b")])
    with pytest.raises(ValueError, match=r"outputs differ from the model's by up to") as info:
        compact(mlp)
    # a model without channels_first convolutions is not told about them
    assert "(tolerance " in str(info.value) and "channels_first" not in str(info.value)


# --- what compact checks itself: exact classes between, graph operations, dtypes, padding -------


class _FlipReLU(keras.layers.ReLU):
    """A ReLU subclass that reverses the units: not entry-wise, though its base class is."""

    def call(self, x: Any) -> Any:
        return keras.ops.flip(super().call(x), axis=-1)


@pytest.mark.parametrize("shape", [(6,), (None, 6)])
@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_a_subclass_between_the_pair_is_refused(shape: tuple[Any, ...], kind: str) -> None:
    # (None, 6): the self-check has no batch of known shape, so this check alone stops it.
    keras.utils.set_random_seed(0)
    layers = [_dense(8, "a"), _FlipReLU(name="flip"), _dense(3, "b")]
    if kind == "sequential":
        model = keras.Sequential([keras.Input(shape), *layers])
    else:
        x = keras.Input(shape)
        model = keras.Model(x, layers[2](layers[1](layers[0](x))))
    _kill(model, "a", "b", ([], [0, 1]))
    with pytest.raises(ValueError, match=r"_FlipReLU 'flip' .* is a subclass of ReLU") as info:
        compact(model)
    assert "override call" in str(info.value) and "channels_first" not in str(info.value)


def _with_ops(kind: str) -> tuple[keras.Model, np.ndarray]:
    """A functional pair ``a -> b`` in a graph that holds operations that are not layers (a
    ``keras.ops`` call; an Embedding mask's ``NotEqual``, which the mean pooling reads)."""
    if kind == "ops":
        x = keras.Input((5,))
        h = keras.ops.multiply(x, 2.0)
        data = np.random.default_rng(1).standard_normal((64, 5)).astype("float32")
    else:
        x = keras.Input((7,), dtype="int32")
        h = keras.layers.Embedding(20, 5, mask_zero=True)(x)
        data = np.random.default_rng(1).integers(0, 20, (64, 7)).astype("int32")
        data[:, 4:] = 0  # masked positions, left out of the mean
    h = _dense(4, "b")(_dense(6, "a", activation="sigmoid")(h))
    if kind == "embedding mask":
        h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(x, h), data


@pytest.mark.parametrize("kind", ["ops", "embedding mask"])
def test_operations_that_are_not_layers_pass_through(kind: str) -> None:
    keras.utils.set_random_seed(0)
    model, data = _with_ops(kind)
    _kill(model, "a", "b", ([1], [2, 3]))
    small, report = compact(model)
    assert (report.pairs[0].units_after, report.pairs[0].folded) == (3, 1)
    assert [type(op).__name__ for op in small.operations] == [
        type(op).__name__ for op in model.operations
    ]
    assert np.max(np.abs(np.asarray(small(data)) - np.asarray(model(data)))) <= 1e-5


def test_mixed_float16_folds_to_its_rounding() -> None:
    # The self-check's tolerance comes from float16, the dtype the layers compute in, not from
    # the float32 output (1,000 float32 ulps refused this exact compaction).
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            _dense(32, "a", activation="sigmoid", dtype="mixed_float16"),
            _dense(4, "b", dtype="mixed_float16"),
            keras.layers.Activation("linear", dtype="float32"),
        ]
    )
    model.get_layer("a").bias.assign(np.random.default_rng(3).uniform(-1.5, 1.5, 32))
    _kill(model, "a", "b", ([0, 3], [2, 5]))
    small, report = compact(model)
    assert (report.pairs[0].removed, report.pairs[0].folded) == (2, 2)
    assert small.get_layer("a").compute_dtype == "float16"
    x = np.random.default_rng(1).standard_normal((256, 5)).astype("float32")
    assert np.max(np.abs(np.asarray(small(x)) - np.asarray(model(x)))) <= 4e-3


@pytest.mark.parametrize(
    ("conv", "kernel", "padding", "dilation", "folded"),
    [
        (keras.layers.Conv1D, 1, "same", 1, True),
        (keras.layers.Conv1D, 1, "causal", 3, True),
        (keras.layers.Conv2D, (1, 1), "same", 2, True),
        (keras.layers.Conv2D, (1, 2), "same", 1, False),  # pads the second axis
        (keras.layers.Conv1D, 2, "causal", 1, False),
    ],
)
def test_a_second_conv_that_pads_nothing_folds(
    conv: Any, kernel: Any, padding: str, dilation: int, folded: bool
) -> None:
    # "same" / "causal" pad dilation * (k - 1) positions per axis: none for a one-tap kernel.
    keras.utils.set_random_seed(0)
    shape = (9, 2) if conv is keras.layers.Conv1D else (6, 7, 2)
    model = keras.Sequential(
        [
            keras.Input(shape),
            conv(6, 3, activation="sigmoid", name="a", bias_initializer="random_uniform"),
            conv(3, kernel, padding=padding, dilation_rate=dilation, name="b"),
        ]
    )
    _kill_channels(model, "a", "b", ([0, 3], [5]))
    small, report = compact(model)
    pair = report.pairs[0]
    assert (pair.folded, pair.constant_kept, pair.units_after) == (
        (2, 0, 3) if folded else (0, 2, 5)
    )
    x = np.random.default_rng(1).standard_normal((16, *shape)).astype("float32")
    assert np.max(np.abs(np.asarray(small(x)) - np.asarray(model(x)))) <= 1e-5
