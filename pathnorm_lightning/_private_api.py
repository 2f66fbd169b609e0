"""Every private name of torch and Lightning that ``pathnorm_lightning`` uses: where, why, and
a probe on small real objects of the installed versions. The record type, the check and the
source scan are :mod:`shared_spec.private_api`; ``tests/test_private_api.py`` runs them, and
``pyproject.toml`` keeps torch and lightning below 3."""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import torch

from shared_spec.private_api import PrivateName
from shared_spec.private_api import check as _check

__all__ = ["ENTRIES", "TESTED", "check"]

# The versions these entries were last checked with (the probes pass there).
TESTED = {"torch": "2.13.0", "lightning": "2.6.6"}


def check() -> None:
    """Raise ``PrivateAPIError`` naming each entry that no longer resolves here, and the fix."""
    _check(ENTRIES, TESTED)


def _trainer() -> Any:
    names = ("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary")
    quiet: dict[str, Any] = dict.fromkeys(names, False)
    return pl.Trainer(accelerator="cpu", devices=1, **quiet)


def _should_accumulate() -> bool:
    return callable(_trainer().fit_loop._should_accumulate)


def _should_update_logs() -> bool:
    return isinstance(_trainer()._logger_connector.should_update_logs, bool)


def _batches_that_stepped() -> bool:
    return _trainer().fit_loop.epoch_loop._batches_that_stepped == 0


def _state_key() -> bool:
    key = pl.Callback()._generate_state_key(targets=["a"])
    return isinstance(key, str) and "a" in key


def _attached() -> bool:
    module = pl.LightningModule()
    return module._trainer is None and module._fabric is None


def _parameters() -> bool:
    layer = torch.nn.Linear(2, 2)
    return layer._parameters["weight"] is layer.weight


def _modules() -> bool:
    a, b = torch.nn.Linear(2, 2), torch.nn.ReLU()
    return list(torch.nn.Sequential(a, b)._modules.items()) == [("0", a), ("1", b)]


def _forward_pre_hooks() -> bool:
    layer = torch.nn.Linear(2, 2)
    torch.nn.utils.prune.l1_unstructured(layer, "weight", amount=0.5)
    hooks = list(layer._forward_pre_hooks.values())
    return any(isinstance(h, torch.nn.utils.prune.BasePruningMethod) for h in hooks)


def _forward_hooks() -> bool:
    layer = torch.nn.Linear(2, 2)
    handle = layer.register_forward_hook(lambda *args: None)
    return list(layer._forward_hooks) == [handle.id]


def _reversed_padding() -> bool:
    conv = torch.nn.Conv2d(1, 1, 3, padding=(1, 2))
    return tuple(conv._reversed_padding_repeated_twice) == (2, 2, 1, 1)


def _saved_sizes() -> bool:
    x = torch.zeros(2, 3, 4, 5, requires_grad=True)
    return tuple(x.flatten(1).grad_fn._saved_self_sym_sizes) == (2, 3, 4, 5)  # type: ignore[union-attr]


def _saved_pooling() -> bool:
    x = torch.zeros(2, 3, 4, 4, requires_grad=True)
    pool = torch.nn.functional.avg_pool2d(x, 2, divisor_override=1).grad_fn
    mean = x.mean((2, -1)).grad_fn
    sizes = tuple(mean._saved_self_sym_sizes)  # type: ignore[union-attr]
    return (
        pool._saved_divisor_override == 1  # type: ignore[union-attr]
        and [d if d < 2**63 else d - 2**64 for d in mean._saved_dim] == [2, -1]  # type: ignore[union-attr]
        and mean._saved_keepdim is False  # type: ignore[union-attr]
        and sizes == (2, 3, 4, 4)
    )


def _found_inf() -> bool:
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([weight], fused=True)
    seen: list[Any] = []
    optimizer.register_step_post_hook(lambda o, *_: seen.append(getattr(o, "found_inf", None)))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((weight**2).sum()).backward()
    weight.grad.fill_(float("inf"))  # type: ignore[union-attr]
    scaler.step(optimizer)
    return len(seen) == 1 and isinstance(seen[0], torch.Tensor) and bool(seen[0])


def _step_hooks() -> bool:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])
    hooked = getattr(type(optimizer).step, "hooked", False)
    return hooked is True and isinstance(optimizer._optimizer_step_post_hooks, dict)


