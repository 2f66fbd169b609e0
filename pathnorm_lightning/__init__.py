"""pathnorm for PyTorch / Lightning: the exact proximal map of the 1-path-norm."""

from pathnorm_lightning.functional import (
    path_norm,
    product_bound,
    project_rows_l1_ball,
    project_rows_l1_ball_,
    prox_l1,
    prox_l1_,
    prox_path_norm,
    prox_path_norm_,
)

__all__ = [
    "path_norm",
    "product_bound",
    "project_rows_l1_ball",
    "project_rows_l1_ball_",
    "prox_l1",
    "prox_l1_",
    "prox_path_norm",
    "prox_path_norm_",
]
