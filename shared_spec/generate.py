"""Regenerate ``shared_spec/vectors/*.json`` from the exhaustive float64 reference.

Usage::

    python -m shared_spec.generate            # rewrite the packaged vector files
    python -m shared_spec.generate --out DIR  # write them somewhere else
    python -m shared_spec.generate --check    # exit 1 if the packaged files are stale

Every input comes from a fixed seed or is written out by hand, every expected value from
:mod:`shared_spec.reference`, and the files are written with sorted keys and a fixed layout, so
the output is byte-for-byte reproducible. This module lists the cases and writes the files;
:mod:`shared_spec._cases` builds each case.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shared_spec._cases import (
    GenerationError,
    ball_case,
    conv_case,
    first_unique,
    l1_case,
    prox_case,
)
from shared_spec._inputs import (
    ERRATA_ATOL,
    ERRATA_LAM,
    ERRATA_PROX_W1,
    ERRATA_PROX_W2,
    ERRATA_W1,
    ERRATA_W2,
    boundary_units,
    equal_norm_pair,
    exact_boundary_units,
    f32,
    ties,
    uniform,
    zeros,
)
from shared_spec.reference import F64

VECTORS_DIR = Path(__file__).resolve().parent / "vectors"


def errata_case() -> dict[str, Any]:
    """The authors' conformance vector, checked against the printed (4-decimal) prox."""
    w_in, w_out = np.array(ERRATA_W1), np.array(ERRATA_W2)
    case = prox_case(
        "errata_conformance",
        "The authors' conformance vector (docs/errata.md), lam = 0.1; torch layout there: "
        "W1 = w_in (3x4) = Y, W2 = w_out (2x3) = X.T. Expected values are the exact "
        "reference output; the printed 4-decimal values agree to 1e-4.",
        w_out.T,
        w_in,
        ERRATA_LAM,
    )
    V, W = np.array(case["expected"]["V"]), np.array(case["expected"]["W"])
    err = max(np.abs(W - ERRATA_PROX_W1).max(), np.abs(V.T - ERRATA_PROX_W2).max())
    if err > ERRATA_ATOL:
        raise GenerationError(f"reference misses the ERRATA conformance vector by {err:.3g}")
    return case


BOUNDARY_EPS = 1e-6


def _supports(case: dict[str, Any]) -> list[tuple[int, int]]:
    """Per unit, the number of nonzeros of the expected ``(v, w)``."""
    V, W = np.array(case["expected"]["V"]), np.array(case["expected"]["W"])
    return [(int(np.count_nonzero(v)), int(np.count_nonzero(w))) for v, w in zip(V, W, strict=True)]


def _boundary(k: int, l_: int, sign: float) -> dict[str, Any]:
    """lam with k l lam^2 = (1 -/+ 1e-6)^2: the support pair (k, l) just feasible/infeasible.

    Units 0 to 2 (:func:`boundary_units`) have (k, l) as their minimiser below the boundary and
    a different support above it; checked here, so a solver that drops near-boundary pairs fails.
    """
    lam = (1.0 + sign * BOUNDARY_EPS) / math.sqrt(k * l_)
    side = "below" if sign < 0 else "above"
    case = prox_case(
        f"lam_boundary_k{k}_l{l_}_{side}",
        f"lam = (1 {'-' if sign < 0 else '+'} 1e-6) / sqrt({k} * {l_}): k l lam^2 just "
        f"{side} 1, where the support pair (k, l) = ({k}, {l_}) turns infeasible. Units 0 to 2 "
        f"have top-{k} and top-{l_} sums in the ratio 1 : sqrt({l_}/{k}) and tails of at most 2e-4: "
        f"their minimiser keeps {k} and {l_} entries below the boundary, fewer above.",
        *boundary_units(k, l_, BOUNDARY_EPS),
        lam,
        # d = 1 - k l lam^2 is about 2e-6 here; the solution is that much worse conditioned.
        tolerance={"rtol": 1e-7, "atol": 1e-9, "objective_rtol": 1e-9},
    )
    supports = _supports(case)
    on_pair = [s == (k, l_) for s in supports]
    if on_pair != ([True] * 3 + [False] * 2 if sign < 0 else [False] * 5):
        raise GenerationError(
            f"{case['name']}: per-unit supports {supports}; units 0 to 2 must keep ({k}, {l_}) "
            "below the boundary and no unit may keep it above"
        )
    return case


