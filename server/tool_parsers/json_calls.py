"""Tool calls read from output that structured outputs shaped: ``tool_choice`` ``required`` and a
named function.

With ``required`` the output is a JSON array of ``{"name": ..., "arguments": {...}}`` objects;
each element becomes a call when it closes. With a named function the output is the arguments
object itself, so it streams as argument fragments from the first token, under a call announced
before any of them. Neither has content.
"""

from __future__ import annotations

import json

from .base import ToolCallDelta, ToolParseDelta, ToolParser, arguments_json


class RequiredToolCallsParser(ToolParser):
    """A JSON array of calls; the scanner tracks strings and nesting to find each element."""

    name = "required"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._element: list[str] = []  # characters of the element being read (depth >= 2)

    def feed(self, text: str) -> ToolParseDelta:
        out = ToolParseDelta()
        for ch in text:
            if self._depth >= 2:
                self._element.append(ch)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._element = [ch]
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1:
                    out += self._element_done("".join(self._element))
        return out

    def finish(self) -> ToolParseDelta:
        return ToolParseDelta()  # an element cut off by the end is no call

    def _element_done(self, text: str) -> ToolParseDelta:
        try:
            obj = json.loads(text)
        except ValueError:
            return ToolParseDelta()
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolParseDelta()
        return ToolParseDelta(tool_calls=[self._announce(obj["name"], arguments_json(obj.get("arguments", {})))])


class NamedToolCallParser(ToolParser):
    """The output is the named function's arguments, verbatim."""

    name = "named"

    def __init__(self, function_name: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.function_name = function_name

    def feed(self, text: str) -> ToolParseDelta:
        if not self.called:
            return ToolParseDelta(tool_calls=[self._announce(self.function_name, text)])
        if not text:
            return ToolParseDelta()
        return ToolParseDelta(tool_calls=[ToolCallDelta(index=0, arguments=text)])

    def finish(self) -> ToolParseDelta:
        return self.feed("") if not self.called else ToolParseDelta()

