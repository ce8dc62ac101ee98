"""``ServerState``: what every handler needs from the engine, read once when the app is built."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import ENGINE_DEAD, APIError
from .limits import DEFAULT_MAX_CHAT_MESSAGES
from .logprobs import TokenIdText, TokenText

if TYPE_CHECKING:
    from jaxserve import LoRARequest
    from jaxserve.engine.protocol import EngineClient

    from .lora import ServedLoRAs

T = TypeVar("T")


class ServerState:
    """The engine, the model name it answers to, its tokenizer and limits.

    ``engine`` is an ``EngineClient`` (``jaxserve.engine.protocol``): a running ``AsyncLLM`` or
    ``DPAsyncLLM``, or anything else with that interface.
    """

    def __init__(self, engine: EngineClient, *, served_model_name: str | None = None,
                 chat_template: str | None = None, model_root: str | None = None,
                 max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES, split_special_tokens_in_content: bool = False):
        self.engine = engine
        self.split_special_tokens_in_content = split_special_tokens_in_content
        self.max_prompt_chars = engine.config.max_prompt_chars
        self.allowed_local_media_path = getattr(engine.config, "allowed_local_media_path", "")  # file:// URLs
        self.limit_mm_per_prompt = getattr(engine.config, "limit_mm_per_prompt", None)  # checked before decoding
        self.image_placeholder = getattr(engine, "image_placeholder", "<image>")  # a chat image part's text
        self.max_chat_messages = max_chat_messages
        # Chat templates and tokenizers run off the event loop, which keeps serving meanwhile, on the
        # engine's input pool: one pool tokenizes, for the server and the engine alike.
        self.input_pool: concurrent.futures.Executor = engine.input_pool
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name or engine.served_model_name
        self.model_root = model_root or self.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.chat_template = chat_template
        self.token_text = TokenText(self.tokenizer)
        self.token_id_text = TokenIdText(self.tokenizer)  # return_tokens_as_token_ids
        self.loras: ServedLoRAs | None = None  # set by the app when the engine serves LoRA adapters

    def require_loras(self) -> ServedLoRAs:
        if self.loras is None:
            raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora", param="lora_name")
        return self.loras

    def lora_for(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names, None for the base model."""
        if name is None or name == self.model_name or self.loras is None:
            return None
        return self.loras.by_name.get(name)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the input pool (tokenizing, rendering a template): seconds of work for
        a long prompt, during which ``/health`` and short requests are still answered."""
        context = contextvars.copy_context()  # the request's entry-times record goes along
        return await asyncio.get_running_loop().run_in_executor(self.input_pool,
                                                                functools.partial(context.run, fn, *args))

    def check_prompt_chars(self, param: str, num_chars: int) -> None:
        """Refuse text longer than ``max_prompt_chars`` before any tokenizing or rendering."""
        if num_chars > self.max_prompt_chars:
            raise APIError(400, f"{param}: {num_chars} characters exceed max_prompt_chars={self.max_prompt_chars}",
                           param=param)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and self.lora_for(name) is None:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def truncation(self, truncate_prompt_tokens: int | None) -> int | None:
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
        """503 once the engine loop has failed, saying why (a lost host of a multi-node engine ...)."""
        if self.engine.is_dead:
            raise APIError(503, f"{dead_message(self.engine)}; restart the server", code=ENGINE_DEAD)


def dead_message(engine: EngineClient) -> str:
    """What a 503 of a dead engine says: its loop failed, and the cause when the engine knows it."""
    reason = engine.dead_reason
    return f"the engine is dead (its loop failed: {reason})" if reason else "the engine is dead (its loop failed)"
