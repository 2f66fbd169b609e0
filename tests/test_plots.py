"""The sweep's and the main job's plots are readable: tick labels do not overlap, and no
legend covers a data point (checked on the drawn figures, in display coordinates)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pathnorm_experiments.settings import EPS

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402


def _result(reg: str, method: str, lam: float, rng: np.random.Generator) -> dict[str, Any]:
    clean = 0.05 + 0.3 * rng.random()
    robust = {f"{e:g}": min(1.0, clean + e * 3 + 0.1 * rng.random()) for e in EPS}
    iters = list(range(10, 510, 10))
    return {
        "dataset": "mnist",
        "config": {"regularizer": reg, "method": method, "lam": lam},
        "clean_error": clean,
        "robust_error": robust,
        "certified_error": {k: min(1.0, v + 0.2) for k, v in robust.items()},
        "certified_error_interval": {k: min(1.0, v + 0.1) for k, v in robust.items()},
        "nonzero_weights_pct": 100 * rng.random(),
        "effective_nonzero_pct": 100 * rng.random(),
        "final_regularized_loss": rng.random(),
        "path_norm_bound": 100.0,
        "product_bound": 200.0,
        "history": {
            "iteration": iters,
            "batch_objective": list(2.0 / np.sqrt(np.arange(1, len(iters) + 1))),
            "effective_nonzero_pct": list(np.linspace(100, 40, len(iters))),
        },
    }


def _overlaps(a: Any, b: Any) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def readability_problems(fig: Figure) -> list[str]:
    """Overlapping tick labels and legends over data points, in display coordinates."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    problems = []
    for n, ax in enumerate(fig.axes):
        for axis in (ax.xaxis, ax.yaxis):
            boxes = [
                t.get_window_extent(renderer)
                for t in axis.get_ticklabels(minor=False) + axis.get_ticklabels(minor=True)
                if t.get_visible() and t.get_text()
            ]
            for i, a in enumerate(boxes):
                for b in boxes[i + 1 :]:
                    if _overlaps(a, b):
                        problems.append(f"axes {n}: tick labels overlap")
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        for line in ax.get_lines():
            pts = ax.transData.transform(np.column_stack(line.get_data()))
            if any(box.contains(x, y) for x, y in pts):
                problems.append(f"axes {n}: the legend covers a point of {line.get_label()!r}")
        for coll in ax.collections:
            pts = ax.transData.transform(coll.get_offsets())
            if any(box.contains(x, y) for x, y in pts):
                problems.append(f"axes {n}: the legend covers a point of {coll.get_label()!r}")
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    boxes = [leg.get_window_extent(renderer) for leg in legends]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if _overlaps(a, b):
                problems.append("two legends overlap")
    return problems


def test_the_check_finds_an_overlap_and_a_covering_legend() -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([1, 2, 3], [1, 2, 3], "o-", label="data")
    ax.set_xticks([1, 1.01, 3])
    ax.legend(loc="center")
    found = readability_problems(fig)
    plt.close(fig)
    assert "axes 0: tick labels overlap" in found
    assert "axes 0: the legend covers a point of 'data'" in found
    fig, axes = plt.subplots(1, 2, figsize=(4, 2))
    for ax in axes:
        ax.plot([0, 1], [0, 1], label="a rather long label that sticks out")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3))
    found = readability_problems(fig)
    plt.close(fig)
    assert "two legends overlap" in found


def test_training_curve_is_readable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pathnorm_experiments.evaluation import plot_training_curve

    problems: list[str] = []
    save = Figure.savefig

    texts: list[str] = []
    sizes: list[float] = []

    def checking_savefig(fig: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        problems.extend(readability_problems(fig))
        for ax in fig.axes:
            texts.extend([ax.get_title(), ax.get_ylabel()])
            legend = ax.get_legend()
            sizes.extend(t.get_fontsize() for t in legend.get_texts())  # type: ignore[union-attr]
        save(fig, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", checking_savefig)
    result = _result("path", "prox", 1e-3, np.random.default_rng(1))
    n = len(result["history"]["iteration"])
    result.update(
        backend="torch",
        config={**result["config"], "lr": 0.1, "epochs": 10},
        timings={"iterations": 500.0},
    )
    result["history"].update(
        nonzero_pct=list(np.linspace(100, 80, n)),
        epoch_objective=list(np.linspace(1.0, 0.3, 10)),
    )
    path = plot_training_curve(result, tmp_path / "curve.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert problems == []
    # the loss axis says what g is, and the legends read at the size of the tick labels
    assert "cross-entropy + lam * g" in texts and "g = sum of the pairs' 1-path-norms" in texts
    assert len(sizes) == 4 and min(sizes) >= 9
