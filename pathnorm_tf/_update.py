"""The post-step update of the Keras optimizers (:mod:`pathnorm_tf.optimizers`): which targets
a real update changed, the prox on every replica's copy, and the finiteness record of steps
compiled by XLA. A mixin; the regularizer's own update is :mod:`pathnorm_tf._regularizers`.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import keras
import tensorflow as tf

from pathnorm_tf import pairing
from pathnorm_tf._common import NonFiniteWeightsError, non_finite_message

__all__ = ["StepUpdate"]


def _tf_variable(v: Any) -> Any:
    return v.value if isinstance(v, keras.Variable) else v


def _when(is_real: tf.Tensor | None, fn: Any) -> Any:
    """``fn()`` (a bool tensor), run only where ``is_real`` holds (True otherwise)."""
    if is_real is None:
        return fn()
    return tf.cond(is_real, fn, lambda: tf.constant(True))


class _Flag:
    """Holds the variable recording a non-finite target where no error can be raised (under
    XLA): a plain holder, so that the variable is not tracked as optimizer state (not in
    ``optimizer.variables``, nor saved with it)."""

    def __init__(self) -> None:
        self.variable = tf.Variable(0, trainable=False, dtype=tf.int32, name="pathnorm_nonfinite")


class StepUpdate:
    """Mixin of the optimizers: the update after each real step (what the step changed, the
    distribution, the XLA finiteness record). The optimizer defines :meth:`_update`."""

    _pairs: tuple[pairing.Pair, ...]
    _layers: tuple[pairing.Single, ...]
    _labels: list[str]
    _unseen: ValueError | None
    _unverified: bool  # auto pairs resolved without the model: warn at the first step
    regularized_pairs: Any
    _check_finite: bool
    _flag: _Flag | None
    _warned_half_frozen: set[tuple[int, int]]
    _trainable_variables: list[Any]
    _var_key: Any  # keras.optimizers.Optimizer's: a variable's identity
    _update: Any

    def check_weights(self) -> None:
        """Raise :class:`~pathnorm_tf.NonFiniteWeightsError` if a step compiled with XLA found a
        target's weights non-finite (XLA drops assertions, so the step records it and leaves
        the target as it was; ``fit`` calls this when it ends). Clears the record."""
        if self._flag is None:
            return
        bad = int(self._flag.variable.numpy())
        if bad:
            self._flag.variable.assign(0)
            raise NonFiniteWeightsError(
                non_finite_message(self._labels[bad - 1]) + " (found in a step compiled by XLA)"
            )

    def _apply_regularizer(
        self, learning_rate: Any, updated: list[Any], is_real: tf.Tensor | None = None
    ) -> None:
        """The prox (or projection) after a real update (``is_real``: a tensor condition under
        gradient accumulation) on the targets whose kernels are all in ``updated`` (by
        ``_var_key``); a pair with only one there is skipped, with one warning. The set is known
        when the step is traced: Keras traces again after ``compile``."""
        if self._unseen is not None:
            raise self._unseen
        if self._unverified:
            self._unverified = False
            warnings.warn(
                f'pairs="auto" paired {self.regularized_pairs} without seeing the model: a '
                "frozen or shared layer between two paired layers, and the order call() runs "
                "them in, show in the model only. Pass it, PathNormSGD(..., model=model) or "
                "ProxOptimizer(..., model=model), or call optimizer.verify_pairs(model) before "
                "the first step (after keras.models.load_model too), or pass pairs=[...].",
                stacklevel=2,
            )
        keys = {self._var_key(v) for v in updated}
        tv = self._trainable_variables
        targets: list[tuple[int, tuple[int, ...], Any]] = []  # (label index, kernels, layout)
        for k, pair in enumerate(self._pairs):
            moved = [self._var_key(tv[i]) in keys for i in pair[:2]]
            if all(moved):
                targets.append((k, (pair.first, pair.second), pair.layout))
            elif any(moved):
                self._warn_half_frozen((pair.first, pair.second))
        offset = len(self._pairs)
        targets += [
            (offset + k, (s.kernel,), s.entry)
            for k, s in enumerate(self._layers)
            if self._var_key(tv[s.kernel]) in keys
        ]
        if not targets:
            return
        tf.__internal__.distribute.interim.maybe_merge_call(
            functools.partial(self._distributed_regularize, targets=targets),
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
        targets: list[tuple[int, tuple[int, ...], Any]],
    ) -> None:
        tv = self._trainable_variables
        flags = []
        for label, kernels, layout in targets:
            first, *rest = (_tf_variable(tv[i]) for i in kernels)
            finite = distribution.extended.update(
                first,
                functools.partial(self._update, layout=layout, label=self._labels[label]),
                args=(*rest, learning_rate, is_real),
                group=False,
            )
            flags.append((label, distribution.experimental_local_results(finite)))
        if self._check_finite and not tf.executing_eagerly():
            self._record_non_finite(flags)

    def _build_flag(self) -> None:
        """Create the flag when the optimizer is built, before a step is traced: a variable
        created while ``tf.function`` traces the step makes it trace the step again (a second
        compile of the prox). Only with ``check_finite``, the only writer."""
        if self._check_finite:
            self._flag_variable()

    def _flag_variable(self) -> Any:
        """The flag's variable, created if missing: under ``tf.init_scope``, as ``build`` may
        run inside the trace (Keras builds there when ``fit`` has no strategy), in the
        strategy's scope ``build`` runs in (a mirrored variable)."""
        if self._flag is None:
            with tf.init_scope():
                self._flag = _Flag()
        return self._flag.variable

    def _record_non_finite(self, flags: list[tuple[int, Any]]) -> None:
        """Record in the flag the first target whose weights were not finite (label + 1), where
        no error can be raised in the step (XLA); kept until :meth:`check_weights` reads it."""
        flag = self._flag_variable()  # built by build(); created here only as a fallback
        bad = tf.constant(0)
        for label, finite in reversed(flags):
            bad = tf.where(tf.reduce_all(tf.stack(list(finite))), bad, label + 1)
        flag.assign(tf.where(flag > 0, flag, bad))
