"""OpenAI wire format: request and response bodies as pydantic models.

Field names and shapes follow the OpenAI API plus vLLM's extensions (``top_k``, ``ignore_eos``,
``min_tokens``, ``prompt_logprobs``, ``truncate_prompt_tokens`` ...; the README lists them). As in
vLLM, a field no model declares is ignored, not refused: ``ignored_fields()`` names it, and the
server logs it and reports it in a response header. Fields jaxserve knows but cannot honour
(tools, guided decoding, ...) are listed by ``unsupported()``, so the server answers 400 with the
reason instead of silently ignoring them. Ranges that the engine itself checks (penalties,
top_p, ...) are left to ``SamplingParams``; what is checked here is what would otherwise reach
numpy unbounded.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_serializer

# Largest n a request may ask for (each sample is one core request).
MAX_N = 128
# Largest number of prompts in one /v1/completions request.
MAX_PROMPTS = 1024
# /v1/completions' max_tokens when the request leaves it out, as in the OpenAI API.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# logit_bias values are limited to [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT], as in the OpenAI API.
LOGIT_BIAS_LIMIT = 100.0
_INT64 = 2**63
_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4e38


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    # NaN/Infinity are valid in Python's JSON parser but never valid sampling values. Unknown
    # fields are kept aside (model_extra), to be reported, rather than refused.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def ignored_fields(self) -> list[str]:
        """Fields of the body that no model declares, nested ones as ``outer.inner``."""
        names = list(self.model_extra or {})
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, _Request):
                names += [f"{name}.{inner}" for inner in value.ignored_fields()]
        return names


class StreamOptions(_Request):
    include_usage: Optional[bool] = False
    # vLLM's: with include_usage, every chunk carries the usage so far (guidellm always asks).
    continuous_usage_stats: Optional[bool] = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, le=_FLOAT32_MAX)
    top_p: Optional[float] = None
    top_k: Optional[int] = Field(None, ge=-1, le=_INT32_MAX)
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = Field(None, le=_FLOAT32_MAX)
    seed: Optional[int] = Field(None, ge=-_INT64, lt=_INT64)
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[StrictInt]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    priority: int = Field(0, ge=-_INT64, lt=_INT64)
    cache_salt: Optional[str] = None
    # vLLM extensions: -1 truncates to max_model_len; tokens are dropped from the left.
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1, le=_INT32_MAX)
    return_tokens_as_token_ids: bool = False
    # vLLM extensions jaxserve knows but does not implement (400 when they would matter).
    use_beam_search: bool = False
    bad_words: Optional[list[str]] = None
    logits_processors: Optional[list[Any]] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[Any]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[Any] = None
    response_format: Optional[ResponseFormat] = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        if v is None:
            return v
        for key, value in v.items():
            try:
                int(key)
            except ValueError:
                raise ValueError(f"keys must be token ids, got {key!r}") from None
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                                 f"got {value} for token {key}")
        return v

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``SamplingParams`` (max_tokens and logprobs are endpoint-specific)."""
        kw: dict[str, Any] = dict(
            n=self.n,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
        )
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "top_k"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.logit_bias:
            kw["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            kw["allowed_token_ids"] = self.allowed_token_ids
        return kw

    def include_usage(self) -> tuple[bool, bool]:
        """(usage chunk at the end, usage in every chunk): vLLM's reading of stream_options."""
        options = self.stream_options
        final = bool(options and options.include_usage)
        return final, final and bool(options and options.continuous_usage_stats)

    def common_unsupported(self) -> list[tuple[str, str]]:
        out = []
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options is only allowed when stream is true"))
        if self.use_beam_search:
            out.append(("use_beam_search", "beam search is not supported by jaxserve"))
        for name in ("bad_words", "logits_processors"):
            if getattr(self, name):
                out.append((name, f"{name} is not supported by jaxserve"))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
            if getattr(self, name) is not None:
                out.append((name, "guided decoding (structured outputs) is not supported by jaxserve"))
        if self.response_format is not None and self.response_format.type != "text":
            out.append(("response_format", f"response_format type {self.response_format.type!r} is not "
                                           "supported by jaxserve yet (only 'text')"))
        return out


# ---- /v1/completions -----------------------------------------------------------------------------

PromptInput = Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: Optional[int] = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=0)
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0)
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True
    prompt_logprobs: Optional[int] = Field(None, ge=0)

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def unsupported(self) -> list[tuple[str, str]]:
        out = self.common_unsupported()
        if self.suffix is not None:
            out.append(("suffix", "suffix is not supported by jaxserve"))
        if self.best_of is not None and self.best_of != self.n:
            out.append(("best_of", f"best_of={self.best_of} different from n={self.n} is not supported "
                                   "by jaxserve (only best_of == n)"))
        if self.prompt_logprobs is not None and self.stream:
            out.append(("prompt_logprobs", "prompt_logprobs are not available when stream is true"))
        return out

    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens=0``: the answer is the prompt (and its logprobs), as in vLLM."""
        return self.echo and self.max_tokens == 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class PromptLogprob(BaseModel):
    """One token of a prompt position, as vLLM reports ``prompt_logprobs``."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, PromptLogprob]]]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: Optional[UsageInfo] = None


# ---- /v1/chat/completions ------------------------------------------------------------------------


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: Optional[Union[StrictStr, list[ChatContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # OpenAI fields jaxserve does not implement; present so that the 400 can name them.
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[Any] = None
    reasoning_effort: Optional[str] = None
    web_search_options: Optional[Any] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = self.common_unsupported()
        if self.tools:
            out.append(("tools", "tools (function calling) are not supported by jaxserve yet"))
        if self.tool_choice not in (None, "none"):
            out.append(("tool_choice", "tool_choice is not supported by jaxserve yet"))
        if self.parallel_tool_calls:
            out.append(("parallel_tool_calls", "parallel_tool_calls is not supported by jaxserve yet"))
        if self.functions:
            out.append(("functions", "functions (function calling) are not supported by jaxserve"))
        if self.function_call not in (None, "none"):
            out.append(("function_call", "function_call is not supported by jaxserve"))
        if self.audio is not None or (self.modalities and self.modalities != ["text"]):
            out.append(("modalities", "only text output is supported by jaxserve"))
        if self.prediction is not None:
            out.append(("prediction", "predicted outputs are not supported by jaxserve"))
        if self.reasoning_effort is not None:
            out.append(("reasoning_effort", "reasoning_effort is not supported by jaxserve"))
        if self.web_search_options is not None:
            out.append(("web_search_options", "web search is not supported by jaxserve"))
        if self.store:
            out.append(("store", "storing completions is not supported by jaxserve"))
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs requires logprobs to be true"))
        if self.add_generation_prompt and self.continue_final_message:
            out.append(("continue_final_message",
                        "continue_final_message and add_generation_prompt cannot both be true"))
        return out

    def effective_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatLogProbTop(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogProbToken(ChatLogProbTop):
    top_logprobs: list[ChatLogProbTop] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: Optional[list[ChatLogProbToken]] = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        # A delta carries only what changed: {"role": ...} first, then {"content": ...}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# ---- models, tokenize, errors ----------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizerInfoResponse(BaseModel):
    """vLLM's /tokenizer_info: the tokenizer's configuration (``tokenizer_config.json``'s fields)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class TokenizeCompletionRequest(_Request):
    model: Optional[str] = None
    prompt: StrictStr
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: Optional[str] = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
