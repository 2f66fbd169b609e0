"""The shared spec itself: schema, loader, generator determinism, and the reference solver."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jsonschema import Draft202012Validator

from shared_spec import (
    KINDS,
    Case,
    SpecError,
    iter_cases,
    layouts,
    load_schema,
    load_vectors,
    loader,
)
from shared_spec import generate as gen
from shared_spec import reference as ref
from shared_spec.loader import parse_document, vector_files
from shared_spec.reference import F64

ALL_CASES = load_vectors()
PROX_CASES = [c for c in ALL_CASES if c.kind == "path_norm_prox"]


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    schema = load_schema()
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    # The layout is stated once, in the schema.
    assert "X = w_out.T" in schema["description"]
    assert "X = kernel_out" in schema["description"]


def test_packaged_files_and_counts() -> None:
    assert vector_files() == sorted(gen.FILES)
    assert len(ALL_CASES) >= 40
    assert len({c.id for c in ALL_CASES}) == len(ALL_CASES)
    kinds = {c.kind for c in ALL_CASES}
    assert kinds == set(KINDS)
    assert {c.dtype for c in PROX_CASES} == {"float32", "float64"}
    # Mostly unique minimisers; a few flagged on purpose.
    assert 0 < sum(not c.unique for c in PROX_CASES) <= 3


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_expected_values_pass_their_own_check(case: Case) -> None:
    if case.kind == "path_norm_prox":
        assert case.V is not None and case.W is not None
        case.check(case.V, case.W)
        assert case.objective == pytest.approx(case.objective_of(case.V, case.W), rel=1e-15)
    else:
        assert case.expected_w is not None
        case.check(case.expected_w)


def test_coverage_of_the_brief() -> None:
    """The vectors cover what the issue asks for; a regenerated set must keep covering it."""
    prox = {c.name: c for c in PROX_CASES}
    assert "errata_conformance" in prox
    shapes = [(c.X.shape, c.Y.shape) for c in PROX_CASES if c.X is not None and c.Y is not None]
    assert any(x[1] == 1 for x, _ in shapes)  # single output
    assert any(x[1] > 1 for x, _ in shapes)  # multi output
    assert any(x[1] >= 200 and y[1] >= 100 for x, y in shapes)  # wide pairs
    lams = [c.lam for c in PROX_CASES if c.lam is not None]
    assert 0.0 in lams and 1e-8 in lams and 1e6 in lams and any(1 <= x < 1e6 for x in lams)
    assert any(abs(lam**2 * kl - 1) < 1e-5 for lam in lams for kl in range(1, 65))
    zero_rows = [c for c in PROX_CASES if c.X is not None and (np.abs(c.X).sum(1) == 0).any()]
    assert zero_rows
    ball = [c for c in ALL_CASES if c.kind == "l1_ball_rows"]
    assert any(c.radius == 0 for c in ball)
    mixed = next(c for c in ball if c.name == "ball_mixed_rows")
    assert mixed.w is not None and mixed.radius is not None
    norms = np.abs(mixed.w).sum(1)
    assert (norms < mixed.radius).any() and (norms > mixed.radius).any()


@pytest.mark.parametrize("kind", [*KINDS, None])
def test_iter_cases_filters_by_kind(kind: str | None) -> None:
    got = list(iter_cases(kind))
    assert got and all(kind is None or c.kind == kind for c in got)
    assert len(got) == len([c for c in ALL_CASES if kind is None or c.kind == kind])


def test_iter_cases_rejects_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        list(iter_cases("prox"))


@pytest.mark.parametrize("name", ["l1", "l1.json"])
def test_load_by_packaged_name(name: str) -> None:
    cases = load_vectors(name)
    assert [c.name for c in cases] == [c.name for c in ALL_CASES if c.file == "l1.json"]


def test_load_by_path_and_missing_name(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text((Path(gen.VECTORS_DIR) / "l1.json").read_text())
    assert len(load_vectors(path)) == len(load_vectors("l1"))
    with pytest.raises(SpecError, match=r"no vector file 'nope'.*l1\.json"):
        load_vectors("nope")


def test_packaged_names_ignore_same_named_files_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packaged = load_vectors("l1")
    doc = json.loads((Path(gen.VECTORS_DIR) / "l1.json").read_text())
    doc["cases"] = doc["cases"][:1]
    doc["cases"][0]["expected"]["w"][0][0] = 123.0
    (tmp_path / "l1.json").write_text(json.dumps(doc))
    monkeypatch.chdir(tmp_path)
    for got in (load_vectors("l1.json"), load_vectors("l1"), load_vectors()[: len(packaged)]):
        assert [c.name for c in got] == [c.name for c in packaged]
        assert got[0].expected_w is not None and packaged[0].expected_w is not None
        assert got[0].expected_w[0, 0] == packaged[0].expected_w[0, 0] != 123.0
    assert len(list(iter_cases("l1_prox"))) == sum(c.kind == "l1_prox" for c in packaged) == 5
    # A Path, or a string with a directory part, is the file on disk.
    for path in (Path("l1.json"), "./l1.json"):
        (case,) = load_vectors(path)
        assert case.file == str(Path("l1.json")) and case.expected_w is not None
        assert case.expected_w[0, 0] == 123.0


def test_layout_helpers() -> None:
    case = next(c for c in PROX_CASES if c.name == "more_outputs_than_inputs")
    assert case.X is not None and case.Y is not None
    w_in, w_out = case.torch_layout()
    kernel_in, kernel_out = case.keras_layout()
    n, p = case.X.shape
    m = case.Y.shape[1]
    assert w_in.shape == (n, m) and w_out.shape == (p, n)
    assert kernel_in.shape == (m, n) and kernel_out.shape == (n, p)
    np.testing.assert_array_equal(w_out[:, 0], case.X[0])
    np.testing.assert_array_equal(kernel_in[:, 0], case.Y[0])
    l1 = next(c for c in ALL_CASES if c.kind == "l1_prox")
    with pytest.raises(ValueError, match="not a path_norm_prox case"):
        l1.torch_layout()


# --- Case.check catches wrong answers -----------------------------------------------------


def _unique_case() -> Case:
    return next(c for c in PROX_CASES if c.name == "multi_output_lam_0.15")


def test_check_rejects_a_moved_point() -> None:
    case = _unique_case()
    assert case.V is not None and case.W is not None
    V = case.V.copy()
    i = np.argwhere(V != 0)[0]
    V[tuple(i)] += 1e-6
    with pytest.raises(AssertionError, match=r"multi_output_lam_0\.15: (objective|V)"):
        case.check(V, case.W)


def test_check_rejects_a_changed_zero_pattern() -> None:
    case = _unique_case()
    assert case.V is not None and case.W is not None
    W = case.W.copy()
    i = tuple(np.argwhere(W == 0)[0])
    W[i] = 1e-300  # within every tolerance, but no longer a zero
    with pytest.raises(AssertionError, match="zero pattern of W"):
        case.check(case.V, W)


def test_check_on_a_non_unique_case_accepts_any_minimiser() -> None:
    case = next(c for c in PROX_CASES if c.name == "lam_huge_equal_norms")
    assert not case.unique and case.X is not None and case.Y is not None
    # The other minimiser: every unit keeps its incoming side instead.
    case.check(np.zeros_like(case.X), case.Y)
    with pytest.raises(AssertionError, match="objective"):
        case.check(case.X, case.Y)  # the identity is far from optimal at lam = 1e6
    with pytest.raises(AssertionError, match="NaN or inf"):
        case.check(np.full_like(case.X, np.nan), case.Y)


def _f32_wide() -> Case:
    return next(c for c in PROX_CASES if c.name == "f32_wide_p64_m96")


def test_non_unique_cases_record_the_rival_margin() -> None:
    flagged = {c.name: c.rival_rtol for c in PROX_CASES if not c.unique}
    assert flagged == {"lam_huge_equal_norms": 1e-12, "f32_wide_p64_m96": 1e-6}
    assert all(c.rival_rtol is None for c in ALL_CASES if c.unique)


def test_non_unique_check_rejects_a_unit_outside_the_rival_margin() -> None:
    """Per unit, every candidate of the exhaustive reference within ``rival_rtol * (1 + s)``
    of the minimum passes and every other fails, although most of those pass the layer's
    objective tolerance (the probe found 23 such wrong points, up to 0.022 off)."""
    case = _f32_wide()
    assert case.X is not None and case.Y is not None and case.V is not None
    assert case.W is not None and case.lam is not None and case.rival_rtol is not None
    scales = ref.unit_scales(case.X, case.Y)
    assert case.objective is not None
    layer_tol = case.objective_atol + case.objective_rtol * case.objective
    rivals, caught, caught_by_unit_only = 0, 0, 0
    for i in range(case.X.shape[0]):
        best = ref.objective(case.V[i], case.W[i], case.X[i], case.Y[i], case.lam)
        for h, v, w in ref.prox_unit_candidates(case.X[i], case.Y[i], case.lam):
            V, W = case.V.copy(), case.W.copy()
            V[i], W[i] = v, w
            if h - best <= case.rival_rtol * scales[i]:
                case.check(V, W)
                rivals += 1
                continue
            layer_passes = abs(case.objective_of(V, W) - case.objective) <= layer_tol
            unit_message = rf"f32_wide_p64_m96: unit {i} is not a minimiser"
            with pytest.raises(AssertionError, match=unit_message if layer_passes else "objective"):
                case.check(V, W)
            caught += 1
            caught_by_unit_only += layer_passes
    # each unit's own point plus 6 rivals within the margin; 23 wrong points within the
    # layer's objective tolerance
    assert (rivals, caught_by_unit_only) == (4 + 6, 23) and caught > 100


def test_check_l1_kind() -> None:
    case = next(c for c in ALL_CASES if c.name == "l1_random")
    assert case.expected_w is not None
    with pytest.raises(AssertionError, match=r"l1::l1_random: w\[\d+, \d+\]"):
        case.check(case.expected_w + 1e-3)


# --- the boundary vectors catch solvers that mishandle d = 1 - k l lam^2 near 0 --------------


def _enumerating_prox(X: F64, Y: F64, lam: float, skip: Callable[[float], bool]) -> tuple[F64, F64]:
    """A prox like the reference's that skips the pairs with ``skip(d)``, and that takes the
    least objective with ``np.argmin`` (a NaN objective wins, as in ``torch.min``). With
    ``d <= 0`` it is right; ``d < 1e-3`` drops near-boundary pairs; ``d < 0`` divides 0 by 0."""
    V, W = np.zeros_like(X), np.zeros_like(Y)
    for i, (x, y) in enumerate(zip(X, Y, strict=True)):
        ox, oy = np.argsort(-np.abs(x), kind="stable"), np.argsort(-np.abs(y), kind="stable")
        xs, ys = np.abs(x)[ox], np.abs(y)[oy]
        points = [(x.copy(), np.zeros_like(y)), (np.zeros_like(x), y.copy())]
        for k in range(1, x.size + 1):
            for l_ in range(1, y.size + 1):
                d = np.float64(1.0) - k * l_ * lam * lam
                if skip(float(d)):
                    continue
                with np.errstate(divide="ignore", invalid="ignore"):
                    a = (xs[:k].sum() - k * lam * ys[:l_].sum()) / d
                    b = (ys[:l_].sum() - l_ * lam * xs[:k].sum()) / d
                if a < 0 or b < 0 or xs[k - 1] - lam * b < 0 or ys[l_ - 1] - lam * a < 0:
                    continue  # a NaN norm passes: every comparison with NaN is false
                v, w = np.zeros_like(x), np.zeros_like(y)
                v[ox[:k]] = np.sign(x[ox[:k]]) * (xs[:k] - lam * b)
                w[oy[:l_]] = np.sign(y[oy[:l_]]) * (ys[:l_] - lam * a)
                points.append((v, w))
        with np.errstate(invalid="ignore"):
            h = [ref.objective(v, w, x, y, lam) for v, w in points]
        V[i], W[i] = points[int(np.argmin(h))]
    return V, W


BOUNDARY = [c for c in PROX_CASES if c.name.startswith("lam_boundary_")]
EXACT_BOUNDARY = [c for c in PROX_CASES if c.name.startswith("lam_exact_boundary_")]


def _run(case: Case, skip: Callable[[float], bool]) -> None:
    assert case.X is not None and case.Y is not None and case.lam is not None
    case.check(*_enumerating_prox(case.X, case.Y, case.lam, skip))


@pytest.mark.parametrize("case", BOUNDARY + EXACT_BOUNDARY, ids=lambda c: c.id)
def test_boundary_vectors_pass_the_right_enumeration(case: Case) -> None:
    _run(case, lambda d: d <= 0)


@pytest.mark.parametrize("case", BOUNDARY, ids=lambda c: c.id)
def test_boundary_vectors_keep_their_support_pair_below_only(case: Case) -> None:
    k, l_ = (int(t) for t in re.findall(r"_k(\d+)_l(\d+)_", case.name)[0])
    assert case.X is not None and case.V is not None and case.W is not None
    assert case.lam is not None and case.Y is not None
    below = case.name.endswith("_below")
    assert (k * l_ * case.lam**2 < 1) == below
    supports = [
        (int(np.count_nonzero(v)), int(np.count_nonzero(w)))
        for v, w in zip(case.V, case.W, strict=True)
    ]
    assert supports[:3] == ([(k, l_)] * 3 if below else supports[:3])
    assert ((k, l_) in supports) == below
    for x, y in zip(case.X[:3], case.Y[:3], strict=True):
        table = ref._unit_candidate_objectives(x, y, case.lam)
        assert any(r[1] == k and r[2] == l_ for r in table[2:]) == below  # feasible pair


@pytest.mark.parametrize(
    "case", [c for c in BOUNDARY if c.name.endswith("_below")], ids=lambda c: c.id
)
def test_dropping_near_boundary_pairs_fails_the_below_vectors(case: Case) -> None:
    with pytest.raises(AssertionError, match=rf"{case.name}: (objective|V|W)"):
        _run(case, lambda d: d < 1e-3)


@pytest.mark.parametrize("case", EXACT_BOUNDARY, ids=lambda c: c.id)
def test_dividing_by_zero_at_the_exact_boundary_fails_the_vector(case: Case) -> None:
    """A prox that does not skip d == 0 gets 0 / 0 = NaN in the units built for it."""
    assert case.X is not None and case.Y is not None and case.lam is not None
    V, W = _enumerating_prox(case.X, case.Y, case.lam, lambda d: d < 0)
    bad = [i for i in range(len(V)) if np.isnan(V[i]).any() or np.isnan(W[i]).any()]
    assert bad == ([0, 1, 2] if case.lam == 0.5 else [0, 1])
    with pytest.raises(AssertionError, match=rf"{case.name}: output contains NaN"):
        case.check(V, W)


# --- malformed files -------------------------------------------------------------------------


def _doc() -> dict[str, Any]:
    return json.loads((Path(gen.VECTORS_DIR) / "path_norm_prox.json").read_text())


def _set(path: list[Any], value: Any) -> Any:
    def edit(doc: dict[str, Any]) -> dict[str, Any]:
        doc = copy.deepcopy(doc)
        node = doc
        for p in path[:-1]:
            node = node[p]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return doc

    return edit


_DELETE = object()

MALFORMED = {
    "missing_field": (
        _set(["cases", 1, "tolerance"], _DELETE),
        r"case 'single_output_lam_0\.05' \(cases\[1\]\) at \$\.cases\[1\]: 'tolerance' is a required",
    ),
    "unknown_kind": (
        _set(["cases", 2, "kind"], "prox"),
        r"case 'single_output_lam_0\.2' \(cases\[2\]\) at \$\.cases\[2\]\.kind: 'prox' is not one of",
    ),
    "negative_lam": (
        _set(["cases", 0, "inputs", "lam"], -0.1),
        r"case 'errata_conformance' \(cases\[0\]\) at \$\.cases\[0\]\.inputs\.lam: -0\.1 is less than",
    ),
    "string_entry": (
        _set(["cases", 0, "inputs", "X", 1, 0], "0.5"),
        r"at \$\.cases\[0\]\.inputs\.X\[1\]\[0\]: '0\.5' is not of type 'number'",
    ),
    "bad_dtype": (
        _set(["cases", 0, "dtype"], "float16"),
        r"at \$\.cases\[0\]\.dtype: 'float16' is not one of",
    ),
    "rows_do_not_pair": (
        _set(["cases", 0, "inputs", "Y"], [[0.1, 0.2], [0.3, 0.4]]),
        r"case 'errata_conformance' \(cases\[0\]\) at \$\.cases\[0\]\.inputs: X has 3 rows but Y has 2",
    ),
    "ragged_rows": (
        _set(["cases", 0, "inputs", "X", 1], [0.1]),
        r"at \$\.cases\[0\]\.inputs\.X: rows of unequal length \[1, 2\]",
    ),
    "expected_shape": (
        _set(["cases", 0, "expected", "V"], [[0.1, 0.2]]),
        r"at \$\.cases\[0\]\.expected\.V: V has shape \(1, 2\), X has \(3, 2\)",
    ),
    "extra_key": (
        _set(["cases", 0, "expected", "V_new"], [[0.0]]),
        r"at \$\.cases\[0\]\.expected: Additional properties are not allowed \('V_new'",
    ),
    "no_cases": (_set(["cases"], []), r"at \$\.cases: \[\] should be non-empty"),
    "duplicate_name": (
        _set(["cases", 1, "name"], "errata_conformance"),
        r"case 'errata_conformance' \(cases\[1\]\) at \$\.cases\[1\]\.name: duplicate",
    ),
    "float32_not_exact": (
        _set(["cases", 0, "dtype"], "float32"),
        r"at \$\.cases\[0\]\.inputs\.X: a float32 case's input is not exactly representable",
    ),
    "inf_scalar": (
        _set(["cases", 2, "tolerance", "rtol"], float("inf")),
        r"case 'single_output_lam_0\.2' \(cases\[2\]\) at \$\.cases\[2\]\.tolerance\.rtol: inf is not a finite",
    ),
    "missing_kind": (
        _set(["cases", 0, "kind"], _DELETE),
        r"case 'errata_conformance' \(cases\[0\]\) at \$\.cases\[0\]: 'kind' is a required "
        r"property \(schema: shared_spec/schema\.json, 1 error\(s\) in all\)",
    ),
    "inputs_not_an_object": (
        _set(["cases", 0, "inputs"], []),
        r"at \$\.cases\[0\]\.inputs: \[\] is not of type 'object'",
    ),
    "objective_not_that_of_V_W": (
        _set(["cases", 0, "expected", "objective"], 0.2),
        r"case 'errata_conformance' \(cases\[0\]\) at \$\.cases\[0\]\.expected\.objective: "
        r"objective 0\.2 is not the objective of the expected V, W at these inputs "
        r"\(0\.15176712071692877\): the file contradicts itself",
    ),
    "lam_edited": (
        _set(["cases", 0, "inputs", "lam"], 0.12),
        r"at \$\.cases\[0\]\.expected\.objective: objective 0\.15176712071692877 is not the "
        r"objective of the expected V, W at these inputs \(0\.1754462506676630\d\)",
    ),
    "V_edited": (
        _set(["cases", 0, "expected", "V", 0, 0], 0.5),
        r"at \$\.cases\[0\]\.expected\.objective: objective 0\.15176712071692877 is not the",
    ),
    "unique_flipped_on_a_non_unique_case": (
        _set(["cases", 18, "unique"], True),
        r"case 'lam_huge_equal_norms' \(cases\[18\]\) at "
        r"\$\.cases\[18\]\.tolerance\.rival_rtol: rival_rtol is for cases whose minimiser is not "
        r"unique, and this one has unique = true: remove it",
    ),
    "non_unique_without_rival_margin": (
        _set(["cases", 0, "unique"], False),
        r"at \$\.cases\[0\]\.tolerance: 'rival_rtol' is a required property",
    ),
    "nan_entry": (
        _set(["cases", 0, "expected", "V", 2, 1], float("nan")),
        r"case 'errata_conformance' \(cases\[0\]\) at \$\.cases\[0\]\.expected\.V\[2\]\[1\]: nan is not a finite",
    ),
}


def test_layers_on_an_l1_case_is_rejected_where_it_is() -> None:
    doc = json.loads((Path(gen.VECTORS_DIR) / "l1.json").read_text())
    doc["cases"][0]["inputs"]["layers"] = _conv_doc()["cases"][0]["inputs"]["layers"]
    with pytest.raises(SpecError) as info:
        parse_document(doc, "broken.json")
    assert str(info.value) == (
        "broken.json: case 'l1_random' (cases[0]) at $.cases[0].inputs: Additional properties "
        "are not allowed ('layers' was unexpected) (schema: shared_spec/schema.json, 1 error(s) "
        "in all)"
    )


@pytest.mark.parametrize(
    ("file", "name", "key"),
    [
        ("path_norm_prox_float32.json", "f32_multi_output", "lam"),
        ("l1.json", "l1_f32", "lam"),
        ("l1.json", "ball_f32", "radius"),
    ],
)
def test_float32_case_with_a_scalar_not_in_float32_is_rejected(
    file: str, name: str, key: str
) -> None:
    doc = json.loads((Path(gen.VECTORS_DIR) / file).read_text())
    i = next(i for i, c in enumerate(doc["cases"]) if c["name"] == name)
    doc["cases"][i]["inputs"][key] = 0.1
    with pytest.raises(SpecError) as info:
        parse_document(doc, "broken.json")
    assert str(info.value) == (
        f"broken.json: case {name!r} (cases[{i}]) at $.cases[{i}].inputs.{key}: a float32 "
        f"case's {key} 0.1 is not exactly representable in float32 (nearest: "
        "0.10000000149011612); write that value and regenerate the expected values"
    )


@pytest.mark.parametrize(
    ("old", "new", "where"),
    [
        ('"lam": 0.1\n', '"lam": 0.1,\n        "lam": 0.7\n', "case 'errata_conformance' "),
        (
            '"name": "errata_conformance",',
            '"name": "errata_conformance",\n      "name": "renamed",',
            "case 'renamed' ",
        ),
        ('"format_version": 1', '"format_version": 1,\n  "format_version": 1', ""),
    ],
    ids=["lam", "name", "top-level"],
)
def test_repeated_key_is_rejected(tmp_path: Path, old: str, new: str, where: str) -> None:
    """json keeps the last of two equal keys; the loader refuses the file instead."""
    text = (Path(gen.VECTORS_DIR) / "path_norm_prox.json").read_text()
    assert text.count(old) == 1
    path = tmp_path / "twice.json"
    path.write_text(text.replace(old, new))
    with pytest.raises(SpecError) as info:
        load_vectors(path)
    key = re.findall(r'"(\w+)"', old)[0]
    at = {"lam": "$.cases[0].inputs.lam", "name": "$.cases[0].name"}.get(key, "$.format_version")
    cases = "(cases[0]) " if where else ""
    assert str(info.value) == (
        f"{path}: {where}{cases}at {at}: the key {key!r} appears more than once in this object "
        "(JSON keeps only the last value); remove the duplicate"
    )


def _conv_doc() -> dict[str, Any]:
    return json.loads((Path(gen.VECTORS_DIR) / "path_norm_prox_conv.json").read_text())


CONV_MALFORMED = {
    "torch_not_the_units": (
        _set(["cases", 0, "inputs", "layers", "torch", "first", 0, 0, 0, 0], 9.0),
        r"at \$\.cases\[0\]\.inputs\.layers\.torch: the torch weights do not hold the units X, Y",
    ),
    "expected_not_the_units": (
        _set(["cases", 1, "expected", "layers", "torch", "second", 0, 0, 0], 9.0),
        r"at \$\.cases\[1\]\.expected\.layers\.torch: the torch weights do not hold the units V",
    ),
    "keras_not_torch": (
        _set(["cases", 2, "inputs", "layers", "keras", "second", 0, 0], 9.0),
        r"at \$\.cases\[2\]\.inputs\.layers\.keras: the Keras kernels are not the torch weights'",
    ),
    "ragged_tensor": (
        _set(["cases", 1, "inputs", "layers", "torch", "first", 0], [[0.5]]),
        r"at \$\.cases\[1\]\.inputs\.layers\.torch\.first: not a regular tensor",
    ),
    "unknown_network": (
        _set(["cases", 0, "inputs", "layers", "network"], "conv3d-conv3d"),
        r"at \$\.cases\[0\]\.inputs\.layers\.network: 'conv3d-conv3d' is not one of",
    ),
    "wrong_network": (
        _set(["cases", 0, "inputs", "layers", "network"], "conv1d-conv1d"),
        r"at \$\.cases\[0\]\.inputs\.layers\.torch: conv1d-conv1d: the first weight must have 3",
    ),
    "no_expected_layers": (
        _set(["cases", 0, "expected", "layers"], _DELETE),
        r"at \$\.cases\[0\]\.expected: 'layers' is a required property",
    ),
    "extra_native_key": (
        _set(["cases", 0, "inputs", "layers", "jax"], {}),
        r"at \$\.cases\[0\]\.inputs\.layers: Unevaluated properties are not allowed \('jax'",
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED) + sorted(CONV_MALFORMED))
def test_malformed_document_is_rejected_with_a_clear_message(name: str) -> None:
    edit, pattern = MALFORMED[name] if name in MALFORMED else CONV_MALFORMED[name]
    doc = _doc() if name in MALFORMED else _conv_doc()
    with pytest.raises(SpecError) as info:
        parse_document(edit(doc), "broken.json")
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith("broken.json:"), message
    assert re.search(pattern, message), message


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ('{"format_version": 1, "cases": [', r"bad\.json: not valid JSON"),
        (
            '{"format_version": 1, "description": "", "cases": [NaN]}',
            r"bad\.json: NaN is not a JSON number",
        ),
    ],
)
def test_malformed_file_is_rejected(tmp_path: Path, text: str, pattern: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(SpecError, match=pattern.replace(r"bad\.json", r".*bad\.json")):
        load_vectors(path)


def test_non_utf8_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(
        '{"format_version": 1, "description": "caf\u00e9", "cases": []}'.encode("latin-1")
    )
    with pytest.raises(SpecError) as info:
        load_vectors(path)
    assert str(info.value) == (
        f"{path}: not UTF-8 text (byte b'\\xe9' at offset 41: invalid continuation byte); "
        "vector files are UTF-8 JSON"
    )


@pytest.mark.parametrize("depth", [40, 900, 100_000])
def test_deeply_nested_file_is_rejected(tmp_path: Path, depth: int) -> None:
    # 900 levels parse but overflow the recursive validators; 100,000 overflow json's decoder
    path = tmp_path / "deep.json"
    path.write_text('{"format_version": 1, "cases": [' + "[" * depth + "]" * depth + "]}")
    with pytest.raises(SpecError) as info:
        load_vectors(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert "nested more than 32 levels deep" in message
    if depth < 1000:
        assert f"at $.cases{'[0]' * 32}: " in message


def test_nesting_of_a_real_file_is_accepted() -> None:
    assert loader.MAX_DEPTH > 6  # $.cases[i].inputs.X[row][col]: what the packaged files hold
    assert len(load_vectors("path_norm_prox")) > 0


@pytest.mark.parametrize(
    ("old", "new", "where"),
    [
        (
            '"lam": 0.1',
            '"lam": 1e999',
            r"case 'errata_conformance' \(cases\[0\]\) at \$\.cases\[0\]\.inputs\.lam: 1e999",
        ),
        (
            '"lam": 0.05',
            '"lam": 2E+400',
            r"case 'single_output_lam_0\.05' \(cases\[1\]\) at \$\.cases\[1\]\.inputs\.lam: 2E\+400",
        ),
        (
            '"objective": 0.15176712071692877',
            '"objective": 1.5e308000',
            r"at \$\.cases\[0\]\.expected\.objective: 1\.5e308000",
        ),
        (
            '"objective": 0.15176712071692877',
            '"objective": 1' + "0" * 400,
            r"at \$\.cases\[0\]\.expected\.objective: 1000000000\.\.\. \(an integer of 401 digits\)",
        ),
        ('"rtol": 1e-09', '"rtol": 1e309', r"at \$\.cases\[0\]\.tolerance\.rtol: 1e309"),
    ],
    ids=["lam", "lam-upper-E", "objective", "objective-huge-int", "tolerance"],
)
def test_overflowing_number_literal_is_rejected(
    tmp_path: Path, old: str, new: str, where: str
) -> None:
    # json turns 1e999 into inf, which the schema's "type": "number", "minimum": 0 accepts
    text = (Path(gen.VECTORS_DIR) / "path_norm_prox.json").read_text()
    assert old in text
    path = tmp_path / "bad.json"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(SpecError) as info:
        load_vectors(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert re.search(where + " is not a finite float64 number", message), message


# --- generation ------------------------------------------------------------------------------


def test_generation_is_deterministic_and_matches_the_committed_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = gen.write(tmp_path)  # one full regeneration (the slow part of this file)
    assert sorted(p.name for p in paths) == vector_files()
    for p in paths:
        committed = (Path(gen.VECTORS_DIR) / p.name).read_bytes()
        assert p.read_bytes() == committed, (
            f"{p.name} is stale: run `python -m shared_spec.generate` and commit the result"
        )
    # --check compares without writing; reuse the rendered text instead of regenerating.
    texts = {p.name: p.read_text(encoding="utf-8") for p in paths}
    monkeypatch.setattr(gen, "render", lambda: texts)
    assert gen.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "l1.json").write_text("{}")
    assert gen.main(["--check", "--out", str(tmp_path)]) == 1
    assert (tmp_path / "l1.json").read_text() == "{}"


# --- the reference ---------------------------------------------------------------------------


def test_reference_reproduces_the_errata_conformance_vector() -> None:
    w_in, w_out = np.array(gen.ERRATA_W1), np.array(gen.ERRATA_W2)
    V, W = ref.prox_path_norm(w_out.T, w_in, gen.ERRATA_LAM)
    np.testing.assert_allclose(W, gen.ERRATA_PROX_W1, atol=1e-4, rtol=0)
    np.testing.assert_allclose(V.T, gen.ERRATA_PROX_W2, atol=1e-4, rtol=0)
    case = next(c for c in PROX_CASES if c.name == "errata_conformance")
    np.testing.assert_array_equal(case.W, W)
    np.testing.assert_array_equal(case.V, V)
    # The printed zeros are exact zeros.
    assert W[1, 1] == 0.0 and W[2, 3] == 0.0


@pytest.mark.parametrize("seed", range(20))
def test_reference_candidate_views_agree(seed: int) -> None:
    """prox_unit, prox_unit_candidates and the vectorised candidate table see the same optimum."""
    rng = np.random.default_rng(seed)
    p, m = rng.integers(1, 6), rng.integers(1, 9)
    x, y = rng.normal(size=p), rng.normal(size=m)
    if seed % 4 == 0:
        x[0] = 0.0
        y = np.round(y * 2) / 2  # ties
    lam = float(rng.choice([0.01, 0.1, 0.3, 0.7, 2.0]))
    v, w, h = ref.prox_unit(x, y, lam)
    cands = ref.prox_unit_candidates(x, y, lam)
    assert min(c[0] for c in cands) == h
    table = ref._unit_candidate_objectives(x, y, lam)
    assert table[:, 0].min() == pytest.approx(h, rel=1e-12, abs=1e-15)
    assert len(table) == len(cands)
    # Block-wise optimality (every global minimiser is a fixed point of both soft-thresholds).
    np.testing.assert_allclose(v, ref.prox_l1(x, lam * np.abs(w).sum()), atol=1e-12)
    np.testing.assert_allclose(w, ref.prox_l1(y, lam * np.abs(v).sum()), atol=1e-12)


def test_minimiser_margin_flags_a_tie() -> None:
    X, Y = np.array([[0.5, -0.25]]), np.array([[-0.25, 0.5, 0.0]])
    gap, spread = ref.minimiser_margin(X, Y, 1e6, 1e-12)
    assert gap == 0.0 and spread == 0.5
    gap, spread = ref.minimiser_margin(np.array([[0.5, 0.0]]), Y, 1e6, 1e-12)
    assert gap == pytest.approx((0.3125 - 0.25) / 2 / (1 + (0.25 + 0.3125) / 2)) and spread == 0.0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ref.prox_path_norm(np.ones((2, 1)), np.ones((3, 1)), 0.1), "must pair"),
        (lambda: ref.prox_unit(np.ones(2), np.ones(2), -1.0), "lam must be a finite"),
        (lambda: ref.prox_l1(np.ones(2), float("nan")), "lam must be a finite"),
        (lambda: ref.project_rows_l1_ball(np.ones((2, 2)), -1.0), "radius must be a finite"),
    ],
)
def test_reference_rejects_bad_input(call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


# --- convolutional pairs: native layouts ----------------------------------------------------

CONV_CASES = [c for c in PROX_CASES if c.layers is not None]


def test_conv_cases_round_trip_through_the_layouts() -> None:
    assert len(CONV_CASES) >= 5
    for case in CONV_CASES:
        assert case.layers is not None and case.X is not None and case.Y is not None
        network, (first, second) = case.layers.network, case.layers.torch
        for got, want in zip(
            layouts.weights(network, case.X, case.Y, first.shape, second.shape),
            (first, second),
            strict=True,
        ):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(
            layouts.torch_weights(network, *case.layers.keras), (first, second), strict=True
        ):
            np.testing.assert_array_equal(got, want)
        case.check_layers("torch", *case.layers.torch_expected)
        case.check_layers("keras", *case.layers.keras_expected)


def test_conv_layouts_by_hand() -> None:
    """Unit c's weights, located by hand in both layouts of a Conv2d -> Flatten -> Linear."""
    case = next(c for c in CONV_CASES if c.name == "conv2d_flatten_linear")
    assert case.layers is not None and case.X is not None and case.Y is not None
    (conv, linear), (kconv, dense) = case.layers.torch, case.layers.keras
    assert conv.shape == (3, 1, 2, 3) and linear.shape == (2, 18)
    assert kconv.shape == (2, 3, 1, 3) and dense.shape == (18, 2)
    for c in range(3):
        np.testing.assert_array_equal(case.Y[c], conv[c].ravel())
        np.testing.assert_array_equal(kconv[..., c].transpose(2, 0, 1).ravel(), case.Y[c])
        np.testing.assert_array_equal(case.X[c], linear[:, 6 * c : 6 * c + 6].ravel())
        np.testing.assert_array_equal(dense[c::3].T, linear[:, 6 * c : 6 * c + 6])


