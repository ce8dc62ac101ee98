"""Where a model's reasoning ends, in token ids: the engine side of ``reasoning_parser`` (vLLM's
``ReasoningParser.is_reasoning_end``), so that structured outputs constrain only the answer that
follows ``</think>``. Pure Python: token ids in, answers out; no jax, no llguidance.

The server's reasoning parsers split the *text*; this one needs only the token ids of the think
tags. In Qwen3's and DeepSeek-R1's tokenizers each tag is one token. A tokenizer without them as
tokens (the demo model's) has each tag as the token sequence its text encodes to; a model that
spells a tag with other tokens is then not seen ending its reasoning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The think tags of each reasoning parser (the names of ``--reasoning-parser``); Qwen3 and
# DeepSeek-R1 differ only in how the server splits an output that never opens <think>.
THINK_TAGS: dict[str, tuple[str, str]] = {
    "qwen3": ("<think>", "</think>"),
    "deepseek_r1": ("<think>", "</think>"),
}


def tag_token_ids(tokenizer: Any, tag: str) -> tuple[int, ...]:
    """The tag's one token id if the tokenizer has it as a token, else its text's encoding."""
    token_id = tokenizer.get_vocab().get(tag)
    if token_id is not None:
        return (int(token_id),)
    return tuple(tokenizer.encode(tag, add_special_tokens=False))


def find_last(token_ids: Sequence[int], tag: Sequence[int]) -> int:
    """Index just past the last occurrence of ``tag`` in ``token_ids``; -1 if it does not occur."""
    n = len(tag)
    first = tag[0]
    for i in range(len(token_ids) - n, -1, -1):
        if token_ids[i] == first and tuple(token_ids[i:i + n]) == tuple(tag):
            return i + n
    return -1


@dataclass(frozen=True)
class Reasoner:
    """The think tags of one reasoning parser as token ids. Invariant: ``start`` and ``end`` are
    non-empty and differ."""

    name: str
    start: tuple[int, ...]
    end: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.start or not self.end or self.start == self.end:
            raise ValueError(f"reasoning parser {self.name}: the think tags need distinct token ids")

    @classmethod
    def from_tokenizer(cls, name: str, tokenizer: Any) -> Reasoner:
        """The reasoner registered as ``name`` for ``tokenizer`` (a Hugging Face tokenizer)."""
        if name not in THINK_TAGS:
            raise ValueError(f"reasoning_parser: unknown parser {name!r} (known: {', '.join(sorted(THINK_TAGS))})")
        start, end = THINK_TAGS[name]
        return cls(name, tag_token_ids(tokenizer, start), tag_token_ids(tokenizer, end))

    @property
    def single_token_tags(self) -> bool:
        return len(self.start) == 1 and len(self.end) == 1

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """True if the last think tag in ``token_ids`` is the end tag. On a prompt: a template that
        closes an empty think block (``enable_thinking: false``) has ended the reasoning before
        the output starts; one that opens ``<think>``, or has no tag, has not."""
        end = find_last(token_ids, self.end)
        return end >= 0 and end > find_last(token_ids, self.start)

    def end_in(self, tail: Sequence[int], new: Sequence[int]) -> int | None:
        """Where the end tag completes in ``new`` (given ``tail``, the tokens just before it): the
        number of ``new``'s tokens up to and including the tag, or None if it does not end there."""
        n = len(self.end)
        window = (list(tail[-(n - 1):]) if n > 1 else []) + list(new)
        offset = len(window) - len(new)
        for i in range(len(window) - n + 1):
            if tuple(window[i:i + n]) == self.end and i + n > offset:
                return i + n - offset
        return None
