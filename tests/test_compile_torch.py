"""torch.compile and the network bounds: a compiled nn.Sequential shows its chain in the module
tree and keeps path_norm_bound (no warning); layers whose chain only the forward pass could show
get a "not seen under torch.compile" warning, never a skip-connection one."""

from __future__ import annotations

import csv
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pathnorm_lightning import PathNormProx, attach  # noqa: E402

X = torch.randn(8, 20, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def can_compile() -> None:
    try:
        torch.compile(nn.Linear(2, 2), backend="eager")(torch.ones(1, 2))
    except Exception as err:  # no dynamo on this Python / platform
        pytest.skip(f"torch.compile is unavailable here: {type(err).__name__}: {err}")


@pytest.fixture(autouse=True)
def fresh_dynamo(can_compile: None) -> Iterator[None]:
    torch._dynamo.reset()  # no cache limit reached across tests (it would run them eagerly)
    yield
    torch._dynamo.reset()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 4))


class Body(nn.Module):
    """A custom module whose layers sit in an nn.Sequential (the tree shows their chain)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


class Attributes(nn.Module):
    """A custom module with its layers as attributes (only the forward pass shows the chain)."""

    def __init__(self) -> None:
        super().__init__()
        net = mlp()
        self.a, self.b = net[0], net[2]

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.relu(self.a(x)))


def compiled(module: nn.Module, backend: str = "eager") -> nn.Module:
    return torch.compile(module, backend=backend)  # type: ignore[return-value]


def in_place(module: nn.Module) -> nn.Module:
    module.compile(backend="eager")
    return module


def with_compiled_body(body: Callable[[nn.Module], nn.Module]) -> Body:
    model = Body()
    model.body = body(model.body)  # type: ignore[assignment]
    return model


def train(model: nn.Module, pairs: Any = "auto") -> tuple[dict[str, float], list[str]]:
    """Two SGD steps with the prox; the hook's metrics and every warning's message."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook = attach(opt, model, lam=0.05, pairs=pairs)
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(X), Y).backward()
            opt.step()
    metrics = hook.metrics()
    hook.remove()
    return metrics, [str(w.message) for w in caught]


def ours(messages: list[str]) -> list[str]:
    words = ("bound", "chain", "verified", "torch.compile", "skip connection")
    return [m for m in messages if any(w in m for w in words)]


@pytest.mark.parametrize(
    ("make", "pairs"),
    [
        (lambda: compiled(mlp()), "auto"),
        (lambda: compiled(mlp(), "aot_eager"), "auto"),
        (lambda: compiled(mlp()), [("_orig_mod.0", "_orig_mod.2")]),  # names as named_modules
        (lambda: with_compiled_body(compiled), "auto"),
        (lambda: with_compiled_body(in_place), "auto"),
        (lambda: compiled(Body()), "auto"),  # the output check is hidden: skipped
    ],
    ids=["sequential", "aot_eager", "explicit-pairs", "inner", "inner-in-place", "outer-body"],
)
def test_compiled_chain_keeps_bounds_without_warning(
    make: Callable[[], nn.Module], pairs: Any
) -> None:
    expected, _ = train(mlp())
    metrics, messages = train(make(), pairs)
    assert metrics["path_norm_bound"] == pytest.approx(expected["path_norm_bound"], rel=1e-6)
    assert metrics["product_bound"] == pytest.approx(expected["product_bound"], rel=1e-6)
    assert metrics["sparsity"] == pytest.approx(expected["sparsity"])
    assert ours(messages) == []


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = compiled(mlp())

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) + x[:, :4]


def test_compiled_sequential_output_is_still_checked() -> None:
    # a guard (as before the fix): the output check at the compiled module's output sees a skip
    metrics, messages = train(Skip())
    assert "path_norm_bound" not in metrics
    [message] = ours(messages)
    assert "[('net._orig_mod.2', '<output>')]" in message and "skip connection" in message


