"""Helpers for parsers that read generated text in arbitrary pieces (stream deltas).

A parser that looks for a tag (``<think>``, ``<tool_call>`` ...) must not emit the start of a tag
that the next piece completes, so it holds back the longest end of its buffer that could still
become the tag. Every parser built on these helpers gives the same result however the text is
split, which is what makes the streamed and the non-streamed answers agree.
"""

from __future__ import annotations

from dataclasses import dataclass


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def take_until_tag(buffer: str, tag: str) -> tuple[str, bool, str]:
    """Split ``buffer`` at the first ``tag``: (text before it, found, rest after it). Without the
    tag, the text before is what can be released now and the rest is the partial tag held back."""
    at = buffer.find(tag)
    if at >= 0:
        return buffer[:at], True, buffer[at + len(tag):]
    keep = partial_tag_len(buffer, tag)
    cut = len(buffer) - keep
    return buffer[:cut], False, buffer[cut:]


@dataclass
class TrimmedText:
    """Text released in pieces with whitespace trimmed where a boundary (a tag) touches it.

    ``drop_leading`` drops whitespace at the start of the text; whitespace at the current end is
    held back until non-space text follows it (released) or a boundary comes (``boundary``
    drops it) or the text ends (``flush`` releases it, ``drop_pending`` drops it).
    """

    drop_leading: bool = False
    pending: str = ""

    def push(self, text: str) -> str:
        if self.drop_leading:
            text = text.lstrip()
            if not text:
                return ""
            self.drop_leading = False
        body = text.rstrip()
        if not body:
            self.pending += text
            return ""
        out = self.pending + body
        self.pending = text[len(body):]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def boundary(self, *, drop_following: bool) -> None:
        """A tag ends the text here: its trailing whitespace goes, and with ``drop_following``
        the next text's leading whitespace too."""
        self.pending = ""
        self.drop_leading = drop_following
