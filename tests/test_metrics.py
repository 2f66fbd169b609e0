"""Sparsity, PathNormBound and ProductBound against hand-computed and brute-force values."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor

from pathnorm_lightning import PathNormBound, ProductBound, Sparsity, path_norm, product_bound


def chain(
    *shapes: tuple[int, int], seed: int = 0, dtype: torch.dtype = torch.float32
) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype) for s in shapes]


def brute_force_path_norm(weights: list[Tensor]) -> float:
    """Sum over every input-output path of the product of absolute weights (float64)."""
    dims = [weights[0].shape[1]] + [w.shape[0] for w in weights]
    total = 0.0
    for path in itertools.product(*(range(d) for d in dims)):
        prod = 1.0
        for layer, w in enumerate(weights):
            prod *= abs(float(w[path[layer + 1], path[layer]]))
        total += prod
    return total


def test_sparsity_counts_zeros_and_alive_units_by_hand() -> None:
    w_in = torch.tensor(
        [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 3.0], [1.0, 1.0, 1.0]]
    )  # (4, 3)
    w_out = torch.tensor([[1.0, 5.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # (2, 4)
    metric = Sparsity()
    metric.update([w_in, w_out])
    out = metric.compute()
    # zeros: 6 of 12 in w_in, 6 of 8 in w_out -> 12 / 20.
    assert out["sparsity"].item() == pytest.approx(12 / 20)
    # unit 0: row nonzero, column [1, 0] nonzero -> alive; unit 1: row zero -> dead;
    # unit 2: column zero -> dead; unit 3: column zero -> dead.
    assert out["alive_units"].item() == pytest.approx(1 / 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sparsity_signed_zeros_nan_and_empty_layers(dtype: torch.dtype) -> None:
    # -0.0 is a zero, NaN is not; a layer with no inputs has only dead units.
    w_in = torch.tensor([[-0.0, 0.0], [float("nan"), 0.0], [0.0, -2.0]], dtype=dtype)
    w_out = torch.tensor([[1.0, 1.0, -0.0]], dtype=dtype)
    metric = Sparsity()
    metric.update([w_in, w_out])
    out = metric.compute()
    assert out["sparsity"].item() == pytest.approx(5 / 9)
    assert out["alive_units"].item() == pytest.approx(1 / 3)  # unit 1 (NaN row) only
    metric = Sparsity()
    metric.update([torch.zeros(3, 0, dtype=dtype), torch.ones(2, 3, dtype=dtype)])
    assert metric.compute()["alive_units"].item() == 0.0
    assert metric.compute()["sparsity"].item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_sparsity_counts_every_kind_of_entry_in_large_strided_weights(dtype: torch.dtype) -> None:
    # Enough entries for the vectorised paths, every special value, a transposed weight.
    g = torch.Generator().manual_seed(0)
    kinds = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), 1e-40, -2.0])
    index = torch.randint(len(kinds), (257, 131), generator=g)
    w_in = kinds.to(dtype)[index].t()  # (131, 257), not contiguous
    w_out = kinds.to(dtype)[torch.randint(len(kinds), (5, 131), generator=g)]
    w_in[::3], w_out[:, ::5] = -0.0, 0.0  # dead units: signed zeros in, zeros out
    metric = Sparsity()
    metric.update([w_in, w_out])
    zero = (w_in == 0).sum() + (w_out == 0).sum()
    assert metric.compute()["sparsity"].item() == float(zero) / (w_in.numel() + w_out.numel())
    alive = ((w_in != 0).any(1) & (w_out != 0).any(0)).double().mean()  # NaN != 0
    assert 0.4 < float(alive) < 0.7
    assert metric.compute()["alive_units"].item() == pytest.approx(float(alive))


def test_sparsity_of_no_entry_is_nan() -> None:
    metric = Sparsity()
    metric.update([torch.zeros(0, 3), torch.zeros(2, 0)])  # 0 / 0 entries: no sparsity
    out = metric.compute()
    assert math.isnan(out["sparsity"].item()) and math.isnan(out["alive_units"].item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bounds_in_a_module_cast_to_half_precision_still_sum_in_float64(
    dtype: torch.dtype,
) -> None:
    # module.to(float16) (Lightning's "16-true") casts the metric's states too: the float16
    # sum overflowed to inf at 65504, the bfloat16 one rounded (12.875 for 12.87)
    holder = torch.nn.Module()
    holder.path, holder.product = PathNormBound(), ProductBound()
    holder.to(dtype)
    weights = [torch.ones(64, 64), torch.ones(64, 64)]
    pairs = [torch.tensor([[1.1]]), torch.tensor([[1.3]]), torch.tensor([[9.0]])]
    for metric in (holder.path, holder.product):
        metric.update(weights)
        assert metric.compute().item() == 64.0**3  # 262144
        metric.reset()
        metric.update(pairs)
        assert metric.compute().item() == pytest.approx(1.1 * 1.3 * 9.0, rel=1e-7)


def test_sparsity_pools_updates_and_single_matrices() -> None:
    metric = Sparsity()
    metric.update([torch.zeros(2, 3)])
    assert math.isnan(metric.compute()["alive_units"].item())
    metric.update([torch.ones(3, 2), torch.ones(1, 3)])
    out = metric.compute()
    assert out["sparsity"].item() == pytest.approx(6 / 15)
    assert out["alive_units"].item() == pytest.approx(1.0)
    metric.reset()
    metric.update(torch.tensor([[0.0, 2.0]]))  # a bare tensor is a one-matrix chain
    assert metric.compute()["sparsity"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("seed", range(3))
def test_bounds_equal_functional_for_one_pair(seed: int) -> None:
    w_in, w_out = chain((7, 5), (3, 7), seed=seed)
    pn, pb = PathNormBound(), ProductBound()
    pn.update([w_in, w_out])
    pb.update([w_in, w_out])
    assert pn.compute().item() == pytest.approx(path_norm(w_in, w_out).item(), rel=1e-6)
    assert pb.compute().item() == pytest.approx(product_bound(w_in, w_out).item(), rel=1e-6)


@pytest.mark.parametrize("shapes", [[(3, 2), (4, 3), (2, 4)], [(2, 3), (3, 2), (2, 3), (1, 2)]])
def test_path_norm_bound_is_the_sum_over_paths(shapes: list[tuple[int, int]]) -> None:
    weights = chain(*shapes, seed=1, dtype=torch.float64)
    metric = PathNormBound()
    metric.update(weights)
    assert metric.compute().item() == pytest.approx(brute_force_path_norm(weights), rel=1e-12)


def test_product_bound_formula_and_ordering() -> None:
    weights = chain((6, 4), (5, 6), (3, 5), seed=2, dtype=torch.float64)
    metric = ProductBound()
    metric.update(weights)
    expected = (
        weights[2].abs().sum().item()
        * weights[1].abs().sum(1).max().item()
        * weights[0].abs().sum(1).max().item()
    )
    assert metric.compute().item() == pytest.approx(expected, rel=1e-12)
    path = PathNormBound()
    path.update(weights)
    assert path.compute().item() <= metric.compute().item()


def test_bounds_average_updates_and_reduce_like_replicas() -> None:
    a = chain((4, 3), (2, 4), seed=3)
    b = [2 * w for w in a]  # path norm scales by 4
    metric = PathNormBound()
    metric.update(a)
    metric.update(b)
    assert metric.compute().item() == pytest.approx(2.5 * path_norm(*a).item(), rel=1e-6)
    # Two identical replicas merged (what the "sum" reduction does across ranks) report the same.
    r0, r1 = ProductBound(), ProductBound()
    r0.update(a)
    r1.update(a)
    r0.merge_state(r1)
    assert r0.compute().item() == pytest.approx(product_bound(*a).item(), rel=1e-6)
    assert math.isnan(PathNormBound().compute().item())


def test_half_precision_weights_do_not_overflow() -> None:
    weights = [torch.full((64, 64), 8.0, dtype=torch.float16) for _ in range(4)]
    metric = PathNormBound()
    metric.update(weights)
    assert metric.compute().item() == pytest.approx(64.0**5 * 8.0**4, rel=1e-9)


@pytest.mark.parametrize("metric_cls", [Sparsity, PathNormBound, ProductBound])
@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ([], r"needs at least one weight matrix"),
        (
            [torch.ones(3)],
            r"weights\[0\] must be a 2-D weight matrix \(out, in\) or a .*got \(3,\)",
        ),
        ([torch.ones(3, 2), "w"], r"weights\[1\] must be a 2-D weight matrix .*, got str"),
        (
            [torch.ones(3, 2), torch.ones(2, 4)],
            r"weights\[0\] \(3, 2\) and weights\[1\] \(2, 4\) do not chain",
        ),
        (  # |1j| is 1, not the 0 that a cast to float keeps
            [torch.tensor([[1j, 0], [0, 2]]), torch.ones(1, 2)],
            r"weights\[0\] is complex \(torch.complex64\).*pass real weights",
        ),
    ],
)
def test_update_errors(metric_cls: type, weights: list, match: str) -> None:
    with pytest.raises(ValueError, match=rf"{metric_cls.__name__}\.update: .*{match}|{match}"):
        metric_cls().update(weights)


@pytest.mark.parametrize("metric", [PathNormBound, ProductBound])
def test_bounds_of_float32_weights_accumulate_in_float64(metric: type) -> None:
    # |w| summed per row in float32 overflowed to inf at 1e38 scale; the bound is 1.6e9
    weights = [torch.full((2, 4), 2e38), torch.full((1, 2), 1e-30)]
    bound = metric()
    bound.update(weights)
    expected = metric()
    expected.update([w.double() for w in weights])
    assert bound.compute().item() == pytest.approx(expected.compute().item(), rel=1e-12)
    assert math.isfinite(bound.compute().item())


def test_the_two_bounds_stay_apart_in_a_metric_collection() -> None:
    # torchmetrics groups metrics whose states have the same names and values after their first
    # update: with shared names, bounds equal at the first update (one hidden unit) stayed one
    from torchmetrics import MetricCollection

    bounds = MetricCollection({"path": PathNormBound(), "product": ProductBound()})
    bounds.update([torch.ones(1, 3), torch.ones(2, 1)])  # one unit: the bounds are equal (6)
    bounds.reset()
    weights = [torch.tensor([[1.0, 0.0], [0.0, 3.0]]), torch.tensor([[1.0, 1.0]])]
    bounds.update(weights)
    alone = ProductBound()
    alone.update(weights)
    assert bounds.compute()["product"].item() == alone.compute().item() == 6.0
    assert bounds.compute()["path"].item() == 4.0
