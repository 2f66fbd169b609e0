"""Keras 3 optimizers that follow every real update with the exact path-norm prox (or a baseline).

Proximal SGD (the paper's training method) is ``W <- prox_{lam * lr * R}(W - lr * grad)``.
Two ways to get it:

* :class:`PathNormSGD`: ``keras.optimizers.SGD`` (momentum, Nesterov, every base argument)
  followed by the 1-path-norm prox of the paired kernels with step ``lam * lr``.
* :class:`ProxOptimizer`: wraps *any* Keras optimizer (like ``LossScaleOptimizer``) and
  follows its step with the path-norm prox, the L1 prox (``regularizer="l1"``) or the
  layer-wise l_inf projection (``regularizer="linf"``, ``||K||_{inf->inf} <= radius``).

The invariant, held in one place (:meth:`_KernelRegularizer._apply_regularizer`): **the prox
runs exactly once per real update, on exactly the variables that update changed.** "Real
update" means what the optimizer means by it: under ``gradient_accumulation_steps=s`` the prox
runs once per ``s`` batches, right after the weights move, with the learning rate that step
used (schedules are honoured). "The variables it changed" are the ones handed to this step
(``apply``/``apply_gradients``, less those without a gradient), matched by identity: a layer
frozen after the optimizer was built (``trainable = False``, then ``compile`` again) is left
alone, and a pair with one side frozen is skipped with a warning. Which kernels *can* be
regularized is resolved from the variables' paths when the optimizer is built (see
:mod:`pathnorm_tf.pairing`): ``Dense``, ``Conv1D`` and ``Conv2D`` kernels, whose hidden units
(features or channels) the layer seam (:mod:`pathnorm_tf.layers`) lays out as the matrices the
prox takes; the optimizer stores indices and those layouts, so model variables never become
optimizer variables, and records where explicit names resolved in its config, so a reloaded
model keeps its pairs. Under
``tf.distribute`` the prox runs on every replica's copy of the (already identical) weights.
Requires the TensorFlow backend of Keras.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import inspect
import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from pathnorm_tf import layers as seam
from pathnorm_tf import pairing
from pathnorm_tf._baselines import soft_threshold
from pathnorm_tf._common import check_scalar, warn_if_xla
from pathnorm_tf.functional import _prox_kernels
from pathnorm_tf.functional import project_linf_operator_norm as _project_linf

__all__ = ["PathNormSGD", "ProxOptimizer"]

REGULARIZERS = ("path", "l1", "linf")


def _check_backend(cls_name: str) -> None:
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            f"{cls_name} needs the TensorFlow backend of Keras, but KERAS_BACKEND is "
            f"{keras.backend.backend()!r}; set KERAS_BACKEND=tensorflow (torch users: "
            "pathnorm_lightning)"
        )


def _check_strength(value: Any, name: str, owner: str) -> float:
    """``lam``/``radius`` as a float: the rule of :func:`pathnorm_tf._common.check_scalar`
    (``TypeError`` for a non-real, ``ValueError`` for NaN, inf, negative or a shape)."""
    if value is None:
        raise TypeError(f"{owner} needs {name} (a finite number >= 0), e.g. {name}=1e-4")
    if getattr(value, "shape", ()) != ():  # (prox_path_norm also takes a 1-element tensor)
        raise ValueError(f"{name} must be a real number, not an array of shape {value.shape}")
    return float(check_scalar(value, name))


# The model that ``verify_pairs`` builds an optimizer for (a custom loop's way to show it).
_MODEL_HINT: contextvars.ContextVar[Any] = contextvars.ContextVar("model_hint", default=None)


def _model_of(variables: list[Any]) -> keras.Model | None:
    """The model whose ``fit``/``compile`` is building this optimizer, if any: Keras calls
    ``optimizer.build(self.trainable_variables)`` from the model's own method (through a
    ``LossScaleOptimizer``'s build at most), and a variable keeps no link to its layer. None in
    a custom loop (``optimizer.apply`` or ``build`` called directly) unless it goes through
    ``verify_pairs(model)``."""
    ids = [id(v) for v in variables]
    hint = _MODEL_HINT.get()
    if hint is not None and [id(v) for v in hint.trainable_variables] == ids:
        return hint
    frame = inspect.currentframe()
    for _ in range(8):
        frame = frame.f_back if frame is not None else None
        owner = frame.f_locals.get("self") if frame is not None else None
        if isinstance(owner, keras.Model) and [id(v) for v in owner.trainable_variables] == ids:
            return owner
    return None


def _tf_variable(v: Any) -> Any:
    return v.value if isinstance(v, keras.Variable) else v


def _when(is_real: tf.Tensor | None, fn: Any) -> None:
    if is_real is None:
        fn()
        return

    def run() -> tf.Tensor:
        fn()
        return tf.constant(True)

    tf.cond(is_real, run, lambda: tf.constant(False))


def alive_units(k_in: Any, k_out: Any, layout: seam.PairLayout | None = None) -> tf.Tensor:
    """Per hidden unit, (n,) bool: its incoming weights (column ``j`` of the seam's in-view,
    ``k_in[:, j]`` for Dense kernels) and its outgoing ones (row ``j`` of the out-view,
    ``k_out[j, :]``) both hold a nonzero weight. ``layout``: the pair's, None for Dense."""
    if layout is not None:
        k_in, k_out = layout.views(k_in, k_out)
    return tf.reduce_any(tf.not_equal(k_in, 0), 0) & tf.reduce_any(tf.not_equal(k_out, 0), 1)


