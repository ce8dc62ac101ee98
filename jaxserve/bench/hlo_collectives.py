"""Counting the collectives of a compiled step's HLO: what tensor parallelism costs per step.

Megatron's plan has one all-reduce after the attention's ``o`` projection and one after the MLP's
``down`` projection per layer, one for the vocabulary-parallel embedding and one all-gather of
the logits; an all-gather whose result has a weight's shape would mean a weight is being
gathered whole (the plan is broken), unless what it gathers is a matmul's product (the logits of
a row bucket as wide as a tied embedding is: 256 rows of a 256-wide draft). Asynchronous pairs
(``all-reduce-start``/``-done`` on a GPU) count once, as their start.
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
_OPERAND = re.compile(r"%(?P<name>[\w.\-]+)")
# The instruction that made an operand is a matmul: a dot, or a fusion or custom call XLA made of
# one (a GPU gemm fusion keeps the dot's jax name in its metadata).
_PRODUCT = re.compile(r"\sdot\(|\s(custom-call|fusion)\(.*?(op_name=\"[^\"]*dot_general\"|gemm)")


@dataclasses.dataclass(frozen=True)
class Collectives:
    """Collective ops by kind, and the result shapes of the all-gathers."""

    counts: dict[str, int]
    all_gather_shapes: tuple[tuple[int, ...], ...]
    # per all-gather, whether it gathers a matmul's product (empty: not known, none assumed)
    gathered_products: tuple[bool, ...] = ()

    def weight_all_gathers(self, weight_shapes: Iterable[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """All-gathers whose result has the shape of one of ``weight_shapes``, or a transpose of
        it (a tied LM head is the embedding transposed), and that gather no matmul's product."""
        weights = {tuple(sorted(s)) for s in weight_shapes if len(s) >= 2}
        products = self.gathered_products or (False,) * len(self.all_gather_shapes)
        return [s for s, product in zip(self.all_gather_shapes, products, strict=True)
                if tuple(sorted(s)) in weights and not product]

    def as_dict(self) -> dict:
        return {"collectives": dict(self.counts), "all_gather_shapes": [list(s) for s in self.all_gather_shapes],
                "gathered_products": list(self.gathered_products)}


def count_collectives(hlo_text: str) -> Collectives:
    """The collectives of one compiled module's HLO text (``compiled.as_text()``)."""
    counts = dict.fromkeys(KINDS, 0)
    gathers, products = [], []
    for match in _OP.finditer(hlo_text):
        kind = match["kind"]
        counts[kind] += 1
        if kind == "all-gather":
            shapes = _SHAPE.findall(match["result"])
            if shapes:  # an async start's tuple holds (operand, result): the result is last
                gathers.append(tuple(int(d) for d in shapes[-1].split(",") if d))
                products.append(_is_product(hlo_text, hlo_text[match.end():hlo_text.find("\n", match.end())]))
    return Collectives(counts, tuple(gathers), tuple(products))


def _is_product(hlo_text: str, operands: str) -> bool:
    """Whether the first operand (in the text after the op's opening parenthesis) was made by a matmul."""
    operand = _OPERAND.search(operands)
    if operand is None:
        return False
    made = re.search(rf"^\s*%{re.escape(operand['name'])} = [^\n]*", hlo_text, re.MULTILINE)
    return made is not None and _PRODUCT.search(made.group(0)) is not None
