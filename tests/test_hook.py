"""``attach``: the prox after every real optimizer step in a plain torch (or Fabric) loop, and the
same trajectory as the Lightning callback built on it."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from test_callbacks import MLP, linears, loader, make_data, trainer
from torch import nn

import pathnorm_lightning
from pathnorm_lightning import (
    PathNormBound,
    PathNormProx,
    ProductBound,
    Sparsity,
    StepHook,
    _chain,
    attach,
    path_norm,
    product_bound,
    prox_path_norm,
)


def _attached(seed: int, lam: float) -> tuple[MLP, torch.optim.Optimizer, StepHook]:
    """A seeded MLP trained one epoch with the prox attached to its optimizer."""
    torch.manual_seed(seed)
    model = MLP()
    optimizer = model.configure_optimizers()
    handle = attach(optimizer, model, lam=lam)
    _plain_loop(model, optimizer)
    return model, optimizer, handle


def _plain_loop(model: MLP, optimizer: torch.optim.Optimizer, epochs: int = 1) -> None:
    for _ in range(epochs):
        for batch in loader(make_data()):
            optimizer.zero_grad()
            model.loss(batch).backward()
            optimizer.step()


def test_attach_trajectory_equals_path_norm_prox_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = MLP(sizes=(20, 16, 12, 8, 4))
    plain = copy.deepcopy(model)
    trainer(max_epochs=2, callbacks=[PathNormProx(lam=0.05)]).fit(model, loader(make_data()))
    optimizer = plain.configure_optimizers()
    handle = attach(optimizer, plain, lam=0.05)
    _plain_loop(plain, optimizer, epochs=2)
    assert handle.num_steps == 12
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert (linears(plain)[0].weight == 0).any()  # the prox did act


def test_each_param_group_lr_and_schedule_is_honoured() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.Linear(4, 3))
    model.append(nn.ReLU()).append(nn.Linear(3, 2))  # pairs (0, 2) and (3, 5)
    optimizer = torch.optim.SGD(
        [
            {"params": [*model[0].parameters(), *model[2].parameters()], "lr": 0.5},
            {"params": [*model[3].parameters(), *model[5].parameters()], "lr": 0.1},
        ]
    )
    schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    handle = attach(optimizer, model, lam=0.2)
    x = torch.randn(8, 6)
    for step in range(3):
        before = copy.deepcopy(model)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        # by hand: the same SGD step, then each pair's prox with its own group's lr
        optimizer_b = torch.optim.SGD(before.parameters(), lr=1.0)
        optimizer_b.zero_grad()
        before(x).square().mean().backward()
        with torch.no_grad():
            for (i, j), lr in (((0, 2), 0.5 * 0.5**step), ((3, 5), 0.1 * 0.5**step)):
                for layer in (before[i], before[j]):
                    for p in layer.parameters():
                        p -= lr * p.grad  # type: ignore[operator]
                new = prox_path_norm(before[i].weight, before[j].weight, 0.2 * lr)
                before[i].weight.copy_(new[0])
                before[j].weight.copy_(new[1])
        for p, q in zip(model.parameters(), before.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        schedule.step()
    assert handle.num_steps == 3


def test_remove_stops_the_prox_and_leaves_no_hook() -> None:
    model, optimizer, handle = _attached(2, lam=0.1)
    assert handle.num_steps == 6
    handle.remove()
    handle.remove()  # idempotent
    assert len(optimizer._optimizer_step_post_hooks) == 0
    weights = copy.deepcopy(model)
    plain_sgd = copy.deepcopy(model)
    _plain_loop(model, optimizer)
    _plain_loop(plain_sgd, plain_sgd.configure_optimizers())
    assert handle.num_steps == 6
    for p, q in zip(model.parameters(), plain_sgd.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not all(
        torch.equal(p, q) for p, q in zip(model.parameters(), weights.parameters(), strict=True)
    )


def test_metrics_on_demand_equal_direct_computation() -> None:
    model, _, handle = _attached(3, lam=0.3)
    values = handle.metrics()
    w_in, w_out = (layer.weight.detach() for layer in linears(model))
    zeros = int((w_in == 0).sum() + (w_out == 0).sum())
    assert math.isclose(float(values["sparsity"]), zeros / (w_in.numel() + w_out.numel()))
    alive = ((w_in != 0).any(1) & (w_out != 0).any(0)).double().mean()
    assert math.isclose(float(values["alive_units"]), float(alive))
    assert math.isclose(
        float(values["path_norm_bound"]), float(path_norm(w_in, w_out)), rel_tol=1e-6
    )
    assert math.isclose(
        float(values["product_bound"]), float(product_bound(w_in, w_out)), rel_tol=1e-6
    )
    assert 0 < float(values["sparsity"]) < 1


def test_tied_weights_are_refused_before_the_first_step() -> None:
    model = MLP(sizes=(20, 16, 16))
    model.net[2].weight = model.net[0].weight  # one Parameter in both layers of the pair
    kept = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"share one weight \(tied weights\)"):
        attach(model.configure_optimizers(), model, lam=0.1)
    cb = PathNormProx(lam=0.1)
    with pytest.raises(ValueError, match=r"share one weight \(tied weights\)"):
        trainer(max_epochs=1, callbacks=[cb]).fit(model, loader(make_data(classes=16)))
    assert cb.num_steps == 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, kept[key]), key


def test_attach_unwraps_a_fabric_optimizer() -> None:
    fabric = pytest.importorskip("lightning").Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(4)
    model = MLP()
    plain = copy.deepcopy(model)
    wrapped_model, wrapped_opt = fabric.setup(model, model.configure_optimizers())
    handle = attach(wrapped_opt, wrapped_model, lam=0.1)
    for batch in loader(make_data()):
        wrapped_opt.zero_grad()
        fabric.backward(model.loss(batch))
        wrapped_opt.step()
    optimizer = plain.configure_optimizers()
    attach(optimizer, plain, lam=0.1)
    _plain_loop(plain, optimizer)
    assert handle.num_steps == 6
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)


class _Lookahead(torch.optim.Optimizer):
    """A Lookahead wrapper: steps ``optimizer``, then every ``k`` steps pulls the weights halfway
    back to their slow copy (so a prox inside its step would be undone)."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 2, init: bool = True) -> None:
        if init:
            super().__init__(optimizer.param_groups, optimizer.defaults)
        else:  # as wrappers that skip Optimizer.__init__: no step hooks
            self.param_groups, self.defaults, self.state = optimizer.param_groups, {}, {}
        self.optimizer, self.k, self.count = optimizer, k, 0
        self.slow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        self.optimizer.step()
        self.count += 1
        if self.count % self.k == 0:
            params = [p for g in self.param_groups for p in g["params"]]
            for slow, p in zip(self.slow, params, strict=True):
                slow.add_(p - slow, alpha=0.5)
                p.copy_(slow)


