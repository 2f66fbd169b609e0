"""Which layers pair up: auto pairing, explicit names, and every error message."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from torch import nn

from pathnorm_lightning.pairing import (
    layer_chain,
    normalize_layers,
    normalize_pairs,
    resolve_layers,
    resolve_pairs,
)


class Net(nn.Module):
    """Nested names as users write them: encoder.0, encoder.2, head."""

    def __init__(self, sizes: tuple[int, ...] = (8, 6, 5, 4, 3), conv: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(sizes[0], sizes[1]), nn.ELU(), nn.Linear(sizes[1], sizes[2])
        )
        self.middle = nn.Linear(sizes[2], sizes[3])
        self.head = nn.Linear(sizes[3], sizes[4])
        if conv:
            self.conv = nn.Conv1d(1, 1, 3)


def names(pairs: list[Any]) -> list[tuple[str, str]]:
    return [(p.first_name, p.second_name) for p in pairs]


def test_auto_pairs_consecutive_linears_in_module_order() -> None:
    net = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pairs = resolve_pairs(net, "auto")
        assert names(resolve_pairs(net.encoder, "auto")) == [("0", "2")]
        assert names(resolve_pairs(net, [("middle", "head")])) == [("middle", "head")]
    assert names(pairs) == [("encoder.0", "encoder.2"), ("middle", "head")]
    assert pairs[0].first is net.encoder[0] and pairs[1].second is net.head
    assert [p.first.out_features for p in pairs] == [6, 4]
    # one nn.Sequential with an activation between: verified by the module tree; (middle, head)
    # are attributes, which forward() could run in any order: left to the forward pass
    assert [p.verified for p in pairs] == [True, False]
    assert resolve_pairs(net, [("middle", "head")])[0].verified  # explicit: taken as given


@pytest.mark.parametrize(
    "between",
    [
        lambda: nn.BatchNorm1d(4),
        lambda: nn.LayerNorm(4),
        lambda: nn.PReLU(),
        lambda: nn.Sequential(nn.LayerNorm(4)),
    ],
    ids=["batchnorm", "layernorm", "prelu", "nested-norm"],
)
def test_auto_refuses_a_pair_across_a_module_with_parameters(between: Any) -> None:
    net = nn.Sequential(nn.Linear(5, 4), between(), nn.ReLU(), nn.Linear(4, 3))
    with pytest.raises(
        ValueError, match=r"would pair '0' with '3', but '1(\.0)?' .* Name the pairs"
    ):
        resolve_pairs(net, "auto")
    assert names(resolve_pairs(net, [("0", "3")])) == [("0", "3")]  # the user's explicit choice


@pytest.mark.parametrize("explicit", [False, True])
def test_tied_weights_in_one_pair_are_refused(explicit: bool) -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    net[2].weight = net[0].weight
    with pytest.raises(ValueError, match=r"layers '0' and '2' share one weight \(tied weights\)"):
        resolve_pairs(net, [("0", "2")] if explicit else "auto")


def test_auto_warns_about_an_unpaired_last_layer() -> None:
    net = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with pytest.warns(
        UserWarning, match=r"3 chained layers \(Linear\), so the last one \('4'\) is not paired"
    ):
        pairs = resolve_pairs(net, "auto")
    assert names(pairs) == [("0", "2")]


def test_explicit_pairs_by_module_name() -> None:
    net = Net()
    pairs = resolve_pairs(net, [("encoder.2", "middle")])
    assert names(pairs) == [("encoder.2", "middle")]
    assert pairs[0].first is net.encoder[2] and pairs[0].second is net.middle
    # Lists (as YAML/CLI deliver them) work like tuples.
    assert names(resolve_pairs(net, [["encoder.0", "encoder.2"], ["middle", "head"]])) == [
        ("encoder.0", "encoder.2"),
        ("middle", "head"),
    ]


@pytest.mark.parametrize(
    ("model", "pairs", "error", "match"),
    [
        (
            Net(),
            [("encoder.0", "encodr.2")],
            ValueError,
            r"no submodule named 'encodr.2'\. Did you mean \['encoder.2'",
        ),
        (
            Net(),
            [("encoder.0", "tail")],
            ValueError,
            r"Its nn.Conv1d, nn.Conv2d, nn.Linear layers are \['encoder.0', 'encoder.2', "
            r"'middle', 'head'\]",
        ),
        (
            Net(),
            [("encoder.0", "encoder.1")],
            ValueError,
            r"module 'encoder.1' is a ELU, but only nn.Conv1d, nn.Conv2d, nn.Linear layers are "
            r"supported",
        ),
        (
            Net(conv=True),
            [("head", "conv")],
            ValueError,
            r"'head' and 'conv' do not chain: a Conv1d cannot read the units of a Linear",
        ),
        (
            Net(),
            [("encoder.0", "middle")],
            ValueError,
            r"'encoder.0' \(6 outputs\) and 'middle' \(5 inputs\) do not chain",
        ),
        (
            Net(),
            [("encoder.0", "encoder.2"), ("encoder.2", "middle")],
            ValueError,
            r"pairs\[1\]: layer 'encoder.2' is already in pairs\[0\]",
        ),
        (Net(), [("middle", "middle")], ValueError, r"cannot pair with itself \('middle'\)"),
        (Net(), [], ValueError, r"pairs is empty"),
        (
            Net(),
            "every",
            ValueError,
            r"pairs must be 'auto' or a list of \(first, second\) module names, got 'every'",
        ),
        (Net(), 5, TypeError, r"pairs must be 'auto' or a list .* got int"),
        (
            Net(),
            ["encoder.0"],
            ValueError,
            r"pairs\[0\] must be a \(first, second\) pair of module names, got 'encoder.0'",
        ),
        (Net(), [("encoder.0", 2)], ValueError, r"pairs\[0\] must be a \(first, second\) pair"),
        (
            nn.Sequential(nn.Linear(3, 2), nn.ReLU()),
            "auto",
            ValueError,
            r"pairs='auto' found 1 layer\(s\) of the types nn.Conv1d, nn.Conv2d, nn.Linear in "
            r"Sequential",
        ),
        (nn.Sequential(nn.ReLU()), "auto", ValueError, r"found 0 layer\(s\) of the types"),
        (
            nn.Sequential(nn.Linear(3, 2), nn.Linear(4, 2)),
            "auto",
            ValueError,
            r"'0' \(2 outputs\) and '1' \(4 inputs\) do not chain",
        ),
        (
            nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2)),
            "auto",
            ValueError,
            r"layer '0' is a LazyLinear whose weight is not materialized yet .* forward pass",
        ),
    ],
)
def test_resolve_pairs_errors(model: nn.Module, pairs: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        resolve_pairs(model, pairs)


def test_resolve_layers_auto_and_explicit() -> None:
    net = Net(conv=True)
    assert [n for n, _ in resolve_layers(net)] == [
        "encoder.0",
        "encoder.2",
        "middle",
        "head",
        "conv",
    ]
    found = resolve_layers(net, ["head", "encoder.0"])
    assert [n for n, _ in found] == ["head", "encoder.0"]
    assert found[0][1] is net.head


@pytest.mark.parametrize(
    ("model", "layers", "error", "match"),
    [
        (
            Net(),
            ["headd"],
            ValueError,
            r"layers\[0\]: Net has no submodule named 'headd'\. Did you mean \['head'\]",
        ),
        (
            Net(),
            ["encoder.1"],
            ValueError,
            r"layers\[0\]: module 'encoder.1' is a ELU, but only nn.Conv1d, nn.Conv2d, nn.Linear",
        ),
        (Net(), ["head", "head"], ValueError, r"layers\[1\]: layer 'head' is listed twice"),
        (Net(), [], ValueError, r"layers is empty"),
        (Net(), "all", ValueError, r"layers must be 'auto' or a list of module names, got 'all'"),
        (Net(), [3], TypeError, r"layers must be 'auto' or a list of module names, got \[3\]"),
        (
            nn.Sequential(nn.ReLU()),
            "auto",
            ValueError,
            r"layers='auto' found no layer of the types nn.Conv1d, nn.Conv2d, nn.Linear in "
            r"Sequential",
        ),
        (nn.Sequential(nn.LazyLinear(4)), "auto", ValueError, r"'0' is a LazyLinear whose weight"),
        (nn.Sequential(nn.LazyLinear(4)), ["0"], ValueError, r"'0' is a LazyLinear whose weight"),
    ],
)
def test_resolve_layers_errors(model: nn.Module, layers: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        resolve_layers(model, layers)


def test_normalize_specs() -> None:
    assert normalize_pairs("auto") == "auto"
    assert normalize_pairs([["a", "b"]]) == [("a", "b")]
    assert normalize_layers(("a", "b")) == ["a", "b"]


def test_layer_chain() -> None:
    net = Net()
    assert layer_chain(net) == [net.encoder[0], net.encoder[2], net.middle, net.head]
    assert layer_chain(nn.Sequential(nn.Linear(3, 2), nn.Linear(3, 2))) is None
    assert layer_chain(nn.Sequential(nn.ReLU())) is None
    cnn = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Conv2d(3, 2, 2), nn.Flatten())
    cnn.append(nn.Linear(2 * 9, 4)).append(nn.ELU()).append(nn.Linear(4, 2))
    assert layer_chain(cnn) == [cnn[0], cnn[2], cnn[4], cnn[6]]
    cnn[4] = nn.Linear(7, 4)  # 7 inputs: not a whole number of positions of 2 channels
    assert layer_chain(cnn) is None
    assert layer_chain(nn.Sequential(nn.Linear(4, 3), nn.Conv1d(3, 2, 1))) is None
    assert layer_chain(nn.Sequential(nn.Conv2d(2, 2, 1, groups=2))) is None  # not the seam's
    # a BatchNorm between the pairs scales the units
    deep = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert layer_chain(deep.append(nn.Linear(4, 2))) is None
