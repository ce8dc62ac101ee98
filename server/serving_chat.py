"""/v1/chat/completions: messages rendered by the chat template into one prompt, ``n`` samples.

A stream opens with one ``{"role": "assistant"}`` delta per choice, then content deltas.
``render_chat`` is also what /tokenize uses for messages.
"""

from __future__ import annotations

from typing import Any, AsyncGenerator, Optional

from jaxserve import RequestOutput, SamplingParams

from .errors import APIError
from .generation import Generations
from .logprobs import TokenText, chat_logprobs
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
)
from .serving_engine import OpenAIServing, ResponseIds, StreamUsage, make_sampling_params, usage
from .state import ServerState

# Arguments the server passes to the template itself; a request may not override them.
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tokenize", "chat_template", "add_generation_prompt",
                            "continue_final_message", "return_dict", "tools", "documents")


def _message_dict(msg: ChatMessage) -> dict[str, Any]:
    """The message as the template sees it: text parts joined by newlines, absent assistant
    content as ``""``."""
    d = msg.model_dump(exclude_none=True)
    content = msg.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text":
                raise APIError(400, f"messages: content parts of type {part.type!r} are not supported by "
                                    "jaxserve (text only)", param="messages")
            texts.append(part.text or "")
        d["content"] = "\n".join(texts)
    elif content is None:
        if msg.role != "assistant":
            raise APIError(400, f"messages: a {msg.role!r} message needs content", param="messages")
        d["content"] = ""
    return d


def render_chat(state: ServerState, messages: list[ChatMessage], *, add_generation_prompt: bool,
                continue_final_message: bool, add_special_tokens: bool,
                chat_template_kwargs: Optional[dict[str, Any]]) -> tuple[str, list[int]]:
    """Apply the chat template (the server's ``--chat-template``, else the tokenizer's); returns
    (prompt text, token ids)."""
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
    conversation = [_message_dict(m) for m in messages]
    if continue_final_message and conversation[-1].get("role") != "assistant":
        raise APIError(400, "continue_final_message needs the last message to be from the assistant",
                       param="continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in RESERVED_TEMPLATE_KWARGS:
        if reserved in kwargs:
            raise APIError(400, f"chat_template_kwargs: {reserved!r} cannot be set here",
                           param="chat_template_kwargs")
    try:
        text = tok.apply_chat_template(conversation, tokenize=False, chat_template=template,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, **kwargs)
    except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
        raise APIError(400, f"messages: the chat template failed: {type(exc).__name__}: {exc}",
                       param="messages") from None
    if not isinstance(text, str):
        raise APIError(500, "the chat template did not render to a string")
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    return text, ids


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"

    def prepare(self, req: ChatCompletionRequest) -> tuple[list[Any], SamplingParams]:
        state = self.state
        state.check_model(req.model)
        state.check_unsupported(req.unsupported())
        text, ids = render_chat(state, req.messages, add_generation_prompt=req.add_generation_prompt,
                                continue_final_message=req.continue_final_message,
                                add_special_tokens=req.add_special_tokens,
                                chat_template_kwargs=req.chat_template_kwargs)
        keep = state.truncation(req.truncate_prompt_tokens)
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
            text = state.tokenizer.decode(ids)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        kw = req.sampling_kwargs()
        params = make_sampling_params(dict(kw, max_tokens=req.effective_max_tokens(), logprobs=logprobs))
        return [{"prompt": text, "prompt_token_ids": ids}], params

    def _tokens(self, req: ChatCompletionRequest) -> TokenText:
        return self.state.token_id_text if req.return_tokens_as_token_ids else self.state.token_text

    def response_body(self, req: ChatCompletionRequest, outputs: list[RequestOutput],
                      ids: ResponseIds) -> ChatCompletionResponse:
        ro = outputs[0]
        top_k = req.top_logprobs or 0
        choices = [ChatCompletionResponseChoice(
            index=out.index, message=ChatResponseMessage(content=out.text),
            logprobs=chat_logprobs(out, self._tokens(req), top_k) if req.logprobs else None,
            finish_reason=out.finish_reason, stop_reason=out.stop_reason) for out in ro.outputs]
        choices.sort(key=lambda c: c.index)
        return ChatCompletionResponse(id=ids.id, created=ids.created, model=ids.model, choices=choices,
                                      usage=usage(len(ro.prompt_token_ids), sum(len(o.token_ids) for o in ro.outputs)))

    async def stream_chunks(self, req: ChatCompletionRequest, generations: Generations, ids: ResponseIds,
                            stream_usage: StreamUsage) -> AsyncGenerator[ChatCompletionStreamResponse, None]:
        top_k = req.top_logprobs or 0
        tokens = self._tokens(req)
        prompt_tokens = 0
        generated = [0] * req.n  # tokens so far, per choice

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
                # A step whose text is held back (a partial character or stop string) still sends
                # an empty delta, so chunk timing follows token timing.
                delta = DeltaMessage(content=out.text) if out.text or out.finish_reason is None else DeltaMessage()
                yield chunk([ChatCompletionStreamChoice(index=out.index, delta=delta, logprobs=lp,
                                                        finish_reason=out.finish_reason,
                                                        stop_reason=out.stop_reason)], so_far(out.index))
        if stream_usage.final:
            yield chunk([], usage(prompt_tokens, sum(generated)))