def _zero_over_zero(x: F64, y: F64, lam: float, k: int, l_: int) -> bool:
    """Whether the closed form of the pair (k, l) is 0 / 0: d and both numerators exactly 0."""
    cx, cy = np.sort(np.abs(x))[::-1][:k].sum(), np.sort(np.abs(y))[::-1][:l_].sum()
    d = 1.0 - k * l_ * lam * lam
    return d == 0.0 and cx - k * lam * cy == 0.0 and cy - l_ * lam * cx == 0.0


def _exact_boundary(lam: float, pairs: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    """lam with k l lam^2 == 1 exactly: unit i divides 0 by 0 in ``pairs[i]``, checked here."""
    kl = round(lam**-2)
    X, Y = exact_boundary_units(lam, pairs, (5, 4, 8), 500 + kl)
    for i, (k, l_) in enumerate(pairs):
        if not _zero_over_zero(X[i], Y[i], lam, k, l_):
            raise GenerationError(f"lam_exact_boundary_{lam}: unit {i} is not 0 / 0 in ({k}, {l_})")
    listed = ", ".join(f"unit {i}: ({k}, {l_})" for i, (k, l_) in enumerate(pairs))
    return prox_case(
        f"lam_exact_boundary_{lam}",
        f"lam = {lam}: k l lam^2 == 1 exactly (in floating point) for k l = {kl}; the pair must "
        f"be skipped, not divided by zero. In {listed}, both numerators of the pair's closed "
        "form are exactly 0 too (0 / 0 = NaN, which passes sign tests): a solver that does not "
        "skip d == 0 and takes its least objective with argmin or torch.min returns NaN.",
        X,
        Y,
        lam,
    )


def _prox_shape_cases() -> list[dict[str, Any]]:
    """The errata vector, then single and multi output, p > m and scalar units."""
    cases = [errata_case()]
    for i, lam in enumerate((0.05, 0.2, 0.6)):
        cases.append(
            prox_case(
                f"single_output_lam_{lam}",
                f"Single output (p = 1), n = 6 hidden units, m = 8 inputs, lam = {lam}.",
                uniform(10 + i, (6, 1)),
                uniform(20 + i, (6, 8)),
                lam,
            )
        )
    for i, lam in enumerate((0.05, 0.15, 0.4)):
        cases.append(
            prox_case(
                f"multi_output_lam_{lam}",
                f"Multi output, n = 6, m = 7, p = 4, lam = {lam}.",
                uniform(30 + i, (6, 4)),
                uniform(40 + i, (6, 7)),
                lam,
            )
        )
    cases += [
        prox_case(
            "more_outputs_than_inputs",
            "p = 6 > m = 2 (implementations that enumerate the shorter side swap roles).",
            uniform(50, (5, 6)),
            uniform(51, (5, 2)),
            0.15,
        ),
        prox_case(
            "scalar_units",
            "p = m = 1: every unit is a pair of scalars.",
            uniform(52, (8, 1), scale=2.0),
            uniform(53, (8, 1), scale=2.0),
            0.7,
        ),
    ]
    return cases


def _prox_tie_and_zero_cases() -> list[dict[str, Any]]:
    """Equal magnitudes (two lam), zero rows and entries, and an all-zero pair."""
    return [
        prox_case(
            "ties_equal_magnitudes",
            "Equal magnitudes within and across the sides of each unit, mixed signs.",
            *ties(),
            0.125,
        ),
        prox_case(
            "ties_equal_magnitudes_large_lam",
            "The tie layer with lam = 0.75 (only small supports survive).",
            *ties(),
            0.75,
        ),
        prox_case(
            "zeros_rows_and_entries",
            "A unit with zero outgoing weights, one with zero incoming weights, a dead unit, "
            "and scattered zero entries; zeros must stay zero.",
            *zeros(),
            0.2,
        ),
        prox_case(
            "all_zero",
            "An all-zero layer pair is its own prox.",
            np.zeros((3, 2)),
            np.zeros((3, 4)),
            0.5,
        ),
    ]


def _prox_lam_range_cases() -> list[dict[str, Any]]:
    """lam from 0 through 1e-8 and 1 to 1e6, with equal norms at the largest."""
    return [
        prox_case(
            "lam_zero_identity",
            "lam = 0: the prox is the identity.",
            uniform(60, (4, 3)),
            uniform(61, (4, 5)),
            0.0,
        ),
        prox_case(
            "lam_tiny",
            "lam = 1e-8: every entry moves by about lam times the other side's l1 norm.",
            uniform(62, (4, 3)),
            uniform(63, (4, 5)),
            1e-8,
        ),
        prox_case(
            "lam_one",
            "lam = 1: k l lam^2 >= 1 for every support pair, so each unit keeps one side.",
            uniform(64, (5, 3), scale=3.0),
            uniform(65, (5, 4), scale=3.0),
            1.0,
        ),
        prox_case(
            "lam_large",
            "lam = 4: every unit keeps its side of larger squared norm unchanged.",
            uniform(66, (5, 3)),
            uniform(67, (5, 4)),
            4.0,
        ),
        prox_case(
            "lam_huge",
            "lam = 1e6: each unit keeps its side of larger squared norm unchanged, zeros the "
            "other; no NaN or overflow.",
            uniform(68, (6, 3)),
            uniform(69, (6, 5)),
            1e6,
        ),
        prox_case(
            "lam_huge_equal_norms",
            "lam = 1e6 with ||x||^2 == ||y||^2 in every unit: (x, 0) and (0, y) are both "
            "minimisers; compare the objective only.",
            *equal_norm_pair(),
            1e6,
            unique=False,
        ),
    ]


def _prox_lam_boundary_cases() -> list[dict[str, Any]]:
    """lam where a support pair (k, l) turns infeasible: just below, just above, exactly on."""
    cases: list[dict[str, Any]] = []
    for k, l_ in ((1, 1), (2, 3), (1, 4)):
        cases += [_boundary(k, l_, -1.0), _boundary(k, l_, +1.0)]
    cases += [
        _exact_boundary(0.5, ((2, 2), (1, 4), (4, 1))),
        _exact_boundary(0.25, ((2, 8), (4, 4))),
    ]
    return cases


def prox_float64_cases() -> list[dict[str, Any]]:
    """Float64 ``path_norm_prox`` cases: shapes, ties, zeros, and the range of lam."""
    return [
        *_prox_shape_cases(),
        *_prox_tie_and_zero_cases(),
        *_prox_lam_range_cases(),
        *_prox_lam_boundary_cases(),
    ]


def prox_wide_cases() -> list[dict[str, Any]]:
    """Wide hidden-to-hidden pairs (p and m in the hundreds, few units: the reference is slow)."""
    return [
        prox_case(
            "wide_p200_m300",
            "Wide hidden-to-hidden pair: n = 4, p = 200, m = 300, lam = 0.004 (supports of "
            "about 100 and 250 survive).",
            uniform(70, (4, 200)),
            uniform(71, (4, 300)),
            0.004,
        ),
        prox_case(
            "wide_p300_m120",
            "Wide pair with p > m: n = 3, p = 300, m = 120, lam = 0.006.",
            uniform(72, (3, 300)),
            uniform(73, (3, 120)),
            0.006,
        ),
    ]


def prox_float32_cases() -> list[dict[str, Any]]:
    """Float32 cases: inputs exactly representable in float32, expected values in float64."""
    fp32 = "float32"
    return [
        prox_case(
            "f32_single_output",
            "float32, single output: n = 6, m = 8, p = 1, lam = 0.2.",
            *first_unique(80, 6, 1, 8, float(np.float32(0.2)), fp32),
            float(np.float32(0.2)),
            dtype=fp32,
        ),
        prox_case(
            "f32_multi_output",
            "float32, multi output: n = 8, m = 10, p = 5, lam = 0.1.",
            *first_unique(82, 8, 5, 10, float(np.float32(0.1)), fp32),
            float(np.float32(0.1)),
            dtype=fp32,
        ),
        prox_case(
            "f32_ties_and_zeros",
            "float32, ties (dyadic magnitudes) and exact zeros, lam = 0.125.",
            *ties(),
            0.125,
            dtype=fp32,
        ),
        prox_case(
            "f32_zeros_rows_and_entries",
            "float32 version of zeros_rows_and_entries.",
            f32(zeros()[0]),
            f32(zeros()[1]),
            float(np.float32(0.2)),
            dtype=fp32,
        ),
        prox_case(
            "f32_lam_huge",
            "float32, lam = 1e6: one side kept, the other zeroed.",
            f32(uniform(84, (6, 3))),
            f32(uniform(85, (6, 5))),
            1e6,
            dtype=fp32,
        ),
        prox_case(
            "f32_wide_p64_m96",
            "float32, n = 4, p = 64, m = 96, lam = 0.01.",
            f32(uniform(86, (4, 64))),
            f32(uniform(87, (4, 96))),
            float(np.float32(0.01)),
            dtype=fp32,
            unique=None,
        ),
    ]


def _conv_weights(seed: int, shape: tuple[int, ...]) -> F64:
    return uniform(seed, (shape[0], int(np.prod(shape[1:])))).reshape(shape)


def conv_cases() -> list[dict[str, Any]]:
    """Convolutional pairs: which weight is which unit's, in torch's and Keras's layouts."""
    sparse_first = _conv_weights(640, (3, 2, 2, 2))
    sparse_first[1] = 0.0  # channel 1 has no incoming weights
    sparse_first[0, 1, 0, :] = 0.0
    sparse_second = _conv_weights(641, (2, 3, 2, 3))
    sparse_second[:, 2] = 0.0  # channel 2 is read by nothing
    sparse_second[1, 0, 1, 2] = 0.0
    return [
        conv_case(
            "conv2d_conv2d",
            "torch Conv2d(2, 3, (2, 3)) -> Conv2d(3, 2, (3, 2)), weights (3, 2, 2, 3) and "
            "(2, 3, 3, 2); Keras Conv2D kernels (2, 3, 2, 3) and (3, 2, 3, 2). Non-square "
            "kernels pin the two kernel axes; lam = 0.08.",
            "conv2d-conv2d",
            _conv_weights(600, (3, 2, 2, 3)),
            _conv_weights(601, (2, 3, 3, 2)),
            0.08,
        ),
        conv_case(
            "conv1d_conv1d",
            "torch Conv1d(2, 4, 3) -> Conv1d(4, 3, 2); Keras Conv1D kernels (3, 2, 4) and "
            "(2, 4, 3); lam = 0.15.",
            "conv1d-conv1d",
            _conv_weights(610, (4, 2, 3)),
            _conv_weights(611, (3, 4, 2)),
            0.15,
        ),
        conv_case(
            "conv2d_flatten_linear",
            "torch Conv2d(1, 3, (2, 3)) on 3 x 5 inputs (2 x 3 = 6 positions per channel) -> "
            "Flatten -> Linear(18, 2): channel c owns the Linear columns 6c..6c+5 (channels "
            "first); Keras Conv2D -> Flatten -> Dense, Dense kernel (18, 2): channel c owns the "
            "rows c, c + 3, ..., c + 15 (channels last); lam = 0.05.",
            "conv2d-flatten-linear",
            _conv_weights(620, (3, 1, 2, 3)),
            uniform(621, (2, 18)),
            0.05,
        ),
        conv_case(
            "conv1d_flatten_linear",
            "torch Conv1d(2, 2, 2) on inputs of length 5 (4 positions) -> Flatten -> "
            "Linear(8, 3); Keras Conv1D -> Flatten -> Dense, kernel (8, 3); lam = 0.1.",
            "conv1d-flatten-linear",
            _conv_weights(630, (2, 2, 2)),
            uniform(631, (3, 8)),
            0.1,
        ),
        conv_case(
            "conv2d_conv2d_zeros",
            "torch Conv2d(2, 3, 2) -> Conv2d(3, 2, (2, 3)) with a channel without incoming "
            "weights, one that nothing reads, and scattered zeros; zeros stay zero; lam = 0.25.",
            "conv2d-conv2d",
            sparse_first,
            sparse_second,
            0.25,
        ),
    ]


def _ball_rows() -> F64:
    return np.array(
        [
            [0.2, -0.3, 0.1, 0.0],  # inside (||.||_1 = 0.6)
            [0.5, -0.25, 0.25, 0.0],  # exactly on the sphere
            [1.5, -0.5, 0.25, -2.0],  # outside
            [0.0, 0.0, 0.0, 0.0],  # zero row
            [0.75, -0.75, 0.75, -0.75],  # outside, all tied
            [3.0, 0.01, -0.02, 0.0],  # outside, one entry dominates
        ]
    )


def l1_cases() -> list[dict[str, Any]]:
    """Soft-thresholding and the row-wise l1-ball projection."""
    ties = np.array([[0.25, -0.25, 0.5, 0.0], [-0.125, 0.375, -0.5, 0.25]])
    return [
        l1_case("l1_random", "Soft-thresholding, lam = 0.3.", uniform(90, (5, 7)), 0.3),
        l1_case(
            "l1_at_threshold",
            "Entries with |w| == lam exactly (dyadic) go to zero; zeros stay zero.",
            ties,
            0.25,
        ),
        l1_case("l1_lam_zero", "lam = 0 is the identity.", uniform(91, (3, 4)), 0.0),
        l1_case("l1_lam_huge", "lam = 1e6 zeros everything.", uniform(92, (3, 4)), 1e6),
        l1_case(
            "l1_f32",
            "float32 soft-thresholding, lam = 0.3.",
            f32(uniform(93, (6, 9))),
            float(np.float32(0.3)),
            "float32",
        ),
        ball_case(
            "ball_mixed_rows",
            "Rows inside (unchanged), on, and outside the l1 ball of radius 1 (projected onto "
            "the sphere), a zero row, an all-tied row.",
            _ball_rows(),
            1.0,
        ),
        ball_case("ball_radius_zero", "radius = 0 projects every row to zero.", _ball_rows(), 0.0),
        ball_case(
            "ball_random_wide",
            "Random rows of length 300, radius 5 (about half the rows outside).",
            uniform(94, (8, 300), scale=0.04),
            5.0,
        ),
        ball_case(
            "ball_f32",
            "float32 projection of random rows, radius 1.5.",
            f32(uniform(95, (6, 9))),
            1.5,
            "float32",
        ),
    ]


#: file name -> (description, case builder)
FILES: dict[str, tuple[str, Callable[[], list[dict[str, Any]]]]] = {
    "path_norm_prox.json": (
        "Exact prox of the 1-path-norm, float64: the authors' conformance vector, single and "
        "multi output, ties, zeros, lam from 0 to 1e6 and around k l lam^2 = 1.",
        prox_float64_cases,
    ),
    "path_norm_prox_wide.json": (
        "Exact prox of the 1-path-norm, float64, wide hidden-to-hidden pairs.",
        prox_wide_cases,
    ),
    "path_norm_prox_conv.json": (
        "Exact prox of the 1-path-norm of convolutional pairs, float64: the units of each pair, "
        "and the pair in torch's and Keras's own layouts (which weight is which unit's).",
        conv_cases,
    ),
    "path_norm_prox_float32.json": (
        "Exact prox of the 1-path-norm run in float32 (expected values from float64).",
        prox_float32_cases,
    ),
    "l1.json": (
        "The paper's baselines: soft-thresholding and the row-wise l1-ball projection.",
        l1_cases,
    ),
}


def _dump(obj: Any, indent: int = 0) -> str:
    """JSON with sorted keys; a list of numbers (a matrix row) stays on one line."""
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k)}: {_dump(obj[k], indent + 2)}" for k in sorted(obj)]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list):
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in obj):
            return "[" + ", ".join(json.dumps(x, allow_nan=False) for x in obj) + "]"
        return "[\n" + ",\n".join(inner + _dump(x, indent + 2) for x in obj) + "\n" + pad + "]"
    return json.dumps(obj, allow_nan=False)


def render() -> dict[str, str]:
    """The text of every vector file, by file name."""
    return {
        fname: _dump({"format_version": 1, "description": description, "cases": build()}) + "\n"
        for fname, (description, build) in FILES.items()
    }


def write(out_dir: Path) -> list[Path]:
    """Write every vector file into ``out_dir`` (created if missing); return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fname, text in render().items():
        path = out_dir / fname
        path.write_text(text, encoding="utf-8", newline="\n")
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared_spec.generate", description=__doc__)
    parser.add_argument("--out", type=Path, default=VECTORS_DIR, help="output directory")
    parser.add_argument(
        "--check", action="store_true", help="compare with the files in --out instead of writing"
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = [
            f
            for f, text in render().items()
            if not (args.out / f).is_file() or (args.out / f).read_text(encoding="utf-8") != text
        ]
        for f in stale:
            print(f"stale: {args.out / f} (run python -m shared_spec.generate)", file=sys.stderr)
        return 1 if stale else 0
    for path in write(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
