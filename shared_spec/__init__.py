"""Backend-neutral truth for pathnorm: the exhaustive NumPy reference, test vectors, a loader.

Layout (neutral, per hidden unit i): ``X[i]`` = outgoing weights, ``X`` (n, p); ``Y[i]`` =
incoming weights, ``Y`` (n, m). Torch: ``X = w_out.T``, ``Y = w_in``; Keras Dense:
``X = kernel_out``, ``Y = kernel_in.T``. See ``schema.json`` and ``docs/spec.md``.
"""

from shared_spec.loader import KINDS, Case, SpecError, iter_cases, load_schema, load_vectors

__all__ = ["KINDS", "Case", "SpecError", "iter_cases", "load_schema", "load_vectors"]
