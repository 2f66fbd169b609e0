"""pathnorm for PyTorch / Lightning: the exact proximal map of the 1-path-norm."""

from pathnorm_lightning.callbacks import (
    AfterOptimizerStep,
    L1Prox,
    LayerwiseLinfProjection,
    PathNormProx,
    StepTarget,
)
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
from pathnorm_lightning.metrics import PathNormBound, ProductBound, Sparsity
from pathnorm_lightning.pairing import LayerPair, resolve_layers, resolve_pairs

__all__ = [
    "AfterOptimizerStep",
    "L1Prox",
    "LayerPair",
    "LayerwiseLinfProjection",
    "NonFiniteWeightsError",
    "PathNormBound",
    "PathNormProx",
    "ProductBound",
    "Sparsity",
    "StepTarget",
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
