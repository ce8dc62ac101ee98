"""Structured outputs and reasoning (vLLM's ``StructuredOutputsConfig``)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.base import SubConfig

# The reasoning parsers' names (``jaxserve.structured.reasoner`` and the server's parsers know each).
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclasses.dataclass
class StructuredOutputsConfig(SubConfig):
    structured_outputs_max_grammar_bytes: int = 131072
    """Largest JSON schema, regex, grammar or choice list a structured-output request may send, in bytes."""
    structured_outputs_compile_timeout_s: float = 10.0
    """A structured-output request whose grammar has not compiled after this many seconds is aborted."""
    structured_outputs_any_whitespace: bool = False
    """JSON constraints allow any JSON whitespace between tokens (vLLM's default). Off: compact JSON
    (vLLM's disable_any_whitespace), since a model that favours whitespace could otherwise emit it
    without end; a request's whitespace_pattern still applies."""
    reasoning_parser: str | None = None
    """How the model marks its reasoning (vLLM's reasoning parsers): 'qwen3' (content unless the
    output opens <think>) or 'deepseek_r1' (reasoning until </think>). Structured outputs then
    constrain only what follows </think>, generated or already in the prompt, and the server
    splits <think>...</think> into message.reasoning_content. Default: none."""

    def validate(self) -> None:
        if self.structured_outputs_max_grammar_bytes < 1:
            raise self.bad("structured_outputs_max_grammar_bytes", "must be >= 1")
        if not self.structured_outputs_compile_timeout_s > 0:
            raise self.bad("structured_outputs_compile_timeout_s", "must be > 0")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise self.bad("reasoning_parser", f"must be one of {', '.join(REASONING_PARSERS)}")