def _links(chain: Sequence[Any]) -> list[tuple[Any, Any, seam.PairLayout | None]]:
    """The consecutive kernels of ``chain`` with their layout (a :class:`pairing.Chain`'s;
    None for a plain list of Dense kernels)."""
    layouts = getattr(chain, "layouts", [None] * max(len(chain) - 1, 0))
    return [(a, b, lay) for (a, b), lay in zip(itertools.pairwise(chain), layouts, strict=True)]


def dead_pairs(chains: Sequence[Sequence[Any]]) -> list[tuple[str, str]]:
    """The layer paths of the consecutive kernels in ``chains`` with hidden units, none alive."""
    return [
        (pairing.layer_path(k_in), pairing.layer_path(k_out))
        for chain in chains
        for k_in, k_out, layout in _links(chain)
        if int(k_in.shape[-1]) > 0 and not bool(tf.reduce_any(alive_units(k_in, k_out, layout)))
    ]


def warn_dead_pairs(
    dead: list[tuple[str, str]], optimizer: Any, warned: set[tuple[str, str]]
) -> None:
    """Warn once (per ``warned``) for each pair in ``dead`` that lost every hidden unit, with
    what to change on ``optimizer`` (a path-norm optimizer or any other)."""
    if getattr(optimizer, "_radius", None) is not None:
        strength = f"radius={optimizer._radius} is too small for these layers; try a larger one"
    elif getattr(optimizer, "_lam", None) is not None:
        strength = f"lam={optimizer._lam} is too large for these layers; try one 3-10x smaller"
    else:
        strength = "the regularization is too strong for these layers; try a smaller lam"
    for names in dead:
        if names in warned:
            continue
        warned.add(names)
        warnings.warn(
            f"pathnorm_tf: pair {names} has no alive hidden unit left (each unit's incoming or "
            "outgoing weights are all zero): it maps every input to the same output. "
            f"{strength}. The pull on each weight grows with the layers' widths: see "
            "'Choosing lam' in the Keras docs (docs/keras.md).",
            UserWarning,
            stacklevel=2,
        )


