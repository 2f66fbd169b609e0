"""The checks of a vector file's raw JSON, before its schema: finite float64
numbers (an overflowing literal such as ``1e999`` keeps its text for the message), a bounded
depth, no repeated key; and where in the document a JSON path lies."""

from __future__ import annotations

import math
import sys
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "case_at",
    "first_non_finite",
    "first_repeated_key",
    "object_hook",
    "parse_float",
    "too_deep",
]


class _Literal(float):
    """A float that remembers the JSON text it was parsed from (kept for non-finite ones)."""

    literal: str


def parse_float(text: str) -> float:
    value = float(text)
    if math.isfinite(value):
        return value
    out = _Literal(value)  # 1e999: json gives inf, which the schema's "number" accepts
    out.literal = text
    return out


def first_non_finite(node: Any, path: tuple[Any, ...] = ()) -> tuple[list[Any], str] | None:
    """(JSON path, description) of the first number that is not a finite float64, else None."""
    if isinstance(node, float):
        if not math.isfinite(node):
            return list(path), getattr(node, "literal", repr(node))
    elif isinstance(node, int) and not isinstance(node, bool):
        if abs(node) > sys.float_info.max:  # float(node) would raise OverflowError
            digits, sign = str(abs(node)), "-" if node < 0 else ""
            return list(path), f"{sign}{digits[:10]}... (an integer of {len(digits)} digits)"
    elif isinstance(node, dict | list):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            found = first_non_finite(value, (*path, key))
            if found is not None:
                return found
    return None


def case_at(doc: Any, path: list[Any]) -> str:
    """`` case 'name' (cases[i])`` when ``path`` lies inside a case, else ``""``."""
    if len(path) >= 2 and path[0] == "cases" and isinstance(path[1], int):
        case = doc["cases"][path[1]]
        cname = case.get("name", "?") if isinstance(case, dict) else "?"
        return f" case {cname!r} (cases[{path[1]}])"
    return ""


# A vector file nests six levels deep ($.cases[i].inputs.X[r][c]); the validators recurse,
# so a far deeper document would end in RecursionError instead of a message.
MAX_DEPTH = 32


def too_deep(doc: Any) -> list[Any] | None:
    """JSON path of the first node nested deeper than :data:`MAX_DEPTH`, else None (iterative)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > MAX_DEPTH:
            return list(path)
        if isinstance(node, dict | list):
            items = node.items() if isinstance(node, dict) else enumerate(node)
            stack.extend((value, (*path, key)) for key, value in items)
    return None


class _Repeated(dict):  # type: ignore[type-arg]
    """A JSON object in which ``key`` appeared more than once (json keeps the last value)."""

    key: str


def object_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: a dict, marked (:class:`_Repeated`) when a key repeats."""
    out = dict(pairs)
    if len(out) == len(pairs):
        return out
    marked = _Repeated(out)
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            marked.key = key
            break
        seen.add(key)
    return marked


def first_repeated_key(doc: Any) -> list[Any] | None:
    """JSON path (ending in the key) of the first repeated key, in document order, else None."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, _Repeated):
            return [*path, node.key]
        if isinstance(node, dict | list):
            items = list(node.items() if isinstance(node, dict) else enumerate(node))
            stack.extend((value, (*path, key)) for key, value in reversed(items))
    return None
