"""Keras 3 optimizers that follow every real update with the exact path-norm prox (or a baseline).

Proximal SGD (the paper's training method) is ``W <- prox_{lam * lr * R}(W - lr * grad)``:
:class:`PathNormSGD` is ``keras.optimizers.SGD`` followed by the 1-path-norm prox;
:class:`ProxOptimizer` wraps *any* Keras optimizer, followed by the path-norm prox, the L1 prox
or the layer-wise l_inf projection.

The invariant, held in one place (:meth:`pathnorm_tf._update.StepUpdate._apply_regularizer`):
**the prox runs exactly once per real update, on exactly the variables that update changed.**
Under ``gradient_accumulation_steps=s`` it runs once per ``s`` batches, right after the weights
move, with the learning rate that step used (schedules are honoured). The variables are those
handed to this step (``apply``/``apply_gradients``, less those without a gradient), matched by
identity: a layer frozen after the optimizer was built (``trainable = False``, then ``compile``
again) is left alone, and a pair with one side frozen is skipped with a warning.

Which kernels *can* be regularized is resolved when the optimizer is built, from the variables'
paths and, given by ``model=`` or :meth:`~PathNormSGD.verify_pairs`, the model (Keras shows an
optimizer its variables only; see :mod:`pathnorm_tf.pairing`): ``Dense``, ``Conv1D`` and
``Conv2D`` kernels, laid out by the layer seam (:mod:`pathnorm_tf.layers`). The optimizer stores
indices and layouts, so model variables never become optimizer variables, and records where
explicit names resolved in its config, so a reloaded model keeps its pairs. Under
``tf.distribute`` the prox runs on every replica's copy of the (already identical) weights.
Requires the TensorFlow backend of Keras.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import keras
import tensorflow as tf

from pathnorm_tf import pairing
from pathnorm_tf._common import (
    NonFiniteWeightsError,
    check_scalar,
    non_finite_message,
    tracing_for_xla,
)
from pathnorm_tf._regularizers import REGULARIZERS as _RULES
from pathnorm_tf._regularizers import Regularizer
from pathnorm_tf._units import dead_pairs, warn_dead_pairs
from pathnorm_tf._update import StepUpdate, _when
from pathnorm_tf.functional import _prox_kernels

__all__ = ["PathNormSGD", "ProxOptimizer"]

#: The public names of the regularizers (:data:`pathnorm_tf._regularizers.REGULARIZERS`).
REGULARIZERS = tuple(_RULES)


def _check_backend(cls_name: str) -> None:
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            f"{cls_name} needs the TensorFlow backend of Keras, but KERAS_BACKEND is "
            f"{keras.backend.backend()!r}; set KERAS_BACKEND=tensorflow (torch users: "
            "pathnorm_lightning)"
        )


def _check_strength(value: Any, name: str, owner: str) -> float:
    """``lam``/``radius`` as a float: the rule of :func:`pathnorm_tf._common.check_scalar`
    (``TypeError`` for a non-real, ``ValueError`` for NaN, inf, negative or not 0-d); None, the
    keyword's default, is an argument not given."""
    if value is None:
        raise TypeError(f"{owner} needs {name} (a finite number >= 0), e.g. {name}=1e-4")
    return float(check_scalar(value, name))


