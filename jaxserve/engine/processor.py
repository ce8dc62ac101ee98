"""Input processing shared by ``LLM`` and ``AsyncLLM``: prompt -> token ids -> core ``Request``s.

Everything that can be wrong with a request is checked here, before it reaches the core, and
raised as a ValueError naming the field; a bad request fails alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.models.config import ModelConfig
from jaxserve.sample.metadata import SamplingMetadataBuilder

PromptType = Union[str, list[int], dict[str, Any]]


@dataclasses.dataclass
class ProcessedRequest:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    core_requests: list[Request]


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


class InputProcessor:
    def __init__(self, tokenizer, model_config: ModelConfig, max_model_len: int, max_logprobs: int):
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.vocab_size = model_config.vocab_size
        self.sampling_validator = SamplingMetadataBuilder(vocab_size=model_config.vocab_size,
                                                          max_num_logprobs=max_logprobs)
        tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        eos_ids = list(model_config.eos_token_ids)
        self.eos_token_id = tok_eos if tok_eos is not None else (eos_ids[0] if eos_ids else None)
        # Models with several EOS ids (Llama 3) stop on all of them.
        self.extra_eos_ids = [e for e in eos_ids if e != self.eos_token_id]

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a text prompt needs a tokenizer; pass token ids instead")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: the prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                f"(prompt plus at least one output token must fit)")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: {params.max_tokens} output tokens plus the {n}-token prompt exceed "
                f"max_model_len={self.max_model_len}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.max_logprobs:
            raise ValueError(f"prompt_logprobs: {params.prompt_logprobs} exceeds max_logprobs={self.max_logprobs}")
        for t in params.stop_token_ids or []:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"stop_token_ids: token id {t} is outside the vocabulary [0, {self.vocab_size})")
        self.sampling_validator.validate(params)

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float,
                priority: int = 0, cache_salt: Optional[str] = None) -> ProcessedRequest:
        text, ids = self.tokenize_prompt(prompt)
        self.validate(ids, params)
        core = [self._core_request(child_request_id(i, request_id) if params.n > 1 else request_id,
                                   ids, self._child_params(params, i), arrival_time, priority, cache_salt)
                for i in range(params.n)]
        return ProcessedRequest(request_id, text, ids, core)

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        if params.n == 1 and not self.extra_eos_ids:
            return params
        child = params.clone()
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + index  # distinct but reproducible samples
        if self.extra_eos_ids and not params.ignore_eos:
            child.stop_token_ids = list(params.stop_token_ids or []) + self.extra_eos_ids
        return child

    def _core_request(self, core_id, ids, params, arrival_time, priority, cache_salt) -> Request:
        return Request(core_id, ids, params, self.eos_token_id, arrival_time=arrival_time,
                       priority=priority, cache_salt=cache_salt)