def test_attach_follows_the_whole_step_of_a_wrapper_that_changes_weights_after_its_inner_step() -> (
    None
):
    torch.manual_seed(5)
    model = MLP()
    reference = copy.deepcopy(model)
    optimizer = _Lookahead(model.configure_optimizers())
    handle = attach(optimizer, model, lam=0.1)
    by_hand = _Lookahead(reference.configure_optimizers())
    first, second = linears(reference)[0], linears(reference)[1]
    for batch in loader(make_data()):
        for net, opt in ((model, optimizer), (reference, by_hand)):
            opt.zero_grad()
            net.loss(batch).backward()
            opt.step()
        with torch.no_grad():  # the prox after the wrapper's whole step
            pathnorm_lightning.prox_path_norm_(first.weight, second.weight, 0.1 * model.lr)
    assert handle.optimizers == [optimizer] and handle.num_steps == 6
    assert (second.weight == 0).any()  # the prox did act
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_attach_refuses_optimizers_whose_step_runs_no_hooks() -> None:
    model = MLP()
    with pytest.raises(TypeError, match=r"_Lookahead.step does not run torch's optimizer step"):
        attach(_Lookahead(model.configure_optimizers(), init=False), model, lam=0.1)
    plain = type("Holder", (), {"optimizer": model.configure_optimizers()})()
    with pytest.raises(TypeError, match=r"expected a torch.optim.Optimizer, got Holder"):
        attach(plain, model, lam=0.1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lam": "0.1"}, TypeError, r"attach: lam must be a real number"),
        ({"lam": -1.0}, ValueError, r"attach: lam must be a finite number >= 0"),
        ({"lam": 0.1, "check_finite": 1}, TypeError, r"check_finite must be a bool"),
        ({"lam": 0.1, "pairs": [("net.0", "net.9")]}, ValueError, r"no submodule named 'net.9'"),
    ],
)
def test_attach_rejects_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    model = MLP()
    with pytest.raises(error, match=match):
        attach(model.configure_optimizers(), model, **kwargs)


