"""One chat choice's text turned into what the answer carries: reasoning, content, tool calls.

The text goes through the reasoning parser (``--reasoning-parser``), whose content part goes
through the tool parser of the request's ``tool_choice`` mode; either may be absent. Streamed
and non-streamed answers use the same ``ChoiceParser`` (fed per delta, or once with the whole
text), so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .reasoning import ReasoningDelta, ReasoningParser, reasoning_parser_class
from .tool_calls import ToolChoice
from .tool_parsers import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    ToolCall,
    ToolCallDelta,
    ToolParseDelta,
    ToolParser,
    merge,
    tool_parser_class,
)


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __add__(self, other: ChoiceDelta) -> ChoiceDelta:
        return ChoiceDelta(self.reasoning + other.reasoning, self.content + other.content,
                           self.tool_calls + other.tool_calls)


class ChoiceParser:
    """Reasoning split, then tool calls from the content; with neither, the text is content."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None):
        self.reasoning = reasoning
        self.tools = tools

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def feed(self, text: str) -> ChoiceDelta:
        return self._tool_step(self.reasoning.feed(text) if self.reasoning else ReasoningDelta(content=text),
                               finished=False)

    def finish(self) -> ChoiceDelta:
        return self._tool_step(self.reasoning.finish() if self.reasoning else ReasoningDelta(), finished=True)

    def _tool_step(self, delta: ReasoningDelta, *, finished: bool) -> ChoiceDelta:
        if self.tools is None:
            return ChoiceDelta(delta.reasoning, delta.content)
        parsed = self.tools.feed(delta.content)
        if finished:
            parsed += self.tools.finish()
        return ChoiceDelta(delta.reasoning, parsed.content, parsed.tool_calls)


def finish_reason(engine_reason: str | None, called: bool) -> str | None:
    """A choice that ended normally after calling tools finishes with ``tool_calls``; one cut by
    ``length`` (or aborted) keeps its reason, since its last call may be incomplete."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason


@dataclass(frozen=True)
class ChatParsers:
    """The server's parser settings (``--enable-auto-tool-choice``, ``--tool-call-parser``,
    ``--reasoning-parser``); ``check`` refuses unknown names at start-up."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def check(self) -> None:
        """``ValueError`` for a setting that cannot work."""
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.tool_call_parser:
            tool_parser_class(self.tool_call_parser)
        if self.reasoning_parser:
            reasoning_parser_class(self.reasoning_parser)

    @property
    def auto_tool_choice(self) -> bool:
        return self.enable_auto_tool_choice and bool(self.tool_call_parser)

    def new_choice_parser(self, choice: ToolChoice) -> ChoiceParser:
        """A fresh parser for one choice of a request in mode ``choice``."""
        tools: ToolParser | None = None
        if choice.mode == "auto":
            tools = tool_parser_class(self.tool_call_parser or "")()
        elif choice.mode == "required":
            tools = RequiredToolCallsParser()
        elif choice.mode == "named":
            tools = NamedToolCallParser(choice.function or "")
        # In every mode: the engine's structured outputs (required/named) constrain only what
        # follows the reasoning, so the calls are in the content, as in the free modes.
        reasoning = reasoning_parser_class(self.reasoning_parser)() if self.reasoning_parser else None
        return ChoiceParser(reasoning, tools)


def merged(deltas: ChoiceDelta) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning, content, calls) of a whole answer; the strings None when empty."""
    calls = merge(ToolParseDelta(tool_calls=deltas.tool_calls)).tool_calls
    return deltas.reasoning or None, deltas.content or None, calls
