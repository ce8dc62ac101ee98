"""Reasoning parsers (``--reasoning-parser``): split a choice's text into reasoning and content."""

from __future__ import annotations

from ..parser_registry import lookup
from .base import ReasoningDelta, ReasoningParser, extract_reasoning
from .think_tags import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    return lookup(REASONING_PARSERS, name, "--reasoning-parser")


__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "extract_reasoning", "reasoning_parser_class"]