@pytest.mark.parametrize(
    ("make", "links", "where"),
    [
        (lambda: compiled(Attributes()), "('_orig_mod.a', '_orig_mod.b')", "the model itself"),
        (lambda: in_place(Attributes()), "('a', 'b')", "the model itself"),
        (
            lambda: with_compiled_body(lambda _: compiled(Attributes())),
            "('body._orig_mod.a',",
            "'body'",
        ),
    ],
    ids=["compiled", "in-place", "inner"],
)
def test_compiled_custom_module_warns_not_seen_and_drops_bounds(
    make: Callable[[], nn.Module], links: str, where: str
) -> None:
    metrics, messages = train(make())
    assert set(metrics) == {"sparsity", "alive_units"}
    assert not [m for m in messages if "skip connection" in m]
    [bounds] = [m for m in messages if "path_norm_bound" in m]
    assert links in bounds and f"compiled: {where}" in bounds
    assert "not seen" in bounds and "are not computed" in bounds
    assert "compile an nn.Sequential that holds the layers instead" in bounds
    [pairs] = [m for m in messages if "could not be verified" in m]
    assert "(under torch.compile it is not seen)" in pairs


class HalfCompiled(nn.Module):
    """A pair whose second layer runs compiled, its first eagerly."""

    def __init__(self) -> None:
        super().__init__()
        net = mlp()
        self.a = net[0]
        self.rest = compiled(nn.Sequential(net[1], net[2]))

    def forward(self, x: Tensor) -> Tensor:
        return self.rest(self.a(x))


def test_pair_with_a_compiled_layer_is_not_seen_rather_than_contradicted() -> None:
    metrics, messages = train(HalfCompiled())
    assert "path_norm_bound" not in metrics
    [pairs] = [m for m in messages if "could not be verified" in m]
    assert "[('a', 'rest._orig_mod.1')]" in pairs and "it is not seen" in pairs
    assert "does not run" not in pairs  # not taken as contradicted by the forward pass


class LM(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit(model: Any, tmp_path: Path, name: str) -> tuple[dict[str, str], list[str]]:
    """Three steps with PathNormProx; the last logged row and every warning's message."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        callbacks=[PathNormProx(lam=0.05)],
        logger=CSVLogger(tmp_path, name=name),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(X.repeat(3, 1), Y.repeat(3)), batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    text = next((tmp_path / name).rglob("metrics.csv")).read_text()
    rows = list(csv.DictReader(text.splitlines()))
    return [r for r in rows if r.get("pathnorm/sparsity")][-1], [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "make",
    [lambda: LM(compiled(mlp())), lambda: LM(compiled(mlp(), "aot_eager"))],
    ids=["eager", "aot_eager"],
)
def test_lightning_module_with_compiled_sequential_logs_bounds(
    tmp_path: Path, make: Callable[[], Any]
) -> None:
    expected, _ = fit(LM(mlp()), tmp_path, "plain")
    row, messages = fit(make(), tmp_path, "compiled")
    bound = float(row["pathnorm/path_norm_bound"])
    assert bound == pytest.approx(float(expected["pathnorm/path_norm_bound"]), rel=1e-6)
    assert ours(messages) == []


def test_lightning_compiled_as_a_whole_still_logs_bounds(tmp_path: Path) -> None:
    # a guard: trainer.fit(torch.compile(model)) kept its bounds before, and still does
    expected, _ = fit(LM(mlp()), tmp_path, "plain")
    row, messages = fit(compiled(LM(mlp())), tmp_path, "whole")
    bound = float(row["pathnorm/path_norm_bound"])
    assert bound == pytest.approx(float(expected["pathnorm/path_norm_bound"]), rel=1e-6)
    assert ours(messages) == []


def test_lightning_compiled_custom_module_says_not_seen(tmp_path: Path) -> None:
    row, messages = fit(LM(compiled(Attributes())), tmp_path, "custom")
    assert not row.get("pathnorm/path_norm_bound")
    assert not [m for m in messages if "skip connection" in m]
    bounds = [m for m in messages if "path_norm_bound" in m]
    assert len(bounds) == 1  # one warning, which says why: not "do not form a chain"
    assert "not seen" in bounds[0] and "torch.compile" in bounds[0] and "not computed" in bounds[0]