def _orig_mod() -> bool:
    layer = torch.nn.Linear(2, 2)
    wrapper: Any = torch.compile(layer, backend="eager")  # compiles nothing until called
    kind = sys.modules["torch._dynamo.eval_frame"].OptimizedModule
    named = dict(wrapper.named_modules())
    return isinstance(wrapper, kind) and wrapper._orig_mod is layer and named["_orig_mod"] is layer


def _compiled_call_impl() -> bool:
    layer = torch.nn.Linear(2, 2)
    before = layer._compiled_call_impl
    layer.compile(backend="eager")  # compiles nothing until called
    return before is None and layer._compiled_call_impl is not None


def _compiler_ctx() -> bool:
    from lightning.pytorch.utilities.compile import from_compiled

    module = pl.LightningModule()
    before = module._compiler_ctx
    wrapper: Any = torch.compile(module, backend="eager")  # compiles nothing until called
    return before is None and from_compiled(wrapper)._compiler_ctx is not None


ENTRIES: tuple[PrivateName, ...] = (
    PrivateName(
        "lightning",
        "_should_accumulate",
        "trainer.fit_loop._should_accumulate()",
        ("pathnorm_lightning/callbacks.py:AfterOptimizerStep.on_train_batch_end",),
        "the batch-end hook runs on every batch; this tells whether the optimizer stepped "
        "(metrics are logged after a real step only, as Lightning's own step logging does)",
        _should_accumulate,
    ),
    PrivateName(
        "lightning",
        "_logger_connector",
        "trainer._logger_connector.should_update_logs",
        ("pathnorm_lightning/callbacks.py:AfterOptimizerStep.on_train_batch_end",),
        "the trainer's own flush condition for log_every_n_steps (Lightning's "
        "LearningRateMonitor reads it the same way)",
        _should_update_logs,
    ),
    PrivateName(
        "lightning",
        "_batches_that_stepped",
        "trainer.fit_loop.epoch_loop._batches_that_stepped",
        ("pathnorm_lightning/callbacks.py:AfterOptimizerStep.log_metric_values",),
        "the step axis of Lightning's own step-level logging, so the metrics line up with "
        "the loss in the loggers",
        _batches_that_stepped,
    ),
    PrivateName(
        "lightning",
        "_generate_state_key",
        "Callback._generate_state_key(**kwargs)",
        ("pathnorm_lightning/callbacks.py:AfterOptimizerStep.state_key",),
        "the key format Lightning gives stateful callbacks, so several instances keep their "
        "own checkpoint state",
        _state_key,
    ),
    *(
        PrivateName(
            "lightning",
            name,
            f"LightningModule.{name}",
            ("pathnorm_lightning/compact.py:_copy",),
            "compact deep-copies the model without the trainer/Fabric it is attached to "
            "(if renamed, the copy would silently include the trainer)",
            _attached,
        )
        for name in ("_trainer", "_fabric")
    ),
    PrivateName(
        "torch",
        "_parameters",
        'module._parameters.get("weight")',
        (
            "pathnorm_lightning/compact.py:_ops",
            "pathnorm_lightning/_plan.py:Guard.holds",
            "pathnorm_lightning/_plan.py:followed",
            "pathnorm_lightning/pairing.py:weight_parameter",
        ),
        "the registered weight Parameter itself, not what module.weight computes under a "
        "parametrization or pruning (the prox must write the trained tensor)",
        _parameters,
    ),
    PrivateName(
        "torch",
        "_modules",
        "nn.Sequential._modules",
        (
            "pathnorm_lightning/compact.py:_sequential_between",
            "pathnorm_lightning/pairing.py:_children_between",
            "pathnorm_lightning/_plan.py:submodule",
        ),
        "the children in registration order by name, None entries included, to find the "
        "modules between the two layers of a pair; and, at every step, the module a pair's "
        "layer name finds now (get_submodule's lookup without its per-call cost)",
        _modules,
    ),
    PrivateName(
        "torch",
        "_forward_pre_hooks",
        "module._forward_pre_hooks",
        (
            "pathnorm_lightning/pairing.py:weight_parameter",
            "pathnorm_lightning/compact.py:_check_hooks",
        ),
        "recognises torch.nn.utils.prune (a forward pre-hook) to say why a weight is computed; "
        "compact refuses a pair whose layers have other forward hooks (it cannot see their effect)",
        _forward_pre_hooks,
    ),
    PrivateName(
        "torch",
        "_forward_hooks",
        "module._forward_hooks",
        ("pathnorm_lightning/compact.py:_check_hooks",),
        "compact refuses a pair whose layers (or a module between) have forward hooks: it "
        "cannot see what they change (no public API lists a module's hooks)",
        _forward_hooks,
    ),
    PrivateName(
        "torch",
        "_reversed_padding_repeated_twice",
        "nn.Conv2d._reversed_padding_repeated_twice",
        (
            "pathnorm_lightning/compact.py:_ConvUnits.input_shift",
            "pathnorm_lightning/compact.py:_ConvUnits.probe",
        ),
        "the resolved padding ('same' included) as numbers, to know whether zero padding "
        "touches an output",
        _reversed_padding,
    ),
    PrivateName(
        "torch",
        "_saved_self_sym_sizes",
        "autograd ViewBackward0/ReshapeAliasBackward0 node ._saved_self_sym_sizes",
        ("pathnorm_lightning/_forward.py:_keeps_units",),
        "the input shape of a flatten in the training graph, to verify that a conv's channels "
        "reach the Linear layer as its units (renamed: such auto pairs would all be refused)",
        _saved_sizes,
    ),
    *(
        PrivateName(
            "torch",
            name,
            "autograd AvgPool2DBackward0._saved_divisor_override, MeanBackward1._saved_dim, "
            "._saved_keepdim, ._saved_self_sym_sizes",
            (
                "pathnorm_lightning/_forward.py:_keeps_units",
                "pathnorm_lightning/_forward.py:_mean_axes",
            ),
            "whether a pooling in the training graph averages the positions of each channel (no "
            "divisor_override, a mean over positions only): renamed, a window sum or a mean "
            "over the channels would pass as pooling, and the bounds would be too small",
            _saved_pooling,
        )
        for name in ("_saved_divisor_override", "_saved_dim", "_saved_keepdim")
    ),
    *(
        PrivateName(
            "torch",
            name,
            "type(optimizer).step.hooked, optimizer._optimizer_step_post_hooks",
            ("pathnorm_lightning/hook.py:_unwrap",),
            "whether an optimizer's step runs its step hooks (both set by Optimizer.__init__, "
            "which some wrappers skip): else the prox would silently never run",
            _step_hooks,
        )
        for name in ("hooked", "_optimizer_step_post_hooks")
    ),
    PrivateName(
        "torch",
        "_orig_mod",
        "torch._dynamo.eval_frame.OptimizedModule._orig_mod (the module torch.compile(module) "
        "wraps, registered as its submodule '_orig_mod')",
        (
            "pathnorm_lightning/_forward.py:unwrap",
            "pathnorm_lightning/_forward.py:output_module",
        ),
        "sees through torch.compile(module) to the module tree the chain of the network bounds "
        "is read from (a compiled nn.Sequential shows its chain), and hooks the wrapper, whose "
        "hooks run outside the compiled code: else a compiled chain loses its bounds",
        _orig_mod,
    ),
    PrivateName(
        "torch",
        "_compiled_call_impl",
        "nn.Module._compiled_call_impl (set by module.compile())",
        ("pathnorm_lightning/_forward.py:_compiled_scopes",),
        "whether a module was compiled in place, so its forward passes are hidden from the "
        "forward check: links only that check could verify then get no network bounds",
        _compiled_call_impl,
    ),
    PrivateName(
        "lightning",
        "_compiler_ctx",
        "LightningModule._compiler_ctx (set when trainer.fit(torch.compile(model)) unwraps it)",
        ("pathnorm_lightning/_forward.py:_compiled_scopes",),
        "whether Lightning compiled the model's forward and steps, so its forward passes are "
        "hidden from the forward check: links only that check could verify then get no network "
        "bounds",
        _compiler_ctx,
    ),
    PrivateName(
        "torch",
        "found_inf",
        "optimizer.found_inf (set by GradScaler.step on fused optimizers)",
        ("pathnorm_lightning/hook.py:_skipped_by_scaler",),
        "a fused optimizer under GradScaler steps with inf/NaN gradients and updates "
        "nothing; the prox must skip that step too",
        _found_inf,
    ),
)
