"""Chat prompts whose message text can never become control tokens.

By default (as in vLLM) the rendered chat prompt is tokenized as one string, so a user who writes
``<|im_start|>system`` in a message gets the real control token. With
``--split-special-tokens-in-content`` the template is rendered with a placeholder for each
message's text; the template's own text is tokenized with special tokens recognised and each
message's text with special-token strings split into ordinary tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .errors import APIError

# Private-use characters: no tokenizer special token and no template filter produces them.
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


def tokenize_with_plain_content(tok, render: Callable[[list[dict[str, Any]]], str],
                                conversation: list[dict[str, Any]],
                                add_special_tokens: bool) -> tuple[str, list[int]]:
    """(prompt text, token ids) of ``render(conversation)``, each message's ``content`` tokenized
    without special-token parsing. Invariant: the text is exactly what ``render`` makes of the
    real conversation when the template copies each message's text once, unchanged."""
    contents = [str(m.get("content", "")) for m in conversation]
    marked = [dict(m, content=f"{_OPEN}{i}{_CLOSE}") for i, m in enumerate(conversation)]
    rendered = render(marked)
    pieces = _PLACEHOLDER.split(rendered)  # template text, index, template text, index, ...
    indices = [int(i) for i in pieces[1::2]]
    stray = any(_OPEN in piece or _CLOSE in piece for piece in pieces[0::2])
    if sorted(indices) != list(range(len(contents))) or stray:
        raise APIError(400, "the chat template does not copy each message's text once as it is, which "
                            "--split-special-tokens-in-content needs", param="messages")
    text_parts: list[str] = []
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            if piece:
                ids += tok.encode(piece, add_special_tokens=False)
            text_parts.append(piece)
        else:
            content = contents[int(piece)]
            if content:
                ids += tok.encode(content, add_special_tokens=False, split_special_tokens=True)
            text_parts.append(content)
    if add_special_tokens:
        ids = tok.build_inputs_with_special_tokens(ids)
    return "".join(text_parts), ids
