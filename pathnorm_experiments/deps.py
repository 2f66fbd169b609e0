"""Which optional packages a command needs, checked before any work, with the extra to install.

The extras (``pyproject.toml``): ``torch`` (PyTorch, Lightning), ``tf`` / ``tf-cpu`` (TensorFlow,
Keras), ``experiments`` (matplotlib, tqdm). A check only looks modules up
(:func:`importlib.util.find_spec`), importing nothing. The command it names fits the install:
``pip install -e ".[extra]"`` in a checkout, ``pip install "pathnorm[extra]==VERSION"`` from an
installed wheel (pip then adds the extra's packages to the installed version).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

__all__ = [
    "BACKEND_MODULES",
    "CPU_INDEX",
    "MissingDependency",
    "cpu_note",
    "default_backend",
    "installed_wheel_version",
    "missing",
    "pip_install",
    "require",
    "where",
]

# module -> (what it is, the extra that installs it)
_EXTRA = {
    "torch": ("PyTorch", "torch"),
    "lightning": ("Lightning", "torch"),
    "tensorflow": ("TensorFlow", "tf-cpu"),
    "keras": ("Keras", "tf-cpu"),
    "matplotlib": ("matplotlib", "experiments"),
}
BACKEND_MODULES = {"torch": ("torch",), "tf": ("tensorflow", "keras")}
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"  # PyTorch's CPU builds
_ROOT = Path(__file__).resolve().parents[1]  # a checkout's root, or site-packages


class MissingDependency(RuntimeError):
    """An optional package that the command needs is not installed (the message says which
    extra installs it)."""


def missing(modules: tuple[str, ...]) -> list[str]:
    """The modules of ``modules`` that cannot be imported (``None`` in ``sys.modules`` counts)."""
    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing, or a broken __spec__
            found = False
        if not found:
            out.append(name)
    return out


def installed_wheel_version() -> str | None:
    """pathnorm's installed version where this code runs from a wheel; None in a checkout (its
    folder holds ``pyproject.toml``) or where pathnorm is not installed."""
    if (_ROOT / "pyproject.toml").is_file():
        return None
    try:
        return importlib.metadata.version("pathnorm")
    except importlib.metadata.PackageNotFoundError:
        return None


def _spec(extra: str) -> str:
    version = installed_wheel_version()
    return f'".[{extra}]"' if version is None else f'"pathnorm[{extra}]=={version}"'


def pip_install(extra: str) -> str:
    """The pip command that installs ``extra`` into this install of pathnorm."""
    return f"pip install {'-e ' if installed_wheel_version() is None else ''}{_spec(extra)}"


def where() -> str:
    """`` in the pathnorm checkout`` where :func:`pip_install` is meant for a checkout, else
    ``""``."""
    return " in the pathnorm checkout" if installed_wheel_version() is None else ""


def require(modules: tuple[str, ...], what: str) -> None:
    """Raise :class:`MissingDependency` if a module of ``modules`` is missing; ``what`` (e.g.
    ``"--backend tf"``) needs them. The one-line message names the missing packages and the
    pip command that installs their extra."""
    gone = missing(modules)
    if not gone:
        return
    names = " and ".join(_EXTRA.get(m, (m, ""))[0] for m in gone)
    extras = sorted({_EXTRA[m][1] for m in gone if m in _EXTRA})
    hint = " ".join(pip_install(e) for e in extras)
    if "tf-cpu" in extras:
        hint += f" ({_spec('tf')} for TensorFlow with GPU support)"
    raise MissingDependency(
        f"{what} needs {names}, which {'is' if len(gone) == 1 else 'are'} not installed: "
        f"install {'it' if len(gone) == 1 else 'them'} with {hint}{where()}{cpu_note(extras)}"
    )


def cpu_note(extras: list[str]) -> str:
    """What a CPU-only machine adds to a pip command that installs the ``torch`` extra."""
    if "torch" not in extras:
        return ""
    return f"; on a CPU-only machine add {CPU_INDEX} (else pip fetches CUDA's torch)"


def default_backend() -> str:
    """``"torch"`` if PyTorch is installed, else ``"tf"`` if TensorFlow and Keras are, else
    ``"torch"`` (whose check then names the extras)."""
    if not missing(BACKEND_MODULES["torch"]):
        return "torch"
    if not missing(BACKEND_MODULES["tf"]):
        return "tf"
    return "torch"
