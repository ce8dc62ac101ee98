"""Logprobs in the OpenAI shapes, and the token strings and bytes they are reported with.

``TokenText`` turns token ids into display strings and raw bytes. The builders turn the engine's
per-position ``{token_id: Logprob}`` dicts into the completions ``logprobs`` object (parallel
lists with text offsets) or the chat one (a list of tokens, each with its top alternatives).
Every logprob reported is at least ``LOGPROB_FLOOR``.
"""

from __future__ import annotations

from functools import lru_cache

from jaxserve import CompletionOutput, Logprob, RequestOutput

from .protocol import ChatLogProbs, ChatLogProbToken, ChatLogProbTop, CompletionLogProbs, PromptLogprob

# -inf is not valid JSON: a token the sampler ruled out reports this floor instead (vLLM's value).
LOGPROB_FLOOR = -9999.0
# Ids remembered per cache: the tokens a server keeps seeing, with memory bounded on any vocabulary.
TOKEN_CACHE_SIZE = 65536


def floored(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet, in which each of the 256 bytes is one printable
    code point: printable Latin-1 bytes stand for themselves, the rest are moved to 256 and up in
    byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    code_point = {b: b for b in printable}
    moved = [b for b in range(256) if b not in code_point]
    for n, b in enumerate(moved):
        code_point[b] = 256 + n
    return {chr(c): b for b, c in code_point.items()}


class TokenText:
    """Display strings and raw bytes of token ids (cached per id).

    Without a tokenizer a token shows as ``token_id:<id>``. On a byte-level tokenizer ``bytes``
    are the token's own bytes (a piece of a UTF-8 character stays exact); otherwise they are the
    UTF-8 of its decoded text.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self._text = lru_cache(maxsize=TOKEN_CACHE_SIZE)(self._text_uncached)
        self._bytes = lru_cache(maxsize=TOKEN_CACHE_SIZE)(self._bytes_uncached)

    def text(self, token_id: int, decoded: str | None = None) -> str:
        """The token's string; ``decoded`` (the engine's own detokenization) wins when given."""
        if decoded is not None:
            return decoded
        return self._text(token_id)

    def bytes(self, token_id: int) -> list[int]:
        return self._bytes(token_id)

    def _text_uncached(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _bytes_uncached(self, token_id: int) -> list[int]:
        if self.tokenizer is None:
            return list(f"token_id:{token_id}".encode())
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            table = byte_decoder()
            if isinstance(piece, str) and piece and all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(self._text(token_id).encode("utf-8"))


class TokenIdText(TokenText):
    """``return_tokens_as_token_ids``: every token is shown as ``token_id:<id>``, as vLLM shows it,
    so a client can map logprobs to ids whatever the tokenizer; ``bytes`` stay the token's own."""

    def text(self, token_id: int, decoded: str | None = None) -> str:
        return f"token_id:{token_id}"


def _is_byte_level(tokenizer) -> bool:
    try:
        decoder = tokenizer.backend_tokenizer.decoder
    except Exception:  # noqa: BLE001 - slow tokenizers have none: fall back to utf-8 of the text
        return False
    return type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)


# ---- /v1/completions ---------------------------------------------------------------------------


def top_entries(entry: dict[int, Logprob], token_id: int, top_n: int | None) -> dict[int, Logprob]:
    """The position's token and its ``top_n`` likeliest alternatives (all of them when None): the
    engine may have computed more, for another field of the same request."""
    if top_n is None:
        return entry
    return {tid: lp for tid, lp in entry.items() if tid == token_id or (lp.rank is not None and lp.rank <= top_n)}


def _append_position(lp: CompletionLogProbs, text: str, token_id: int, entry: dict[int, Logprob] | None,
                     tokens: TokenText, offset: int, top_n: int | None = None) -> int:
    """One position of a completions ``logprobs`` object (no ``entry``: no logprobs there); returns
    the next text offset."""
    chosen = entry.get(token_id) if entry is not None else None
    lp.tokens.append(text)
    lp.token_logprobs.append(None if chosen is None else floored(chosen.logprob))
    top: dict[str, float] | None = None
    if entry is not None:
        top = {}
        for tid, alt in sorted(top_entries(entry, token_id, top_n).items(), key=lambda kv: kv[1].rank or 0):
            # Distinct ids can share a display string (partial UTF-8 shows as U+FFFD): keep the likelier.
            top.setdefault(tokens.text(tid, alt.decoded_token), floored(alt.logprob))
    lp.top_logprobs.append(top)
    lp.text_offset.append(offset)
    return offset + len(text)


def completion_logprobs(out: CompletionOutput, tokens: TokenText, start_offset: int) -> CompletionLogProbs:
    """The generated tokens' logprobs; text offsets count from ``start_offset``."""
    lp = CompletionLogProbs()
    offset = start_offset
    for token_id, entry in zip(out.token_ids, out.logprobs or []):
        chosen = entry.get(token_id)
        text = tokens.text(token_id, chosen.decoded_token if chosen else None)
        offset = _append_position(lp, text, token_id, entry, tokens, offset)
    return lp


def prepend_prompt_logprobs(ro: RequestOutput, tokens: TokenText, generated: CompletionLogProbs,
                            top_n: int | None = None) -> CompletionLogProbs:
    """``echo`` with ``logprobs``: the prompt's tokens come first, the first one without a logprob
    (nothing precedes it), as the OpenAI completions API reports them; ``top_n`` alternatives each."""
    lp = CompletionLogProbs()
    offset = 0
    plp = ro.prompt_logprobs or []  # [None, {token: Logprob}, ...]
    for i, token_id in enumerate(ro.prompt_token_ids):
        entry = (plp[i] if i < len(plp) else None) or None  # the first position's None, or {}: no logprobs
        offset = _append_position(lp, tokens.text(token_id), token_id, entry, tokens, offset, top_n)
    lp.tokens += generated.tokens
    lp.token_logprobs += generated.token_logprobs
    lp.top_logprobs += generated.top_logprobs
    lp.text_offset += generated.text_offset
    return lp


def prompt_logprobs_field(ro: RequestOutput, top_n: int) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` of a completions choice: per prompt position (None first), the
    prompt token and its ``top_n`` alternatives by id."""
    out: list[dict[int, PromptLogprob] | None] = []
    for token_id, entry in zip(ro.prompt_token_ids, ro.prompt_logprobs or []):
        if entry is None:
            out.append(None)
            continue
        out.append({tid: PromptLogprob(logprob=floored(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
                    for tid, lp in top_entries(entry, token_id, top_n).items()})
    return out


# ---- /v1/chat/completions ----------------------------------------------------------------------


def chat_logprobs(out: CompletionOutput, tokens: TokenText, top_k: int) -> ChatLogProbs:
    """One entry per generated token, each with its ``top_k`` likeliest alternatives by rank."""
    content = []
    for token_id, entry in zip(out.token_ids, out.logprobs or []):
        chosen = entry.get(token_id)
        top = sorted((kv for kv in entry.items() if kv[1].rank is not None and kv[1].rank <= top_k),
                     key=lambda kv: kv[1].rank)[:top_k]
        content.append(ChatLogProbToken(
            token=tokens.text(token_id, chosen.decoded_token if chosen else None),
            logprob=floored(chosen.logprob) if chosen else LOGPROB_FLOOR,
            bytes=tokens.bytes(token_id),
            top_logprobs=[ChatLogProbTop(token=tokens.text(tid, alt.decoded_token), logprob=floored(alt.logprob),
                                         bytes=tokens.bytes(tid)) for tid, alt in top]))
    return ChatLogProbs(content=content)
