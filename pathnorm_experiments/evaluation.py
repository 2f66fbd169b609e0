"""Backend-neutral assembly of a run's result (both backends report the same fields)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from pathnorm_experiments.certify import (
    Layer,
    certified_error,
    effective_nonzero_fraction,
    interval_certified_error,
    layer_linf_norm,
    nonzero_fraction,
    path_norm_bound,
    product_bound,
    regularizer_value,
)
from pathnorm_experiments.data import Dataset
from pathnorm_experiments.regularizers import regularizer
from pathnorm_experiments.results import History
from pathnorm_experiments.settings import TrainConfig, float_key

__all__ = ["build_result", "format_summary", "place_legends", "plot_training_curve"]


def build_result(
    cfg: TrainConfig,
    data: Dataset,
    weights: Sequence[Layer],
    biases: Sequence[np.ndarray],
    *,
    clean_error: float,
    clean_error_attacked: float,
    robust_error: dict[str, float],
    train_ce: float,
    n_adv: int,
    history: History,
    timings: dict[str, float],
    backend: str,
) -> dict[str, Any]:
    """The JSON-ready result: errors per eps, sparsity, bounds and the final objective.

    ``weights``/``biases`` are NumPy arrays in torch layout (out, in), a convolution a
    :class:`~pathnorm_experiments.certify.ConvLayer` (bounds, certificates and
    ``layer_linf_norms`` are then the unrolled network's). ``clean_error`` is on all test
    images; ``clean_error_attacked``, the robust and the certified errors on the same first
    ``n_adv``, so these are comparable. Each certificate (``certified_error``: the path-norm
    Lipschitz bound; ``certified_error_interval``: interval bound propagation in the [0, 1]
    pixel box) bounds any attack's error from above.
    """
    g = regularizer_value(weights, cfg.regularizer)
    x_adv, y_adv = data.x_test[:n_adv], data.y_test[:n_adv]
    cert = certified_error(weights, biases, x_adv, y_adv, cfg.eps, cfg.activation)
    cert_interval = interval_certified_error(weights, biases, x_adv, y_adv, cfg.eps, cfg.activation)
    return {
        "backend": backend,
        "dataset": data.name,
        "partial_train_set": data.partial,
        "n_train": int(data.x_train.shape[0]),
        "n_test": int(data.x_test.shape[0]),
        "n_attacked": n_adv,
        "config": cfg.to_dict(),
        "clean_error": clean_error,
        "clean_error_attacked": clean_error_attacked,
        "robust_error": robust_error,
        "certified_error": cert,  # the path-norm Lipschitz certificate
        "certified_error_interval": cert_interval,  # interval bound propagation
        "nonzero_weights_pct": 100.0 * nonzero_fraction(weights),
        "effective_nonzero_pct": 100.0 * effective_nonzero_fraction(weights),
        "path_norm_bound": path_norm_bound(weights),
        "product_bound": product_bound(weights),
        "layer_linf_norms": [layer_linf_norm(w) for w in weights],
        "regularizer_value": g,
        "train_cross_entropy": train_ce,
        "final_regularized_loss": train_ce + cfg.lam * g,
        "history": asdict(history),
        "timings": timings,
    }


def format_summary(result: dict[str, Any]) -> str:
    """A human-readable table of one result."""
    cfg = result["config"]
    if cfg.get("model", "mlp") == "conv":
        kernel, stride = cfg["kernel_size"], cfg["stride"]
        network = f"conv {cfg['hidden'][0]} channels, kernel {kernel}, stride {stride}"
    else:
        network = f"hidden={cfg['hidden']}"
    lines = [
        f"{result['dataset']} ({result['n_train']} train, {result['n_test']} test"
        f"{', PARTIAL train set' if result['partial_train_set'] else ''}) | backend "
        f"{result['backend']} | {cfg['regularizer']}/{cfg['method']} lam={cfg['lam']:g} "
        f"lr={cfg['lr']:g} epochs={cfg['epochs']} {network}",
        f"clean error {100 * result['clean_error']:.2f}% on all {result['n_test']} test images, "
        f"{100 * result['clean_error_attacked']:.2f}% on the first {result['n_attacked']}, "
        f"where robust (PGD-{cfg['pgd_steps']} on {cfg.get('attack', 'ce')}) and certified "
        "error are measured",
        f"{'eps':>9} {'robust err %':>13} {'certified err %: Lipschitz':>27} {'interval':>9}",
    ]
    interval = result.get("certified_error_interval", {})
    for e in cfg["eps"]:
        k = float_key(e)
        lines.append(
            f"{k:>9} {100 * result['robust_error'][k]:>13.2f} "
            f"{100 * result['certified_error'][k]:>27.2f} "
            f"{100 * interval.get(k, float('nan')):>9.2f}"
        )
    lines += [
        f"nonzero weights {result['nonzero_weights_pct']:.2f}% (on live paths "
        f"{result['effective_nonzero_pct']:.2f}%)  path-norm bound "
        f"{result['path_norm_bound']:.4g}  product bound {result['product_bound']:.4g}",
        f"final regularized loss {result['final_regularized_loss']:.5f} (train CE "
        f"{result['train_cross_entropy']:.5f} + lam * g, g = {result['regularizer_value']:.5g})",
        f"time: train {result['timings'].get('train_s', 0):.1f} s, eval "
        f"{result['timings'].get('eval_s', 0):.1f} s",
    ]
    return "\n".join(lines)


def place_legends(fig: Any) -> None:
    """Move every axes' legend just below what the axes draw (ticks, tick labels, x label)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is None:
            continue
        leg.set_visible(False)
        bottom = ax.get_tightbbox(renderer).y0  # display coordinates, without the legend
        leg.set_visible(True)
        y = ax.transAxes.inverted().transform((0.0, bottom))[1]
        leg.set_bbox_to_anchor((0.5, y), transform=ax.transAxes)
        leg.set_in_layout(True)  # savefig's tight bounding box includes it again


def plot_training_curve(result: dict[str, Any], path: str | Path) -> Path:
    """Write the training curves of a :func:`build_result` result as a PNG (needs matplotlib);
    returns ``path``.

    Left: ``cross-entropy + lam * g`` (its title says what g is), the minibatch mean between
    records and on the training set at each epoch's end. Right: the % of nonzero weights, raw
    and on live paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, hist = result["config"], result["history"]
    per_epoch = result["timings"]["iterations"] / max(1, cfg["epochs"])
    fig, (ax_loss, ax_nz) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(hist["iteration"], hist["batch_objective"], lw=1, label="minibatch mean")
    ends = [per_epoch * (k + 1) for k in range(len(hist["epoch_objective"]))]
    ax_loss.plot(ends, hist["epoch_objective"], "o-", ms=3, label="training set, epoch end")
    ax_loss.set_ylabel("cross-entropy + lam * g")
    ax_loss.set_title(regularizer(cfg["regularizer"]).penalty_text, fontsize=10)
    ax_nz.plot(hist["iteration"], hist["nonzero_pct"], lw=1, label="raw")
    ax_nz.plot(hist["iteration"], hist["effective_nonzero_pct"], lw=1, label="on live paths")
    ax_nz.set_ylabel("% nonzero weights")
    for ax in (ax_loss, ax_nz):
        ax.set_xlabel("iteration")
        # 9 pt: as large as the tick labels' 10 allows; laid out by place_legends, below
        leg = ax.legend(fontsize=9, ncol=2, loc="upper center", frameon=False)
        leg.set_in_layout(False)
    fig.suptitle(
        f"{result['dataset']} | {result['backend']} | {cfg['regularizer']}/{cfg['method']} "
        f"lam={cfg['lam']:g} lr={cfg['lr']:g}",
        fontsize=10,
    )
    fig.tight_layout()
    place_legends(fig)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return Path(path)
