"""OpenAI wire format: request and response bodies as pydantic models.

Field names and shapes follow the OpenAI API plus vLLM's extensions (``top_k``, ``ignore_eos``,
``min_tokens``, ``prompt_logprobs``, ``truncate_prompt_tokens`` ...; the README lists them). As in
vLLM, a field no model declares is ignored, not refused: ``ignored_fields()`` names it, and the
server logs it and reports it in a response header. Fields jaxserve knows but cannot honour
(beam search, legacy ``functions`` ...) are listed by ``unsupported()``, so the server answers 400 with
the reason instead of silently ignoring them. Tool definitions, tool calls in messages and in answers
follow the OpenAI shapes (arguments are JSON text). Ranges that the engine itself checks (penalties,
top_p, ...) are left to ``SamplingParams``; what is checked here is what would otherwise reach
numpy unbounded.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_serializer,
    model_validator,
)

from .errors import InvalidTextError
from .structured_outputs import structured_outputs_from_request

# Largest number of prompts in one /v1/completions request.
MAX_PROMPTS = 1024
# /v1/completions' max_tokens when the request leaves it out, as in the OpenAI API.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# logit_bias values are limited to [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT], as in the OpenAI API.
LOGIT_BIAS_LIMIT = 100.0
_INT64 = 2**63
_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4e38


# A string that must say something (a prompt, a stop string).
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def find_invalid_text(value: Any, path: str = "") -> str | None:
    """The path of the first string (value or key) in ``value`` that is not Unicode text, else None."""
    if isinstance(value, str):
        return None if _is_text(value) else (path or "body")
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _is_text(key):
                return path or "body"
            found = find_invalid_text(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = find_invalid_text(item, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


class _Request(BaseModel):
    # NaN/Infinity are valid in Python's JSON parser but never valid sampling values. Unknown
    # fields are kept aside (model_extra), to be reported, rather than refused. Strict: JSON
    # types as OpenAI's API has them ("max_tokens": "16" is refused, not converted).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    def ignored_fields(self) -> list[str]:
        """Fields of the body that no model declares, nested ones as ``outer.inner``."""
        names = list(self.model_extra or {})
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, _Request):
                names += [f"{name}.{inner}" for inner in value.ignored_fields()]
        return names


class _Body(_Request):
    """A whole request body (nested objects are plain ``_Request``s)."""

    @model_validator(mode="before")
    @classmethod
    def _only_unicode_text(cls, data: Any) -> Any:
        # Every string, known field or not, once, before any is used (tokenized, hashed, echoed);
        # here only, so nested models do not walk their part again.
        where = find_invalid_text(data)
        if where is not None:
            raise InvalidTextError(where)
        return data


class StreamOptions(_Request):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk carries the usage so far (guidellm always asks).
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: the schema is enforced whether or not ``strict`` is set."""

    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    description: str | None = None
    # "schema" would shadow a BaseModel attribute: stored under another name, read by its alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class ResponseFormat(_Request):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Request):
    """vLLM's ``structured_outputs`` body field: the keys of ``StructuredOutputsParams``."""

    model_config = ConfigDict(populate_by_name=True)
    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool | None = None
    disable_additional_properties: StrictBool | None = None
    whitespace_pattern: StrictStr | None = None

    def given(self) -> dict[str, Any]:
        """The keys set (not None), by the dataclass's names; unknown keys are only reported."""
        return {f.alias or name: getattr(self, name) for name, f in type(self).model_fields.items()
                if getattr(self, name) is not None}


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1)  # the engine's --max-n bounds it
    # The ranges SamplingParams enforces, stated here too so that the OpenAPI schema says them.
    temperature: float | None = Field(None, ge=0, le=_FLOAT32_MAX)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=_INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=_FLOAT32_MAX)
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = Field(None, min_length=1)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = Field(0, ge=-_INT64, lt=_INT64)
    cache_salt: str | None = None
    # vLLM extensions: -1 truncates to max_model_len; tokens are dropped from the left.
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=_INT32_MAX)
    return_tokens_as_token_ids: bool = False
    # Structured outputs (server/structured_outputs.py maps them to one constraint).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None
    # vLLM extensions jaxserve knows but does not implement (400 when they would matter).
    use_beam_search: bool = False
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None

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
        structured = structured_outputs_from_request(self)
        if structured is not None:
            kw["structured_outputs"] = structured
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
        if self.response_format is not None and self.response_format.type not in RESPONSE_FORMAT_TYPES:
            out.append(("response_format", f"response_format type {self.response_format.type!r} is not "
                                           f"supported by jaxserve (only {', '.join(RESPONSE_FORMAT_TYPES)})"))
        return out


# ---- /v1/completions -----------------------------------------------------------------------------

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
PromptInput = Union[NonEmptyStr, TokenIds, Annotated[list[NonEmptyStr], Field(min_length=1)],
                    Annotated[list[TokenIds], Field(min_length=1)]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0)

    def prompts(self) -> list[str | list[int]]:
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
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class PromptLogprob(BaseModel):
    """One token of a prompt position, as vLLM reports ``prompt_logprobs``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


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
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ------------------------------------------------------------------------


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionDefinition(_Request):
    name: StrictStr
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatCompletionToolsParam(_Request):
    """One entry of ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: StrictStr


class ChatCompletionNamedToolChoiceParam(_Request):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class MessageFunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    arguments: StrictStr | dict[str, Any]  # JSON text, as OpenAI sends it; an object is accepted too


class MessageToolCall(BaseModel):
    """A call in an assistant message of the conversation."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


def tool_dicts(tools: list[ChatCompletionToolsParam] | None) -> list[dict[str, Any]] | None:
    """The tools as plain OpenAI tool objects (what the chat template and the schemas read)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: StrictStr
    content: StrictStr | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer
    reasoning_content: str | None = None  # assistant messages, as vLLM returns them


class _ChatTemplateFields(_Body):
    """The conversation and how the chat template renders it: shared by /v1/chat/completions and
    the chat form of /tokenize, so both render a conversation the same way."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call with tool_choice required
    # OpenAI fields jaxserve does not implement; present so that the 400 can name them.
    functions: list[Any] | None = None
    function_call: Any | None = None
    audio: Any | None = None
    modalities: list[str] | None = None
    prediction: Any | None = None
    reasoning_effort: str | None = None
    web_search_options: Any | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = self.common_unsupported()
        if self.functions:
            out.append(("functions", "functions (legacy function calling) are not supported by jaxserve; "
                                     "use tools"))
        if self.function_call not in (None, "none"):
            out.append(("function_call", "function_call (legacy function calling) is not supported by "
                                         "jaxserve; use tool_choice"))
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

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatLogProbTop(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbToken(ChatLogProbTop):
    top_logprobs: list[ChatLogProbTop] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogProbToken] | None = None


def _drop_none(model: BaseModel, handler) -> dict[str, Any]:
    return {k: v for k, v in handler(model).items() if v is not None}


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    # vLLM's names for the text inside <think>...</think> (--reasoning-parser): both are sent.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        return _drop_none(self, handler)


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: the first of each ``index`` has ``id``, ``type`` and the name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        return _drop_none(self, handler)


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        # A delta carries only what changed: {"role": ...} first, then {"content": ...}.
        return _drop_none(self, handler)


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenize, errors ----------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizerInfoResponse(BaseModel):
    """vLLM's /tokenizer_info: the tokenizer's configuration (``tokenizer_config.json``'s fields)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: StrictStr
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_ChatTemplateFields):
    model: str | None = None
    return_token_strs: bool = False


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
