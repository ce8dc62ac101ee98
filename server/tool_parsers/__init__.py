"""Tool parsers: ``--tool-call-parser NAME`` for ``tool_choice: auto``, and the parsers of the
output that ``required`` and a named function constrain."""

from __future__ import annotations

from ..parser_registry import lookup
from .base import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParseDelta,
    ToolParser,
    extract_tool_calls,
    merge,
    new_tool_call_id,
)
from .hermes import HermesToolParser
from .json_calls import NamedToolCallParser, RequiredToolCallsParser

# Parsers of free-form output, selectable with --tool-call-parser.
TOOL_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in (HermesToolParser,)}


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    return lookup(TOOL_PARSERS, name, "--tool-call-parser")


__all__ = [
    "TOOL_PARSERS", "ExtractedToolCalls", "NamedToolCallParser", "RequiredToolCallsParser", "ToolCall",
    "ToolCallDelta", "ToolParseDelta", "ToolParser", "extract_tool_calls", "merge", "new_tool_call_id",
    "tool_parser_class",
]