def test_non_finite_weights_after_a_step_raise_with_the_pair_name() -> None:
    model = MLP(poison_batch=0)
    optimizer = model.configure_optimizers()
    attach(optimizer, model, lam=0.1)
    batch = next(iter(loader(make_data())))
    optimizer.zero_grad()
    (model.loss(batch) * float("inf")).backward()
    with pytest.raises(pathnorm_lightning.NonFiniteWeightsError, match=r"attach: the weights of"):
        optimizer.step()


def test_the_torch_loop_example_trains_a_sparse_network() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "torch_loop.py"
    spec = importlib.util.spec_from_file_location("torch_loop", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(epochs=1, lam=1e-3)
    assert result["accuracy"] > 0.5 and result["sparsity"] > 0.01
    assert result["path_norm_bound"] <= result["product_bound"]


def _one_step(model: MLP, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model.loss(next(iter(loader(make_data())))).backward()
    optimizer.step()


def test_the_plan_is_reused_and_rebuilt_when_a_group_or_a_weight_changes() -> None:
    torch.manual_seed(2)
    model = MLP()
    optimizer = model.configure_optimizers()
    handle = attach(optimizer, model, lam=0.05)
    plan = handle._plan
    for _ in range(3):
        _one_step(model, optimizer)
    assert handle._plan is plan and handle.num_steps == 3  # not re-planned at each step
    params = optimizer.param_groups[0]["params"]
    optimizer.param_groups[0]["params"] = list(params)  # the same weights in a new list
    _one_step(model, optimizer)
    assert handle._plan is not plan and handle.num_steps == 4
    # A pair's weight replaced in its module and in the group's list, in place (same length):
    first = linears(model)[0]
    fresh = nn.Parameter(first.weight.detach().clone())
    params = optimizer.param_groups[0]["params"]
    params[next(i for i, p in enumerate(params) if p is first.weight)] = fresh
    first.weight = fresh
    _one_step(model, optimizer)
    assert handle._plan[id(optimizer)][0].target.weights[0] is fresh
    assert handle.num_steps == 5 and (fresh == 0).any()  # the prox acted on the new weight


def test_a_weight_swapped_out_of_its_group_in_place_is_refused_at_the_next_step() -> None:
    torch.manual_seed(3)
    model = MLP()
    optimizer = model.configure_optimizers()
    handle = attach(optimizer, model, lam=0.05)
    _one_step(model, optimizer)
    params = optimizer.param_groups[0]["params"]
    weight = linears(model)[0].weight
    params[next(i for i, p in enumerate(params) if p is weight)] = nn.Parameter(weight.detach())
    before = weight.detach().clone()
    with pytest.raises(ValueError, match="not in any optimizer"):
        _one_step(model, optimizer)
    assert torch.equal(weight.detach(), before) and handle.num_steps == 1


def _square_pair(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 3))


def _square_step(model: nn.Sequential, optimizer: torch.optim.Optimizer, seed: int) -> None:
    optimizer.zero_grad()
    torch.manual_seed(100 + seed)
    model(torch.randn(8, 5)).square().sum().backward()
    optimizer.step()


def test_a_layer_replaced_in_the_model_after_attach_is_refused_at_the_next_step() -> None:
    # Before, the hook kept proxing model[0] with the removed head's weight (the new head was
    # never regularized, and metrics() described the removed layer), without a word.
    model = _square_pair(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = attach(optimizer, model, lam=0.5)
    _square_step(model, optimizer, 0)
    model[2] = nn.Linear(5, 3)
    optimizer.add_param_group({"params": model[2].parameters()})
    with pytest.raises(ValueError, match=r"pair \('0', '2'\): the model's '2' is no longer"):
        _square_step(model, optimizer, 1)
    assert handle.num_steps == 1
    handle.remove()


def test_a_weight_re_strided_over_the_same_storage_is_re_planned() -> None:
    # weight.data = weight.data.t() keeps the storage: the plan (its cached views) must follow
    # the new layout. Before, it kept the old one and drifted 2e-2 a step from the prox.
    model, plain = _square_pair(1), _square_pair(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    handle = attach(optimizer, model, lam=0.5)
    for net in (model, plain):
        net[0].weight.data = net[0].weight.data.t()
    for step in range(3):
        _square_step(model, optimizer, step)
        _square_step(plain, plain_optimizer, step)
        with torch.no_grad():
            v, w = prox_path_norm(plain[0].weight, plain[2].weight, 0.5 * 0.1)
            plain[0].weight.copy_(v)
            plain[2].weight.copy_(w)
        torch.testing.assert_close(model[0].weight, plain[0].weight, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(model[2].weight, plain[2].weight, rtol=1e-6, atol=1e-7)
    assert handle.num_steps == 3
    handle.remove()


@pytest.mark.parametrize("lr", [-0.1, math.nan, math.inf])
def test_a_bad_learning_rate_is_named_as_such(lr: float) -> None:
    model = _square_pair(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = attach(optimizer, model, lam=0.3)
    optimizer.param_groups[0]["lr"] = lr  # (before, the error said "lam must be ... >= 0")
    with pytest.raises(ValueError, match=r"the learning rate of its parameter group is"):
        _square_step(model, optimizer, 0)
    handle.remove()


class _RelativeStep(torch.optim.Optimizer):
    """Steps by ``eps`` times the gradient, whatever ``"lr"`` holds (as optimizers with relative
    step sizes do: Adafactor(relative_step=True) has lr=None)."""

    def __init__(self, params: Any, **defaults: Any) -> None:
        super().__init__(params, {"eps": 0.1, **defaults})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["eps"])


@pytest.mark.parametrize(
    ("defaults", "says"), [({"lr": None}, "has lr=None"), ({}, "has no 'lr' key")]
)
def test_an_optimizer_without_a_learning_rate_is_refused_when_attached(
    defaults: dict, says: str
) -> None:
    # Before, attach took it and its first step raised a bare TypeError/KeyError.
    model = _square_pair(5)
    kept = copy.deepcopy(model)
    optimizer = _RelativeStep(model.parameters(), **defaults)
    with pytest.raises(
        ValueError,
        match=rf"attach: pair \('0', '2'\): parameter group 0 of its optimizer \(_RelativeStep\) "
        rf"{says}, but the prox step is lam \* group\['lr'\].* Give the group an lr",
    ):
        attach(optimizer, model, lam=0.3)
    assert not optimizer._optimizer_step_post_hooks
    for p, q in zip(model.parameters(), kept.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("lr", [None, "0.1?", torch.ones(2)], ids=["none", "str", "tensor"])
def test_a_learning_rate_that_stops_being_a_number_is_named_at_the_step(lr: Any) -> None:
    model = _square_pair(6)
    optimizer = _RelativeStep(model.parameters(), lr=0.1)
    handle = attach(optimizer, model, lam=0.3)
    optimizer.param_groups[0]["lr"] = lr  # e.g. set by a scheduler
    plain = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"parameter group 0 of its optimizer .* has lr="):
        _square_step(model, optimizer, 0)
    _square_step(plain, _RelativeStep(plain.parameters()), 0)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)  # the optimizer's step, no prox
    assert handle.num_steps == 0
    handle.remove()


def test_follow_moves_the_prox_to_re_created_optimizers() -> None:
    model, plain = _square_pair(7), _square_pair(7)
    old = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = attach(old, model, lam=0.5)
    _square_step(model, old, 0)
    with pytest.raises(ValueError, match="not in any optimizer"):
        handle.follow([torch.optim.SGD(model[0].parameters(), lr=0.1)])
    assert handle.optimizers == [old]  # a refused follow leaves the hook as it was
    new = torch.optim.SGD(model.parameters(), lr=0.2)
    handle.follow([new, new])
    assert not old._optimizer_step_post_hooks and len(new._optimizer_step_post_hooks) == 1
    for step, lr in enumerate([0.1, 0.2, 0.2]):
        optimizer = torch.optim.SGD(plain.parameters(), lr=lr)
        _square_step(plain, optimizer, step)
        with torch.no_grad():
            v, w = prox_path_norm(plain[0].weight, plain[2].weight, 0.5 * lr)
            plain[0].weight.copy_(v)
            plain[2].weight.copy_(w)
        if step:
            _square_step(model, new, step)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert handle.num_steps == 3
    handle.remove()


def test_the_dead_pair_warning_says_what_its_step_counts() -> None:
    model = _square_pair(8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    handle = attach(optimizer, model, lam=50.0)
    with pytest.warns(
        UserWarning,
        match=r"no hidden unit left after the prox of step 1 \(steps as num_steps counts them: "
        r"those the prox acted on, not the trainer's global_step\)",
    ):
        _square_step(model, optimizer, 0)
    handle.remove()


def test_a_pair_of_two_dtypes_is_refused_when_attached_with_its_name() -> None:
    model = _square_pair(3)
    model[0].double()
    with pytest.raises(ValueError, match=r"pair \('0', '2'\): its layers' weights are torch"):
        attach(torch.optim.SGD(model.parameters(), lr=0.1), model, lam=0.3, pairs=[("0", "2")])


def test_a_weight_held_as_a_buffer_is_refused_as_such() -> None:
    model = _square_pair(4)
    weight = model[0].weight.detach()
    del model[0].weight
    model[0].register_buffer("weight", weight)  # a common way to freeze it
    with pytest.raises(ValueError, match=r"holds its weight as a buffer, not an nn\.Parameter"):
        attach(torch.optim.SGD(model.parameters(), lr=0.1), model, lam=0.3, pairs=[("0", "2")])


def test_a_parametrized_bias_of_the_first_layer_keeps_the_pair_and_its_bounds() -> None:
    # Before, the bias's ParametrizationList (a child of layer 0) counted as a module
    # registered between the two layers: the auto pair was refused, explicit pairs lost the
    # bounds, and the same on layer 2 was accepted.
    from torch.nn.utils import parametrize

    class Clamp(nn.Module):
        def forward(self, b: torch.Tensor) -> torch.Tensor:
            return b.clamp(-1, 1)

    model = _square_pair(5)
    parametrize.register_parametrization(model[0], "bias", Clamp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = attach(optimizer, model, lam=0.3)
    _square_step(model, optimizer, 0)
    assert handle.num_steps == 1
    assert {"path_norm_bound", "product_bound"} <= set(handle.metrics())
    handle.remove()


def test_setting_check_finite_re_plans_the_check() -> None:
    torch.manual_seed(4)
    model = MLP()
    optimizer = model.configure_optimizers()
    handle = attach(optimizer, model, lam=0.05, check_finite=False)
    _one_step(model, optimizer)
    handle.check_finite = True
    with torch.no_grad():
        linears(model)[0].weight[0, 0] = float("nan")
    with pytest.raises(pathnorm_lightning.NonFiniteWeightsError):
        _one_step(model, optimizer)


def test_the_planned_prox_equals_the_facade_and_refuses_non_finite_weights() -> None:
    torch.manual_seed(5)
    model = MLP(sizes=(20, 16, 4))
    optimizer = model.configure_optimizers()
    handle = attach(optimizer, model, lam=0.05)
    views = handle._plan[id(optimizer)][0].target.views
    assert views is not None and views.prox is not None  # planned: checked once, here
    w_in, w_out = (layer.weight for layer in linears(model)[:2])
    expected = prox_path_norm(w_in.detach(), w_out.detach(), 0.03)
    versions = (w_in._version, w_out._version)
    assert views.prox(0.03, True)
    assert torch.equal(w_in.detach(), expected[0]) and torch.equal(w_out.detach(), expected[1])
    assert w_in._version > versions[0] and w_out._version > versions[1]  # autograd sees it
    for step in (0.0, 2.5, math.nan, -1.0):  # left to prox_path_norm_ (0, capping, errors)
        assert not views.prox(step, True)
    with torch.no_grad():
        w_out[1, 3] = math.inf
    before = (w_in.detach().clone(), w_out.detach().clone())
    with pytest.raises(pathnorm_lightning.NonFiniteWeightsError, match="w_out"):
        views.prox(0.03, True)
    assert torch.equal(w_in.detach(), before[0]) and torch.equal(w_out.detach(), before[1])


def _conv_pair(seed: int) -> nn.Sequential:
    """Conv1d(3, 4, 3) -> ReLU -> Conv1d(4, 2, 2): its outgoing view (4 x 2 taps, 4 units) is
    a copy, shorter than the incoming side (3 x 3 taps), so the planned prox applies."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.Conv1d(4, 2, 2)).double()


def _conv_step(model: nn.Sequential, optimizer: torch.optim.Optimizer, seed: int) -> None:
    optimizer.zero_grad()
    x = torch.randn(5, 3, 9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    model(x).sum().backward()
    optimizer.step()


def test_a_conv_pair_with_a_copied_view_takes_the_planned_prox_bit_for_bit() -> None:
    model, twin = _conv_pair(6), _conv_pair(6)
    handles = []
    for net in (model, twin):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        handles.append((attach(optimizer, net, lam=1.0), optimizer))
    views = handles[0][0]._plan[id(handles[0][1])][0].target.views
    assert views is not None and views.copies and views.prox is not None  # planned, on a copy
    assert views.cached[1] is None and views.buffers[1] is not None
    twin_views = handles[1][0]._plan[id(handles[1][1])][0].target.views
    assert twin_views is not None
    object.__setattr__(twin_views, "prox", None)  # the twin: the per-call facade
    planned, calls = views.prox, []

    def counted(step: float, check: bool) -> bool:
        calls.append(step)
        return planned(step, check)

    object.__setattr__(views, "prox", counted)
    for step in range(4):
        for net, (_, optimizer) in zip((model, twin), handles, strict=True):
            _conv_step(net, optimizer, step)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)  # the same prox, to the bit
    assert (model[0].weight == 0).any() and handles[0][0].num_steps == 4
    assert calls == [0.05] * 4  # every step on the planned path (lam * lr)
    assert 0 < handles[0][0].metrics()["alive_units"] < 1  # units died, some live
    handle, optimizer = handles[0]
    with torch.no_grad():
        model[2].weight[1, 0, 1] = math.nan  # the outgoing side, read through the buffer
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # an SGD step that leaves the weights as they are
    before = [p.detach().clone() for p in (model[0].weight, model[2].weight)]
    with pytest.raises(pathnorm_lightning.NonFiniteWeightsError, match=r"pair \('0', '2'\)"):
        optimizer.step()
    for w, old in zip((model[0].weight, model[2].weight), before, strict=True):
        assert torch.equal(w.detach().nan_to_num(7.0), old.nan_to_num(7.0))  # nothing written
    assert handle.num_steps == 4
    for handle, _ in handles:
        handle.remove()


def test_metrics_read_each_weight_once_and_equal_the_metric_classes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(7)
    model = MLP(sizes=(20, 16, 12, 8, 4))  # pairs (0, 1) and (2, 3) of a 4-layer chain
    optimizer = model.configure_optimizers()
    handle = attach(optimizer, model, lam=0.05)
    _plain_loop(model, optimizer)
    reads = []
    absolute = _chain.absolute
    monkeypatch.setattr(_chain, "absolute", lambda w: reads.append(w.data_ptr()) or absolute(w))
    values = handle.metrics()
    weights = [layer.weight.detach() for layer in linears(model)]
    assert sorted(reads) == sorted(w.data_ptr() for w in weights)  # each weight read once
    monkeypatch.undo()
    sparsity, bound, product = Sparsity(), PathNormBound(), ProductBound()
    for metric in (bound, product):
        metric.update(weights)
    sparsity.update(weights[:2])  # the hook counts the alive units within its pairs
    sparsity.update(weights[2:])
    expected = {
        "sparsity": float(sparsity.compute()["sparsity"]),
        "alive_units": float(sparsity.compute()["alive_units"]),
        "path_norm_bound": float(bound.compute()),
        "product_bound": float(product.compute()),
    }
    assert values == pytest.approx(expected, rel=1e-6)  # float32 weights, summed in order
    assert 0 < values["sparsity"] < 1 and values["path_norm_bound"] < values["product_bound"]


@pytest.mark.parametrize("check_finite", [True, False])
def test_lam_zero_is_plain_sgd_and_still_checks_when_asked(check_finite: bool) -> None:
    torch.manual_seed(8)
    model = MLP()
    plain = copy.deepcopy(model)
    optimizer = model.configure_optimizers()
    handle = attach(optimizer, model, lam=0.0, check_finite=check_finite)
    for net, opt in ((model, optimizer), (plain, plain.configure_optimizers())):
        for _ in range(2):
            _one_step(net, opt)
    assert handle.num_steps == 2
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
    with torch.no_grad():
        linears(model)[0].weight[0, 0] = math.nan
    if check_finite:
        with pytest.raises(pathnorm_lightning.NonFiniteWeightsError, match="pair"):
            _one_step(model, optimizer)
    else:
        _one_step(model, optimizer)  # unchecked, as asked: the NaN propagates
        assert handle.num_steps == 3 and linears(model)[0].weight.isnan().any()
