"""The torch and TensorFlow backends give the same numbers: the prox itself, and training.

Layouts: torch ``w_in`` (n, m), ``w_out`` (p, n); Keras ``kernel_in = w_in.T`` (m, n),
``kernel_out = w_out.T`` (n, p).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import inspect
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import pathnorm_lightning as pnl  # noqa: E402
import pathnorm_tf as pntf  # noqa: E402
from pathnorm_lightning import PathNormProx  # noqa: E402

SHAPES = [(1, 1, 1), (5, 3, 1), (7, 6, 2), (12, 9, 4), (3, 8, 11), (40, 16, 10), (4, 5, 64)]


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    scale = max(float(np.max(np.abs(b))), 1e-300) if b.size else 1.0
    return float(np.max(np.abs(a - b))) / scale if a.size else 0.0


def _layers(rng: np.random.Generator, m: int, n: int, p: int) -> tuple[np.ndarray, np.ndarray]:
    w_in = rng.standard_normal((n, m))
    w_out = rng.standard_normal((p, n))
    # Some exact zeros and ties, as training produces them.
    w_in[rng.random(w_in.shape) < 0.15] = 0.0
    w_out[rng.random(w_out.shape) < 0.15] = 0.0
    w_in[0, : min(m, 3)] = 0.5
    return w_in, w_out


# Both sides have several exact methods (torch: compiled kernel, whole-row sort; TF: band,
# sort); every combination must give the same numbers.
TORCH_METHODS = (
    ["kernel", "sort"] if "method" in inspect.signature(pnl.prox_path_norm).parameters else [None]
)
TF_METHODS = ["band", "sort"]


def _torch_prox(w_in: np.ndarray, w_out: np.ndarray, lam: float, method: str | None) -> Any:
    kwargs = {} if method is None else {"method": method}
    return pnl.prox_path_norm(torch.from_numpy(w_in), torch.from_numpy(w_out), lam, **kwargs)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("lam", [1e-3, 0.07, 0.4, 3.0, 1e30])
@pytest.mark.parametrize(("dtype", "tol"), [("float64", 1e-12), ("float32", 1e-6)])
@pytest.mark.parametrize("method", TORCH_METHODS)
@pytest.mark.parametrize("tf_method", TF_METHODS)
def test_prox_agrees(
    shape: tuple[int, int, int],
    lam: float,
    dtype: str,
    tol: float,
    method: str | None,
    tf_method: str,
) -> None:
    rng = np.random.default_rng(abs(hash((shape, lam))) % 2**32)
    w_in, w_out = (a.astype(dtype) for a in _layers(rng, *shape))
    t_in, t_out = _torch_prox(w_in, w_out, lam, method)
    k_in, k_out = pntf.prox_path_norm(
        tf.constant(w_in.T), tf.constant(w_out.T), lam, method=tf_method
    )
    for got, want in ((k_in.numpy().T, t_in.numpy()), (k_out.numpy().T, t_out.numpy())):
        assert got.dtype == want.dtype == np.dtype(dtype)
        assert _rel_err(got, want) <= tol
        np.testing.assert_array_equal(got == 0, want == 0)


# Exact ties between candidates (neutral layout: x = outgoing, y = incoming weights of one unit):
# every method of both backends keeps the first candidate of least objective, in the order
# (x, 0), (0, y), then the stationary points by increasing k (shared_spec.reference.prox_unit).
TIES = [
    (np.array([0.5, -0.25]), np.array([-0.25, 0.5, 0.0]), 1e6),  # ||x||^2 = ||y||^2
    (np.array([1.0, 0.0]), np.array([0.5, -0.5, 0.5, 0.5]), 50.0),
    (np.array([0.5, 0.5, -0.5, 0.5]), np.array([0.0, -1.0]), 3.0),  # p > m
]


@pytest.mark.parametrize("case", range(len(TIES)))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("method", TORCH_METHODS)
@pytest.mark.parametrize("tf_method", TF_METHODS)
def test_exact_ties_are_broken_alike(
    case: int, dtype: str, method: str | None, tf_method: str
) -> None:
    x, y, lam = TIES[case]
    w_in, w_out = y[np.newaxis, :].astype(dtype), x[:, np.newaxis].astype(dtype)  # torch layout
    t_in, t_out = (t.numpy() for t in _torch_prox(w_in, w_out, lam, method))
    k_in, k_out = pntf.prox_path_norm(
        tf.constant(w_in.T), tf.constant(w_out.T), lam, method=tf_method
    )
    np.testing.assert_array_equal(t_out, w_out)  # (x, 0): the outgoing weights stay
    np.testing.assert_array_equal(t_in, 0.0)
    np.testing.assert_array_equal(k_out.numpy().T, t_out)
    np.testing.assert_array_equal(k_in.numpy().T, t_in)


# Realistic float32 layers (Glorot-uniform, as Keras and the paper's net initialise them), where
# float32 arithmetic in the per-unit work would differ from torch's compiled kernel by up to
# 1e-3 (and flip zeros): both must give the exact prox rounded to float32, up to an ulp.
REAL_SHAPES = [(784, 200, 10), (200, 50, 1), (64, 40, 100), (10, 30, 300)]


@pytest.mark.parametrize("shape", REAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float32_glorot_layers_agree(shape: tuple[int, int, int]) -> None:
    m, n, p = shape
    rng = np.random.default_rng(m * 1000 + p)
    s_in, s_out = np.sqrt(6 / (m + n)), np.sqrt(6 / (n + p))
    w_in = rng.uniform(-s_in, s_in, (n, m)).astype(np.float32)
    w_out = rng.uniform(-s_out, s_out, (p, n)).astype(np.float32)
    xla = tf.function(
        lambda a, b, lam: pntf.prox_path_norm(a, b, lam, check_finite=False), jit_compile=True
    )
    k_in, k_out = tf.constant(w_in.T), tf.constant(w_out.T)
    for lam in (1e-4, 1e-3, 1e-2, 0.1):
        t_in, t_out = (t.numpy() for t in _torch_prox(w_in, w_out, lam, "kernel"))
        results = {
            "band": pntf.prox_path_norm(k_in, k_out, lam),
            "sort": pntf.prox_path_norm(k_in, k_out, lam, method="sort"),
            "xla": xla(k_in, k_out, tf.constant(lam, tf.float64)),
        }
        for name, (a, b) in results.items():
            for got, want in ((a.numpy().T, t_in), (b.numpy().T, t_out)):
                assert _rel_err(got, want) <= 1e-6, (name, lam)
                np.testing.assert_array_equal(got == 0, want == 0, err_msg=f"{name} {lam}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bounds_and_baselines_agree(dtype: str) -> None:
    rng = np.random.default_rng(11)
    w_in, w_out = (a.astype(dtype) for a in _layers(rng, 9, 7, 3))
    ti, to = torch.from_numpy(w_in), torch.from_numpy(w_out)
    ki, ko = tf.constant(w_in.T), tf.constant(w_out.T)
    tol = 1e-12 if dtype == "float64" else 1e-6
    assert float(pntf.path_norm(ki, ko)) == pytest.approx(float(pnl.path_norm(ti, to)), rel=tol)
    assert float(pntf.product_bound(ki, ko)) == pytest.approx(
        float(pnl.product_bound(ti, to)), rel=tol
    )
    np.testing.assert_array_equal(pntf.prox_l1(ki, 0.3).numpy().T, pnl.prox_l1(ti, 0.3).numpy())
    # Layer-wise l_inf constraint: torch rows of the weight == Keras columns of the kernel.
    got = pntf.project_linf_operator_norm(ki, 1.5).numpy().T
    want = pnl.project_rows_l1_ball(ti, 1.5).numpy()
    assert _rel_err(got, want) <= tol
    np.testing.assert_array_equal(got == 0, want == 0)


# --- end to end: the same proximal gradient descent through Lightning and through Keras ------

M, N, P, SAMPLES, STEPS, LR, LAM = 12, 10, 3, 32, 20, 0.25, 0.05


class _TorchMLP(pl.LightningModule):
    def __init__(self, w: list[np.ndarray], b: list[np.ndarray]) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(M, N), torch.nn.ELU(), torch.nn.Linear(N, P)
        ).double()
        with torch.no_grad():
            for layer, wi, bi in zip((self.net[0], self.net[2]), w, b, strict=True):
                layer.weight.copy_(torch.from_numpy(wi))
                layer.bias.copy_(torch.from_numpy(bi))

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _problem() -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2020)
    w = [rng.standard_normal((N, M)) * 0.5, rng.standard_normal((P, N)) * 0.5]
    b = [rng.standard_normal(N) * 0.1, rng.standard_normal(P) * 0.1]
    x = rng.standard_normal((SAMPLES, M))
    y = rng.standard_normal((SAMPLES, P))
    return w, b, x, y


def _train_torch() -> list[np.ndarray]:
    w, b, x, y = _problem()
    model = _TorchMLP(w, b)
    data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[PathNormProx(lam=LAM)],
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=SAMPLES, shuffle=False))
    return [p.detach().numpy() for p in model.net.parameters()]


def _train_keras(jit_compile: bool) -> list[np.ndarray]:
    w, b, x, y = _problem()
    model = keras.Sequential(
        [keras.Input((M,)), keras.layers.Dense(N, activation="elu"), keras.layers.Dense(P)]
    )
    model.set_weights([w[0].T, b[0], w[1].T, b[1]])
    model.compile(
        optimizer=pntf.PathNormSGD(learning_rate=LR, lam=LAM), loss="mse", jit_compile=jit_compile
    )
    model.fit(x, y, batch_size=SAMPLES, epochs=STEPS, shuffle=False, verbose=0)
    k_in, b_in, k_out, b_out = model.get_weights()
    return [k_in.T, b_in, k_out.T, b_out]


@pytest.mark.parametrize("jit_compile", [False, True])
def test_end_to_end_proximal_gradient_descent(float64_keras: None, jit_compile: bool) -> None:
    torch_weights = _train_torch()
    keras_weights = _train_keras(jit_compile)
    w0 = _problem()[0]
    assert np.count_nonzero(torch_weights[0] == 0) > 0  # the prox did sparsify
    assert not np.allclose(torch_weights[0], w0[0])  # and training moved the weights
    for got, want in zip(keras_weights, torch_weights, strict=True):
        assert got.dtype == want.dtype == np.float64
        assert _rel_err(got, want) <= 1e-9
        np.testing.assert_array_equal(got == 0, want == 0)
