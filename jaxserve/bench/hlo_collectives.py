"""Counting the collectives of a compiled step's HLO: what tensor parallelism costs per step.

Megatron's plan has one all-reduce after the attention's ``o`` projection and one after the MLP's
``down`` projection per layer, one for the vocabulary-parallel embedding and one all-gather of
the logits; an all-gather whose result has a weight's shape would mean a weight is being
gathered whole (the plan is broken). Asynchronous pairs (``all-reduce-start``/``-done`` on a GPU)
count once, as their start.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# `%name = type[dims]{layout} kind(` or `kind-start(`; the result may be a tuple `(t[..], ...)`.
_OP = re.compile(r"=\s*(?P<result>\(?[a-z0-9]+\[[0-9,]*\][^=]*?)\s+(?P<kind>" + "|".join(KINDS)
                 + r")(?:-start)?\(")
_SHAPE = re.compile(r"[a-z0-9]+\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collectives:
    """Collective ops by kind, and the result shapes of the all-gathers."""

    counts: dict[str, int]
    all_gather_shapes: tuple[tuple[int, ...], ...]

    def weight_all_gathers(self, weight_shapes: Iterable[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """All-gathers whose result has the shape of one of ``weight_shapes``, or a transpose of
        it (a tied LM head is the embedding transposed)."""
        weights = {tuple(sorted(s)) for s in weight_shapes if len(s) >= 2}
        return [s for s in self.all_gather_shapes if tuple(sorted(s)) in weights]

    def as_dict(self) -> dict:
        return {"collectives": dict(self.counts), "all_gather_shapes": [list(s) for s in self.all_gather_shapes]}


def count_collectives(hlo_text: str) -> Collectives:
    """The collectives of one compiled module's HLO text (``compiled.as_text()``)."""
    counts = dict.fromkeys(KINDS, 0)
    gathers = []
    for match in _OP.finditer(hlo_text):
        kind = match["kind"]
        counts[kind] += 1
        if kind == "all-gather":
            shapes = _SHAPE.findall(match["result"])
            if shapes:  # an async start's tuple holds (operand, result): the result is last
                gathers.append(tuple(int(d) for d in shapes[-1].split(",") if d))
    return Collectives(counts, tuple(gathers))
