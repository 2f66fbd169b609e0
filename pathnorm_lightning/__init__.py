"""pathnorm for PyTorch / Lightning: the exact proximal map of the 1-path-norm.

Where things live:

    functional.py   pure tensor functions: prox_path_norm(_), path_norm, bounds, baselines
    layers.py       the layer seam: one entry per layer type (Linear, Conv1d/2d) with its units
    pairing.py      which layers pair up ("auto" or explicit names), with clear errors
    hook.py         attach(): the prox after every real optimizer step, for any torch loop
    callbacks.py    PathNormProx, L1Prox, LayerwiseLinfProjection: the hook in a Lightning Trainer
    metrics.py      torchmetrics Metrics: sparsity, path-norm bound, product bound
    compact.py      compact(): remove the dead hidden units (features or channels) of every pair

The algorithms behind ``functional.py`` are private modules: ``_sort.py`` (the shortest exact
algorithm, in tensor ops: read it first), ``_kernel.py`` / ``_kernel_jit.py`` (numba, CPU),
``_cuda_graph.py`` (replays ``_sort`` on CUDA), ``_triton.py`` (one Triton kernel, CUDA) and
``_baselines.py`` (l1 prox, l1-ball projection); ``_common.py`` holds the checks they share,
and ``_chain.py`` the counts and bounds of a chain of weights. The hook's parts: ``_target.py``
(targets and their unit views), ``_plan.py`` (the plan and its guard), ``_checks.py`` (the
finiteness checks).

``attach``, the functional API and the pairing need torch (and numba for the CPU kernel) only;
the callbacks (Lightning) and the metrics (torchmetrics) are imported on first use.
"""

import importlib
from typing import TYPE_CHECKING, Any

from pathnorm_lightning.compact import CompactionReport, compact
from pathnorm_lightning.functional import (
    NonFiniteWeightsError,
    path_norm,
    product_bound,
    project_rows_l1_ball,
    project_rows_l1_ball_,
    prox_l1,
    prox_l1_,
    prox_path_norm,
    prox_path_norm_,
)
from pathnorm_lightning.hook import FiniteCheck, StepHook, StepTarget, attach
from pathnorm_lightning.pairing import LayerPair, resolve_layers, resolve_pairs

if TYPE_CHECKING:
    from pathnorm_lightning.callbacks import (
        AfterOptimizerStep,
        L1Prox,
        LayerwiseLinfProjection,
        PathNormProx,
    )
    from pathnorm_lightning.metrics import PathNormBound, ProductBound, Sparsity

#: Exports imported on first use (the callbacks need Lightning, the metrics torchmetrics).
_LAZY = {
    "pathnorm_lightning.callbacks": (
        "AfterOptimizerStep",
        "L1Prox",
        "LayerwiseLinfProjection",
        "PathNormProx",
    ),
    "pathnorm_lightning.metrics": ("PathNormBound", "ProductBound", "Sparsity"),
}


def __getattr__(name: str) -> Any:
    for module_name, names in _LAZY.items():
        if name in names:
            value = getattr(importlib.import_module(module_name), name)
            globals()[name] = value
            return value
    raise AttributeError(f"module 'pathnorm_lightning' has no attribute {name!r}")


__all__ = [
    "AfterOptimizerStep",
    "CompactionReport",
    "FiniteCheck",
    "L1Prox",
    "LayerPair",
    "LayerwiseLinfProjection",
    "NonFiniteWeightsError",
    "PathNormBound",
    "PathNormProx",
    "ProductBound",
    "Sparsity",
    "StepHook",
    "StepTarget",
    "attach",
    "compact",
    "path_norm",
    "product_bound",
    "project_rows_l1_ball",
    "project_rows_l1_ball_",
    "prox_l1",
    "prox_l1_",
    "prox_path_norm",
    "prox_path_norm_",
    "resolve_layers",
    "resolve_pairs",
]
