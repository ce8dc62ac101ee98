"""``ServerState``: what every handler needs from the engine, read once when the app is built."""

from __future__ import annotations

from typing import Optional

from .errors import ENGINE_DEAD, APIError
from .logprobs import TokenIdText, TokenText


class ServerState:
    """The engine, the model name it answers to, its tokenizer and limits.

    ``engine`` is a running ``AsyncLLM`` or anything with its public interface (``generate``,
    ``tokenizer``, ``served_model_name``, ``max_model_len``, ``model_config.vocab_size``,
    ``is_dead``, ``render_metrics``).
    """

    def __init__(self, engine, *, served_model_name: Optional[str] = None, chat_template: Optional[str] = None,
                 model_root: Optional[str] = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name or engine.served_model_name
        self.model_root = model_root or self.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.chat_template = chat_template
        self.token_text = TokenText(self.tokenizer)
        self.token_id_text = TokenIdText(self.tokenizer)  # return_tokens_as_token_ids

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def truncation(self, truncate_prompt_tokens: Optional[int]) -> Optional[int]:
        """How many prompt tokens to keep, from the end (vLLM's ``truncate_prompt_tokens``; -1
        means ``max_model_len``); None keeps the whole prompt."""
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == -1:
            return self.max_model_len
        if not 1 <= truncate_prompt_tokens <= self.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens: must be -1 or in [1, max_model_len={self.max_model_len}], "
                                f"got {truncate_prompt_tokens}", param="truncate_prompt_tokens")
        return truncate_prompt_tokens

    @staticmethod
    def check_unsupported(problems: list[tuple[str, str]]) -> None:
        if problems:
            param, message = problems[0]
            raise APIError(400, message, param=param, code="unsupported_parameter")

    def check_alive(self) -> None:
        if self.engine.is_dead:
            raise APIError(503, "the engine is dead (its loop failed); restart the server", code=ENGINE_DEAD)
