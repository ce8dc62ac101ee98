"""/v1/chat/completions: messages rendered by the chat template into one prompt, ``n`` samples.

A stream opens with one ``{"role": "assistant"}`` delta per choice, then content deltas (with a
reasoning parser, reasoning deltas; with tools, tool-call deltas). ``render_chat`` is also what
/tokenize uses for messages. Tools reach the template as OpenAI tool objects, and the arguments
of an assistant message's tool calls as objects (parsed from their JSON text), as vLLM passes
them: that is what chat templates such as Qwen3's expect.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import jaxserve
from jaxserve import InvalidRequestError, RequestOutput, SamplingParams, chat_images

from . import entry_times
from .chat_output import ChatParsers, ChoiceDelta, ChoiceParser, finish_reason, merged
from .chat_tokens import tokenize_with_plain_content
from .errors import APIError, invalid_request
from .generation import Generations
from .logprobs import chat_logprobs
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    tool_dicts,
)
from .serving_engine import OpenAIServing, ResponseIds, StreamUsage, make_sampling_params, usage
from .state import ServerState
from .tool_calls import ToolChoice, resolve_tool_choice, tool_choice_schema

# Arguments the server passes to the template itself; a request may not override them.
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tokenize", "chat_template", "add_generation_prompt",
                            "continue_final_message", "return_dict", "tools", "documents")


def _message_dict(msg: ChatMessage) -> dict[str, Any]:
    """The message as the template sees it: text parts joined by newlines, absent assistant
    content as ``""``. Image parts stay as parts, for ``chat_images``."""
    d = msg.model_dump(exclude_none=True)
    content = msg.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type == "image_url":
                return d
            if part.type != "text":
                raise APIError(400, f"messages: content parts of type {part.type!r} are not supported by "
                                    "jaxserve (text, image_url)", param="messages")
            texts.append(part.text or "")
        d["content"] = "\n".join(texts)
    elif content is None:
        if msg.role != "assistant":
            raise APIError(400, f"messages: a {msg.role!r} message needs content", param="messages")
        d["content"] = ""
    for call in d.get("tool_calls", ()):
        call["function"]["arguments"] = _arguments_object(call["function"]["arguments"])
    return d


def _arguments_object(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        raise APIError(400, f"messages: tool call arguments must be JSON text, got {arguments[:80]!r}",
                       param="messages") from None


def render_chat(state: ServerState, messages: list[ChatMessage], *, add_generation_prompt: bool,
                continue_final_message: bool, add_special_tokens: bool,
                chat_template_kwargs: dict[str, Any] | None,
                tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int], list[Any]]:
    """Apply the chat template (the server's ``--chat-template``, else the tokenizer's); returns
    (prompt text, token ids, images). Image parts become the model's placeholder in the text, their
    images (``data:`` URLs, ``file://`` under ``--allowed-local-media-path``) decoded here: a bad
    one is a 400 naming its part, before anything reaches the engine."""
    tok = state.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer, so chat is unavailable; use /v1/completions with "
                            "token ids", param="messages")
    template = state.chat_template or getattr(tok, "chat_template", None)
    if not template:
        raise APIError(400, "the model has no chat template; start the server with --chat-template",
                       param="messages")
    if not messages:
        raise APIError(400, "messages: must contain at least one message", param="messages")
    if len(messages) > state.max_chat_messages:
        raise APIError(400, f"messages: {len(messages)} messages exceed max_chat_messages={state.max_chat_messages}",
                       param="messages")
    try:
        conversation, images = chat_images([_message_dict(m) for m in messages], state.allowed_local_media_path,
                                           state.image_placeholder, limit=state.limit_mm_per_prompt)
    except InvalidRequestError as exc:
        raise invalid_request(exc) from None
    state.check_prompt_chars("messages", sum(len(str(m.get("content", ""))) for m in conversation))
    if continue_final_message and conversation[-1].get("role") != "assistant":
        raise APIError(400, "continue_final_message needs the last message to be from the assistant",
                       param="continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in RESERVED_TEMPLATE_KWARGS:
        if reserved in kwargs:
            raise APIError(400, f"chat_template_kwargs: {reserved!r} cannot be set here",
                           param="chat_template_kwargs")
    def render(conv: list[dict[str, Any]]) -> str:
        try:
            text = tok.apply_chat_template(conv, tokenize=False, chat_template=template,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tools=tools, **kwargs)
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise APIError(400, f"messages: the chat template failed: {type(exc).__name__}: {exc}",
                           param="messages") from None
        if not isinstance(text, str):
            raise APIError(500, "the chat template did not render to a string")
        entry_times.mark("templated")
        return text

    if state.split_special_tokens_in_content:
        text, ids = tokenize_with_plain_content(tok, render, conversation, add_special_tokens)
    else:
        text = render(conversation)
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
    entry_times.mark("tokenized")
    return text, ids, images


def _constrained_calls(kw: dict[str, Any], req: ChatCompletionRequest, choice: ToolChoice,
                       tools: list[dict[str, Any]] | None) -> None:
    """Add the structured output that makes ``required``/named answer with valid calls."""
    schema = tool_choice_schema(tools or [], choice, req.parallel_tool_calls)
    if schema is None:
        return
    what = "tool_choice 'required'" if choice.mode == "required" else "a named tool_choice"
    if kw.get("structured_outputs") is not None:
        raise APIError(400, f"{what} cannot be combined with another structured output "
                            "(response_format, guided_*, structured_outputs)", param="tool_choice")
    kw["structured_outputs"] = jaxserve.StructuredOutputsParams(json=schema)


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"

    def __init__(self, state: ServerState, parsers: ChatParsers | None = None):
        super().__init__(state)
        # Without explicit settings, the split follows the engine's reasoning parser, after whose
        # end its structured outputs start.
        self.parsers = parsers or ChatParsers(reasoning_parser=state.engine.config.reasoning_parser)

    def tool_choice(self, req: ChatCompletionRequest, tools: list[dict] | None = None) -> ToolChoice:
        """The request's tool choice, resolved against its tools (``tools``: already as dicts)."""
        try:
            return resolve_tool_choice(tool_dicts(req.tools) if tools is None else tools, req.tool_choice,
                                       auto_enabled=self.parsers.auto_tool_choice)
        except InvalidRequestError as exc:
            raise invalid_request(exc) from None

    def choice_parsers(self, req: ChatCompletionRequest, n: int) -> list[ChoiceParser]:
        """A fresh output parser for each of ``n`` choices, the tool choice resolved once."""
        choice = self.tool_choice(req)
        return [self.parsers.new_choice_parser(choice) for _ in range(n)]

    def prepare(self, req: ChatCompletionRequest) -> tuple[list[Any], SamplingParams]:
        state = self.state
        state.check_model(req.model)
        state.check_unsupported(req.unsupported())
        tools = tool_dicts(req.tools)
        choice = self.tool_choice(req, tools)
        text, ids, images = render_chat(state, req.messages, add_generation_prompt=req.add_generation_prompt,
                                continue_final_message=req.continue_final_message,
                                add_special_tokens=req.add_special_tokens,
                                chat_template_kwargs=req.chat_template_kwargs, tools=tools)
        keep = state.truncation(req.truncate_prompt_tokens)
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
            text = state.tokenizer.decode(ids)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        kw = req.sampling_kwargs()
        _constrained_calls(kw, req, choice, tools)
        params = make_sampling_params(dict(kw, max_tokens=req.effective_max_tokens(), logprobs=logprobs))
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return [prompt], params

    def response_body(self, req: ChatCompletionRequest, outputs: list[RequestOutput],
                      ids: ResponseIds) -> ChatCompletionResponse:
        ro = outputs[0]
        top_k = req.top_logprobs or 0
        choices = []
        for out, parser in zip(ro.outputs, self.choice_parsers(req, len(ro.outputs))):
            message = _message(parser, out.text)
            choices.append(ChatCompletionResponseChoice(
                index=out.index, message=message,
                logprobs=chat_logprobs(out, self._tokens(req), top_k) if req.logprobs else None,
                finish_reason=finish_reason(out.finish_reason, parser.called), stop_reason=out.stop_reason))
        choices.sort(key=lambda c: c.index)
        return ChatCompletionResponse(id=ids.id, created=ids.created, model=ids.model, choices=choices,
                                      usage=usage(len(ro.prompt_token_ids), sum(len(o.token_ids) for o in ro.outputs)))

    async def stream_chunks(self, req: ChatCompletionRequest, generations: Generations, ids: ResponseIds,
                            stream_usage: StreamUsage) -> AsyncGenerator[ChatCompletionStreamResponse, None]:
        top_k = req.top_logprobs or 0
        tokens = self._tokens(req)
        prompt_tokens = 0
        generated = [0] * req.n  # tokens so far, per choice
        parsers = self.choice_parsers(req, req.n)

        def chunk(choices, usage_info=None) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(id=ids.id, created=ids.created, model=ids.model,
                                                choices=choices, usage=usage_info)

        def so_far(index: int):
            return usage(prompt_tokens, generated[index]) if stream_usage.continuous else None

        async for _, ro in generations:
            if not prompt_tokens:
                # the role chunks wait for the first output, which tells the prompt's length
                prompt_tokens = len(ro.prompt_token_ids)
                for i in range(req.n):
                    yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))],
                                so_far(i))
            for out in ro.outputs:
                generated[out.index] += len(out.token_ids)
                lp = chat_logprobs(out, tokens, top_k) if req.logprobs and out.logprobs else None
                if not out.text and not out.token_ids and out.finish_reason is None:
                    continue
                parser = parsers[out.index]
                parsed = parser.feed(out.text)
                if out.finish_reason is not None:
                    parsed += parser.finish()
                delta = _delta(parsed)
                if delta == DeltaMessage() and out.finish_reason is None:
                    # A step whose text is held back (a partial character, a stop string, a tag)
                    # still sends an empty delta, so chunk timing follows token timing.
                    delta = DeltaMessage(content="")
                yield chunk([ChatCompletionStreamChoice(index=out.index, delta=delta, logprobs=lp,
                                                        finish_reason=finish_reason(out.finish_reason,
                                                                                    parser.called),
                                                        stop_reason=out.stop_reason)], so_far(out.index))
        if stream_usage.final:
            yield chunk([], usage(prompt_tokens, sum(generated)))


def _message(parser: ChoiceParser, text: str) -> ChatResponseMessage:
    """The non-streamed message of one choice; without parsers its content is the text as is."""
    if not parser.active:
        return ChatResponseMessage(content=text)
    reasoning, content, calls = merged(parser.feed(text) + parser.finish())
    return ChatResponseMessage(
        content=content, reasoning_content=reasoning, reasoning=reasoning,
        tool_calls=[ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls])


def _delta(parsed: ChoiceDelta) -> DeltaMessage:
    calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                           function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.tool_calls]
    return DeltaMessage(content=parsed.content or None, reasoning_content=parsed.reasoning or None,
                        reasoning=parsed.reasoning or None, tool_calls=calls or None)
