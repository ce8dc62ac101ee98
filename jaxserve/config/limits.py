"""What one request may ask for: the bounds the input processor checks before a request reaches
the scheduler."""

from __future__ import annotations

import dataclasses

from jaxserve.config.base import SubConfig


@dataclasses.dataclass
class LimitsConfig(SubConfig):
    max_logprobs: int = 20
    """Largest logprobs/prompt_logprobs a request may ask for."""
    max_prompt_chars: int = 1_000_000
    """Longest text prompt, in characters, checked before it is tokenized (tokenizing costs about a
    second per megabyte)."""
    max_n: int = 128
    """Most samples (n) one request may ask for; each is a sequence in the engine."""
    max_stop_strings: int = 64
    """Most stop strings one request may give."""
    max_stop_str_chars: int = 1024
    """Longest stop string, in characters."""

    def validate(self) -> None:
        if self.max_logprobs < 0:
            raise self.bad("max_logprobs", "must be >= 0")
        for name in ("max_prompt_chars", "max_n", "max_stop_strings", "max_stop_str_chars"):
            if getattr(self, name) < 1:
                raise self.bad(name, "must be >= 1")
