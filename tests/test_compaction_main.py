"""The main job's compacted network (``pathnorm_experiments.compaction``) in torch: the units
``compact`` keeps, the parameters and the output before and after (the MLP through the
Lightning module, and the conv network), the timing helpers, a network ``compact`` refuses,
and what ``pathnorm-train`` prints and writes. The Keras side:
``test_backend_compaction_keras.py`` (a process of its own, as every file that loads
TensorFlow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from pathnorm_experiments import compaction, train  # noqa: E402
from pathnorm_experiments.data import load_embedded  # noqa: E402
from pathnorm_experiments.settings import TrainConfig  # noqa: E402

HIDDEN = 16
OUT_DEAD = (0, 1, 2)  # zero outgoing weights: removed
IN_DEAD = (2, 3, 4, 5)  # zero incoming weights: folded into the next bias (2: both)
ALIVE = HIDDEN - 6


def _params(units: int) -> int:
    """Parameters of 784-units-10."""
    return 784 * units + units + units * 10 + 10


def _conv_params(channels: int) -> int:
    """Parameters of the conv network: Conv2d(1, channels, 5, stride 2), Linear(channels * 144,
    10)."""
    return channels * 25 + channels + channels * 144 * 10 + 10


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return load_embedded().x_test[:300]


def kill(w_in: np.ndarray, w_out: np.ndarray) -> None:
    """Zero the dead units' weights in place (torch layout: w_in (n, m), w_out (p, n))."""
    w_out[:, list(OUT_DEAD)] = 0
    w_in[list(IN_DEAD)] = 0


def check(
    info: dict[str, Any], pairs: list[str], units: tuple[int, int], params: tuple[int, int]
) -> None:
    """``measure``'s record: the pairs, units and parameters before and after, the same outputs
    (float32) and positive times."""
    assert info["pairs"] == pairs
    assert (info["hidden_before"], info["hidden_after"], info["hidden_alive"]) == (*units, units[1])
    assert (info["params_before"], info["params_after"]) == params
    assert 0 <= info["max_abs_output_diff"] < 1e-5
    assert info["ms_per_1000_before"] > 0 and info["ms_per_1000_after"] > 0
    ratio = info["ms_per_1000_before"] / info["ms_per_1000_after"]
    assert info["speedup"] == pytest.approx(ratio) and info["repeats"] == 2


def test_hidden_alive_leaves_out_the_zero_unit_of_an_all_dead_pair() -> None:
    from pathnorm_lightning import compact

    first, second = nn.Linear(6, 4), nn.Linear(4, 3)
    model = nn.Sequential(first, nn.ELU(), second)
    with torch.no_grad():
        second.weight[:, :3] = 0
    assert compaction.hidden_alive(compact(model)[1]) == 1
    with torch.no_grad():
        first.weight[3] = 0  # the last one has no incoming weights: folded
    _, report = compact(model)
    assert report.units_after == 1 and compaction.hidden_alive(report) == 0


def test_torch_measures_the_lightning_modules_network(images: np.ndarray) -> None:
    from pathnorm_experiments.lightning_module import PaperMLP

    module = PaperMLP(TrainConfig(hidden=(HIDDEN,)))
    net = module.net
    first, second = (m for m in net if isinstance(m, nn.Linear))
    w_in, w_out = first.weight.detach().numpy(), second.weight.detach().numpy()
    kill(w_in, w_out)  # in place: numpy views of the parameters
    before = [p.detach().clone() for p in net.parameters()]
    module.train()
    info = compaction.measure(module, images, "torch", repeats=2)
    check(info, ["0 -> 2"], (HIDDEN, ALIVE), (_params(HIDDEN), _params(ALIVE)))
    assert module.training and net.training  # the mode is restored
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    text = compaction.format_compaction(info)
    assert text.startswith("compacted network (0 -> 2): hidden units 16 -> 10, parameters 12,730 ")
    assert "-> 7,960 (62.5%)\ninference, batch of 1,000 test images (median of 2 " in text


def test_torch_measures_the_conv_network(images: np.ndarray) -> None:
    from pathnorm_experiments.torch_backend import build_network

    net = build_network(TrainConfig(model="conv", hidden=(8,)))
    conv, linear = (m for m in net if isinstance(m, nn.Conv2d | nn.Linear))
    with torch.no_grad():
        conv.weight[6:] = 0  # zero incoming: folded (a valid convolution, then a Flatten)
        linear.weight[:, : 2 * 144] = 0  # channels 0 and 1 (144 positions each): removed
    info = compaction.measure(net, images, "torch", repeats=2)
    check(info, ["1 -> 4"], (8, 4), (_conv_params(8), _conv_params(4)))


def test_a_network_compact_refuses_is_an_error_entry(images: np.ndarray) -> None:
    model = nn.Sequential(nn.Linear(784, 8), nn.LayerNorm(8), nn.ELU(), nn.Linear(8, 10))
    info = compaction.measure(model, images, "torch", repeats=1)
    assert list(info) == ["error"] and "LayerNorm" in info["error"]
    assert compaction.format_compaction(info) == f"compacted network: not made ({info['error']})"
    with pytest.raises(ValueError, match="backend must be 'torch' or 'tf', got 'jax'"):
        compaction.measure(model, images, "jax")


def test_time_calls_alternates_the_order_and_takes_medians() -> None:
    order: list[str] = []
    calls = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    times, repeats = compaction.time_calls(calls, repeats=3, sample_s=0.0)
    # warm-up and one sizing call each, then a b, b a, a b (one call per sample)
    assert order == ["a", "a", "b", "b", "a", "b", "b", "a", "a", "b"]
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values()) and repeats == 3
    # a budget far below one turn: the least number of samples
    assert compaction.time_calls(calls, repeats=9, budget_s=1e-9)[1] == compaction.MIN_REPEATS
    assert compaction.time_calls(calls, repeats=9, budget_s=10.0)[1] == 9
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        compaction.time_calls(calls, repeats=0)


def test_batch_of_cycles_the_images() -> None:
    x = np.arange(3)[:, None]
    assert compaction.batch_of(x, 5).ravel().tolist() == [0, 1, 2, 0, 1]
    assert compaction.batch_of(np.arange(2000)[:, None]).shape == (1000, 1)
    with pytest.raises(ValueError, match="no test images to time the networks on"):
        compaction.batch_of(x[:0])


def test_the_main_job_prints_and_records_the_compacted_network(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--engine", "loop", "--epochs", "1", "--n-train", "300", "--n-test", "100"]
    args += ["--pgd-samples", "20", "--pgd-steps", "2", "--no-progress", "--lam", "0.05"]
    assert train.main([*args, "--out", str(tmp_path)]) == 0
    info = json.loads((tmp_path / "results.json").read_text())["compaction"]
    assert info["pairs"] == ["0 -> 2"] and info["hidden_before"] == 200
    assert 0 <= info["hidden_alive"] < 200  # lam 0.05 kills units in one epoch
    assert info["params_after"] == _params(max(info["hidden_alive"], 1))
    assert info["max_abs_output_diff"] < 1e-5
    out = capsys.readouterr().out
    assert f"compacted network (0 -> 2): hidden units 200 -> {info['hidden_alive']}," in out
