"""The private names of other libraries that the library packages rely on, checked.

Each backend lists its own as :class:`PrivateName` records in its ``_private_api.py``
(:mod:`pathnorm_lightning._private_api`, :mod:`pathnorm_tf._private_api`); this pure-Python
module holds what the two share: :func:`check` runs every record's ``probe`` (small real
objects of the installed versions) and raises :class:`PrivateAPIError` naming the name, the
version, the call site and the fix; :func:`scan` reads a package's sources (``ast``, its
``_private_api.py`` left out) so that a test can hold the list complete (:func:`unlisted`) and
current (:func:`stale`); :func:`audit` runs the three checks of a list.

:func:`scan` counts, by name (a package attribute named like another library's private one
hides it): ``x._name`` (``self`` included) and the string ``"_name"`` (as in
``getattr(x, "_name")``) where the package defines no ``_name`` itself (a ``def``, ``class`` or
assignment; an annotation alone defines nothing); ``super()._name`` always; the names in
:data:`INTERNAL_ATTRIBUTES`; imports from private modules of other packages (a dotted part
starting with ``_``, ``tensorflow.python``, ``keras.src``).
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "INTERNAL_ATTRIBUTES",
    "PrivateAPIError",
    "PrivateName",
    "Use",
    "audit",
    "check",
    "problems",
    "scan",
    "stale",
    "unlisted",
]

# Attributes that are no public API although their names carry no underscore.
INTERNAL_ATTRIBUTES = frozenset({"found_inf", "grad_scale", "f_locals", "__internal__", "hooked"})
_PRIVATE_MODULES = ("tensorflow.python", "keras.src")


class PrivateAPIError(RuntimeError):
    """An installed library no longer has a private name that pathnorm uses."""


@dataclass(frozen=True)
class PrivateName:
    """One private name of another library that a library package uses.

    Attributes:
        library: the importable library that owns it (``torch``, ``lightning``, ``keras``,
            ``tensorflow``); its ``__version__`` is the installed version.
        name: what :func:`scan` sees at the call sites (attribute or module name).
        access: how the package reaches it, e.g. ``trainer.fit_loop._should_accumulate()``.
        used_in: the call sites, ``"package/file.py:function"``.
        why: what it gives that no public API does.
        probe: resolves it on real objects of the installed version; raises, or returns
            False, when it has moved.
    """

    library: str
    name: str
    access: str
    used_in: tuple[str, ...]
    why: str
    probe: Callable[[], object]

    @property
    def files(self) -> frozenset[str]:
        return frozenset(site.partition(":")[0] for site in self.used_in)


class Use(NamedTuple):
    """A private name at a line of a package file (``package/file.py``)."""

    file: str
    line: int
    name: str


def _version(library: str) -> str:
    try:
        return str(importlib.import_module(library).__version__)
    except Exception as err:  # the probe reports what is wrong; the version is context
        return f"(version unknown: {type(err).__name__})"


def problems(entries: Iterable[PrivateName], tested: Mapping[str, str]) -> list[str]:
    """One message per entry whose probe fails on the installed versions."""
    found = []
    for entry in entries:
        try:
            ok = entry.probe() is not False
            cause = "its probe found it changed"
        except Exception as err:
            ok, cause = False, f"{type(err).__name__}: {err}"
        if ok:
            continue
        good = tested.get(entry.library, "?")
        found.append(
            f"{entry.library} {_version(entry.library)}: the private name {entry.access} no "
            f"longer resolves ({cause}). pathnorm uses it in {', '.join(entry.used_in)} "
            f"({entry.why}). Tested with {entry.library} {good}. Install a tested version "
            f"(pip install '{entry.library}=={good}') or update the call site and its "
            "entry in the package's _private_api.py."
        )
    return found


def check(entries: Iterable[PrivateName], tested: Mapping[str, str]) -> None:
    """Raise :class:`PrivateAPIError` listing every entry that does not resolve."""
    found = problems(entries, tested)
    if found:
        raise PrivateAPIError("\n".join(found))


def _defined_names(trees: Iterable[ast.AST]) -> set[str]:
    """Names the package defines itself: defs, classes, assigned variables and attributes,
    import aliases (annotations without a value define nothing)."""
    nodes = [node for tree in trees for node in ast.walk(tree)]
    declared = {
        id(node.target) for node in nodes if isinstance(node, ast.AnnAssign) and node.value is None
    }
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name)
        elif isinstance(node, ast.Name | ast.Attribute) and id(node) not in declared:
            if isinstance(node.ctx, ast.Store):
                names.add(node.id if isinstance(node, ast.Name) else node.attr)
    return names


def _is_super(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _uses(tree: ast.AST, own: set[str], package: str) -> Iterable[tuple[int, str]]:
    def private(name: str) -> bool:
        return name[:1] == "_" and name[1:2] != "_" and name not in own

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if (
                node.attr in INTERNAL_ATTRIBUTES
                or private(node.attr)
                or (_is_super(node.value) and node.attr[:1] == "_" and node.attr[1:2] != "_")
            ):
                yield node.lineno, node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value  # as in getattr(x, "_name") or a tuple of names to getattr
            if name in INTERNAL_ATTRIBUTES or (name.isidentifier() and private(name)):
                yield node.lineno, name
        elif isinstance(node, ast.ImportFrom | ast.Import):
            if isinstance(node, ast.ImportFrom):
                modules = [] if node.level else [node.module or ""]
            else:
                modules = [alias.name for alias in node.names]
            for module in modules:
                root = module.split(".")[0]
                if root not in (package, "__future__") and (
                    module.startswith(_PRIVATE_MODULES)
                    or any(part.startswith("_") for part in module.split("."))
                ):
                    yield node.lineno, module


def scan(package_dir: Path) -> list[Use]:
    """The private names of other libraries used in the package at ``package_dir`` (its
    ``_private_api.py``, the list and its probes, left out)."""
    package = package_dir.name
    files = sorted(f for f in package_dir.rglob("*.py") if f.name != "_private_api.py")
    trees = {f: ast.parse(f.read_text(encoding="utf-8"), str(f)) for f in files}
    own = _defined_names(trees.values())
    found = []
    for f, tree in trees.items():
        rel = f"{package}/{f.relative_to(package_dir).as_posix()}"
        found += [Use(rel, line, name) for line, name in _uses(tree, own, package)]
    return sorted(set(found))


def unlisted(uses: Iterable[Use], entries: Iterable[PrivateName]) -> list[str]:
    """Uses that no entry lists (its name, in that file)."""
    listed = {(e.name, f) for e in entries for f in e.files}
    return [
        f"{u.file}:{u.line}: the private name {u.name!r} is used but not listed in the "
        "package's _private_api.py: add an entry (library, access, call site, why, probe), "
        "or use a public API instead."
        for u in uses
        if (u.name, u.file) not in listed
    ]


def audit(
    package_dir: Path, entries: Iterable[PrivateName], tested: Mapping[str, str]
) -> list[str]:
    """What is wrong with a package's list: :func:`unlisted` and :func:`stale` uses, and
    libraries with no tested version."""
    entries = tuple(entries)
    uses = scan(package_dir)
    untested = sorted({e.library for e in entries} - set(tested))
    return [
        *unlisted(uses, entries),
        *stale(uses, entries),
        *(f"_private_api.py: TESTED has no version for {lib}" for lib in untested),
    ]


def stale(uses: Iterable[Use], entries: Iterable[PrivateName]) -> list[str]:
    """Entries that name a file where the scan no longer finds their name."""
    seen = {(u.name, u.file) for u in uses}
    return [
        f"_private_api.py lists {e.access} in {f}, which no longer uses {e.name!r}: remove that "
        "call site from the entry (or the entry)."
        for e in entries
        for f in sorted(e.files)
        if (e.name, f) not in seen
    ]
