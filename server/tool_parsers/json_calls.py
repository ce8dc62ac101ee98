"""Tool calls read from output that structured outputs shaped: ``tool_choice`` ``required`` and a
named function.

With ``required`` the output is a JSON array of ``{"name": ..., "arguments": {...}}`` objects;
each element becomes a call as soon as its name is read, and its arguments stream as written.
With a named function the output is the arguments object itself, so it streams as argument
fragments from the first token, under a call announced before any of them. Neither has content.
Arguments are the text the model wrote (valid JSON, since the schema shaped it), not re-encoded.
"""

from __future__ import annotations

import json

from .base import ToolCallDelta, ToolParseDelta, ToolParser


class _Element:
    """One ``{"name": ..., "arguments": ...}`` element read a character at a time.

    It follows the element's top level (keys, colons, values) and keeps the raw text of the
    ``arguments`` value as it arrives, so arguments can stream before the element closes.
    ``depth`` counts open brackets from the element's own ``{`` (1 at its top level)."""

    def __init__(self) -> None:
        self.depth = 1
        self.in_string = False
        self.escaped = False
        self.state = "key"  # key -> colon -> value -> after -> key ... ; done once closed
        self.key_raw = ""
        self.key = ""
        self.value_kind = ""  # container | string | literal
        self.value_raw = ""  # the name's raw value (a JSON string)
        self.name: str | None = None
        self.arguments = ""  # raw text of the arguments value read so far
        self.has_arguments = False

    def feed(self, ch: str) -> None:
        """One character after the element's opening brace."""
        if self.state == "value":
            self._value_char(ch)
            return
        if self.in_string:  # the key being read
            self._string_char(ch)
            if self.in_string:
                self.key_raw += ch
            else:
                self.key = _json_string(self.key_raw)
                self.state = "colon"
            return
        if ch.isspace():
            return
        if self.state == "key" and ch == '"':
            self.in_string, self.key_raw = True, ""
        elif self.state == "colon" and ch == ":":
            self.state = "value_start"
        elif self.state == "value_start":
            self.state = "value"
            self.value_kind = "container" if ch in "[{" else "string" if ch == '"' else "literal"
            self.value_raw = ""
            self._value_char(ch)
        elif self.state == "after" and ch == ",":
            self.state = "key"
        elif ch == "}":
            self.state = "done"

    def _value_char(self, ch: str) -> None:
        kind = self.value_kind
        if kind == "literal" and (ch.isspace() or ch in ",}"):
            self._value_done()
            self.state = "after"
            self.feed(ch)  # the delimiter belongs to the element
            return
        self._take(ch)
        if self.in_string:
            self._string_char(ch)
            ended = kind == "string" and not self.in_string
        elif ch == '"':
            self.in_string = True
            ended = False
        elif ch in "[{":
            self.depth += 1
            ended = False
        elif ch in "]}":
            self.depth -= 1
            ended = kind == "container" and self.depth == 1
        else:
            ended = False
        if ended:
            self._value_done()
            self.state = "after"

    def _string_char(self, ch: str) -> None:
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False

    def _take(self, ch: str) -> None:
        if self.key == "arguments":
            self.arguments += ch
            self.has_arguments = True
        elif self.key == "name":
            self.value_raw += ch

    def _value_done(self) -> None:
        if self.key == "name":
            name = _json_string(self.value_raw)
            self.name = name if name else None


def _json_string(raw: str) -> str:
    """The text of a JSON string literal (``raw`` without its quotes for keys); "" if invalid."""
    text = raw if raw.startswith('"') else f'"{raw}"'
    try:
        value = json.loads(text)
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""


class RequiredToolCallsParser(ToolParser):
    """A JSON array of calls. A call is announced once its name is read; its arguments stream as
    their raw text arrives (held until the announcement if they come first). The output is
    shaped by the schema, so the text is valid JSON; an element cut off by the end keeps what
    was released."""

    name = "required"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._started = False  # the array's [ has been read
        self._element: _Element | None = None
        self._released = 0  # characters of the current element's arguments already sent
        self._index = -1  # index of the current element's call, once announced

    def feed(self, text: str) -> ToolParseDelta:
        out = ToolParseDelta()
        for ch in text:
            element = self._element
            if element is None:
                if not self._started:
                    self._started = ch == "["
                elif ch == "{":
                    self._element, self._released, self._index = _Element(), 0, -1
                continue
            element.feed(ch)
            if element.state == "done":
                out += self._release(element, closing=True)
                self._element = None
            elif element.name is not None and self._index < 0:
                out += self._release(element, closing=False)
        if self._element is not None:
            out += self._release(self._element, closing=False)
        return out

    def finish(self) -> ToolParseDelta:
        return ToolParseDelta()

    def _release(self, element: _Element, *, closing: bool) -> ToolParseDelta:
        """The announcement (once the name is known) and the arguments read since last time."""
        if element.name is None:
            return ToolParseDelta()
        pending = element.arguments[self._released:]
        if closing and not element.has_arguments:
            pending = "{}"
        self._released = len(element.arguments)
        if self._index < 0:
            first = self._announce(element.name, pending)
            self._index = first.index
            return ToolParseDelta(tool_calls=[first])
        if not pending:
            return ToolParseDelta()
        return ToolParseDelta(tool_calls=[ToolCallDelta(index=self._index, arguments=pending)])


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

