"""Load and validate the shared test vectors (NumPy + jsonschema only, no backend).

A backend's conformance test is a loop over :func:`iter_cases`::

    from shared_spec import iter_cases

    for case in iter_cases("path_norm_prox"):
        w_in, w_out = case.torch_layout()          # or case.keras_layout()
        ...run the backend in case.dtype, map the result back to neutral (V, W)...
        case.check(V, W)                           # raises AssertionError with details

The layout is the neutral one of :mod:`shared_spec`. Arrays are float64 (float32 cases hold
values exact in float32: cast the inputs to ``case.dtype`` before running).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from jsonschema import Draft202012Validator
from numpy.typing import NDArray

from shared_spec import _json, layouts, reference
from shared_spec._json import MAX_DEPTH

F64 = NDArray[np.float64]

KINDS = ("path_norm_prox", "l1_prox", "l1_ball_rows")

__all__ = [
    "KINDS",
    "Case",
    "Layers",
    "SpecError",
    "iter_cases",
    "load_schema",
    "load_vectors",
    "vector_files",
]


class SpecError(ValueError):
    """A vector file is malformed: the message names the file, the case and the JSON path."""


@dataclass(frozen=True)
class Layers:
    """A convolutional pair of a ``path_norm_prox`` case, as native weights: ``(first,
    second)`` in torch's and in Keras's layout, before (``torch``, ``keras``) and after
    (``torch_expected``, ``keras_expected``) the prox. See :mod:`shared_spec.layouts`."""

    network: str
    torch: tuple[F64, F64]
    keras: tuple[F64, F64]
    torch_expected: tuple[F64, F64]
    keras_expected: tuple[F64, F64]

    @property
    def flatten_positions(self) -> int | None:
        """Positions per channel of the Flatten (None for conv -> conv)."""
        if not layouts.NETWORKS[self.network][1]:
            return None
        return int(self.torch[1].shape[1] // self.torch[0].shape[0])


@dataclass(frozen=True)
class Case:
    """One test vector. Inputs and expected values are float64 NumPy arrays.

    ``path_norm_prox``: inputs ``X`` (n, p), ``Y`` (n, m), ``lam``; expected ``V``, ``W``,
    ``objective``; a convolutional pair also has ``layers`` (:class:`Layers`). ``l1_prox``:
    inputs ``w``, ``lam``; ``l1_ball_rows``: ``w``, ``radius``; both expect ``expected_w``.
    ``rival_rtol`` is set exactly when ``unique`` is false. Fields that do not apply to the
    kind are None.
    """

    file: str
    name: str
    kind: str
    description: str
    dtype: str
    unique: bool
    rtol: float
    atol: float
    objective_rtol: float
    objective_atol: float
    rival_rtol: float | None = None
    lam: float | None = None
    radius: float | None = None
    X: F64 | None = None
    Y: F64 | None = None
    V: F64 | None = None
    W: F64 | None = None
    objective: float | None = None
    w: F64 | None = None
    expected_w: F64 | None = None
    layers: Layers | None = None

    @property
    def id(self) -> str:
        """``file::name``, unique over the packaged vectors (a pytest id)."""
        return f"{Path(self.file).stem}::{self.name}"

    @property
    def np_dtype(self) -> np.dtype:
        """The NumPy dtype the backend must run the case in."""
        return np.dtype(self.dtype)

    def _pair(self) -> tuple[F64, F64]:
        if self.X is None or self.Y is None:
            raise ValueError(f"{self.id} is a {self.kind} case, not a path_norm_prox case")
        return self.X, self.Y

    def torch_layout(self) -> tuple[F64, F64]:
        """``(w_in, w_out)`` = ``(Y, X.T)``: the weights of ``Linear(m, n)`` and ``Linear(n, p)``."""
        X, Y = self._pair()
        return Y.copy(), X.T.copy()

    def keras_layout(self) -> tuple[F64, F64]:
        """``(kernel_in, kernel_out)`` = ``(Y.T, X)``: the kernels of two Dense layers."""
        X, Y = self._pair()
        return Y.T.copy(), X.copy()

    def objective_of(self, V: F64, W: F64) -> float:
        """The prox objective of a candidate ``(V, W)`` (neutral layout), in float64."""
        X, Y = self._pair()
        V, W = np.asarray(V, dtype=np.float64), np.asarray(W, dtype=np.float64)
        return reference.path_norm_objective(V, W, X, Y, float(self.lam))  # type: ignore[arg-type]

    def check(self, V: F64, W: F64 | None = None) -> None:
        """Assert a backend's output conforms; ``check(w)`` for the l1 kinds.

        ``path_norm_prox``: the objective always; when ``unique``, also the point and its zero
        pattern; otherwise each unit's objective, which must be within ``rival_rtol * (1 +
        s_i)`` of the unit's minimum (``s_i = 1/2 (||X[i]||^2 + ||Y[i]||^2)``): any of the
        unit's minimisers passes, a worse point does not. Raises AssertionError naming the case
        and the worst entry or unit.
        """
        if self.kind != "path_norm_prox":
            _assert_close(self.id, "w", np.asarray(V, dtype=np.float64), self.expected_w, self)
            return
        X, Y = self._pair()
        V, W = np.asarray(V, dtype=np.float64), np.asarray(W, dtype=np.float64)
        if V.shape != X.shape or W.shape != Y.shape:
            raise AssertionError(
                f"{self.id}: got V {V.shape}, W {W.shape}; expected {X.shape}, {Y.shape}"
            )
        if not (np.isfinite(V).all() and np.isfinite(W).all()):
            raise AssertionError(f"{self.id}: output contains NaN or inf")
        got, want = self.objective_of(V, W), float(self.objective)  # type: ignore[arg-type]
        if abs(got - want) > self.objective_atol + self.objective_rtol * abs(want):
            raise AssertionError(
                f"{self.id}: objective {got!r} != expected {want!r} "
                f"(|diff| = {abs(got - want):.3g}, rtol {self.objective_rtol}, "
                f"atol {self.objective_atol})"
            )
        if self.unique:
            _assert_close(self.id, "V", V, self.V, self)
            _assert_close(self.id, "W", W, self.W, self)
            for label, got_a, want_a in (("V", V, self.V), ("W", W, self.W)):
                bad = np.argwhere((got_a == 0) != (want_a == 0))
                if bad.size:
                    i = tuple(int(j) for j in bad[0])
                    raise AssertionError(
                        f"{self.id}: zero pattern of {label} differs at {len(bad)} entries, "
                        f"first {list(i)}: got {float(got_a[i])!r}, "
                        f"expected {float(want_a[i])!r}"  # type: ignore[index]
                    )
        else:
            self._check_units(V, W)

    def _check_units(self, V: F64, W: F64) -> None:
        """Each unit of a non-unique case is one of its minimisers, up to ``rival_rtol``."""
        X, Y = self._pair()
        assert self.V is not None and self.W is not None and self.rival_rtol is not None
        lam = float(self.lam)  # type: ignore[arg-type]
        got = reference.unit_objectives(V, W, X, Y, lam)
        excess = got - reference.unit_objectives(self.V, self.W, X, Y, lam)
        margin = self.rival_rtol * reference.unit_scales(X, Y)
        if not (excess <= margin).all():
            i = int(np.argmax(excess - margin))
            raise AssertionError(
                f"{self.id}: unit {i} is not a minimiser: its objective exceeds the unit's "
                f"minimum by {float(excess[i]):.3g} > {float(margin[i]):.3g} = rival_rtol "
                f"{self.rival_rtol} x (1 + s) (non-unique case: any point within the margin "
                "passes)"
            )

    def check_layers(self, backend: str, first: Any, second: Any) -> None:
        """Assert a backend's new native weights of a convolutional case conform.

        ``backend`` is ``"torch"`` or ``"keras"``; ``first`` and ``second`` are the new
        weights in that backend's layout (arrays of the shapes in ``self.layers``). They are
        mapped to the neutral ``(V, W)`` by :mod:`shared_spec.layouts` and checked as by
        :meth:`check`: a weight moved to another unit fails.
        """
        if self.layers is None:
            raise ValueError(f"{self.id} is not a convolutional case (it has no layers)")
        if backend not in ("torch", "keras"):
            raise ValueError(f'backend must be "torch" or "keras", got {backend!r}')
        first, second = np.asarray(first, np.float64), np.asarray(second, np.float64)
        want = self.layers.torch if backend == "torch" else self.layers.keras
        for label, got, expected in zip(("first", "second"), (first, second), want, strict=True):
            if got.shape != expected.shape:
                raise AssertionError(
                    f"{self.id}: {backend} {label} has shape {got.shape}, expected {expected.shape}"
                )
        if backend == "keras":
            first, second = layouts.torch_weights(self.layers.network, first, second)
        V, W = layouts.units(self.layers.network, first, second)
        self.check(V, W)


def _assert_close(cid: str, label: str, got: F64, want: F64 | None, case: Case) -> None:
    assert want is not None
    if got.shape != want.shape:
        raise AssertionError(f"{cid}: {label} has shape {got.shape}, expected {want.shape}")
    err = np.abs(got - want) - (case.atol + case.rtol * np.abs(want))
    if not (err <= 0).all():  # also catches NaN
        i = tuple(
            int(j) for j in np.unravel_index(np.argmax(np.nan_to_num(err, nan=np.inf)), err.shape)
        )
        raise AssertionError(
            f"{cid}: {label}{list(i)} = {float(got[i])!r}, expected {float(want[i])!r} "
            f"(rtol {case.rtol}, atol {case.atol})"
        )


def _package_dir() -> Any:
    return resources.files("shared_spec")


def load_schema() -> dict[str, Any]:
    """The JSON Schema of vector files (``shared_spec/schema.json``)."""
    return json.loads((_package_dir() / "schema.json").read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=1)
def _validator() -> Draft202012Validator:
    return Draft202012Validator(load_schema())


def vector_files() -> list[str]:
    """Names of the packaged vector files, sorted."""
    vdir = _package_dir() / "vectors"
    return sorted(e.name for e in vdir.iterdir() if e.name.endswith(".json"))


def _json_path(parts: Any) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def _matrix(value: list[list[float]], where: str, fail: Any, exact_f32: bool) -> F64:
    """A validated matrix; ``fail(msg, path)`` raises."""
    widths = {len(r) for r in value}
    if len(widths) != 1:
        fail(f"rows of unequal length {sorted(widths)}", where)
    a = np.asarray(value, dtype=np.float64)
    if not np.isfinite(a).all():
        fail("contains a non-finite number", where)
    if exact_f32 and not np.array_equal(a.astype(np.float32).astype(np.float64), a):
        fail("a float32 case's input is not exactly representable in float32", where)
    return a


#: The recorded objective must equal the objective of the recorded V, W to this relative
#: accuracy (the generator writes the objective of exactly those values).
OBJECTIVE_CONSISTENCY = 1e-12


def _parse_case(file: str, index: int, raw: dict[str, Any]) -> Case:
    name = raw["name"]

    def fail(msg: str, path: str) -> None:
        raise SpecError(f"{file}: case {name!r} (cases[{index}]) at {path}: {msg}")

    base = f"$.cases[{index}]"
    inp, exp, tol = raw["inputs"], raw["expected"], raw["tolerance"]
    common = {
        "file": file,
        "name": name,
        **{key: raw[key] for key in ("kind", "description", "dtype", "unique")},
        **{key: float(tol[key]) for key in ("rtol", "atol", "objective_rtol", "objective_atol")},
        "rival_rtol": float(tol["rival_rtol"]) if "rival_rtol" in tol else None,
    }
    if raw["unique"] and "rival_rtol" in tol:
        fail(
            "rival_rtol is for cases whose minimiser is not unique, and this one has unique "
            "= true: remove it (or set unique to false if rival minimisers exist)",
            f"{base}.tolerance.rival_rtol",
        )
    scalar_key = "radius" if raw["kind"] == "l1_ball_rows" else "lam"
    scalar = float(inp[scalar_key])

    def check_scalar() -> None:
        if raw["dtype"] == "float32" and float(np.float32(scalar)) != scalar:
            fail(
                f"a float32 case's {scalar_key} {scalar!r} is not exactly representable in "
                f"float32 (nearest: {float(np.float32(scalar))!r}); write that value and "
                "regenerate the expected values",
                f"{base}.inputs.{scalar_key}",
            )

    def mat(group: dict[str, Any], key: str, where: str) -> F64:
        exact_f32 = raw["dtype"] == "float32" and where == "inputs"
        return _matrix(group[key], f"{base}.{where}.{key}", fail, exact_f32)

    if raw["kind"] == "path_norm_prox":
        X, Y = mat(inp, "X", "inputs"), mat(inp, "Y", "inputs")
        V, W = mat(exp, "V", "expected"), mat(exp, "W", "expected")
        if X.shape[0] != Y.shape[0]:
            fail(
                f"X has {X.shape[0]} rows but Y has {Y.shape[0]}: both need one row per "
                "hidden unit (X = outgoing (n, p), Y = incoming (n, m))",
                f"{base}.inputs",
            )
        if V.shape != X.shape:
            fail(f"V has shape {V.shape}, X has {X.shape}", f"{base}.expected.V")
        if W.shape != Y.shape:
            fail(f"W has shape {W.shape}, Y has {Y.shape}", f"{base}.expected.W")
        check_scalar()
        objective = float(exp["objective"])
        own = reference.path_norm_objective(V, W, X, Y, scalar)
        if abs(objective - own) > OBJECTIVE_CONSISTENCY * (1.0 + abs(objective)):
            fail(
                f"objective {objective!r} is not the objective of the expected V, W at these "
                f"inputs ({own!r}): the file contradicts itself (edited by hand?); regenerate "
                "it with python -m shared_spec.generate",
                f"{base}.expected.objective",
            )
        native = _parse_layers(inp, exp, X, Y, V, W, base, fail) if "layers" in inp else None
        return Case(
            **common,
            lam=scalar,
            X=X,
            Y=Y,
            V=V,
            W=W,
            objective=objective,
            layers=native,
        )
    w, ew = mat(inp, "w", "inputs"), mat(exp, "w", "expected")
    if ew.shape != w.shape:
        fail(f"expected w has shape {ew.shape}, input w has {w.shape}", f"{base}.expected.w")
    check_scalar()
    if raw["kind"] == "l1_prox":
        return Case(**common, lam=scalar, w=w, expected_w=ew)
    return Case(**common, radius=scalar, w=w, expected_w=ew)


def _parse_layers(
    inp: dict[str, Any],
    exp: dict[str, Any],
    X: F64,
    Y: F64,
    V: F64,
    W: F64,
    base: str,
    fail: Any,
) -> Layers:
    """The :class:`Layers` of a convolutional case, checked against its units: the torch
    weights must hold ``(X, Y)`` (and ``(V, W)`` after the prox), the Keras kernels must be
    the torch weights' (:func:`layouts.keras_kernels`), exactly."""
    network = inp["layers"]["network"]

    def pair(group: dict[str, Any], backend: str, where: str) -> tuple[F64, F64]:
        out = []
        for key in ("first", "second"):
            try:
                a = np.asarray(group["layers"][backend][key], dtype=np.float64)
            except ValueError:
                fail("not a regular tensor (rows of unequal length)", f"{where}.{backend}.{key}")
            out.append(a)
        return out[0], out[1]

    torch_in, keras_in = (pair(inp, b, f"{base}.inputs.layers") for b in ("torch", "keras"))
    torch_out, keras_out = (pair(exp, b, f"{base}.expected.layers") for b in ("torch", "keras"))
    for where, (first, second), units, keras in (
        ("inputs", torch_in, (X, Y), keras_in),
        ("expected", torch_out, (V, W), keras_out),
    ):
        path = f"{base}.{where}.layers"
        try:
            got = layouts.units(network, first, second)
            want_keras = layouts.keras_kernels(network, first, second)
        except ValueError as err:
            fail(str(err), f"{path}.torch")
        label = "X, Y" if where == "inputs" else "V, W"
        if not all(np.array_equal(a, b) for a, b in zip(got, units, strict=True)):
            fail(f"the torch weights do not hold the units {label} of this case", f"{path}.torch")
        if not all(
            a.shape == b.shape and np.array_equal(a, b)
            for a, b in zip(keras, want_keras, strict=True)
        ):
            fail(
                "the Keras kernels are not the torch weights' (shared_spec.layouts)",
                f"{path}.keras",
            )
    return Layers(network, torch_in, keras_in, torch_out, keras_out)


