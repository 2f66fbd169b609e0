"""What ``compact`` makes of a trained network: the main job's and the sweep's measures.

``pathnorm-train`` compacts the network it trained (:func:`pathnorm_lightning.compact` or
:func:`pathnorm_tf.compact`, ``pairs="auto"``) and prints and records in ``results.json`` the
hidden units, parameters and inference time per batch of 1,000 test images before and after
(:func:`measure`, :func:`format_compaction`). The sweep records :func:`hidden_alive` in
``runs.csv``. Times are medians of interleaved repeats in this process, in eval mode without
autograd in torch and in a ``tf.function`` in Keras, on the threads the run was given.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

__all__ = [
    "BATCH",
    "REPEATS",
    "batch_of",
    "format_compaction",
    "hidden_alive",
    "measure",
    "time_calls",
    "torch_hidden_alive",
]

BATCH = 1000  # images per timed forward pass
REPEATS = 15  # timed samples per network, at most
MIN_REPEATS = 5  # ... and at least, whatever the budget
BUDGET_S = 0.6  # the timed samples of both networks take about this long (slow networks: fewer)
SAMPLE_S = 0.005  # each sample repeats the call for at least this long


class _Pair(Protocol):
    units_before: int
    removed: int
    folded: int


class _Report(Protocol):
    @property
    def pairs(self) -> tuple[Any, ...]: ...


def hidden_alive(report: _Report) -> int:
    """The hidden units that ``compact`` keeps, over all pairs of its report (either backend):
    neither ``removed`` nor ``folded``. The one zero unit ``compact`` keeps where a pair's units
    are all dead is not counted (0, where the report's ``units_after`` says 1).
    """
    pairs: tuple[_Pair, ...] = report.pairs
    return sum(p.units_before - p.removed - p.folded for p in pairs)


def time_calls(
    calls: Mapping[str, Callable[[], object]],
    repeats: int,
    sample_s: float = SAMPLE_S,
    budget_s: float | None = None,
) -> tuple[dict[str, float], int]:
    """Median seconds per call of each function of no arguments, the functions timed in turn.

    Each is called once to warm up and once to size its samples, then ``repeats`` (>= 1)
    samples are taken of each, in turns (the order reversed every other turn); a sample repeats
    its call for at least ``sample_s``. ``budget_s``: fewer samples (down to
    :data:`MIN_REPEATS`, or ``repeats`` if less) where ``repeats`` turns would take longer, as
    the sizing calls estimate.

    Returns:
        (name -> median seconds per call, the samples taken of each).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    per_sample, turn = {}, 0.0
    for name, fn in calls.items():
        fn()
        t0 = time.perf_counter()
        fn()
        once = max(time.perf_counter() - t0, 1e-7)
        per_sample[name] = max(1, int(sample_s / once) + 1)
        turn += per_sample[name] * once
    if budget_s is not None:
        repeats = min(repeats, max(MIN_REPEATS, int(budget_s / turn)))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(repeats):
        for name in list(calls) if r % 2 == 0 else list(reversed(list(calls))):
            fn, n = calls[name], per_sample[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: statistics.median(s) for name, s in samples.items()}, repeats


def batch_of(x: np.ndarray, n: int = BATCH) -> np.ndarray:
    """The first ``n`` images of ``x``, taken again from the start where ``x`` has fewer."""
    if len(x) == 0:
        raise ValueError("no test images to time the networks on")
    return x[np.arange(n) % len(x)]


@contextlib.contextmanager
def _auto_pairs() -> Iterator[None]:
    """Drop the warning that an odd number of layers leaves the last one unpaired: the result
    names the pairs that were compacted."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"pairs=.auto.: (the last layer|[0-9]+ chained)")
        yield


def torch_hidden_alive(model: Any) -> int:
    """:func:`hidden_alive` of ``pathnorm_lightning.compact(model)`` (the sweep's column)."""
    from pathnorm_lightning import compact

    with _auto_pairs():
        return hidden_alive(compact(model)[1])


def _torch(model: Any, x: np.ndarray, repeats: int) -> tuple[Any, dict[str, float], int, float]:
    import torch
    from torch import nn

    from pathnorm_lightning import compact

    # the main job's LightningModule is compacted through its ``net``: copying the whole
    # module would copy its data too
    net = getattr(model, "net", None)
    net = net if isinstance(net, nn.Module) else model
    with _auto_pairs():
        small, report = compact(net)
    was_training = net.training
    net.eval()
    small.eval()
    try:
        xb = torch.from_numpy(batch_of(x)).to(next(net.parameters()).dtype)
        with torch.no_grad():
            diff = float((small(xb) - net(xb)).abs().max())
            calls = {"before": lambda: net(xb), "after": lambda: small(xb)}
            times, repeats = time_calls(calls, repeats, budget_s=BUDGET_S)
    finally:
        net.train(was_training)
    return report, times, repeats, diff


def _keras(model: Any, x: np.ndarray, repeats: int) -> tuple[Any, dict[str, float], int, float]:
    import tensorflow as tf

    from pathnorm_tf import compact

    with _auto_pairs():
        small, report = compact(model)
    xb = tf.constant(batch_of(x).astype(model.weights[0].dtype))
    before = tf.function(lambda t: model(t, training=False))
    after = tf.function(lambda t: small(t, training=False))
    diff = float(np.max(np.abs(np.asarray(after(xb)) - np.asarray(before(xb)))))
    calls = {"before": lambda: before(xb), "after": lambda: after(xb)}
    times, repeats = time_calls(calls, repeats, budget_s=BUDGET_S)
    return report, times, repeats, diff


def measure(model: Any, x: np.ndarray, backend: str, repeats: int = REPEATS) -> dict[str, Any]:
    """Compact a trained network and measure both: units, parameters, inference time.

    Args:
        model: a torch ``nn.Module`` / ``LightningModule`` (``backend="torch"``) or a Keras
            model (``"tf"``); left unchanged.
        x: test images, as the evaluation feeds them; the first :data:`BATCH` (cycled where
            there are fewer) are timed.
        repeats: timed samples per network, at most: a slow network gets fewer (no fewer than
            :data:`MIN_REPEATS`), so the timing takes about :data:`BUDGET_S`.

    Returns:
        ``pairs`` (``"first -> second"``), ``hidden_before``, ``hidden_after`` (as the report
        counts), ``hidden_alive``, ``params_before``, ``params_after`` (the whole network's),
        ``ms_per_1000_before``, ``ms_per_1000_after``, ``speedup``, ``max_abs_output_diff`` (on
        the timed batch), ``repeats`` (the samples taken); or ``error`` (why not) where
        ``compact`` refuses the network.
    """
    if backend not in ("torch", "tf"):
        raise ValueError(f"backend must be 'torch' or 'tf', got {backend!r}")
    try:
        report, times, repeats, diff = (_torch if backend == "torch" else _keras)(model, x, repeats)
    except ValueError as e:  # compact refused the network: the run's results still count
        return {"error": str(e)}
    return {
        "pairs": [f"{p.first} -> {p.second}" for p in report.pairs],
        "hidden_before": report.units_before,
        "hidden_after": report.units_after,
        "hidden_alive": hidden_alive(report),
        "params_before": report.params_before,
        "params_after": report.params_after,
        "ms_per_1000_before": 1e3 * times["before"],
        "ms_per_1000_after": 1e3 * times["after"],
        "speedup": times["before"] / times["after"],
        "max_abs_output_diff": diff,
        "repeats": repeats,
    }


def format_compaction(info: Mapping[str, Any]) -> str:
    """Two lines for the run's summary (what :func:`measure` returned)."""
    if "error" in info:
        return f"compacted network: not made ({info['error']})"
    share = info["params_after"] / info["params_before"]
    return (
        f"compacted network ({', '.join(info['pairs'])}): hidden units "
        f"{info['hidden_before']} -> {info['hidden_alive']}, parameters "
        f"{info['params_before']:,} -> {info['params_after']:,} ({share:.1%})\n"
        f"inference, batch of {BATCH:,} test images (median of {info['repeats']} interleaved "
        f"repeats): {info['ms_per_1000_before']:.3f} ms -> {info['ms_per_1000_after']:.3f} ms "
        f"({info['speedup']:.1f}x); largest output difference {info['max_abs_output_diff']:.1e}"
    )
