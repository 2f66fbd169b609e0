"""pathnorm for Keras 3 / TensorFlow: the exact proximal map of the 1-path-norm.

Where things live (the same file names do the same jobs in ``pathnorm_lightning``):

    functional.py   pure tf functions: prox_path_norm, path_norm, product_bound, baselines
    _baselines.py   the baselines' code: prox_l1, project_rows_l1_ball, project_linf_operator_norm
    layers.py       the layer seam: Dense, Conv1D, Conv2D as the unit matrices the prox takes
    pairing.py      which kernels pair up ("auto" or named), with clear errors
    optimizers.py   the training hook: PathNormSGD and ProxOptimizer (prox after each step)
    metrics.py      sparsity and Lipschitz bounds: metric_values and the PathNormMetrics callback
    compact.py      compact: a smaller model without the dead units, the same function
    _sort.py        the shortest exact prox (read first); _band.py the default, faster one

Private helpers: ``_common.py`` (argument checks, dtypes, errors) and ``_xla.py`` (the
XLA-friendly formulations); they import each other in that order only, never the facade.
"""

from pathnorm_tf.compact import CompactionReport, compact
from pathnorm_tf.functional import (
    NonFiniteWeightsError,
    path_norm,
    product_bound,
    project_linf_operator_norm,
    project_rows_l1_ball,
    prox_l1,
    prox_path_norm,
)
from pathnorm_tf.metrics import PathNormMetrics, metric_values
from pathnorm_tf.optimizers import PathNormSGD, ProxOptimizer

__all__ = [
    "CompactionReport",
    "NonFiniteWeightsError",
    "PathNormMetrics",
    "PathNormSGD",
    "ProxOptimizer",
    "compact",
    "metric_values",
    "path_norm",
    "product_bound",
    "project_linf_operator_norm",
    "project_rows_l1_ball",
    "prox_l1",
    "prox_path_norm",
]
