"""One run of the sweep: training (SGD, then the prox or projection; or SGD on the penalty),
the metrics every run gets, the attacks and certificates of a selected run, and their timing.

Training is the torch engine's loop (:mod:`~pathnorm_experiments.engine`, ``pathnorm-train
--engine loop``), given the run as a :class:`~pathnorm_experiments.settings.TrainConfig`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from pathnorm_experiments import certify, compaction
from pathnorm_experiments._sweep_grid import Group, Prepared, RunSpec, SweepConfig
from pathnorm_experiments.attacks_torch import pgd_attack, robust_error
from pathnorm_experiments.engine import run
from pathnorm_experiments.settings import TrainConfig, float_key
from pathnorm_experiments.torch_backend import build_model, linear_layers

__all__ = ["calibrate", "estimate", "evaluate_run", "train_config", "train_metrics", "train_run"]


def train_config(spec: RunSpec, cfg: SweepConfig) -> TrainConfig:
    """The engine's spec of the run ``spec``: 784-``cfg.hidden``-10 ELU at ``cfg``'s batch size."""
    # TrainConfig's leading fields: regularizer, method, lam, lr, epochs, batch_size, hidden
    leading = (spec.regularizer, spec.optimizer, spec.lam, spec.lr, spec.epochs, cfg.batch_size)
    return TrainConfig(*leading, (cfg.hidden,), seed=spec.seed)


def train_run(
    spec: RunSpec, data: Prepared, cfg: SweepConfig, *, steps: int | None = None
) -> tuple[list[Tensor], list[Tensor]] | None:
    """Train one run with :func:`~pathnorm_experiments.engine.run` (deterministic: the main
    job's initial weights and epoch orders) for ``spec.epochs`` epochs, or ``steps`` SGD steps.

    Returns:
        ``(weights, biases)`` (torch layout), or None when a weight became NaN or infinite.
    """
    try:
        model = run(train_config(spec, cfg), data.x_train, data.y_train, steps=steps).model
    except FloatingPointError:
        return None
    layers = linear_layers(model)
    return [lin.weight.detach() for lin in layers], [lin.bias.detach() for lin in layers]


def _error_pct(model: torch.nn.Module, x: Tensor, y: Tensor) -> float:
    wrong = 0
    with torch.no_grad():
        for s in range(0, x.shape[0], 5000):
            wrong += int((model(x[s : s + 5000]).argmax(1) != y[s : s + 5000]).sum())
    return 100.0 * wrong / x.shape[0]


def train_metrics(ws: Sequence[Tensor], bs: Sequence[Tensor], data: Prepared) -> dict[str, float]:
    """The columns every run has: validation, clean errors, sparsity, the path-norm and the
    hidden units that ``compact`` keeps (:func:`~pathnorm_experiments.compaction.hidden_alive`)."""
    w_np = [w.cpu().numpy() for w in ws]
    model = _as_model(ws, bs)
    return {
        "hidden_alive": compaction.torch_hidden_alive(model),
        "val_error": _error_pct(model, data.x_val, data.y_val),
        "clean_error": _error_pct(model, data.x_eval, data.y_eval),
        "clean_error_full": _error_pct(model, data.x_test, data.y_test),
        "nonzero": 100.0 * certify.nonzero_fraction(w_np),
        "nonzero_live": 100.0 * certify.effective_nonzero_fraction(w_np),
        "path_norm": certify.path_norm_bound(w_np),
    }


def _as_model(ws: Sequence[Tensor], bs: Sequence[Tensor]) -> torch.nn.Module:
    model = build_model([ws[0].shape[1], *(w.shape[0] for w in ws)], "elu")
    model.to(ws[0].device)
    with torch.no_grad():
        for lin, w, b in zip(linear_layers(model), ws, bs, strict=True):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
    return model.eval()


def evaluate_run(
    ws: Sequence[Tensor], bs: Sequence[Tensor], data: Prepared, cfg: SweepConfig, seed: int
) -> dict[str, float]:
    """Attacks and certificates of a selected run (weights (out, in)) on ``data``'s evaluation
    sample, the attacks' random starts from ``seed``.

    Returns:
        ``robust_error@EPS``, ``robust_error_strong@EPS``, ``certified_lipschitz@EPS`` and
        ``certified_interval@EPS`` (in %) for every eps.

    Raises:
        RuntimeError: an attack broke a certified point (a bug: a sound certificate never
            meets a successful attack).
    """
    model = _as_model(ws, bs)
    x, y = data.x_eval, data.y_eval
    w_np, b_np = [w.cpu().numpy() for w in ws], [b.cpu().numpy() for b in bs]
    x_np, y_np = x.cpu().numpy(), y.cpu().numpy()
    logits = certify.forward(w_np, b_np, x_np, "elu")
    lip = certify.lipschitz_matrix(w_np)
    gen = torch.Generator(device=x.device).manual_seed(seed + 1)  # advanced across radii
    out: dict[str, float] = {}
    strong = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    for eps in sorted(cfg.eps):
        k = float_key(eps)
        paper = robust_error(model, x, y, eps, steps=cfg.pgd_steps, seed=seed, return_mask=True)
        strong |= paper  # a point found at a smaller eps lies in this ball too
        # the strong attack: margin-loss PGD restarts on the points not yet broken
        for _ in range(cfg.strong_restarts):
            alive = torch.nonzero(~strong).flatten()
            if alive.numel() == 0:
                break
            xa = pgd_attack(
                model,
                x[alive],
                y[alive],
                eps,
                steps=cfg.pgd_steps,
                step_size=eps / 10,
                loss="margin",
                generator=gen,
            )
            with torch.no_grad():
                strong[alive[model(xa).argmax(1) != y[alive]]] = True
        cert_lip = certify.certified_mask(
            w_np, b_np, x_np, y_np, eps, "elu", logits=logits, lip=lip
        )
        cert_ibp = certify.interval_certified_mask(w_np, b_np, x_np, y_np, eps, "elu")
        broken = strong.cpu().numpy()
        if (broken & cert_lip).any() or (broken & cert_ibp).any():
            raise RuntimeError(
                f"eps {k}: an attack broke {int((broken & cert_lip).sum())} examples the "
                f"Lipschitz certificate and {int((broken & cert_ibp).sum())} the "
                "interval certificate certified"
            )
        n = x.shape[0]
        out[f"robust_error@{k}"] = 100.0 * float(paper.sum()) / n
        out[f"robust_error_strong@{k}"] = 100.0 * float(strong.sum()) / n
        out[f"certified_lipschitz@{k}"] = 100.0 * (1.0 - float(cert_lip.mean()))
        out[f"certified_interval@{k}"] = 100.0 * (1.0 - float(cert_ibp.mean()))
    return out


def calibrate(cfg: SweepConfig, data: Prepared) -> dict[str, float]:
    """``{"REG/OPT": seconds per training step, ..., "eval": seconds per selected run's
    evaluation}``, timed on ``data`` (its evaluation sample sets the attacks' cost)."""
    torch.set_num_threads(1)
    times = {}
    for reg, opt, lam in (
        ("none", "prox", 0.0),
        ("l1", "prox", 1e-3),
        ("l1", "penalty", 1e-3),
        ("path", "prox", 1e-3),
        ("path", "penalty", 1e-3),
        ("linf", "prox", 0.2),
    ):
        spec = RunSpec(data.name, reg, opt, lam, 0.1, 0, 1, data.n_train)
        train_run(spec, data, cfg, steps=5)  # warm-up (numba, allocator)
        t0 = time.perf_counter()
        train_run(spec, data, cfg, steps=100)
        times[f"{reg}/{opt}"] = (time.perf_counter() - t0) / 100
    base = RunSpec(data.name, "none", "prox", 0.0, 0.1, 0, 1, data.n_train)
    trained = train_run(base, data, cfg, steps=200)
    assert trained is not None
    # the evaluation with a tenth of the PGD steps, scaled: the strong attack's restarts run
    # on the examples the paper's PGD leaves, as they would
    short = max(1, cfg.pgd_steps // 10)
    t0 = time.perf_counter()
    evaluate_run(*trained, data, replace(cfg, pgd_steps=short), 0)
    times["eval"] = (time.perf_counter() - t0) * cfg.pgd_steps / short
    return times


def estimate(
    groups: Sequence[Group],
    data: Mapping[str, Prepared],
    cfg: SweepConfig,
    times: Mapping[str, float],
    jobs: int,
) -> tuple[int, int, float]:
    """``(training runs, evaluated runs, seconds with jobs workers)`` of ``groups`` (those left
    to run: one that only adds seeds has no selection seeds), at :func:`calibrate`'s times."""
    runs = evals = 0
    seconds = 0.0
    for g in groups:
        n_runs = len(g.lrs) * len(g.select_seeds) + len(g.seeds) - len(g.select_seeds)
        steps = g.epochs * math.ceil(data[g.dataset].n_train / cfg.batch_size)
        per_step = times[f"{g.regularizer}/{g.optimizer}"]
        runs += n_runs
        evals += len(g.seeds)
        # the eval sample's size scales the attacks; calibrated on this dataset's sample
        seconds += n_runs * steps * per_step + len(g.seeds) * times["eval"]
    return runs, evals, seconds / jobs
