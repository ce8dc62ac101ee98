"""The Hermes tool-call format (Qwen2.5, Qwen3, Hermes 2/3): ``--tool-call-parser hermes``.

The model writes each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(usually with newlines inside the tags); text outside the blocks is content, with whitespace
next to a call trimmed. A block is released when it closes, as one announcement carrying its
whole arguments: only then is it known to be valid. A block whose JSON does not parse, or names
no function, stays in the content as it was written, so a malformed call is never lost.
"""

from __future__ import annotations

import json

from ..stream_text import TrimmedText, take_until_tag
from .base import ToolCallDelta, ToolParseDelta, ToolParser, arguments_json

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block's text, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    return obj["name"], arguments_json(obj.get("arguments", {}))


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._buffer = ""  # unreleased text: a possible tag start, or an open block's body
        self._in_call = False
        self._content = TrimmedText()

    def feed(self, text: str) -> ToolParseDelta:
        self._buffer += text
        out = ToolParseDelta()
        while True:
            if self._in_call:
                at = self._buffer.find(CALL_END)
                if at < 0:
                    return out  # the body waits for its closing tag
                body, self._buffer = self._buffer[:at], self._buffer[at + len(CALL_END):]
                out += self._close_block(body, closed=True)
                continue
            before, found, self._buffer = take_until_tag(self._buffer, CALL_START)
            out.content += self._content.push(before)
            if not found:
                return out
            self._in_call = True

    def finish(self) -> ToolParseDelta:
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            out = self._close_block(rest, closed=False)
        else:
            out = ToolParseDelta(content=self._content.push(rest))
        out.content += self._content.flush()
        return out

    def _close_block(self, body: str, *, closed: bool) -> ToolParseDelta:
        """A block has ended (``closed``: by its tag; else by the end of the text)."""
        self._in_call = False
        call = parse_call(body.strip())
        if call is None:
            raw = CALL_START + body + (CALL_END if closed else "")
            # Malformed: the block is content, its surroundings untouched.
            return ToolParseDelta(content=self._content.flush() + self._content.push(raw))
        self._content.boundary(drop_following=True)
        delta: ToolCallDelta = self._announce(*call)
        return ToolParseDelta(tool_calls=[delta])