class _KernelRegularizer(StepUpdate):
    """Mixin: configuration, resolution at build time and the post-step update (the state
    :class:`~pathnorm_tf._update.StepUpdate` reads is declared there)."""

    _regularizer: str
    _rule: Regularizer
    _lam: float | None
    _radius: float | None
    _pairs_spec: pairing.PairsSpec
    _layers_spec: pairing.LayersSpec
    _record: pairing.Record | None
    _model_ref: Any
    _restored: bool
    _warned_dead: set[tuple[str, str]]
    built: bool
    build: Any  # keras.optimizers.Optimizer's

    def _init_regularizer(
        self,
        owner: str,
        regularizer: str,
        lam: Any,
        radius: Any,
        pairs: Any,
        layers: Any,
        check_finite: bool,
        model: Any,
    ) -> None:
        if regularizer not in _RULES:
            raise ValueError(f"regularizer must be one of {REGULARIZERS}, got {regularizer!r}")
        rule = _RULES[regularizer]
        if rule.strength == "radius":
            if lam is not None:
                raise ValueError(
                    f'regularizer="{regularizer}" is a projection: pass radius=..., not lam'
                )
            radius_v: float | None = _check_strength(radius, "radius", owner)
            lam_v: float | None = None
        else:
            if radius is not None:
                raise ValueError(f'radius applies to regularizer="linf" only, not {regularizer!r}')
            lam_v, radius_v = _check_strength(lam, "lam", owner), None
        pairs_spec = pairing.normalize_pairs(pairs)
        layers_spec = pairing.normalize_layers(layers)
        if rule.targets == "pairs" and layers_spec != "auto":
            raise ValueError('layers applies to regularizer="l1"/"linf"; for "path" use pairs')
        if rule.targets == "layers" and pairs_spec != "auto":
            raise ValueError(f'pairs applies to regularizer="path"; for {regularizer!r} use layers')
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {check_finite!r}")
        if model is not None and not isinstance(model, keras.Model):
            raise TypeError(f"{owner}: model must be the keras.Model being trained, got {model!r}")
        self._regularizer = regularizer
        self._rule = rule(radius_v if radius_v is not None else lam_v)  # type: ignore[arg-type]
        self._lam = lam_v
        self._radius = radius_v
        self._pairs_spec = pairs_spec
        self._layers_spec = layers_spec
        self._check_finite = check_finite
        self._pairs = ()
        self._layers = ()
        self._labels = []
        self._record = None
        self._model_ref = None if model is None else weakref.ref(model)
        self._unseen = None
        self._unverified = False
        self._restored = False
        self._flag = None
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

    def _model(self, variables: list[Any]) -> keras.Model | None:
        """The model given by ``model=`` or :meth:`verify_pairs`, if alive, checked to own
        ``variables`` (never guessed: a variable keeps no link to its layer)."""
        model = None if self._model_ref is None else self._model_ref()
        if model is None:
            return None
        own = {id(w) for w in model.weights}
        foreign = [v.path for v in variables if id(v) not in own]
        if foreign:
            raise ValueError(
                f"{type(self).__name__} was given model {model.name!r}, but trains variables "
                f"it does not hold ({foreign[:3]}); pass the model being trained (model=...) "
                "or none"
            )
        return model

    def _resolve(
        self, variables: list[Any], model: keras.Model | None
    ) -> tuple[tuple[pairing.Pair, ...], tuple[pairing.Single, ...]]:
        """The pairs and (baselines) layers in ``variables``, using the record if it applies;
        ``model``: the model that trains them, if known (convolutions need it)."""
        if self._rule.targets == "pairs":
            pairs = pairing.resolve_pairs(variables, self._pairs_spec, self._record, model)
            return pairs, ()
        return (), pairing.resolve_layers(variables, self._layers_spec, self._record, model)

    def _resolve_targets(self, variables: list[Any]) -> None:
        model = self._model(variables)
        self._unseen = None
        try:
            self._pairs, self._layers = self._resolve(variables, model)
        except pairing.ModelNeeded as err:
            if not self._restored:
                raise
            # Keras builds a restored optimizer inside load_model, before the model can be
            # shown: the refusal waits for the first step (verify_pairs(model) resolves it).
            self._unseen, self._pairs, self._layers = err, (), ()
            return
        self._labels = [
            f"pair {tuple(pairing.layer_path(variables[k]) for k in (p.first, p.second))}"
            for p in self._pairs
        ] + [f"kernel {variables[s.kernel].path!r}" for s in self._layers]
        paired = self._rule.targets == "pairs"
        if paired and self._pairs_spec == "auto":
            if model is not None:
                pairing.check_auto_pairs_in_model(model, variables, self._pairs)
            else:  # warned at the first step, unless verify_pairs(model) shows the model first
                self._unverified = True  # (load_model builds a restored optimizer unseen)
        spec = self._pairs_spec if paired else self._layers_spec
        if not isinstance(spec, str):  # names: record where they resolved, for the config
            found = self._pairs if paired else [s.kernel for s in self._layers]
            self._record = pairing.record_of(variables, spec, found, model)

    def verify_pairs(self, model: keras.Model) -> None:
        """Show the optimizer ``model`` (as ``model=`` at construction) and build it for the
        model's trainable variables. Needed for convolution kernels (their layers and Flatten
        order are not in the variables) and to check ``pairs="auto"`` against the model: a
        layer with weights between a pair, frozen or not, is refused, a pair the graph does not
        confirm is warned about. Call it before the first step; on a built optimizer it runs
        the check (and resolves the targets a restored optimizer could not without the
        model)."""
        if not isinstance(model, keras.Model):
            raise TypeError(f"verify_pairs takes the keras.Model being trained, got {model!r}")
        self._model_ref = weakref.ref(model)
        self._unverified = False
        if not self.built:
            self.build(model.trainable_variables)
        elif self._unseen is not None:
            self._resolve_targets(self._trainable_variables)
        elif self._rule.targets == "pairs" and self._pairs_spec == "auto":
            self._model(self._trainable_variables)
            pairing.check_auto_pairs_in_model(model, self._trainable_variables, self._pairs)

    def regularized_chains(
        self, variables: list[Any], model: keras.Model | None = None
    ) -> list[pairing.Chain]:
        """The kernels the regularizer acts on, as forward chains (for the metrics, each a
        :class:`~pathnorm_tf.pairing.Chain`): the ``(kernel_in, kernel_out)`` pairs, or
        (baselines) runs of adjacent kernels whose units chain. Once built, the optimizer's own
        targets; before, ``variables`` (of ``model``) resolved as ``build`` will resolve them."""
        tv, pairs, layers = self._trainable_variables, self._pairs, self._layers
        if not getattr(self, "built", False):
            tv = list(variables)
            pairs, layers = self._resolve(tv, model)
        if self._rule.targets == "pairs":
            return [pairing.Chain([tv[p.first], tv[p.second]], [p.layout]) for p in pairs]
        return [
            pairing.Chain([tv[i] for i in chain], chain.layouts)
            for chain in pairing.kernel_chains(tv, layers, model)
        ]

    def _at_fit_end(self) -> None:
        """At the end of ``fit`` (host side, once): raise for weights an XLA step found
        non-finite (:meth:`check_weights`), then warn once per pair about a pair with no hidden
        unit left (the prox keeps it dead; lam is too large)."""
        if self.built:
            self.check_weights()
            warn_dead_pairs(dead_pairs(self.regularized_chains([])), self, self._warned_dead)

    def _regularizer_config(self) -> dict[str, Any]:
        pairs = self._pairs_spec
        return {
            "lam": self._lam,
            "pairs": pairs if isinstance(pairs, str) else [list(p) for p in pairs],
            "check_finite": self._check_finite,
            **({"resolved": copy.deepcopy(self._record)} if self._record is not None else {}),
        }

    def _set_record(self, record: Any) -> None:
        self._record = pairing.check_record(record)
        self._restored = True

    def _update(self, *operands: Any, layout: Any, label: str) -> tf.Tensor:
        """One target's update on one replica: ``operands`` are its kernels, then the learning
        rate and ``is_real``. Returns whether the kernels were finite (True without
        ``check_finite``); non-finite kernels are left as they are and reported as
        ``check_finite`` in :class:`PathNormSGD` says."""
        *kernels, learning_rate, is_real = operands

        def update() -> tf.Tensor:
            values = [tf.convert_to_tensor(k) for k in kernels]

            def write() -> tf.Tensor:
                new = self._rule.update(values, layout, learning_rate, _prox_kernels)
                for kernel, value in zip(kernels, new, strict=True):
                    kernel.assign(value)
                return tf.constant(True)

            if not self._check_finite:
                return write()
            checked = None
            if not tf.executing_eagerly():
                checked = self._rule.checked_update(values, layout, learning_rate, _prox_kernels)
            if checked is not None:
                # The verdict comes from the prox's own sums; non-finite kernels keep their
                # values (a select that fuses with the write), no cond around the prox.
                new, finite = checked
                for kernel, value, old in zip(kernels, new, values, strict=True):
                    kernel.assign(tf.where(finite, value, old))
                done = finite
            else:
                # One pass over each kernel (eagerly: before anything is written).
                finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values])
                if tf.executing_eagerly():
                    if not bool(finite):
                        raise NonFiniteWeightsError(non_finite_message(label))
                    return write()
                done = tf.cond(finite, write, lambda: tf.constant(False))
            if not tracing_for_xla():
                tf.debugging.Assert(finite, [non_finite_message(label)])
            return done

        return _when(is_real, update)


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
        check_finite: check that the kernels are finite before each prox (default, as on the
            torch side); non-finite ones are left as they are and
            :class:`~pathnorm_tf.NonFiniteWeightsError` is raised: at once eagerly; in a graph
            as the ``InvalidArgumentError`` of a failed assertion (the class is one too);
            under XLA, which drops assertions, when ``fit`` ends (:meth:`check_weights`).
        model: the ``keras.Model`` being trained (held weakly, not serialized): lets the
            optimizer regularize convolutions and check ``pairs="auto"`` against the model's
            layers (Keras shows an optimizer its variables only). Same as
            :meth:`verify_pairs`; without it, Dense pairs resolve from the variables, with a
            warning for ``"auto"``.
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
        check_finite: bool = True,
        model: keras.Model | None = None,
        **kwargs: Any,
    ) -> None:
        _check_backend(type(self).__name__)
        if isinstance(momentum, int) and not isinstance(momentum, bool):
            momentum = float(momentum)
        super().__init__(
            learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, **kwargs
        )
        self._init_regularizer(
            type(self).__name__, "path", lam, None, pairs, "auto", check_finite, model
        )

    def build(self, variables: list[Any]) -> None:
        if self.built:
            return
        super().build(variables)
        self._build_flag()
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
        self._at_fit_end()

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
      convolution a column (of the seam's in-view) is output channel ``c``'s weights
      ``kernel[..., c]`` over every tap and input channel; each row of the unrolled
      convolution holds those (or, at a zero-padded border, some), so its l_inf operator norm
      is at most ``radius`` too.

    ``lr`` is the inner optimizer's rate for that step. The wrapper forwards ``learning_rate``,
    ``iterations`` and ``variables`` to the inner optimizer (like ``LossScaleOptimizer``),
    honours its ``gradient_accumulation_steps`` (one prox per real step) and serializes it.

    ``check_finite`` and ``model``: as for :class:`PathNormSGD`.

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
        check_finite: bool = True,
        model: keras.Model | None = None,
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
                "off, or use PathNormSGD(..., use_ema=True), which averages the proxed weights "
                "(fit() then ends by writing that average into the model: it keeps only the "
                "zeros all the averaged weights share, and PathNormMetrics's logged values do "
                "not describe it; see docs/keras.md, 'use_ema=True')."
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self._init_regularizer(
            type(self).__name__, regularizer, lam, radius, pairs, layers, check_finite, model
        )

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        self._build_flag()
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
        self._at_fit_end()

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "regularizer": self._regularizer,
            "radius": self._radius,
            "layers": self._layers_spec
            if isinstance(self._layers_spec, str)
            else list(self._layers_spec),
            **self._regularizer_config(),
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
