"""The torch hook's invariant: the prox runs exactly once per real update, on exactly the weights
that update changed; and the refusals (with their real cause) where it cannot.

Plain-torch loops through ``attach`` (the hook every Lightning callback is built on); the
Lightning-only cases live in ``test_callbacks.py``.
"""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize, prune

from pathnorm_lightning import attach, layers, prox_path_norm, resolve_pairs


def mlp(*sizes: int, seed: int = 0) -> nn.Sequential:
    """Linear layers with a ReLU between consecutive ones (module names 0, 2, 4, ...)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def batch(m: int = 6, n: int = 8, seed: int = 1) -> Tensor:
    return torch.randn(n, m, generator=torch.Generator().manual_seed(seed))


def sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor) -> None:
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def weights(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def reference_steps(model: nn.Module, lr: float, lam: float, steps: int, x: Tensor) -> nn.Module:
    """Proximal SGD by hand on the pair (0, 2): the plain step, then the prox once."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        sgd_step(model, optimizer, x)
        with torch.no_grad():
            new_in, new_out = prox_path_norm(model[0].weight, model[2].weight, lam * lr)
            model[0].weight.copy_(new_in)
            model[2].weight.copy_(new_out)
    return model


# --- item 2: AMP-skipped steps of fused optimizers ----------------------------------------


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_fused_optimizer_step_skipped_by_the_scaler_is_neither_proxed_nor_counted(
    name: str,
) -> None:
    model = mlp(6, 5, 3)
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=0.05, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    handle = attach(optimizer, model, lam=0.5)
    x = batch()
    for poison in (False, True, False):
        before = weights(model)
        optimizer.zero_grad()
        loss = model(x).square().mean() * (float("inf") if poison else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # calls optimizer.step(); the fused kernel skips an inf step
        scaler.update()
        assert same(before, weights(model)) == poison
    assert handle.num_steps == 2
    assert (model[0].weight == 0).any()  # the two real steps were proxed


def test_a_step_that_changed_none_of_a_pairs_weights_does_not_prox_it() -> None:
    model = mlp(6, 5, 4, 3, 2)  # pairs (0, 2) and (4, 6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    handle = attach(optimizer, model, lam=0.3)
    optimizer.zero_grad()
    model[:3](batch()).square().mean().backward()  # only the first pair is used
    top = [model[4].weight.detach().clone(), model[6].weight.detach().clone()]
    bottom = model[0].weight.detach().clone()
    optimizer.step()
    assert torch.equal(model[4].weight, top[0]) and torch.equal(model[6].weight, top[1])
    assert not torch.equal(model[0].weight, bottom)
    assert handle.num_steps == 1
    optimizer.zero_grad()  # no gradient at all: the step updates nothing, nor does the prox
    kept = weights(model)
    optimizer.step()
    assert same(kept, weights(model)) and handle.num_steps == 1


# --- item 3: one pair, one prox per step ----------------------------------------------------


def test_attach_twice_on_one_optimizer_is_refused_until_the_first_is_removed() -> None:
    model = mlp(6, 5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    first = attach(optimizer, model, lam=0.2)
    with pytest.raises(ValueError, match=r"pair \('0', '2'\) is already regularized .* attach"):
        attach(optimizer, model, lam=0.2)
    assert len(optimizer._optimizer_step_post_hooks) == 1
    sgd_step(model, optimizer, batch())
    assert first.num_steps == 1
    first.remove()
    second = attach(optimizer, model, lam=0.2)  # accepted once the first is gone
    sgd_step(model, optimizer, batch())
    assert second.num_steps == 1


def test_an_optimizer_listed_twice_is_proxed_once_per_step() -> None:
    model = mlp(6, 5, 3)
    expected = reference_steps(model, lr=0.5, lam=0.3, steps=3, x=batch())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    handle = attach([optimizer, optimizer], model, lam=0.3)
    for _ in range(3):
        sgd_step(model, optimizer, batch())
    assert handle.num_steps == 3
    assert len(optimizer._optimizer_step_post_hooks) == 1
    assert same(weights(model), weights(expected))


# --- item 4: a weight tied into two pairs ---------------------------------------------------


@pytest.mark.parametrize("pairs", ["auto", [("0", "2"), ("4", "6")]])
def test_a_weight_tied_into_two_pairs_is_refused(pairs: object) -> None:
    model = mlp(4, 4, 4, 4, 4)
    model[4].weight = model[0].weight
    kept = weights(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.raises(
        ValueError, match=r"pair \('0', '2'\) and pair \('4', '6'\) share a weight \(tied"
    ):
        attach(optimizer, model, lam=0.1, pairs=pairs)  # type: ignore[arg-type]
    assert len(optimizer._optimizer_step_post_hooks) == 0
    assert same(kept, weights(model))


# --- item 5: half frozen, the frozen weight left out of the optimizer ----------------------


@pytest.mark.parametrize("in_optimizer", [True, False])
def test_half_frozen_pair_warns_whether_or_not_the_frozen_weight_is_optimized(
    in_optimizer: bool,
) -> None:
    model = mlp(6, 5, 3)
    model[0].requires_grad_(False)
    plain = copy.deepcopy(model)
    params = (
        model.parameters() if in_optimizer else (p for p in model.parameters() if p.requires_grad)
    )
    optimizer = torch.optim.SGD(params, lr=0.5)
    with pytest.warns(UserWarning, match=r"pair \('0', '2'\) is half frozen") as record:
        handle = attach(optimizer, model, lam=0.5)
        for _ in range(2):
            sgd_step(model, optimizer, batch())
    assert sum("half frozen" in str(w.message) for w in record) == 1  # once per attach
    plain_opt = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        sgd_step(plain, plain_opt, batch())
    assert same(weights(model), weights(plain))  # the pair was left to the optimizer alone
    assert handle.num_steps == 0


# --- items 6 and 12: computed (parametrized, pruned) weights --------------------------------


class _Scale(nn.Module):
    def forward(self, w: Tensor) -> Tensor:
        return 2 * w


def _old_style(wrap: Callable[[nn.Linear], object]) -> Callable[[nn.Linear], object]:
    """The pre-parametrization hooks (weight_norm warns that it is deprecated)."""

    def apply(layer: nn.Linear) -> object:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return wrap(layer)

    return apply


PARAMETRIZED: dict[str, tuple[Callable[[nn.Linear], object], str]] = {
    "weight_norm": (lambda lin: parametrizations.weight_norm(lin), r"parametrized \(_WeightNorm\)"),
    "spectral_norm": (
        lambda lin: parametrizations.spectral_norm(lin),
        r"parametrized \(_SpectralNorm\)",
    ),
    "register_parametrization": (
        lambda lin: parametrize.register_parametrization(lin, "weight", _Scale()),
        r"parametrized \(_Scale\)",
    ),
    "prune": (
        lambda lin: prune.l1_unstructured(lin, "weight", amount=0.5),
        r"pruned \(torch.nn.utils.prune",
    ),
    "old weight_norm": (_old_style(nn.utils.weight_norm), r"wrapped by torch.nn.utils.weight_norm"),
    "old spectral_norm": (
        _old_style(nn.utils.spectral_norm),
        r"wrapped by torch.nn.utils.spectral_norm",
    ),
}


@pytest.mark.parametrize("how", list(PARAMETRIZED))
@pytest.mark.parametrize("pairs", ["auto", [("0", "2")]])
def test_a_parametrized_layer_is_refused_for_its_real_cause(how: str, pairs: object) -> None:
    model = mlp(6, 5, 3)
    apply, cause = PARAMETRIZED[how]
    apply(model[2])
    with pytest.raises(ValueError, match=rf"layer '2' .*{cause}.* computed .* write"):
        resolve_pairs(model, pairs)  # type: ignore[arg-type]


def test_pruning_during_training_is_refused_at_the_next_step_before_the_prox() -> None:
    model = mlp(6, 5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    handle = attach(optimizer, model, lam=0.1)
    sgd_step(model, optimizer, batch())
    prune.l1_unstructured(model[0], "weight", amount=0.5)  # weight = weight_orig * weight_mask
    optimizer.zero_grad()
    model(batch()).square().mean().backward()
    expected = model[0].weight_orig.detach() - 0.5 * model[0].weight_orig.grad  # the SGD step
    with pytest.raises(ValueError, match=r"attach: layer '0' .*pruned .* computed"):
        optimizer.step()
    assert torch.equal(model[0].weight_orig.detach(), expected)  # nothing written after SGD
    assert handle.num_steps == 1


# --- front door: dead pairs, verification from the forward pass, PReLU, metrics ------------


def test_a_pair_that_loses_every_unit_warns_once() -> None:
    model = mlp(6, 5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    attach(optimizer, model, lam=50.0)
    dead = r"attach: pair \('0', '2'\) has no hidden unit left after the prox of step 1 "
    with pytest.warns(UserWarning, match=dead) as rec:
        for _ in range(4):
            sgd_step(model, optimizer, batch())
    assert sum("no hidden unit left" in str(w.message) for w in rec) == 1
    model = mlp(6, 5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    attach(optimizer, model, lam=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            sgd_step(model, optimizer, batch())


class AttributeNet(nn.Module):
    """The usual LightningModule style: layers as attributes, called in ``forward``."""

    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(6, 5)
        self.out = nn.Linear(5, 3)
        self.skip = skip

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.hidden(x))
        if self.skip:  # the second layer's input is not the first's output alone
            return self.out(h + x[:, :5])
        return self.out(nn.functional.dropout(h, 0.1))


def test_auto_pairs_are_verified_from_the_forward_pass() -> None:
    model = AttributeNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = attach(optimizer, model, lam=0.1)
        for _ in range(2):
            sgd_step(model, optimizer, batch())
    assert handle.num_steps == 2


class Reordered(nn.Module):
    """Registered a, b, c, d; run a, c, b, d: module order pairs (a, b), which never chain."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(5, 5) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        return self.d(torch.relu(self.b(torch.relu(self.c(torch.relu(self.a(x)))))))


def _reused() -> nn.Sequential:
    """One Linear layer registered twice in a Sequential: (0, 2) are neighbours in the tree, but
    the network runs the second layer twice."""
    shared = nn.Linear(5, 5)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), shared, nn.ReLU(), shared)


def test_auto_pairs_the_forward_pass_contradicts_warn_at_the_first_step() -> None:
    for model in (Reordered(), AttributeNet(skip=True), _reused()):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        m = 5 if isinstance(model, Reordered) else 6
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            attach(optimizer, model, lam=0.1)  # nothing to say before the forward pass
        with pytest.warns(
            UserWarning, match=r"does not run \[.*\] as shallow pairs.*not be verified"
        ):
            sgd_step(model, optimizer, batch(m=m))


class Deep(nn.Module):
    """Four Linear layers as attributes, two pairs: a chain unless ``variant`` adds a residual
    path around the second pair, a branch into the third layer, or runs the last layer twice."""

    def __init__(self, variant: str = "chain") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3, self.l4 = (nn.Linear(6, 6) for _ in range(4))
        self.variant = variant

    def forward(self, x: Tensor) -> Tensor:
        h = self.l2(torch.relu(self.l1(x)))
        if self.variant == "branch":
            return self.l4(torch.relu(self.l3(h + x)))
        out = self.l4(torch.relu(self.l3(h)))
        if self.variant == "twice":
            out = self.l4(torch.relu(out))
        return out + h if self.variant == "residual" else out


def _softmax_between_pairs() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(2) for m in (nn.Linear(6, 6), nn.Softmax(1))))[:-1]


@pytest.mark.parametrize("variant", ["chain", "residual", "branch", "twice", "softmax"])
def test_network_bounds_only_for_a_chain_the_forward_pass_confirms(variant: str) -> None:
    model = _softmax_between_pairs() if variant == "softmax" else Deep(variant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pairs = [("0", "2")] if variant == "softmax" else [("l1", "l2"), ("l3", "l4")]
    handle = attach(optimizer, model, pairs=pairs, lam=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sgd_step(model, optimizer, batch())
    messages = [str(w.message) for w in caught]
    metrics = handle.metrics()
    if variant == "chain":
        assert messages == []
        assert metrics["path_norm_bound"] > 0 and metrics["product_bound"] > 0
    else:
        assert "path_norm_bound" not in metrics and "product_bound" not in metrics
        assert any("do not form a chain" in m for m in messages), messages
    assert "sparsity" in metrics  # what does not need a chain is still computed


class Between(nn.Module):
    """Two Linear layers as attributes (the forward pass, not the module tree, verifies the
    auto pair) with ``between`` applied to the first one's output."""

    def __init__(self, between: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden, self.out, self.between = nn.Linear(6, 5), nn.Linear(5, 3), between

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.between(self.hidden(x)))


def _unverified(model: nn.Module) -> list[str]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    attach(optimizer, model, lam=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sgd_step(model, optimizer, batch())
    return [str(w.message) for w in caught if "could not be verified" in str(w.message)]


@pytest.mark.parametrize(
    "between",
    [
        nn.Softmax(dim=1),
        nn.LogSoftmax(dim=1),
        lambda h: h.flip(1),
        lambda h: h.roll(1, dims=1),
        lambda h: torch.relu(h)[:, [1, 0, 2, 3, 4]],
        lambda h: torch.relu(h).cumsum(1),
        lambda h: torch.relu(h) + torch.relu(h).mean(1, keepdim=True),
        lambda h: nn.functional.normalize(torch.relu(h), dim=1),
    ],
    ids=["Softmax", "LogSoftmax", "flip", "roll", "permute", "cumsum", "mean", "normalize"],
)
def test_auto_pairs_through_an_op_that_mixes_or_moves_units_warn(between: Any) -> None:
    """Unit i of the first layer would no longer feed column i of the second alone: the
    path-norm prox would couple the wrong weights, or the path-norm bound would not hold."""
    models = [Between(between)]
    if isinstance(between, nn.Module):  # registered between them, without parameters
        models.append(nn.Sequential(nn.Linear(6, 5), between, nn.Linear(5, 3)))
    for model in models:
        (message,) = _unverified(model)
        assert "nothing that mixes or moves the units" in message


# Softsign and the alpha dropouts add a tensor without gradient, which the graph cannot tell
# from a skip connection of the data: only the module tree (an nn.Sequential) verifies them.
_ENTRYWISE_MODULES = [
    cls
    for cls, role in layers.BETWEEN.items()
    if role is layers.Role.POINTWISE
    and cls not in (nn.Softsign, nn.AlphaDropout, nn.FeatureAlphaDropout)
]


@pytest.mark.parametrize(
    "between",
    [
        *(cls() for cls in _ENTRYWISE_MODULES),
        nn.ReLU(inplace=True),
        lambda h: h * torch.sigmoid(h),
        lambda h: torch.where(h > 0, h, 0.1 * h).clamp(-1, 1),
        lambda h: nn.functional.dropout(torch.tanh(h), 0.3) / 2,
        lambda h: torch.relu(h).to(torch.float64).view(-1, 5, 1).squeeze(-1).float(),
    ],
    ids=[
        *(cls.__name__ for cls in _ENTRYWISE_MODULES),
        "ReLU-inplace",
        "x*sigmoid(x)",
        "where-clamp",
        "dropout-scale",
        "cast-view",
    ],
)
def test_auto_pairs_through_entrywise_ops_are_verified(between: Any) -> None:
    assert _unverified(Between(between)) == []


@pytest.mark.parametrize(
    ("between", "name", "slope"),
    [
        (nn.GELU(), "GELU", "1.129"),
        (nn.functional.silu, "SiLU", "1.1"),
        (lambda h: nn.functional.hardswish(nn.functional.gelu(h)), "Hardswish", "1.5"),
        (nn.Mish(), "Mish", "1.089"),
        (torch.relu, None, None),
    ],
    ids=["GELU", "silu", "gelu-then-hardswish", "Mish", "relu"],
)
def test_a_steep_activation_between_attribute_layers_warns_at_the_first_step(
    between: Any, name: str | None, slope: str | None
) -> None:
    """As in an nn.Sequential: the logged bounds are not bounds of this network."""
    model = Between(between)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    attach(optimizer, model, lam=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            sgd_step(model, optimizer, batch())
    steep = [str(w.message) for w in caught if "slope of up to" in str(w.message)]
    expected = f"attach: between 'hidden' and 'out': {name} has a slope of up to {slope} > 1"
    assert [m.split(", so")[0] for m in steep] == ([] if name is None else [expected])


def test_prelu_between_two_layers_is_refused_for_its_learned_slope() -> None:
    model = nn.Sequential(nn.Linear(6, 5), nn.PReLU(), nn.Linear(5, 3))
    with pytest.raises(ValueError, match=r"PReLU learns its slope"):
        resolve_pairs(model, "auto")
    assert len(resolve_pairs(model, [("0", "2")])) == 1  # the user's explicit choice


def test_metrics_are_python_floats() -> None:
    model = mlp(6, 5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    handle = attach(optimizer, model, lam=0.3)
    sgd_step(model, optimizer, batch())
    values = handle.metrics()
    assert set(values) == {"sparsity", "alive_units", "path_norm_bound", "product_bound"}
    assert all(type(v) is float for v in values.values())
    w_in, w_out = model[0].weight.detach(), model[2].weight.detach()
    zeros = int((w_in == 0).sum() + (w_out == 0).sum())
    assert values["sparsity"] == pytest.approx(zeros / (w_in.numel() + w_out.numel()))


_NO_LIGHTNING = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"lightning", "lightning_utilities", "pytorch_lightning",
                                  "torchmetrics"}:
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, Block())
import torch
from pathnorm_lightning import attach, prox_path_norm, resolve_pairs
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
handle = attach(optimizer, model, lam=0.3)
optimizer.zero_grad()
model(torch.randn(4, 6)).square().mean().backward()
optimizer.step()
values = handle.metrics()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {"lightning", "torchmetrics"})
print(handle.num_steps, type(values["sparsity"]).__name__, loaded)
try:
    from pathnorm_lightning import PathNormProx
except ImportError as err:
    print("callbacks:", "lightning" in str(err))
"""


def test_attach_and_the_functional_api_work_without_lightning_and_torchmetrics() -> None:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_NO_LIGHTNING)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["1 float []", "callbacks: True"]