class _KernelRegularizer:
    """Mixin: configuration, resolution at build time and the post-step update."""

    _regularizer: str
    _lam: float | None
    _radius: float | None
    _pairs_spec: pairing.PairsSpec
    _layers_spec: pairing.LayersSpec
    _check_finite: bool
    _pairs: tuple[pairing.Pair, ...]
    _layers: tuple[pairing.Single, ...]
    _record: pairing.Record | None
    _warned_half_frozen: set[tuple[int, int]]
    _warned_dead: set[tuple[str, str]]
    _trainable_variables: list[Any]
    built: bool
    build: Any  # keras.optimizers.Optimizer's
    _var_key: Any  # keras.optimizers.Optimizer's: a variable's identity

    def _init_regularizer(
        self,
        owner: str,
        regularizer: str,
        lam: Any,
        radius: Any,
        pairs: Any,
        layers: Any,
        check_finite: bool,
    ) -> None:
        if regularizer not in REGULARIZERS:
            raise ValueError(f"regularizer must be one of {REGULARIZERS}, got {regularizer!r}")
        if regularizer == "linf":
            if lam is not None:
                raise ValueError('regularizer="linf" is a projection: pass radius=..., not lam')
            radius_v: float | None = _check_strength(radius, "radius", owner)
            lam_v: float | None = None
        else:
            if radius is not None:
                raise ValueError(f'radius applies to regularizer="linf" only, not {regularizer!r}')
            lam_v, radius_v = _check_strength(lam, "lam", owner), None
        pairs_spec = pairing.normalize_pairs(pairs)
        layers_spec = pairing.normalize_layers(layers)
        if regularizer == "path" and layers_spec != "auto":
            raise ValueError('layers applies to regularizer="l1"/"linf"; for "path" use pairs')
        if regularizer != "path" and pairs_spec != "auto":
            raise ValueError(f'pairs applies to regularizer="path"; for {regularizer!r} use layers')
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {check_finite!r}")
        self._regularizer = regularizer
        self._lam = lam_v
        self._radius = radius_v
        self._pairs_spec = pairs_spec
        self._layers_spec = layers_spec
        self._check_finite = check_finite
        self._pairs = ()
        self._layers = ()
        self._record = None
        self._warned_half_frozen = set()
        self._warned_dead = set()

    @property
    def lam(self) -> float | None:
        """Regularization strength (the prox step is ``lam * learning_rate``)."""
        return self._lam

    @property
    def regularized_pairs(self) -> list[tuple[str, str]]:
        """Paths of the (kernel_in, kernel_out) pairs the prox acts on (after ``build``)."""
        tv = self._trainable_variables
        return [(tv[p.first].path, tv[p.second].path) for p in self._pairs]

    @property
    def regularized_kernels(self) -> list[str]:
        """Paths of the kernels the baseline acts on (after ``build``)."""
        return [self._trainable_variables[s.kernel].path for s in self._layers]

    def _resolve(
        self, variables: list[Any], model: keras.Model | None
    ) -> tuple[tuple[pairing.Pair, ...], tuple[pairing.Single, ...]]:
        """The pairs and (baselines) layers in ``variables``, using the record if it applies;
        ``model``: the model that trains them, if known (convolutions need it)."""
        if self._regularizer == "path":
            pairs = pairing.resolve_pairs(variables, self._pairs_spec, self._record, model)
            return pairs, ()
        return (), pairing.resolve_layers(variables, self._layers_spec, self._record, model)

    def _resolve_targets(self, variables: list[Any]) -> None:
        model = _model_of(variables)
        self._pairs, self._layers = self._resolve(variables, model)
        if self._regularizer == "path" and self._pairs_spec == "auto":
            if model is not None:
                pairing.check_auto_pairs_in_model(model, variables, self._pairs)
            else:
                warnings.warn(
                    f'pairs="auto" paired {self.regularized_pairs} without seeing the model (the '
                    "optimizer was built outside model.fit): a frozen layer between two paired "
                    "layers is invisible in the trained variables. Call "
                    "optimizer.verify_pairs(model) before the first step, or pass pairs=[...].",
                    stacklevel=4,
                )
        path = self._regularizer == "path"
        spec = self._pairs_spec if path else self._layers_spec
        if not isinstance(spec, str):  # names: record where they resolved, for the config
            found = self._pairs if path else [s.kernel for s in self._layers]
            self._record = pairing.record_of(variables, spec, found, model)

    def verify_pairs(self, model: keras.Model) -> None:
        """Build the optimizer for ``model`` (custom loops; ``fit`` does this itself), checking
        ``pairs="auto"`` against the model's layers: a layer with weights between a pair,
        frozen or not, is refused, and a pair the model's graph does not confirm is warned
        about. Convolution kernels are only regularized by an optimizer that saw the model
        (their layers and Flatten order are not in the variables). Call it before the first
        step; once built, only the check runs."""
        if not isinstance(model, keras.Model):
            raise TypeError(f"verify_pairs takes the keras.Model being trained, got {model!r}")
        if not self.built:
            token = _MODEL_HINT.set(model)
            try:
                self.build(model.trainable_variables)
            finally:
                _MODEL_HINT.reset(token)
        elif self._regularizer == "path" and self._pairs_spec == "auto":
            pairing.check_auto_pairs_in_model(model, self._trainable_variables, self._pairs)

    def regularized_chains(
        self, variables: list[Any], model: keras.Model | None = None
    ) -> list[pairing.Chain]:
        """The kernels the regularizer acts on, as forward chains (for the metrics), each a
        :class:`~pathnorm_tf.pairing.Chain` (a list of variables, with the layouts between).

        The ``(kernel_in, kernel_out)`` pairs, or (baselines) the kernels split into runs of
        adjacent layers whose units chain. Once built, the optimizer's own variables and
        targets; before, ``variables`` (of ``model``) resolved as ``build`` will resolve them.
        """
        tv, pairs, layers = self._trainable_variables, self._pairs, self._layers
        if not getattr(self, "built", False):
            tv = list(variables)
            pairs, layers = self._resolve(tv, model)
        if self._regularizer == "path":
            return [pairing.Chain([tv[p.first], tv[p.second]], [p.layout]) for p in pairs]
        return [
            pairing.Chain([tv[i] for i in chain], chain.layouts)
            for chain in pairing.kernel_chains(tv, layers, model)
        ]

    def _check_alive(self) -> None:
        """At the end of ``fit`` (host side, once): warn, once per pair, about a pair that has
        lost every hidden unit (its prox then keeps it dead; lam is too large)."""
        if self.built:
            warn_dead_pairs(dead_pairs(self.regularized_chains([])), self, self._warned_dead)

    def _regularizer_config(self) -> dict[str, Any]:
        pairs = self._pairs_spec
        layers = self._layers_spec
        return {
            "lam": self._lam,
            "pairs": pairs if isinstance(pairs, str) else [list(p) for p in pairs],
            "check_finite": self._check_finite,
            **({"layers": layers} if self._regularizer != "path" else {}),
            **({"resolved": copy.deepcopy(self._record)} if self._record is not None else {}),
        }

    def _set_record(self, record: Any) -> None:
        self._record = pairing.check_record(record)

    # -- the update: after the step, on each replica's copy ----------------------------------

    def _apply_regularizer(
        self, learning_rate: Any, updated: list[Any], is_real: tf.Tensor | None = None
    ) -> None:
        """The prox (or projection) after a real update, on the targets that update changed.

        The one place that decides what the regularizer acts on: called once per real update
        (``is_real``: a tensor condition under gradient accumulation), with ``updated``, the
        variables this update changed. A target is acted on when all its kernels are in
        ``updated`` (by identity, ``_var_key``); a pair with one kernel there and one not (a
        layer frozen after the optimizer was built) is skipped, with one warning. The set is
        known when the step is traced: Keras traces again after ``compile``.
        """
        keys = {self._var_key(v) for v in updated}
        tv = self._trainable_variables
        pairs = []
        for pair in self._pairs:
            moved = [self._var_key(tv[k]) in keys for k in pair[:2]]
            if all(moved):
                pairs.append(pair)
            elif any(moved):
                self._warn_half_frozen((pair.first, pair.second))
        layers = [s for s in self._layers if self._var_key(tv[s.kernel]) in keys]
        if not pairs and not layers:
            return
        tf.__internal__.distribute.interim.maybe_merge_call(
            functools.partial(self._distributed_regularize, pairs=pairs, layers=layers),
            tf.distribute.get_strategy(),
            learning_rate,
            is_real,
        )

    def _warn_half_frozen(self, pair: tuple[int, int]) -> None:
        if pair in self._warned_half_frozen:
            return
        self._warned_half_frozen.add(pair)
        tv = self._trainable_variables
        names = tuple(pairing.layer_path(tv[k]) for k in pair)
        warnings.warn(
            f"{type(self).__name__}: pair {names} is half frozen (one of its layers is not "
            "trained by this step: trainable=False, or no gradient); the prox couples both "
            "layers, so it is skipped until both are trainable (compile the model again after "
            "changing trainable).",
            UserWarning,
            stacklevel=2,
        )

    def _distributed_regularize(
        self,
        distribution: Any,
        learning_rate: Any,
        is_real: tf.Tensor | None,
        pairs: list[pairing.Pair],
        layers: list[pairing.Single],
    ) -> None:
        tv = self._trainable_variables
        for i, j, layout in pairs:
            distribution.extended.update(
                _tf_variable(tv[i]),
                functools.partial(self._path_update, layout=layout),
                args=(_tf_variable(tv[j]), learning_rate, is_real),
                group=False,
            )
        for i, entry in layers:
            distribution.extended.update(
                _tf_variable(tv[i]),
                functools.partial(self._layer_update, entry=entry),
                args=(learning_rate, is_real),
                group=False,
            )

    def _step(self, learning_rate: Any) -> tf.Tensor:
        # lam * lr in float64, rounded once (as the torch side's Python float).
        return tf.constant(self._lam, tf.float64) * tf.cast(learning_rate, tf.float64)

    def _read(self, var: Any, name: str) -> tf.Tensor:
        value = tf.convert_to_tensor(var)
        if self._check_finite:
            warn_if_xla(f"check_finite=True: that {name} is finite")
            value = tf.debugging.assert_all_finite(
                value, f"{name} contains NaN or inf before the prox (training diverged?)"
            )
        return value

    def _path_update(
        self,
        k_in: Any,
        k_out: Any,
        learning_rate: Any,
        is_real: tf.Tensor | None,
        layout: seam.PairLayout,
    ) -> None:
        # The prox on the seam's unit views (the kernels themselves for a Dense pair), written
        # back in the kernels' layouts: static reshapes and transposes, fine under XLA.
        def update() -> None:
            first, second = self._read(k_in, "kernel_in"), self._read(k_out, "kernel_out")
            view_in, view_out = layout.views(first, second)
            new_in, new_out = _prox_kernels(view_in, view_out, self._step(learning_rate))
            new_first, new_second = layout.natives(
                new_in, new_out, tuple(first.shape), tuple(second.shape)
            )
            k_in.assign(new_first)
            k_out.assign(new_second)

        _when(is_real, update)

    def _layer_update(
        self,
        kernel: Any,
        learning_rate: Any,
        is_real: tf.Tensor | None,
        entry: seam.LayerEntry,
    ) -> None:
        def update() -> None:
            value = self._read(kernel, "kernel")
            if self._regularizer == "l1":
                kernel.assign(soft_threshold(value, self._step(learning_rate)))
            else:  # each unit's incoming weights (a column of the in-view) onto the l1 ball
                assert self._radius is not None
                rows = _project_linf(entry.in_view(value), self._radius)
                kernel.assign(entry.in_native(rows, tuple(value.shape)))

        _when(is_real, update)


