"""Reasoning parsers (``--reasoning-parser``): split a choice's text into reasoning and content."""

from __future__ import annotations

from .base import ReasoningDelta, ReasoningParser, extract_reasoning
from .think_tags import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r} (known: "
                         f"{', '.join(sorted(REASONING_PARSERS))})") from None


__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "extract_reasoning", "reasoning_parser_class"]
