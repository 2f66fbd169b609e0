"""Backend-neutral assembly of a run's result (both backends report the same fields)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from pathnorm_experiments.certify import (
    certified_error,
    effective_nonzero_fraction,
    nonzero_fraction,
    path_norm_bound,
    product_bound,
    regularizer_value,
)
from pathnorm_experiments.config import History, TrainConfig
from pathnorm_experiments.data import Dataset

__all__ = ["build_result", "format_summary"]


def build_result(
    cfg: TrainConfig,
    data: Dataset,
    weights: Sequence[np.ndarray],
    biases: Sequence[np.ndarray],
    *,
    clean_error: float,
    robust_error: dict[str, float],
    train_ce: float,
    n_adv: int,
    history: History,
    timings: dict[str, float],
    backend: str,
) -> dict[str, Any]:
    """The JSON-ready result: errors per eps, sparsity, bounds and the final objective.

    ``weights``/``biases`` are NumPy arrays in torch layout (out, in). Certified error is on
    the same first ``n_adv`` test images that PGD attacks, so the two are comparable.
    """
    g = regularizer_value(weights, cfg.regularizer)
    cert = certified_error(
        weights, biases, data.x_test[:n_adv], data.y_test[:n_adv], cfg.eps, cfg.activation
    )
    max_row = [float(np.abs(w).sum(1).max()) for w in weights]
    return {
        "backend": backend,
        "dataset": data.name,
        "partial_train_set": data.partial,
        "n_train": int(data.x_train.shape[0]),
        "n_test": int(data.x_test.shape[0]),
        "n_attacked": n_adv,
        "config": cfg.to_dict(),
        "clean_error": clean_error,
        "robust_error": robust_error,
        "certified_error": cert,
        "nonzero_weights_pct": 100.0 * nonzero_fraction(weights),
        "effective_nonzero_pct": 100.0 * effective_nonzero_fraction(weights),
        "path_norm_bound": path_norm_bound(weights),
        "product_bound": product_bound(weights),
        "layer_linf_norms": max_row,
        "regularizer_value": g,
        "train_cross_entropy": train_ce,
        "final_regularized_loss": train_ce + cfg.lam * g,
        "history": asdict(history),
        "timings": timings,
    }


def format_summary(result: dict[str, Any]) -> str:
    """A human-readable table of one result."""
    cfg = result["config"]
    lines = [
        f"{result['dataset']} ({result['n_train']} train, {result['n_test']} test"
        f"{', PARTIAL train set' if result['partial_train_set'] else ''}) | backend "
        f"{result['backend']} | {cfg['regularizer']}/{cfg['method']} lam={cfg['lam']:g} "
        f"lr={cfg['lr']:g} epochs={cfg['epochs']} hidden={cfg['hidden']}",
        f"clean error {100 * result['clean_error']:.2f}%  (robust/certified on the first "
        f"{result['n_attacked']} test images, PGD-{cfg['pgd_steps']} on "
        f"{cfg.get('attack', 'ce')})",
        f"{'eps':>6} {'robust err %':>13} {'certified err %':>16}",
    ]
    for e in cfg["eps"]:
        k = f"{e:g}"
        lines.append(
            f"{e:>6g} {100 * result['robust_error'][k]:>13.2f} {100 * result['certified_error'][k]:>16.2f}"
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
