"""The text shown for each token of a logprobs entry (``Logprob.decoded_token``).

A token is shown as its own decoding, except that a byte-level token ending inside a multi-byte
character would decode to U+FFFD: as in vLLM's logprobs processor, such a token is shown as ""
and the token that completes the character shows the whole character (decoded together with the
pending tokens before it). So the chosen tokens' texts, concatenated, are the generated text, and
a streamed chunk whose text is held back for an incomplete character carries an empty token.
"""

from __future__ import annotations

from functools import lru_cache

REPLACEMENT = "\ufffd"
# A UTF-8 character has at most 4 bytes: a longer pending run is malformed, shown as it decodes.
MAX_PENDING_TOKENS = 3
# Single-token decodings remembered per tokenizer (the ids a server keeps seeing).
TOKEN_CACHE_SIZE = 65536


class LogprobTokenText:
    """Decoded texts for one sequence's logprob positions, in order.

    Invariant: ``pending`` holds the chosen tokens since the last one whose text completed a
    character (at most ``MAX_PENDING_TOKENS``); each of them was shown as "".
    """

    def __init__(self, decode_one, decode_many):
        self._decode_one = decode_one
        self._decode_many = decode_many
        self.pending: list[int] = []

    def position(self, token_ids: list[int]) -> list[str]:
        """Texts of ``token_ids`` at the next position (the chosen token first, then its
        alternatives, all read after the same history); then moves past the chosen token."""
        texts = [self._text(t) for t in token_ids]
        if texts[0] or len(self.pending) >= MAX_PENDING_TOKENS:
            self.pending = []
        else:
            self.pending.append(token_ids[0])
        return texts

    def _text(self, token_id: int) -> str:
        if not self.pending:
            text = self._decode_one(token_id)
        else:
            text = self._decode_many([*self.pending, token_id])
        if text.endswith(REPLACEMENT) and len(self.pending) < MAX_PENDING_TOKENS:
            return ""
        return text


class TokenDecoder:
    """A tokenizer's decodings for logprobs (special tokens shown, as vLLM shows them)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decode_one = lru_cache(maxsize=TOKEN_CACHE_SIZE)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def decode_many(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def sequence(self) -> LogprobTokenText:
        return LogprobTokenText(self.decode_one, self.decode_many)