def test_check_layers_rejects_a_weight_in_another_unit() -> None:
    case = next(c for c in CONV_CASES if c.name == "conv2d_conv2d")
    assert case.layers is not None
    first, second = (a.copy() for a in case.layers.torch_expected)
    first[[0, 1]] = first[[1, 0]]  # two channels' incoming weights swapped
    with pytest.raises(AssertionError, match=r"conv2d_conv2d: (objective|W)"):
        case.check_layers("torch", first, second)
    kfirst, ksecond = case.layers.keras_expected
    with pytest.raises(AssertionError, match=r"keras second has shape \(2, 3, 3, 2\)"):
        case.check_layers("keras", kfirst, ksecond.transpose(1, 0, 2, 3))
    flat = next(c for c in CONV_CASES if c.name == "conv2d_flatten_linear")
    assert flat.layers is not None
    kconv, dense = flat.layers.keras_expected
    channels_first = dense.reshape(6, 3, 2).transpose(1, 0, 2).reshape(18, 2)
    with pytest.raises(AssertionError, match=r"conv2d_flatten_linear: (objective|V)"):
        flat.check_layers("keras", kconv, channels_first)
    with pytest.raises(ValueError, match='backend must be "torch" or "keras"'):
        case.check_layers("jax", first, second)
    with pytest.raises(ValueError, match="not a convolutional case"):
        _unique_case().check_layers("torch", first, second)


def test_expected_layers_without_input_layers_is_rejected() -> None:
    doc = _doc()
    doc["cases"][0]["expected"]["layers"] = _conv_doc()["cases"][0]["expected"]["layers"]
    with pytest.raises(SpecError, match=r"at \$\.cases\[0\]\.expected: .*should not be valid"):
        parse_document(doc, "broken.json")
