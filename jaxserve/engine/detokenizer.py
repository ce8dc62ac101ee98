"""Incremental detokenization that is correct across multi-byte characters.

Decoding one token at a time breaks characters that span several byte-level tokens (a CJK
character or an emoji is 3-4 bytes, often 2-3 tokens) and drops the spaces some tokenizers add
between words. So each step decodes a short window twice: the tokens already emitted
(``prefix_offset:read_offset``) and the same window plus the new ones; the new text is the
difference. While the result ends in U+FFFD (an incomplete character), nothing is emitted and the
window grows until the character completes.
"""

from __future__ import annotations

# Prompt tokens kept as left context so the first output token decodes with correct spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        delta = ""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta += full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: emit whatever is still held back (an incomplete character
        decodes to U+FFFD rather than vanishing)."""
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta
