"""What the hook of :mod:`pathnorm_lightning.hook` acts on: a target (a layer or a pair) and its
weights seen as the layer seam's unit matrices (:class:`UnitViews`, planned once), and the
pair target of two named layers (:func:`pair_target`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from pathnorm_lightning import layers as seam
from pathnorm_lightning.functional import planned_prox
from pathnorm_lightning.pairing import LayerPair, weight_parameter


@dataclass(frozen=True)
class UnitViews:
    """A target's weights as the layer seam's unit matrices (:mod:`pathnorm_lightning.layers`),
    built when the hook plans, not at every step.

    For a pair, ``(in_view, out_view)``: ``(n, m')`` (row ``i``: unit ``i``'s incoming weights)
    and ``(p', n)`` (column ``i``: its outgoing ones); for one layer, ``(in_view,)``. A matrix
    that is a view of the weight (a Linear weight, a contiguous convolution's incoming weights)
    is kept in :attr:`cached` and written through; one whose layout needs a copy (a
    convolution's outgoing weights, a Linear after a Flatten, a channels-last weight) is copied
    at each step into a planned contiguous buffer (:meth:`matrices`, :attr:`buffers`) and
    written back (:meth:`write_back`).
    """

    entries: tuple[seam.LayerEntry, ...]
    n_units: int
    flatten: int | None
    cached: tuple[Tensor | None, ...] = dataclasses.field(repr=False)
    #: Per matrix that is a copy: its buffer (None where :attr:`cached` holds the view), and
    #: the buffer seen in the weight's layout where the seam gives such a view (the weight is
    #: copied straight into it).
    buffers: tuple[Tensor | None, ...] = dataclasses.field(default=(), repr=False, compare=False)
    natives: tuple[Tensor | None, ...] = dataclasses.field(default=(), repr=False, compare=False)
    #: Whether a matrix is a copy (written back after the prox).
    copies: bool = dataclasses.field(default=True, repr=False, compare=False)
    #: For a pair: the planned in-place prox of its two matrices (views or buffers;
    #: :func:`pathnorm_lightning.functional.planned_prox`), checked once, here.
    prox: Callable[[float, bool], bool] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    @classmethod
    def plan(cls, modules: Sequence[nn.Module], weights: Sequence[Tensor]) -> UnitViews:
        """The views of one layer (``modules`` of one) or of a pair, from their weights now."""
        entries = tuple(seam.entry_of(m) for m in modules)
        n_units = entries[0].units_out(modules[0])
        flatten = seam.flatten_positions(*modules) if len(modules) == 2 else None
        views = cls(entries, n_units, flatten, (None,) * len(modules))
        fresh = views.matrices(weights)
        cached = tuple(m if _is_view(m, w) else None for m, w in zip(fresh, weights, strict=True))
        matrices = tuple(
            m if c is not None else m.contiguous() for c, m in zip(cached, fresh, strict=True)
        )
        buffers = tuple(None if c is not None else m for c, m in zip(cached, matrices, strict=True))
        natives = tuple(
            None if b is None else _native(views, index, b, w)
            for index, (b, w) in enumerate(zip(buffers, weights, strict=True))
        )
        prox = planned_prox(matrices[0], matrices[1]) if len(matrices) == 2 else None
        copies = any(c is None for c in cached)
        return cls(entries, n_units, flatten, cached, buffers, natives, copies, prox)

    def matrices(self, weights: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """The unit matrices of ``weights``: the cached views, or copies made now (into the
        planned buffers)."""
        made: list[Tensor] = []
        for index, (cached, weight) in enumerate(zip(self.cached, weights, strict=True)):
            if cached is not None:
                made.append(cached)
                continue
            buffer = self.buffers[index] if self.buffers else None
            native = self.natives[index] if self.natives else None
            if buffer is not None and native is not None:
                native.copy_(weight.detach())  # straight into the buffer
                made.append(buffer)
                continue
            if index == 0:
                copy = self.entries[0].in_view(weight.detach())
            else:
                copy = self.entries[1].out_view(weight.detach(), self.n_units, self.flatten)
            made.append(copy if buffer is None else buffer.copy_(copy))
        return tuple(made)

    def write_back(self, weights: Sequence[Tensor], matrices: Sequence[Tensor]) -> None:
        """Write the matrices that are copies into their weights, in place."""
        for index, (cached, weight, matrix) in enumerate(
            zip(self.cached, weights, matrices, strict=True)
        ):
            if cached is not None:
                continue  # written through the view
            if index == 0:
                self.entries[0].write_in(weight, matrix)
            else:
                self.entries[1].write_out(weight, matrix, self.flatten)


def _native(views: UnitViews, index: int, buffer: Tensor, weight: Tensor) -> Tensor | None:
    """``buffer`` (matrix ``index`` of ``views``) in ``weight``'s layout, if that is a view."""
    if index == 0:
        native = views.entries[0].in_native(buffer, weight.shape)
    else:
        native = views.entries[1].out_native(buffer, weight.shape, views.flatten)
    return native if _is_view(native, buffer) else None


def _is_view(matrix: Tensor, weight: Tensor) -> bool:
    """Whether ``matrix`` is ``weight``'s memory (writes to it are writes to the weight)."""
    return matrix.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()


@dataclass
class StepTarget:
    """What one update acts on: a layer or a pair (its weights, in forward order), and a name
    for error messages.

    With ``layers`` (``(name, module)`` per weight) the hook follows the modules, reading each
    ``weight`` parameter at every step (a weight replaced or parametrized is seen at the next
    step), and with ``unit_views`` also plans their :class:`UnitViews` into ``views`` whenever
    it re-plans; without ``layers`` the ``weights`` are taken as given.
    """

    name: str
    weights: tuple[Tensor, ...]
    layers: tuple[tuple[str, nn.Module], ...] = ()
    unit_views: bool = False
    views: UnitViews | None = None


def pair_target(pair: LayerPair) -> StepTarget:
    """The followed :class:`StepTarget` of a layer pair, with unit views."""
    layers = ((pair.first_name, pair.first), (pair.second_name, pair.second))
    return StepTarget(
        f"pair ({pair.first_name!r}, {pair.second_name!r})",
        tuple(weight_parameter(name, module) for name, module in layers),
        layers,
        unit_views=True,
    )
