"""What ``compact`` reports, the same in both backends: per pair, the hidden units and the
pair's parameters before and after (pure Python: ``pathnorm_lightning.compact`` and
``pathnorm_tf.compact`` both return a :class:`CompactionReport`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CompactionReport", "PairCompaction"]


@dataclass(frozen=True)
class PairCompaction:
    """What ``compact`` did to one pair: hidden units and the pair's parameters, before/after.

    ``removed`` units had zero outgoing weights; ``folded`` ones zero incoming weights (their
    constant output went into ``second``'s bias). ``constant_kept`` units have zero incoming
    weights too, but stay: their constant could not be folded exactly (a zero-padded second
    convolution, or pooling that changes a constant). ``units_after`` is 1 where all were dead.
    """

    first: str
    second: str
    units_before: int
    units_after: int
    removed: int
    folded: int
    params_before: int
    params_after: int
    constant_kept: int = 0


@dataclass(frozen=True)
class CompactionReport:
    """Per-pair results and the whole model's parameter count before and after; ``str()`` is a
    table."""

    pairs: tuple[PairCompaction, ...]
    params_before: int
    params_after: int

    @property
    def units_before(self) -> int:
        """Hidden units of all pairs before compaction."""
        return sum(p.units_before for p in self.pairs)

    @property
    def units_after(self) -> int:
        """Hidden units of all pairs after compaction."""
        return sum(p.units_after for p in self.pairs)

    def __str__(self) -> str:
        head = ("pair", "units", "removed", "folded", "pair params")
        rows = [
            (
                f"{p.first} -> {p.second}",
                f"{p.units_before} -> {p.units_after}",
                str(p.removed),
                str(p.folded),
                f"{p.params_before:,} -> {p.params_after:,}",
            )
            for p in self.pairs
        ]
        widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]
        ]
        share = self.params_after / self.params_before if self.params_before else 1.0
        total = f"model parameters {self.params_before:,} -> {self.params_after:,} ({share:.1%})"
        notes = [
            f"{p.first} -> {p.second}: {p.constant_kept} unit(s) with zero incoming weights kept "
            "(their constant output cannot be folded exactly into the second layer's bias)"
            for p in self.pairs
            if p.constant_kept
        ]
        return "\n".join([*lines, total, *notes])