@keras.saving.register_keras_serializable(package="pathnorm")
class PathNormSGD(_KernelRegularizer, keras.optimizers.SGD):
    """SGD followed, after every real update, by the exact 1-path-norm prox (proximal SGD).

    ``W <- prox_{lam * lr * P}(SGD step(W))`` on every pair, ``P`` the 1-path-norm
    ``sum_i ||K_out[i, :]||_1 ||K_in[:, i]||_1`` over the hidden units (Dense features or
    convolution channels, laid out by :mod:`pathnorm_tf.layers`); ``lr`` is the rate of the
    current step (a schedule is evaluated as SGD evaluates it).

    Args:
        learning_rate: float, ``LearningRateSchedule`` or callable, as for ``SGD``.
        lam: path-norm strength, finite and >= 0 (required).
        momentum, nesterov: as for ``SGD``.
        pairs: ``"auto"`` (consecutive Dense/Conv1D/Conv2D layers (1, 2), (3, 4), ...) or a
            list of ``(first_layer, second_layer)`` names or layers; checked when the
            optimizer is built (first ``fit`` batch), see :mod:`pathnorm_tf.pairing`.
        check_finite: assert the kernels are finite before each prox (a graph assertion).
        **kwargs: every other ``SGD`` argument (``gradient_accumulation_steps``,
            ``weight_decay``, ``clipnorm``, ``use_ema``, ``name``, ...).
    """

    def __init__(
        self,
        learning_rate: Any = 0.01,
        lam: float | None = None,
        momentum: float = 0.0,
        nesterov: bool = False,
        pairs: Any = "auto",
        check_finite: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_backend(type(self).__name__)
        if isinstance(momentum, int) and not isinstance(momentum, bool):
            momentum = float(momentum)
        super().__init__(
            learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, **kwargs
        )
        self._init_regularizer(type(self).__name__, "path", lam, None, pairs, "auto", check_finite)

    def build(self, variables: list[Any]) -> None:
        if self.built:
            return
        super().build(variables)
        self._resolve_targets(self._trainable_variables)

    def _backend_update_step(
        self, grads: Any, trainable_variables: Any, learning_rate: Any
    ) -> None:
        # Called once per real step (inside the accumulation cond), after clipping and decay.
        # trainable_variables: those of this step that have a gradient.
        super()._backend_update_step(grads, trainable_variables, learning_rate)
        self._apply_regularizer(learning_rate, list(trainable_variables))

    def finalize_variable_values(self, var_list: Any) -> None:
        # model.fit calls it once, after the last epoch
        super().finalize_variable_values(var_list)
        self._check_alive()

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(self._regularizer_config())
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> PathNormSGD:
        config = dict(config)
        record = config.pop("resolved", None)
        optimizer = super().from_config(config, custom_objects=custom_objects)
        optimizer._set_record(record)
        return optimizer


@keras.saving.register_keras_serializable(package="pathnorm")
class ProxOptimizer(_KernelRegularizer, keras.optimizers.Optimizer):
    """Wrap any Keras optimizer: its step, then a prox/projection of the chosen kernels.

    ``W <- prox(inner step(W))`` with, per ``regularizer``:

    * ``"path"``: the exact 1-path-norm prox with step ``lam * lr`` on each ``pairs`` pair;
    * ``"l1"``: soft-thresholding by ``lam * lr`` of each kernel in ``layers``;
    * ``"linf"``: each kernel in ``layers`` projected onto ``||K||_{inf->inf} <= radius``
      (every column onto the l1 ball; the paper's layer-wise baseline; no ``lr``). For a
      convolution the columns are those of the seam's in-view: output channel ``c``'s weights
      ``kernel[..., c]`` over every tap and input channel; each row of the unrolled
      convolution holds those weights (or some of them, at a zero-padded border), so its
      l_inf operator norm is at most ``radius`` too.

    ``lr`` is the inner optimizer's rate for that step. The wrapper forwards ``learning_rate``,
    ``iterations`` and ``variables`` to the inner optimizer (like ``LossScaleOptimizer``),
    honours its ``gradient_accumulation_steps`` (one prox per real step) and serializes it.

    Example::

        opt = ProxOptimizer(keras.optimizers.Adam(1e-3), lam=1e-4)             # path-norm
        opt = ProxOptimizer(keras.optimizers.SGD(0.1), lam=1e-4, regularizer="l1")
        opt = ProxOptimizer(keras.optimizers.SGD(0.1), regularizer="linf", radius=2.0)
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        lam: float | None = None,
        regularizer: str = "path",
        radius: float | None = None,
        pairs: Any = "auto",
        layers: Any = "auto",
        check_finite: bool = False,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        _check_backend(type(self).__name__)
        if kwargs:
            raise ValueError(
                f"ProxOptimizer does not take {sorted(kwargs)}; set them on the inner optimizer"
            )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"inner_optimizer must be a keras.optimizers.Optimizer, got {inner_optimizer!r}"
            )
        if isinstance(inner_optimizer, (PathNormSGD, ProxOptimizer)):
            raise ValueError(
                "inner_optimizer already applies a prox; wrap a plain optimizer (e.g. SGD, Adam)"
            )
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            # Its real steps (finite gradients, the end of an accumulation) are decided inside
            # its apply and not visible from here: the prox would also follow skipped steps.
            raise ValueError(
                "ProxOptimizer(LossScaleOptimizer(...)) would apply the prox on the steps the "
                "loss scaler skips; nest them the other way round, "
                "LossScaleOptimizer(ProxOptimizer(...)) (what model.compile builds under a "
                "mixed_float16 policy)"
            )
        if getattr(inner_optimizer, "use_ema", False):
            raise ValueError(
                "inner_optimizer has use_ema=True: its average would be taken before the prox "
                "(of weights that were never proxed, so with none of its zeros). Turn use_ema "
                "off, or use PathNormSGD(..., use_ema=True), which proxes before averaging."
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self._init_regularizer(
            type(self).__name__, regularizer, lam, radius, pairs, layers, check_finite
        )

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        self._resolve_targets(self._trainable_variables)

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "ProxOptimizer is not built: pass trainable_variables or call build() first"
                )
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        learning_rate = self.inner_optimizer.learning_rate  # the rate this step will use
        self.inner_optimizer.apply(grads, trainable_variables)
        steps = getattr(self.inner_optimizer, "gradient_accumulation_steps", None)
        is_real = None
        if steps:
            is_real = tf.equal(self.inner_optimizer._iterations % steps, 0)
        # what the inner step updated: the variables handed in, less those without a gradient
        variables = (
            self._trainable_variables if trainable_variables is None else trainable_variables
        )
        updated = [v for g, v in zip(grads, variables, strict=True) if g is not None]
        self._apply_regularizer(learning_rate, updated, is_real)

    @property
    def variables(self) -> list[Any]:
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    def scale_loss(self, loss: Any) -> Any:
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list: Any) -> None:
        # model.fit calls it once, after the last epoch
        self.inner_optimizer.finalize_variable_values(var_list)
        self._check_alive()

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "regularizer": self._regularizer,
            "radius": self._radius,
            "layers": self._layers_spec
            if isinstance(self._layers_spec, str)
            else list(self._layers_spec),
            **{k: v for k, v in self._regularizer_config().items() if k != "layers"},
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> ProxOptimizer:
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        record = config.pop("resolved", None)
        optimizer = cls(inner, **config)
        optimizer._set_record(record)
        return optimizer
