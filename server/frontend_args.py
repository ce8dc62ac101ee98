"""``FrontendArgs``: the server's own flags as one dataclass, their help the docstring under each
field, generated the way ``EngineConfig``'s are (vLLM's ``FrontendArgs``). The engine's flags stay
``EngineConfig``'s; ``jaxserve serve`` takes both."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

from jaxserve import ConfigError, add_flags, dataclass_flags

from .limits import (
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_CHAT_MESSAGES,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
    DEFAULT_REQUEST_HEADER_TIMEOUT_S,
)


@dataclasses.dataclass
class FrontendArgs:
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 8000
    """Port to bind; 0 picks a free one."""
    served_model_name: str | None = None
    """Model name clients send and responses carry (default: the model path, 'SmolLM2-135M-Instruct'
    for the default demo, 'jaxserve-demo' for the random tiny one)."""
    api_key: str | None = None
    """Require 'Authorization: Bearer <key>' on every route except /health, /metrics and /version
    (default: JAXSERVE_API_KEY from the environment, else no auth)."""
    chat_template: str | None = None
    """Chat template: a file path or the Jinja template itself (default: the tokenizer's)."""
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    """Uvicorn's log level."""
    max_waiting: int = 1024
    """Most requests waiting for the engine; beyond that new requests get 503."""
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    """Largest request body; larger ones get 413."""
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S
    """Seconds a client has to send its request body; slower ones get 408 and the connection is closed."""
    request_header_timeout: float = DEFAULT_REQUEST_HEADER_TIMEOUT_S
    """Seconds a client has to send a request's line and headers, from its connection or its request's
    first byte; slower ones get 408 and the connection is closed."""
    timeout_keep_alive: int = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    """Seconds an idle keep-alive connection stays open."""
    max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES
    """Most messages in one chat request."""
    split_special_tokens_in_content: bool = False
    """Tokenize the text of chat messages with special-token strings (<|im_start|> ...) split into
    ordinary tokens, so that no client text becomes a control token; only the template's own text
    does (default: off, as in vLLM)."""
    enable_tokenizer_info_endpoint: bool = False
    """Serve /tokenizer_info (the tokenizer's configuration and chat template), which clients such
    as lm-eval use to tokenize through the server (default: off, as in vLLM)."""
    enable_auto_tool_choice: bool = False
    """Let the model decide when to call tools (tool_choice 'auto', also the default when a request
    has tools); needs --tool-call-parser (default: off)."""
    tool_call_parser: str | None = None
    """How tool calls are read from the model's text for tool_choice 'auto': 'hermes'
    (<tool_call>{...}</tool_call>, Qwen2.5/Qwen3/Hermes) (default: none)."""
    lora_modules: list[str] | None = None
    """LoRA adapters served from the start (needs --enable-lora), each 'name=path' or the JSON
    '{"name": ..., "path": ..., "base_model_name": ...}'; a request picks one with its 'model' (default: none)."""
    enable_debug_endpoints: bool = False
    """Serve /debug/requests/{id} (a request's timeline), /debug/requests, /debug/steps (the newest
    step records) and /debug/trace (a Chrome/Perfetto trace) (default: off)."""

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_request_body_bytes", "timeout_keep_alive", "max_chat_messages"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("request_body_timeout", "request_header_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_flags(parser.add_argument_group("server"), dataclass_flags(cls))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> FrontendArgs:
        return cls(**{flag.name: getattr(args, flag.name) for flag in dataclass_flags(cls)})
