"""The Keras layer seam (``pathnorm_tf.layers``): which kernel entry is which unit's, the prox
through the seam against the exhaustive reference and the conv spec vectors, the same numbers
as the torch seam from the same weights, and the checks of pairs and of what stands between.

Everything runs eagerly on small float64 layers (one XLA compilation in all).
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # (before TensorFlow, as in test_cross_backend)
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from torch import nn  # noqa: E402

from pathnorm_lightning import layers as torch_layers  # noqa: E402
from pathnorm_tf import _between, layers  # noqa: E402
from shared_spec import Case, iter_cases, layouts, reference  # noqa: E402

F64 = "float64"
K = keras.layers


def _built(layer: Any, input_shape: tuple[int, ...], rng: np.random.Generator) -> Any:
    """``layer`` built for ``input_shape`` (no batch axis), its kernel random with zeros."""
    layer.build((None, *input_shape))
    kernel = rng.normal(size=tuple(layer.kernel.shape))
    kernel[rng.random(kernel.shape) < 0.15] = 0.0
    layer.kernel.assign(kernel)
    return layer


def _pairs() -> dict[str, tuple[Any, Any, list[Any], tuple[int, ...]]]:
    """Named pairs ``(first, second, layers between, input shape)``, channels last;
    non-square kernels, so that a swap of the kernel axes shows."""
    rng = np.random.default_rng(0)

    def conv(rank: int, *args: Any, **kwargs: Any) -> Any:
        return (K.Conv1D if rank == 1 else K.Conv2D)(*args, dtype=F64, use_bias=False, **kwargs)

    def dense(units: int) -> Any:
        return K.Dense(units, dtype=F64, use_bias=False)

    return {
        "dense-dense": (_built(dense(4), (5,), rng), _built(dense(3), (4,), rng), [K.ELU()], (5,)),
        "conv1d-conv1d": (
            _built(conv(1, 3, 3), (9, 2), rng),
            _built(conv(1, 2, 2, strides=2), (7, 3), rng),
            [K.ReLU()],
            (9, 2),
        ),
        "conv2d-conv2d": (
            _built(conv(2, 3, (2, 3)), (5, 6, 2), rng),
            _built(conv(2, 2, (3, 2), padding="same"), (4, 4, 3), rng),
            [K.Activation("tanh")],
            (5, 6, 2),
        ),
        "conv1d-flatten-dense": (
            _built(conv(1, 3, 2), (5, 2), rng),
            _built(dense(2), (12,), rng),
            [K.ELU(), K.Flatten()],
            (5, 2),
        ),
        "conv2d-flatten-dense": (
            _built(conv(2, 3, (2, 3)), (3, 5, 1), rng),
            _built(dense(2), (18,), rng),
            [K.ELU(), K.Flatten()],
            (3, 5, 1),
        ),
        "conv2d-pool-flatten-dense": (
            _built(conv(2, 2, 2), (5, 5, 1), rng),
            _built(dense(3), (8,), rng),
            [K.ELU(), K.MaxPooling2D(2), K.Dropout(0.5), K.Flatten()],
            (5, 5, 1),
        ),
        "conv2d-global-dense": (
            _built(conv(2, 3, 2), (4, 4, 2), rng),
            _built(dense(2), (3,), rng),
            [K.GlobalAveragePooling2D()],
            (4, 4, 2),
        ),
    }


PAIRS = _pairs()


def _hidden(first: Any, between: list[Any], u: np.ndarray) -> tf.Tensor:
    """What the second layer reads, before the flattening (channels last)."""
    h = first(u)
    for layer in between:
        if not isinstance(layer, (K.Flatten, K.GlobalAveragePooling2D)):
            h = layer(h)
    return h


def _read(second: Any, h: tf.Tensor, between: list[Any]) -> np.ndarray:
    for layer in between:
        if isinstance(layer, (K.Flatten, K.GlobalAveragePooling2D)):
            h = layer(h)
    return second(h).numpy()


@pytest.mark.parametrize("name", list(PAIRS))
def test_each_view_column_and_row_is_the_weights_of_one_unit(name: str) -> None:
    """Changing unit c's incoming column changes output channel c only; changing its outgoing
    row changes how the second layer reads channel c only."""
    first, second, between, shape = PAIRS[name]
    entry_first, entry_second = layers.entry_of(first), layers.entry_of(second)
    layers.check_between(first, second, between)
    flattening = next((b for b in between if isinstance(b, K.Flatten)), None)
    flat = layers.flat_of(first, second, flattening)
    n = entry_first.units_out(first)
    assert entry_second.units_in(second, flat) == n
    u = np.random.default_rng(1).normal(size=(3, *shape))
    old_in, old_out = first.kernel.numpy(), second.kernel.numpy()
    base, h = first(u).numpy(), _hidden(first, between, u).numpy()
    for c in range(n):
        cols = entry_first.in_view(first.kernel).numpy()
        cols[:, c] += 1.0
        entry_first.write_in(first.kernel, tf.constant(cols))
        changed = np.abs(first(u).numpy() - base).reshape(-1, n).sum(0)
        first.kernel.assign(old_in)
        assert changed[c] > 0 and changed.sum() == changed[c]

        rows = entry_second.out_view(second.kernel, n, flat).numpy()
        rows[c] += 1.0
        only_c, others = np.zeros_like(h), h.copy()
        only_c[..., c], others[..., c] = np.abs(h[..., c]) + 0.5, 0.0
        before = (_read(second, only_c, between), _read(second, others, between))
        entry_second.write_out(second.kernel, tf.constant(rows), flat)
        after = (_read(second, only_c, between), _read(second, others, between))
        second.kernel.assign(old_out)
        assert not np.allclose(after[0], before[0])
        np.testing.assert_allclose(after[1], before[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(PAIRS))
def test_views_round_trip_and_hold_every_weight_once(name: str) -> None:
    first, second, between, _ = PAIRS[name]
    flat = layers.flat_of(
        first, second, next((b for b in between if isinstance(b, K.Flatten)), None)
    )
    entry_first, entry_second = layers.entry_of(first), layers.entry_of(second)
    n = entry_first.units_out(first)
    view_in, view_out = (
        entry_first.in_view(first.kernel),
        entry_second.out_view(second.kernel, n, flat),
    )
    assert view_in.shape[1] == n and view_out.shape[0] == n
    for view, kernel in ((view_in, first.kernel), (view_out, second.kernel)):
        np.testing.assert_array_equal(np.sort(view.numpy(), None), np.sort(kernel.numpy(), None))
    np.testing.assert_array_equal(entry_first.in_native(view_in, first.kernel.shape), first.kernel)
    np.testing.assert_array_equal(
        entry_second.out_native(view_out, second.kernel.shape, flat), second.kernel
    )


def test_channel_major_flattening() -> None:
    """``Flat(P, channels_last=False)``: a Dense reading a (N, C, P) tensor flattened as it is
    (a channels_first convolution, then a channels_last Flatten) gives channel c the rows
    c * P .. c * P + P - 1."""
    rng = np.random.default_rng(3)
    dense = _built(K.Dense(2, dtype=F64, use_bias=False), (12,), rng)
    entry, flat = layers.entry_of(dense), layers.Flat(4, channels_last=False)
    rows = entry.out_view(dense.kernel, 3, flat).numpy()
    np.testing.assert_array_equal(rows[1], dense.kernel.numpy()[4:8].ravel())
    h = rng.normal(size=(2, 3, 4))  # (N, C, P)
    only_1 = h * (np.arange(3) == 1)[None, :, None]
    np.testing.assert_allclose(
        dense(only_1.reshape(2, 12)).numpy(), h[:, 1] @ rows[1].reshape(4, 2), atol=1e-12
    )
    built = K.Conv2D(3, 2, data_format="channels_first", dtype=F64)
    built.build((None, 1, 3, 3))
    assert layers.flat_of(built, dense, K.Flatten(data_format="channels_last")) == flat
    assert layers.flat_of(built, dense, K.Flatten(data_format="channels_first")) == layers.Flat(4)
    with pytest.raises(ValueError, match="channels_first: the order the Dense layer reads"):
        layers.flat_of(built, dense)
    with pytest.raises(ValueError, match="would interleave positions and channels"):
        layers.flat_of(
            PAIRS["conv2d-flatten-dense"][0],
            _built(K.Dense(1, dtype=F64), (18,), rng),
            K.Flatten(data_format="channels_first"),
        )
    with pytest.raises(ValueError, match=r"Flat\.positions must be >= 1"):
        layers.Flat(0)


# --- the prox through the seam, against the exhaustive reference ----------------------------


def _units(
    entry_first: Any, k1: Any, entry_second: Any, k2: Any, flat: Any
) -> tuple[np.ndarray, np.ndarray]:
    """The neutral (X, Y) of two kernels: rows are units (outgoing, incoming)."""
    y = entry_first.in_view(k1).numpy().T
    return entry_second.out_view(k2, y.shape[0], flat).numpy(), y


def _random_kernels(rng: np.random.Generator) -> tuple[Any, np.ndarray, Any, np.ndarray, Any]:
    """A small random Keras pair as kernels: (entry, kernel, entry, kernel, flat)."""
    conv, dense = layers.ConvEntry(), layers.DenseEntry()
    kind = int(rng.integers(0, 4))
    c_in, c, out = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 3))
    k = tuple(int(v) for v in rng.integers(1, 3, size=int(rng.integers(1, 3))))
    if kind == 0:
        return (
            dense,
            rng.normal(size=(int(rng.integers(1, 7)), c)),
            dense,
            rng.normal(size=(c, out)),
            None,
        )
    first = rng.normal(size=(*k, c_in, c))
    if kind == 1:
        return conv, first, conv, rng.normal(size=(*k[::-1], c, out)), None
    flat = layers.Flat(int(rng.integers(1, 5)), channels_last=kind == 2)
    return conv, first, dense, rng.normal(size=(flat.positions * c, out)), flat


def test_prox_through_the_seam_is_the_exact_prox_of_each_unit() -> None:
    """Random pairs of every type with ties, zeros and lam from 1e-8 to 1e6, both methods:
    per unit the objective is the reference's minimum; a unique minimiser is the reference's."""
    rng = np.random.default_rng(26)
    unique = 0
    for _ in range(24):
        entry1, k1, entry2, k2, flat = _random_kernels(rng)
        style = int(rng.integers(0, 3))
        if style == 0:  # ties
            k1, k2 = (np.sign(a) * rng.choice([0.5, 1.0], size=a.shape) for a in (k1, k2))
        elif style == 1:  # zeros
            k1, k2 = (a * (rng.random(a.shape) < 0.5) for a in (k1, k2))
        lam = float(rng.choice([1e-8, 10 ** rng.uniform(-3, 0.5), 1e6]))
        x, y = _units(entry1, tf.constant(k1), entry2, tf.constant(k2), flat)
        v_ref, w_ref = reference.prox_path_norm(x, y, lam)
        is_unique = reference.minimiser_margin(x, y, lam, 1e-12)[1] == 0.0
        unique += is_unique
        for method in ("band", "sort"):
            new1, new2 = layers.prox_kernels(
                k1, k2, lam, first=entry1, second=entry2, flat=flat, method=method
            )
            assert new1.shape == k1.shape and new2.shape == k2.shape
            v, w = _units(entry1, new1, entry2, new2, flat)
            for i in range(x.shape[0]):
                h = reference.objective(v[i], w[i], x[i], y[i], lam)
                h_ref = reference.objective(v_ref[i], w_ref[i], x[i], y[i], lam)
                assert h <= h_ref + 1e-9 * max(1.0, h_ref), (method, lam, h, h_ref)
            if is_unique:
                np.testing.assert_allclose(v, v_ref, rtol=1e-9, atol=1e-12)
                np.testing.assert_allclose(w, w_ref, rtol=1e-9, atol=1e-12)
    assert unique >= 15


def test_prox_pair_assigns_and_runs_under_xla() -> None:
    first, second, _, _ = PAIRS["conv2d-pool-flatten-dense"]
    old = (first.kernel.numpy(), second.kernel.numpy())
    try:
        new1, new2 = layers.prox_pair(first, second, 0.05)
        np.testing.assert_array_equal(first.kernel.numpy(), old[0])  # assign=False: untouched
        flat = layers.flat_of(first, second)
        entries = {"first": layers.ConvEntry(), "second": layers.DenseEntry(), "flat": flat}
        options = {"method": "sort", "check_finite": False}  # (the band compiles for seconds)
        jit = tf.function(
            lambda a, b: layers.prox_kernels(a, b, 0.05, **entries, **options), jit_compile=True
        )
        xla1, xla2 = jit(tf.constant(old[0]), tf.constant(old[1]))
        np.testing.assert_allclose(xla1, new1, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(xla2, new2, rtol=1e-12, atol=1e-15)
        layers.prox_pair(first, second, 0.05, assign=True, method="sort")
        np.testing.assert_allclose(first.kernel.numpy(), new1, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(second.kernel.numpy(), new2, rtol=1e-12, atol=1e-15)
        assert (second.kernel.numpy() == 0).any()
    finally:
        first.kernel.assign(old[0])
        second.kernel.assign(old[1])


# --- the conv spec vectors, and the torch seam from the same weights ------------------------

CONV_CASES = [c for c in iter_cases("path_norm_prox") if c.layers is not None]


def _keras_pair(network: str, kernels: tuple[np.ndarray, np.ndarray], size: int) -> tuple[Any, Any]:
    """Bias-free float64 Keras layers holding ``kernels`` of ``network``, on inputs of
    ``size`` positions per spatial axis."""
    dims, flat = layouts.NETWORKS[network]
    k1, k2 = kernels
    conv = K.Conv1D if dims == 1 else K.Conv2D
    first = conv(k1.shape[-1], k1.shape[:-2], use_bias=False, dtype=F64)
    first.build((None, *([size] * dims), k1.shape[-2]))
    if flat:
        second = K.Dense(k2.shape[1], use_bias=False, dtype=F64)
        second.build((None, k2.shape[0]))
    else:
        second = conv(k2.shape[-1], k2.shape[:-2], use_bias=False, dtype=F64)
        second.build((None, *([size] * dims), k2.shape[-2]))
    first.kernel.assign(k1)
    second.kernel.assign(k2)
    return first, second


def test_conv_vectors_cover_every_network() -> None:
    assert {c.layers.network for c in CONV_CASES if c.layers} == set(layouts.NETWORKS)


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: c.id)
def test_keras_seam_passes_the_conv_vector(case: Case) -> None:
    assert case.layers is not None and case.lam is not None
    first, second = _keras_pair(case.layers.network, case.layers.keras, 9)
    assert layers.flat_of(first, second) == (
        None
        if case.layers.flatten_positions is None
        else layers.Flat(case.layers.flatten_positions)
    )
    for method in ("band", "sort"):
        new1, new2 = layers.prox_pair(first, second, case.lam, method=method)
        case.check_layers("keras", new1.numpy(), new2.numpy())


def _torch_pair(
    network: str, weights: tuple[np.ndarray, np.ndarray]
) -> tuple[nn.Module, nn.Module]:
    dims, flat = layouts.NETWORKS[network]
    w1, w2 = weights
    conv = nn.Conv1d if dims == 1 else nn.Conv2d
    first = conv(w1.shape[1], w1.shape[0], tuple(w1.shape[2:]), bias=False).double()
    if flat:
        second: nn.Module = nn.Linear(w2.shape[1], w2.shape[0], bias=False).double()
    else:
        second = conv(w2.shape[1], w2.shape[0], tuple(w2.shape[2:]), bias=False).double()
    with torch.no_grad():
        first.weight.copy_(torch.from_numpy(w1))
        second.weight.copy_(torch.from_numpy(w2))
    return first, second


CROSS = {  # network, torch weight shapes, input (C_in, *spatial), pooled
    "conv2d-conv2d": ("conv2d-conv2d", (3, 2, 2, 3), (2, 3, 3, 2), (2, 5, 6), False),
    "conv1d-conv1d": ("conv1d-conv1d", (4, 2, 3), (3, 4, 2), (2, 8), False),
    "conv2d-flatten-linear": ("conv2d-flatten-linear", (3, 1, 2, 3), (2, 18), (1, 3, 5), False),
    "conv1d-flatten-linear": ("conv1d-flatten-linear", (2, 2, 2), (3, 8), (2, 5), False),
    "conv2d-pool-flatten": ("conv2d-flatten-linear", (2, 1, 2, 2), (2, 8), (1, 5, 5), True),
}


@pytest.mark.parametrize("name", list(CROSS))
def test_torch_and_keras_seams_agree_on_the_same_network(name: str) -> None:
    """The same network in torch and Keras (same outputs on the same inputs), its pair's prox
    through each seam, every method of each: the new networks agree to 1e-12 in float64."""
    network, shape1, shape2, in_shape, pooled = CROSS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    w1, w2 = rng.normal(size=shape1), rng.normal(size=shape2)
    w1[rng.random(shape1) < 0.2] = 0.0
    w1.reshape(shape1[0], -1)[0, :2] = 0.5  # ties
    u = rng.normal(size=(3, *in_shape))

    def torch_net(first: nn.Module, second: nn.Module) -> np.ndarray:
        h = torch.nn.functional.elu(first(torch.from_numpy(u)))
        h = torch.nn.functional.max_pool2d(h, 2) if pooled else h
        return second(h.flatten(1) if isinstance(second, nn.Linear) else h).detach().numpy()

    def keras_net(first: Any, second: Any) -> np.ndarray:
        h = K.ELU(dtype=F64)(first(np.moveaxis(u, 1, -1)))
        h = K.MaxPooling2D(2, dtype=F64)(h) if pooled else h
        out = second(K.Flatten(dtype=F64)(h) if isinstance(second, K.Dense) else h).numpy()
        return out if out.ndim == 2 else np.moveaxis(out, -1, 1)

    kernels = layouts.keras_kernels(network, w1, w2)
    t_first, t_second = _torch_pair(network, (w1, w2))
    k_first, k_second = _keras_pair(network, kernels, in_shape[1])
    np.testing.assert_allclose(
        keras_net(k_first, k_second), torch_net(t_first, t_second), rtol=1e-12, atol=1e-12
    )
    for lam in (1e-3, 0.07, 0.4, 3.0):
        wants = []
        for t_method in ("kernel", "sort"):
            a, b = _torch_pair(network, (w1, w2))
            torch_layers.prox_pair_(a, b, lam, method=t_method)
            wants.append(
                layouts.keras_kernels(network, *(w.detach().numpy() for w in (a.weight, b.weight)))
            )
        for k_method, want in zip(("band", "sort"), wants, strict=True):
            got = layers.prox_pair(k_first, k_second, lam, method=k_method)
            for g, w, other in zip(got, want, wants[0], strict=True):
                np.testing.assert_allclose(g.numpy(), w, rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(other, w, rtol=1e-12, atol=1e-12)
                assert np.array_equal(g.numpy() == 0, w == 0)
    layers.prox_pair(k_first, k_second, 0.07, assign=True)
    torch_layers.prox_pair_(t_first, t_second, 0.07)
    np.testing.assert_allclose(
        keras_net(k_first, k_second), torch_net(t_first, t_second), rtol=1e-12, atol=1e-12
    )


# --- the factor s, and refusals -------------------------------------------------------------


@pytest.mark.parametrize(
    ("conv", "size"),
    [
        (K.Conv1D(1, 3, padding="valid"), 7),
        (K.Conv1D(1, 3, padding="same", strides=2), 8),
        (K.Conv1D(1, 3, padding="causal", dilation_rate=2), 7),
        (K.Conv1D(1, 4, padding="same"), 6),
        (K.Conv2D(1, (3, 2), padding="same", strides=(2, 1)), 5),
    ],
    ids=["valid", "same-strided", "causal-dilated", "same-even", "2d-same"],
)
def test_reuse_is_the_count_of_outputs_reading_a_tap(conv: Any, size: int) -> None:
    """``s`` = the most output positions any kernel tap reads a real input through: a conv
    with a single weight 1 at that tap, on an input of ones, sums to that count."""
    dims = len(conv.kernel_size)
    conv.build((None, *([size] * dims), 1))
    ones = np.ones((1, *([size] * dims), 1))
    counts = []
    for tap in np.ndindex(*conv.kernel_size):
        kernel = np.zeros(tuple(conv.kernel.shape))
        kernel[(*tap, 0, 0)] = 1.0
        conv.kernel.assign(kernel.astype(conv.kernel.dtype))
        counts.append(round(float(np.sum(conv(ones.astype(conv.kernel.dtype))))))
    assert layers.entry_of(conv).reuse(conv, (size,) * dims) == max(counts)
    if conv.padding == "valid" or (conv.padding == "same" and conv.strides == (1,) * dims):
        twin = (nn.Conv1d if dims == 1 else nn.Conv2d)(
            1,
            1,
            conv.kernel_size,
            stride=conv.strides,
            padding=conv.padding,
            dilation=conv.dilation_rate,
        )
        assert torch_layers.entry_of(twin).reuse(twin, (size,) * dims) == max(counts)
    dense = K.Dense(2)
    dense.build((None, 3))
    assert layers.entry_of(dense).reuse(dense) == 1


def _unbuilt(layer: Any, shape: tuple[int, ...] | None) -> Any:
    if shape is not None:
        layer.build((None, *shape))
    return layer


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        (_unbuilt(K.Conv3D(2, 2), (4, 4, 4, 1)), _unbuilt(K.Conv3D(1, 2), (3, 3, 3, 2)), "Conv3D .* has no hidden units.*Conv1D, Conv2D, Dense"),
        (_unbuilt(K.Conv2DTranspose(2, 2), (4, 4, 1)), _unbuilt(K.Conv2D(1, 2), (5, 5, 2)), "Conv2DTranspose .* has no hidden"),
        (_unbuilt(K.DepthwiseConv2D(2), (4, 4, 2)), _unbuilt(K.Conv2D(1, 2), (3, 3, 2)), "DepthwiseConv2D .* has no hidden"),
        (_unbuilt(K.Conv2D(4, 2, groups=2), (4, 4, 2)), _unbuilt(K.Conv2D(1, 2), (3, 3, 4)), "has groups=2: a grouped convolution"),
        (K.Dense(3), _unbuilt(K.Dense(1), (3,)), "has no kernel yet: build the model first"),
        (_unbuilt(K.Dense(3), (4,)), _unbuilt(K.Conv1D(1, 2), (5, 3)), "cannot read the units of"),
        (_unbuilt(K.Dense(3), (4,)), _unbuilt(K.Dense(1), (2,)), "with 3 outputs and .* with 2 inputs"),
        (_unbuilt(K.Conv1D(3, 2), (5, 1)), _unbuilt(K.Dense(1), (7,)), "7 inputs are not a whole number of positions of 3"),
    ],
)  # fmt: skip
def test_unsupported_pairs_are_refused(first: Any, second: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layers.prox_pair(first, second, 0.1)


def test_a_layer_cannot_pair_with_itself_and_bad_options_are_refused() -> None:
    first, second, _, _ = PAIRS["conv1d-conv1d"]
    with pytest.raises(ValueError, match="cannot pair with itself"):
        layers.prox_pair(first, first, 0.1)
    with pytest.raises(ValueError, match="method must be one of"):
        layers.prox_pair(first, second, 0.1, method="kernel")
    with pytest.raises(ValueError, match="lam must be a finite number >= 0"):
        layers.prox_pair(first, second, -1.0)


_CONV = _unbuilt(K.Conv2D(2, 2), (5, 5, 1))
_DENSE = _unbuilt(K.Dense(1), (32,))


@pytest.mark.parametrize(
    ("first", "second", "between", "message"),
    [
        (_CONV, _DENSE, [K.BatchNormalization(), K.Flatten()], "BatchNormalization .* is neither"),
        (_CONV, _DENSE, [K.Activation("softmax"), K.Flatten()], "Activation .* is neither"),
        (_CONV, _DENSE, [_unbuilt(K.PReLU(), (4, 4, 2)), K.Flatten()], "PReLU .* is neither"),
        (_CONV, _DENSE, [K.ReLU()], "needs a Flatten"),
        (_CONV, _DENSE, [K.Flatten(), K.Flatten()], "may stand only once"),
        (_CONV, _DENSE, [K.Flatten(), K.MaxPooling1D()], "pools positions, but there are none"),
        (_CONV, _DENSE, [K.MaxPooling2D(data_format="channels_first"), K.Flatten()], "would pool across channels"),
        (_unbuilt(K.Dense(3), (4,)), _unbuilt(K.Dense(1), (3,)), [K.Flatten()], "may stand only once, after a convolution"),
        (_unbuilt(K.Dense(3), (4,)), _unbuilt(K.Dense(1), (3,)), [K.MaxPooling1D()], "pools positions"),
        (_unbuilt(K.Dense(3), (4,)), _unbuilt(K.Conv1D(1, 1), (4, 3)), [], "cannot read the units of a Dense"),
        (_unbuilt(K.Dense(3, activation="softmax"), (4,)), _unbuilt(K.Dense(1), (3,)), [], "applies softmax to its outputs, which mixes its units"),
        (_unbuilt(K.Conv2D(2, 2, activation="log_softmax"), (5, 5, 1)), _DENSE, [K.Flatten()], "applies log_softmax"),
    ],
)  # fmt: skip
def test_check_between_refuses(first: Any, second: Any, between: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layers.check_between(first, second, between)


def test_check_between_reports_pools_and_the_flattening() -> None:
    pool, flat = K.AveragePooling2D(2), K.Flatten()
    found = layers.check_between(_CONV, _DENSE, [K.ELU(), K.SpatialDropout2D(0.1), pool, flat])
    assert found == layers.Between((pool,), flat)
    glob = K.GlobalMaxPooling2D()
    assert layers.check_between(_CONV, _DENSE, [glob]) == layers.Between((glob,), glob)
    assert layers.role_of(K.Activation("relu")) is layers.Role.POINTWISE
    assert layers.role_of(K.Softmax()) is None


@pytest.mark.parametrize("name", [*_between.STEEP, "elu", "relu", "tanh", "softplus", "sigmoid"])
def test_max_slope_is_the_sup_of_the_derivative(name: str) -> None:
    x = tf.constant(np.linspace(-12.0, 12.0, 480_001))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(keras.activations.get(name)(x))
    sup = float(tf.reduce_max(tf.abs(tape.gradient(y, x))))
    slope = layers.max_slope(K.Activation(name))
    assert sup <= slope + 1e-9  # never below: the warning must fire whenever it exceeds 1
    if np.isfinite(slope):
        assert slope - max(sup, 1.0) < 1e-3


@pytest.mark.parametrize(
    ("first", "between", "warns"),
    [(K.Dense(3, activation="gelu"), [], True), (K.Dense(3), [K.Activation("swish")], True),
     (K.Dense(3), [K.ELU(alpha=2.0)], True), (K.Dense(3), [K.LeakyReLU(negative_slope=1.5)], True),
     (K.Dense(3, activation="elu"), [K.Dropout(0.1)], False), (K.Dense(3), [K.ReLU()], False),
     (K.Dense(3, activation="tanh"), [K.LeakyReLU(0.2)], False)],
    ids=lambda v: repr(v)[:40],
)  # fmt: skip
def test_an_activation_steeper_than_one_warns_that_the_bounds_do_not_hold(
    first: Any, between: list[Any], warns: bool
) -> None:
    first = _unbuilt(first, (4,))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        layers.check_between(first, _unbuilt(K.Dense(1), (3,)), between)
    assert len([w for w in seen if "path_norm_bound" in str(w.message)]) == int(warns)


def test_register_adds_a_layer_type() -> None:
    class Twin(K.Dense):  # a subclass: found through its base class
        pass

    class Custom(K.Layer):
        def build(self, input_shape: Any) -> None:
            self.kernel = self.add_weight(shape=(input_shape[-1], 3), dtype=F64)

    twin = _unbuilt(Twin(2, dtype=F64), (3,))
    assert isinstance(layers.entry_of(twin), layers.DenseEntry)
    custom = _unbuilt(Custom(dtype=F64), (4,))
    with pytest.raises(ValueError, match=r"Custom .* has no hidden units"):
        layers.entry_of(custom)
    layers.register(Custom, layers.DenseEntry())
    try:
        new1, new2 = layers.prox_pair(custom, twin, 0.2)
        v_ref, w_ref = reference.prox_path_norm(twin.kernel.numpy(), custom.kernel.numpy().T, 0.2)
        np.testing.assert_allclose(new2.numpy(), v_ref, atol=1e-12)
        np.testing.assert_allclose(new1.numpy().T, w_ref, atol=1e-12)
    finally:
        del layers.ENTRIES[Custom]
    with pytest.raises(TypeError, match=r"keras\.layers\.Layer subclass"):
        layers.register(int, layers.DenseEntry())
    with pytest.raises(TypeError, match="entry must be a LayerEntry"):
        layers.register(Custom, object())  # type: ignore[arg-type]


class _ChannelsFirstHead(keras.Model):
    """conv (channels_first) -> Flatten -> Dense, subclassed: no graph shows the Flatten."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = K.Conv2D(3, 2, data_format="channels_first", name="conv")
        self.flat, self.dense = K.Flatten(), K.Dense(2, name="dense")

    def call(self, x: Any) -> Any:
        return self.dense(self.flat(self.conv(x)))


