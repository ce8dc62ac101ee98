"""Input processing shared by ``LLM`` and ``AsyncLLM``: prompt -> token ids -> core ``Request``s.

The one place a request is checked against the engine (vocabulary, ``max_model_len``, the
sampler's static widths, the token budget), before it reaches the core: ``SamplingParams``
checks only what its fields mean alone. Both raise ``InvalidRequestError`` naming the field;
a bad request fails alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Union

from jaxserve.config import EngineConfig
from jaxserve.core.lora_request import LoRARequest, lora_cache_key
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.timeline import EntryTimes
from jaxserve.exceptions import CONTEXT_LENGTH_EXCEEDED, ConfigError, InvalidRequestError
from jaxserve.models.config import ModelConfig
from jaxserve.sample.metadata import DEFAULT_MAX_ALLOWED_TOKENS, DEFAULT_MAX_LOGIT_BIAS, MAX_MIN_TOKENS_STOP_IDS

if TYPE_CHECKING:
    from jaxserve.engine.mm_processor import MultiModalProcessor
    from jaxserve.models.lora_cache import LoRAAdapterCache
    from jaxserve.structured.backend import GrammarBackend

PromptType = Union[str, list[int], dict[str, Any]]


@dataclasses.dataclass
class ProcessedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    core_requests: list[Request]
    tokenized_time: float | None = None  # monotonic: tokenized and validated
    entry: EntryTimes | None = None  # what the server measured before
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


def check_no_surrogates(field: str, text: str) -> None:
    """Refuse a string with a lone surrogate (JSON's ``"\\ud800"``): it is not Unicode text, and
    encoding it to UTF-8 (to tokenize or hash it) would fail later, far from the request."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(field, f"not valid Unicode text: a lone surrogate at character {exc.start}") \
            from None


def check_request_id(request_id: object) -> str:
    """A request id is a string, as in vLLM: anything else (an int, None, bytes) is a ``TypeError``
    at the entry point, never a silent key that no later lookup by string finds."""
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
    return request_id


def as_request_ids(request_ids: str | Iterable[str]) -> list[str]:
    """One id or several, as vLLM's ``abort_request`` takes them (a lone string is one id, not its
    characters), each checked."""
    ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
    return [check_request_id(r) for r in ids]


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


class InputProcessor:
    def __init__(self, tokenizer, model_config: ModelConfig, max_model_len: int, config: EngineConfig,
                 grammar_backend: GrammarBackend | None = None, mm_processor: MultiModalProcessor | None = None):
        self.tokenizer = tokenizer
        self.mm_processor = mm_processor  # a vision-language model's images (None: text only)
        self.grammar_backend = grammar_backend  # None: structured outputs are refused (no tokenizer)
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.limits = config.limits_config  # read per request: the one copy of the bounds
        # Without chunked prefill a prompt must fit one step's token budget.
        self.max_prompt_tokens = (max_model_len - 1 if config.enable_chunked_prefill
                                  else min(max_model_len - 1, config.max_num_batched_tokens))
        self.vocab_size = model_config.vocab_size
        tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        eos_ids = list(model_config.eos_token_ids)
        self.eos_token_id = tok_eos if tok_eos is not None else (eos_ids[0] if eos_ids else None)
        # Models with several EOS ids (Llama 3) stop on all of them.
        self.extra_eos_ids = [e for e in eos_ids if e != self.eos_token_id]
        self.all_eos_ids = ([] if self.eos_token_id is None else [self.eos_token_id]) + self.extra_eos_ids
        lora = config.lora_config
        self.lora_adapters: LoRAAdapterCache | None = None  # LoRA off: a lora_request is refused
        self.lora_config = lora
        if lora.enable_lora:
            from jaxserve.models.lora_cache import LoRAAdapterCache

            self.lora_adapters = LoRAAdapterCache(model_config, lora.max_cpu_loras or lora.max_loras,
                                                  lora.max_lora_rank)

    def forget_lora(self, lora_name: str) -> None:
        if self.lora_adapters is not None:
            self.lora_adapters.remove(lora_name)

    def resolve_lora(self, lora_request: LoRARequest | None) -> tuple[str | None, Any]:
        """The adapter's prefix-cache key (``name@sha256`` of the weights on disk now) and its
        weights, read from ``lora_path`` on first use (or when the files changed); (None, None)
        for the base model."""
        if lora_request is None:
            return None, None
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError("lora_request", f"expected a LoRARequest, got {type(lora_request).__name__}")
        if self.lora_adapters is None:
            raise InvalidRequestError("lora_request", "this engine serves no LoRA adapters: start it with "
                                                      "enable_lora=True (--enable-lora)")
        try:
            adapter = self.lora_adapters.get(lora_request.lora_name, lora_request.lora_path)
        except ConfigError as exc:
            raise InvalidRequestError("lora_request", str(exc)) from None
        moe_targets = sorted({p for _, p in adapter.weights if p in ("gate_proj", "up_proj", "down_proj")})
        if self.model_config.is_moe and moe_targets:  # the experts take no LoRA delta: refuse, never ignore
            raise InvalidRequestError("lora_request", f"LoRA adapter {lora_request.lora_path}: target_modules "
                                                      f"{', '.join(moe_targets)} target the mixture-of-experts MLP "
                                                      f"of {self.model_config.architecture}, which takes no LoRA "
                                                      "delta yet (q_proj, k_proj, v_proj, o_proj only)")
        for module, weights, flag in (("lm_head", adapter.lm_head, "lora_lm_head"),
                                      ("embed_tokens", adapter.embedding, "lora_embedding")):
            if weights is not None and not getattr(self.lora_config, flag):  # no slots for it: refuse, never ignore
                raise InvalidRequestError("lora_request", f"LoRA adapter {lora_request.lora_path}: target_modules "
                                                          f"{module} needs {flag}=True (--{flag.replace('_', '-')}): "
                                                          "this engine was started without those LoRA slots")
        return lora_cache_key(lora_request.lora_name, adapter.digest), adapter

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "a text prompt needs a tokenizer; pass token ids instead")
            self.check_text("prompt", prompt)
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(
            "prompt", f"expected a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def check_text(self, field: str, text: str) -> None:
        """A text prompt must be valid Unicode text (no lone surrogate, which no tokenizer or hash
        can encode) and at most ``max_prompt_chars`` long, checked before any tokenizing."""
        if len(text) > self.limits.max_prompt_chars:
            raise InvalidRequestError(
                field, f"{len(text)} characters exceed max_prompt_chars={self.limits.max_prompt_chars}")
        check_no_surrogates(field, text)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 cache_salt: str | None = None) -> None:
        """Raise ``InvalidRequestError`` if this engine cannot serve the request as given."""
        if params.n > self.limits.max_n:
            raise InvalidRequestError("n", f"{params.n} samples exceed max_n={self.limits.max_n}")
        self._check_prompt(prompt_token_ids, params)
        if cache_salt is not None:
            if not isinstance(cache_salt, str):
                raise InvalidRequestError("cache_salt", f"must be a string, got {type(cache_salt).__name__}")
            check_no_surrogates("cache_salt", cache_salt)
        self._check_stops(params.stop or [])
        self._check_token_ids("stop_token_ids", params.stop_token_ids or [])
        if params.min_tokens:
            suppressed = set(params.stop_token_ids or []) | set([] if params.ignore_eos else self.all_eos_ids)
            if len(suppressed) > MAX_MIN_TOKENS_STOP_IDS:
                raise InvalidRequestError(
                    "stop_token_ids", f"with min_tokens, the {len(suppressed)} stop and EOS ids to mask exceed the "
                                      f"sampler's static width MAX_MIN_TOKENS_STOP_IDS={MAX_MIN_TOKENS_STOP_IDS}")
        if params.logit_bias:
            self._check_width("logit_bias", len(params.logit_bias), "max_logit_bias", DEFAULT_MAX_LOGIT_BIAS)
            self._check_token_ids("logit_bias", params.logit_bias)
        if params.allowed_token_ids is not None:
            self._check_width("allowed_token_ids", len(params.allowed_token_ids), "max_allowed_tokens",
                              DEFAULT_MAX_ALLOWED_TOKENS)
            self._check_token_ids("allowed_token_ids", params.allowed_token_ids)
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(params, field)
            if value is not None and value > self.limits.max_logprobs:
                raise InvalidRequestError(field, f"{value} exceeds max_logprobs={self.limits.max_logprobs}")
        if params.structured_outputs is not None:
            if self.grammar_backend is None:
                raise InvalidRequestError("structured_outputs", "structured outputs need the model's tokenizer, "
                                                                "and this model has none")
            self.grammar_backend.check(params.structured_outputs)  # a bad schema, regex or grammar is refused here

    def _check_stops(self, stops: Sequence[str]) -> None:
        if len(stops) > self.limits.max_stop_strings:
            raise InvalidRequestError("stop", f"{len(stops)} stop strings exceed max_stop_strings="
                                              f"{self.limits.max_stop_strings}")
        for stop in stops:
            if len(stop) > self.limits.max_stop_str_chars:
                raise InvalidRequestError("stop", f"a stop string of {len(stop)} characters exceeds "
                                                  f"max_stop_str_chars={self.limits.max_stop_str_chars}")
            check_no_surrogates("stop", stop)

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        n = len(ids)
        if n == 0:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                          f"(prompt plus at least one output token must fit)", code=CONTEXT_LENGTH_EXCEEDED)
        if n > self.max_prompt_tokens:
            raise InvalidRequestError(
                "prompt", f"the prompt has {n} tokens, more than max_num_batched_tokens="
                          f"{self.max_prompt_tokens} with chunked prefill disabled")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens", f"{params.max_tokens} output tokens plus the {n}-token prompt exceed "
                              f"max_model_len={self.max_model_len}", code=CONTEXT_LENGTH_EXCEEDED)
        self._check_token_ids("prompt", ids)  # after the length checks: at most max_model_len ids

    def _check_token_ids(self, field: str, ids) -> None:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequestError(field, f"token ids must be integers, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(field, f"token id {t} is outside the vocabulary [0, {self.vocab_size})")

    @staticmethod
    def _check_width(field: str, length: int, width_name: str, width: int) -> None:
        if length > width:
            raise InvalidRequestError(field, f"{length} entries exceed the sampler's static width {width_name}={width}")

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float,
                priority: int = 0, cache_salt: str | None = None,
                lora_request: LoRARequest | None = None) -> ProcessedRequest:
        check_request_id(request_id)
        images = self._images_of(prompt)  # checked before the prompt is tokenized
        text, ids = self.tokenize_prompt(prompt)
        features = None
        if self.mm_processor is not None:
            ids, features = self.mm_processor.process(ids, images)
        self.validate(ids, params, cache_salt)
        lora_key, lora_weights = self.resolve_lora(lora_request)
        core = [self._core_request(child_request_id(i, request_id) if params.n > 1 else request_id,
                                   ids, self._child_params(params, i), arrival_time, priority, cache_salt,
                                   lora_key, lora_weights, features)
                for i in range(params.n)]
        return ProcessedRequest(request_id, text, ids, core, tokenized_time=time.monotonic(),
                                lora_request=lora_request)

    def _images_of(self, prompt: PromptType) -> list[Any]:
        """The prompt's images (``multi_modal_data``), each checked; refused by a text-only model."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if self.mm_processor is None:
            if data:
                raise InvalidRequestError("multi_modal_data", "this model takes no images (a text-only model)")
            return []
        return self.mm_processor.images_of(data) if data else []

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """The core request's own copy when it needs one (n > 1, extra EOS ids, min_tokens)."""
        if params.n == 1 and not self.extra_eos_ids and not params.min_tokens:
            return params
        child = params.clone()
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + index  # distinct but reproducible samples
        if self.extra_eos_ids and not params.ignore_eos:
            child.stop_token_ids = list(params.stop_token_ids or []) + self.extra_eos_ids
        child.update_from_eos(self.all_eos_ids)
        return child

    def _core_request(self, core_id, ids, params, arrival_time, priority, cache_salt,
                      lora_key=None, lora_weights=None, mm_features=None) -> Request:
        return Request(core_id, ids, params, self.eos_token_id, arrival_time=arrival_time,
                       priority=priority, cache_salt=cache_salt, lora_name=lora_key, lora_weights=lora_weights,
                       mm_features=mm_features)
