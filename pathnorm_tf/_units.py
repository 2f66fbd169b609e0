"""Hidden units that are still alive, and the warning for a pair that lost them all (the
optimizers warn at the end of ``fit``; :class:`~pathnorm_tf.metrics.PathNormMetrics` logs the
alive fraction)."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from pathnorm_tf import layers as seam
from pathnorm_tf import pairing

__all__ = ["alive_units", "dead_pairs", "links", "warn_dead_pairs"]


def alive_units(k_in: Any, k_out: Any, layout: seam.PairLayout | None = None) -> tf.Tensor:
    """Per hidden unit, (n,) bool: its incoming weights (column ``j`` of the seam's in-view,
    ``k_in[:, j]`` for Dense kernels) and its outgoing ones (row ``j`` of the out-view,
    ``k_out[j, :]``) both hold a nonzero weight. ``layout``: the pair's, None for Dense."""
    if layout is not None:
        k_in, k_out = layout.views(k_in, k_out)
    return tf.reduce_any(tf.not_equal(k_in, 0), 0) & tf.reduce_any(tf.not_equal(k_out, 0), 1)


def links(chain: Sequence[Any]) -> list[tuple[Any, Any, seam.PairLayout | None]]:
    """The consecutive kernels of ``chain`` with their layout (a :class:`pairing.Chain`'s;
    None for a plain list of Dense kernels)."""
    layouts = getattr(chain, "layouts", [None] * max(len(chain) - 1, 0))
    return [(a, b, lay) for (a, b), lay in zip(itertools.pairwise(chain), layouts, strict=True)]


def dead_pairs(chains: Sequence[Sequence[Any]]) -> list[tuple[str, str]]:
    """The layer paths of the consecutive kernels in ``chains`` with hidden units, none alive."""
    return [
        (pairing.layer_path(k_in), pairing.layer_path(k_out))
        for chain in chains
        for k_in, k_out, layout in links(chain)
        if int(k_in.shape[-1]) > 0 and not bool(tf.reduce_any(alive_units(k_in, k_out, layout)))
    ]


def warn_dead_pairs(
    dead: list[tuple[str, str]], optimizer: Any, warned: set[tuple[str, str]]
) -> None:
    """Warn once (per ``warned``) for each pair in ``dead`` that lost every hidden unit, with
    what to change on ``optimizer`` (a path-norm optimizer or any other)."""
    if getattr(optimizer, "_radius", None) is not None:
        strength = f"radius={optimizer._radius} is too small for these layers; try a larger one"
    elif getattr(optimizer, "_lam", None) is not None:
        strength = f"lam={optimizer._lam} is too large for these layers; try one 3-10x smaller"
    else:
        strength = "the regularization is too strong for these layers; try a smaller lam"
    for names in dead:
        if names in warned:
            continue
        warned.add(names)
        warnings.warn(
            f"pathnorm_tf: pair {names} has no alive hidden unit left (each unit's incoming or "
            "outgoing weights are all zero): it maps every input to the same output. "
            f"{strength}. The pull on each weight grows with the layers' widths: see "
            "'Choosing lam' in the Keras docs (docs/keras.md).",
            UserWarning,
            stacklevel=2,
        )