@pytest.mark.parametrize("pairs", ["auto", [("conv", "dense")]])
def test_a_channels_first_conv_in_a_subclassed_model_says_what_to_do(pairs: Any) -> None:
    # Before: "... pass the Flatten layer", which no optimizer argument takes.
    from pathnorm_tf import PathNormSGD

    model = _ChannelsFirstHead()
    model(np.zeros((1, 1, 4, 4), "float32"))
    with pytest.raises(
        ValueError, match="put a Flatten between them in a Sequential or functional model"
    ):
        PathNormSGD(0.1, lam=1e-3, pairs=pairs, model=model).build(model.trainable_variables)


@pytest.mark.parametrize("pairs", ["auto", [("c", "d")]])
def test_a_permute_between_a_conv_and_its_dense_layer_is_refused(pairs: Any) -> None:
    # Before: the Dense rows were matched to the channels by the conv's own layout (wrong
    # after the Permute) and proxed; with explicit pairs, without a word.
    from pathnorm_tf import PathNormSGD

    head = [K.Permute((3, 1, 2)), K.Flatten(), K.Dense(2, name="d")]
    model = keras.Sequential([keras.Input((6, 6, 2)), K.Conv2D(3, 3, name="c"), *head])
    with pytest.raises(ValueError, match=r"'permute.*' between them moves the entries"):
        PathNormSGD(0.1, lam=1e-3, pairs=pairs, model=model).build(model.trainable_variables)


