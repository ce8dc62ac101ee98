"""Reasoning inside ``<think>…</think>``: Qwen3's and DeepSeek-R1's parsers.

The two differ only in where an output without ``<think>`` stands. Qwen3 writes ``<think>``
itself when it thinks, so without it the whole output is content (as with
``enable_thinking: false``, whose template closes an empty think block in the prompt). DeepSeek-R1
(and models whose template opens ``<think>`` in the prompt) start inside the reasoning, so
everything up to ``</think>`` is reasoning, and an output cut before it is all reasoning.

Whitespace around the tags is trimmed: the reasoning is stripped and the content after
``</think>`` loses its leading blank lines; content with no think block is left as it is.
"""

from __future__ import annotations

from ..stream_text import TrimmedText, take_until_tag
from .base import ReasoningDelta, ReasoningParser

THINK_START = "<think>"
THINK_END = "</think>"

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class ThinkTagReasoningParser(ReasoningParser):
    """``<think>`` may open the output (after whitespace); ``</think>`` ends the reasoning."""

    # Whether an output that does not open with <think> is reasoning (True) or content (False).
    starts_in_reasoning = False

    def __init__(self) -> None:
        self._state = _START
        self._buffer = ""  # text not yet released: a possible tag start
        self._reasoning = TrimmedText(drop_leading=True)
        self._skip_space = False  # drop whitespace right after </think>

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        if self._state == _START:
            return self._read_start()
        if self._state == _REASONING:
            return self._read_reasoning()
        return self._content(self._take_buffer())

    def finish(self) -> ReasoningDelta:
        rest = self._take_buffer()
        if self._state == _START:
            self._state = _REASONING if self.starts_in_reasoning else _CONTENT
            if self._state == _CONTENT:
                return ReasoningDelta(content=rest)
        if self._state == _REASONING:
            out = self._reasoning.push(rest)
            self._reasoning.boundary(drop_following=False)
            return ReasoningDelta(reasoning=out)
        return self._content(rest)

    def _take_buffer(self) -> str:
        out, self._buffer = self._buffer, ""
        return out

    def _read_start(self) -> ReasoningDelta:
        head = self._buffer.lstrip()
        if head.startswith(THINK_START):
            self._buffer = head[len(THINK_START):]
            self._state = _REASONING
            return self._read_reasoning()
        if THINK_START.startswith(head):
            return ReasoningDelta()  # still possibly the tag
        if self.starts_in_reasoning:
            self._state = _REASONING
            return self._read_reasoning()
        self._state = _CONTENT
        return ReasoningDelta(content=self._take_buffer())

    def _read_reasoning(self) -> ReasoningDelta:
        before, found, rest = take_until_tag(self._buffer, THINK_END)
        out = ReasoningDelta(reasoning=self._reasoning.push(before))
        if not found:
            self._buffer = rest
            return out
        self._reasoning.boundary(drop_following=False)
        self._state = _CONTENT
        self._skip_space = True
        self._buffer = ""
        return out + self._content(rest)

    def _content(self, text: str) -> ReasoningDelta:
        if self._skip_space:
            text = text.lstrip()
            if not text:
                return ReasoningDelta()
            self._skip_space = False
        return ReasoningDelta(content=text)


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True
