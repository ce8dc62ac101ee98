"""vLLM's ``/tokenizer_info`` (served with ``--enable-tokenizer-info-endpoint``): the tokenizer's
configuration, as in its ``tokenizer_config.json``, with the chat template the server renders.

Clients that tokenize through the server read it: lm-eval's ``local-completions`` takes it (with
``/tokenize`` and ``/detokenize``) instead of loading a tokenizer by the model's name.
"""

from __future__ import annotations

from typing import Any

from .protocol import TokenizerInfoResponse

# Paths on the server's disk mean nothing to a client.
_FILE_FIELDS = ("vocab_file", "merges_file", "tokenizer_file")


def _json_value(value: Any) -> Any:
    """Special tokens as their text (``AddedToken.content``), containers walked, the rest as is
    when JSON has it, else as a string."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def tokenizer_info(tokenizer, chat_template: str | None) -> TokenizerInfoResponse:
    config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if k not in _FILE_FIELDS}
    info = _json_value(config)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info.setdefault(name, _json_value(getattr(tokenizer, name, None)))
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    info["tokenizer_class"] = type(tokenizer).__name__
    return TokenizerInfoResponse(**info)