def test_auto_pairs_on_parallel_branches_say_to_name_the_pairs() -> None:
    # Before: "... 'a2' -> 'b2' do not chain: 'a2' has 4 units but 'b2' takes 6 inputs ..." and
    # no word of what "auto" had paired, nor of what to do.
    from pathnorm_tf import PathNormSGD

    inp = keras.Input((6,))
    a = K.Dense(4, name="a2")(K.Dense(6, "relu", name="a1")(inp))
    b = K.Dense(4, name="b2")(K.Dense(6, "relu", name="b1")(inp))
    model = keras.Model(inp, K.Dense(3, name="out")(K.Concatenate()([a, b])))
    with pytest.raises(
        ValueError,
        match=r"layers 'a2' -> 'b2' do not chain: 'a2' has 4 units but 'b2' takes 6 inputs .*"
        r"layer order \(it had paired \[\('a1', 'b1'\)\] before\), which in a model with "
        r"parallel branches .*; pass pairs=\[\(first, second\), \.\.\.\] to name the pairs",
    ):
        PathNormSGD(0.1, lam=1e-3, model=model).build(model.trainable_variables)
    named = PathNormSGD(0.1, lam=1e-3, pairs=[("a1", "a2"), ("b1", "b2")], model=model)
    named.build(model.trainable_variables)  # what the message says to do
    assert named.regularized_pairs == [("a1/kernel", "a2/kernel"), ("b1/kernel", "b2/kernel")]