def parse_document(doc: Any, file: str) -> list[Case]:
    """Validate a parsed vector file against the schema and build its cases.

    Args:
        doc: the parsed JSON document.
        file: the name used in error messages.

    Returns:
        The cases, in file order.

    Raises:
        SpecError: the document is malformed (the message names the file, case and JSON path).
    """
    deep = _json.too_deep(doc)
    if deep is not None:
        raise SpecError(
            f"{file}: at {_json_path(deep[: MAX_DEPTH + 1])}: nested more than {MAX_DEPTH} levels "
            "deep (a vector file nests 6: $.cases[i].inputs.X[row][col])"
        )
    bad = _json.first_non_finite(doc)
    if bad is not None:
        path, text = bad
        raise SpecError(
            f"{file}:{_json.case_at(doc, path)} at {_json_path(path)}: {text} is not a finite "
            "float64 number (vectors hold finite numbers only)"
        )
    errors = sorted(_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        # The deepest error is the most specific one (if/then branches report at depth).
        err = max(errors, key=lambda e: len(e.absolute_path))
        path = list(err.absolute_path)
        raise SpecError(
            f"{file}:{_json.case_at(doc, path)} at {_json_path(path)}: {err.message} "
            f"(schema: shared_spec/schema.json, {len(errors)} error(s) in all)"
        )
    cases = [_parse_case(file, i, raw) for i, raw in enumerate(doc["cases"])]
    seen: set[str] = set()
    for i, c in enumerate(cases):
        if c.name in seen:
            raise SpecError(f"{file}: case {c.name!r} (cases[{i}]) at $.cases[{i}].name: duplicate")
        seen.add(c.name)
    return cases


def _decode(file: str, raw: bytes) -> str:
    """``raw`` as UTF-8 text (JSON's encoding); anything else raises :class:`SpecError`."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{file}: not UTF-8 text (byte {raw[e.start : e.start + 1]!r} at offset {e.start}: "
            f"{e.reason}); vector files are UTF-8 JSON"
        ) from None


def _packaged_name(path_or_name: str | os.PathLike[str]) -> str | None:
    """The packaged file a bare string names (``"l1"``, ``"l1.json"``), else None.

    Only a ``str`` without a directory part can name a packaged file; a ``Path`` (or any other
    ``os.PathLike``) and a string such as ``"./l1.json"`` are filesystem paths."""
    if not isinstance(path_or_name, str) or len(Path(path_or_name).parts) != 1:
        return None
    name = path_or_name if path_or_name.endswith(".json") else f"{path_or_name}.json"
    return name if name in vector_files() else None


def _read(path_or_name: str | os.PathLike[str]) -> tuple[str, str]:
    """(display name, text) of a packaged file name or a filesystem path.

    A packaged name always reads the packaged file, never a same-named file in the current
    directory (``"./l1.json"`` or ``Path("l1.json")`` read that one)."""
    name = _packaged_name(path_or_name)
    if name is not None:
        return name, _decode(name, (_package_dir() / "vectors" / name).read_bytes())
    p = Path(path_or_name)
    if p.is_file():
        return str(p), _decode(str(p), p.read_bytes())
    raise SpecError(f"no vector file {str(path_or_name)!r}: give a path or one of {vector_files()}")


def load_vectors(path_or_name: str | os.PathLike[str] | None = None) -> list[Case]:
    """Load and validate vector files.

    Args:
        path_or_name: None for every packaged file (sorted by name); a packaged file name
            with or without ``.json`` (``"l1"``, ``"path_norm_prox.json"``), which always
            reads the packaged file; or a path (a ``Path``, or a string with a directory part
            such as ``"./l1.json"``, or a bare string that names no packaged file).

    Raises:
        SpecError: the file is missing, not UTF-8, not JSON, nested too deep, repeats a key
            in an object, holds a number that is not a finite float64 (``NaN``, or a literal
            such as ``1e999`` that overflows), fails the schema, has inconsistent shapes, an
            objective that is not that of its own V, W, or a float32 case whose lam or radius
            is not a float32 value; the message names the file, the case and the JSON path.
    """
    if path_or_name is None:
        return [c for f in vector_files() for c in load_vectors(f)]  # packaged names only
    file, text = _read(path_or_name)

    def reject(token: str) -> None:
        raise SpecError(f"{file}: {token} is not a JSON number (vectors hold finite numbers only)")

    try:
        # parse_float keeps the text of an overflowing literal (1e999) for parse_document's
        # message, which also names the case and the JSON path
        doc = json.loads(
            text,
            parse_constant=reject,
            parse_float=_json.parse_float,
            object_pairs_hook=_json.object_hook,
        )
    except json.JSONDecodeError as e:
        raise SpecError(f"{file}: not valid JSON: {e}") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise SpecError(
            f"{file}: nested more than {MAX_DEPTH} levels deep (too deep to parse; a vector "
            "file nests 6: $.cases[i].inputs.X[row][col])"
        ) from None
    repeated = _json.first_repeated_key(doc)
    if repeated is not None:
        raise SpecError(
            f"{file}:{_json.case_at(doc, repeated)} at {_json_path(repeated)}: the key "
            f"{repeated[-1]!r} appears more than once in this object (JSON keeps only the last "
            "value); remove the duplicate"
        )
    return parse_document(doc, file)


def iter_cases(kind: str | None = None) -> Iterator[Case]:
    """Every packaged case, optionally only those of one ``kind`` (see :data:`KINDS`)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    for case in load_vectors():
        if kind is None or case.kind == kind:
            yield case
