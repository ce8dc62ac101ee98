"""What a tool parser is: a choice's content in, content and tool-call pieces out.

A parser is fed the content of one choice in the pieces it arrives in (``feed``) and told when
it ends (``finish``). Its pieces, joined (``merge``), are the same however the text was split,
so a streamed answer adds up to the non-streamed one, which is the same parser fed the whole
text at once (``extract_tool_calls``). A call is announced once, with its ``index``, ``id`` and
``name``; its ``arguments`` (a JSON string) may follow in fragments under the same index.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    """One call's piece: the first carries ``id`` and ``name``, later ones only arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolParseDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __add__(self, other: ToolParseDelta) -> ToolParseDelta:
        return ToolParseDelta(self.content + other.content, self.tool_calls + other.tool_calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ExtractedToolCalls:
    content: str | None  # None when there is no content
    tool_calls: list[ToolCall]


def merge(delta: ToolParseDelta) -> ExtractedToolCalls:
    """The whole answer from its pieces (the pieces of each call joined by index)."""
    calls: dict[int, ToolCall] = {}
    for piece in delta.tool_calls:
        call = calls.get(piece.index)
        if call is None:
            calls[piece.index] = ToolCall(piece.id or "", piece.name or "", piece.arguments)
        else:
            call.arguments += piece.arguments
    return ExtractedToolCalls(delta.content or None, [calls[i] for i in sorted(calls)])


def arguments_json(arguments: Any) -> str:
    """A call's arguments as JSON text (a string the model wrote is taken as that text)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


class ToolParser(ABC):
    """One choice's tool-call extraction; a new instance per choice."""

    name: ClassVar[str]

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id):
        self._make_id = make_id
        self._calls = 0

    @abstractmethod
    def feed(self, text: str) -> ToolParseDelta:
        """The next piece of content; returns what can be released now."""

    @abstractmethod
    def finish(self) -> ToolParseDelta:
        """The content has ended: release whatever was held back."""

    @property
    def called(self) -> bool:
        """Whether any tool call has been announced."""
        return self._calls > 0

    def _announce(self, name: str, arguments: str = "") -> ToolCallDelta:
        """The first piece of a new call, numbered in order."""
        delta = ToolCallDelta(index=self._calls, id=self._make_id(), name=name, arguments=arguments)
        self._calls += 1
        return delta


def extract_tool_calls(parser: ToolParser, text: str) -> ExtractedToolCalls:
    """The non-streamed answer: the parser fed the whole content at once."""
    return merge(parser.feed(text) + parser.finish())
