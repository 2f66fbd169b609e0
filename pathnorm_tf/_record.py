"""The record of an explicit resolution (the optimizer config's ``"resolved"`` entry, made and
read by :mod:`pathnorm_tf.pairing`), so that a reloaded optimizer resolves the same way.

A record (JSON-serializable) is ``{"names": [...], "kernels": [[layer name, shape], ...],
"targets": [position, ...]}``: the names (pairs flattened), every trained layer kernel in
variable order (the order Keras restores optimizer variables by: a reloaded model has the same),
and the position in that list of each name's kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Record", "check_record", "flat", "lookup", "make"]

Record = dict[str, Any]
#: ``(index among the variables, layer path)`` of each trained layer kernel, in variable order.
Kernels = Sequence[tuple[int, str]]


def _signature(variables: Sequence[Any], kernels: Kernels) -> list[list[Any]]:
    return [
        [layer.rpartition("/")[2], [int(d) for d in variables[i].shape]] for i, layer in kernels
    ]


def flat(items: Sequence[Any]) -> list[Any]:
    """Pairs flattened (``[(a, b), (c, d)] -> [a, b, c, d]``); a list of layers as is."""
    return [x for item in items for x in (item if isinstance(item, tuple) else (item,))]


def make(
    spec: Sequence[Any], variables: Sequence[Any], kernels: Kernels, indices: Sequence[int]
) -> Record:
    """The record of ``spec`` (explicit pairs or layers) resolved to the kernels ``indices``."""
    position = {i: p for p, (i, _) in enumerate(kernels)}
    return {
        "names": flat(spec),
        "kernels": _signature(variables, kernels),
        "targets": [position[i] for i in indices],
    }


def lookup(
    record: Record | None, names: list[str], variables: Sequence[Any], kernels: Kernels
) -> list[int] | None:
    """Indices for ``names`` from ``record`` if it is theirs and fits ``variables``, else None."""
    if record is None or record["names"] != names:
        return None
    if record["kernels"] != _signature(variables, kernels):
        return None
    return [kernels[p][0] for p in record["targets"]]


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(d, int) and not isinstance(d, bool) for d in value
    )


def check_record(value: Any) -> Record | None:
    """``value`` if it is ``None`` or a well-formed record (:func:`make`) (as read from a config)."""
    if value is None:
        return None
    fields = value if isinstance(value, dict) and len(value) == 3 else {}
    names, kernels, targets = (fields.get(k) for k in ("names", "kernels", "targets"))
    if (
        not isinstance(names, list)
        or not isinstance(kernels, list)
        or not isinstance(targets, list)
        or len(names) != len(targets)
        or not all(isinstance(n, str) for n in names)
        or not all(
            isinstance(k, list) and len(k) == 2 and isinstance(k[0], str) and _is_shape(k[1])
            for k in kernels
        )
        or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(kernels)
            for t in targets
        )
    ):
        raise ValueError(
            "resolved: expected what get_config writes after build, {'names': [name, ...], "
            "'kernels': [[layer name, shape], ...], 'targets': [position per name, ...]}, "
            f"got {value!r}; delete the entry to resolve the layer names afresh"
        )
    return value
