"""What a reasoning parser is: generated text in, (reasoning, content) pieces out.

A parser is fed the text of one choice in the pieces it arrives in (``feed``) and told when it
ends (``finish``); joined, its pieces are the same however the text was split. The non-streamed
split (``extract_reasoning``) is the same parser fed the whole text at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class ReasoningDelta:
    """What one piece of text adds to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: ReasoningDelta) -> ReasoningDelta:
        return ReasoningDelta(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningParser(ABC):
    """One choice's reasoning split; a new instance per choice."""

    name: ClassVar[str]

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """The next piece of generated text; returns what can be released now."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """The text has ended: release whatever was held back."""


def extract_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; each None when empty, as vLLM reports them."""
    delta = parser.feed(text) + parser.finish()
    return delta.reasoning or None, delta.content or None
