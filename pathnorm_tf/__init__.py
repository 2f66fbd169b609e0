"""pathnorm for Keras 3 / TensorFlow: the exact proximal map of the 1-path-norm."""

from pathnorm_tf.callbacks import PathNormMetrics, metric_values
from pathnorm_tf.functional import (
    path_norm,
    product_bound,
    project_linf_operator_norm,
    project_rows_l1_ball,
    prox_l1,
    prox_path_norm,
)
from pathnorm_tf.optimizers import PathNormSGD, ProxOptimizer

__all__ = [
    "PathNormMetrics",
    "PathNormSGD",
    "ProxOptimizer",
    "metric_values",
    "path_norm",
    "product_bound",
    "project_linf_operator_norm",
    "project_rows_l1_ball",
    "prox_l1",
    "prox_path_norm",
]
