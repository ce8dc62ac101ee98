"""/v1/completions and /v1/chat/completions: request -> SamplingParams -> engine -> response/SSE."""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any, AsyncIterator, Optional

from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from jaxserve_server.errors import APIError, bad_request_from_value_error, sse_error
from jaxserve_server.generation import ClientDisconnected, Generations, race_disconnect
from jaxserve_server.protocol import (MAX_PROMPTS, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatCompletionResponseChoice, ChatCompletionStreamChoice,
                                     ChatCompletionStreamResponse, ChatLogProbs, ChatLogProbToken,
                                     ChatLogProbTop, ChatMessage, ChatResponseMessage, CompletionLogProbs,
                                     CompletionRequest, CompletionResponse, CompletionResponseChoice,
                                     CompletionStreamResponse, DeltaMessage, UsageInfo, random_id)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Status nginx uses for "client closed request"; nobody reads it, it only shows up in access logs.
CLIENT_CLOSED = 499


def _sse(model, include_usage: bool = True) -> str:
    body = model.model_dump_json() if include_usage else model.model_dump_json(exclude={"usage"})
    return f"data: {body}\n\n"


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its engine streams, however the stream ends
    (finished, client gone, cancelled, never iterated)."""

    def __init__(self, content: AsyncIterator[str], generations: Generations):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._generations = generations

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._generations.close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


# ---- token strings and bytes for logprobs ----------------------------------------------------


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet (bytes <-> printable code points)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class TokenText:
    """Display strings and raw bytes of token ids (cached per id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = False
        try:
            decoder = tokenizer.backend_tokenizer.decoder
            self.byte_level = type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)
        except Exception:  # noqa: BLE001 - slow tokenizers: fall back to utf-8 of the text
            pass
        self._text = lru_cache(maxsize=65536)(self._text_uncached)
        self._bytes = lru_cache(maxsize=65536)(self._bytes_uncached)

    def text(self, token_id: int, decoded: Optional[str] = None) -> str:
        if decoded is not None:
            return decoded
        return self._text(token_id)

    def _text_uncached(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def bytes(self, token_id: int) -> list[int]:
        return self._bytes(token_id)

    def _bytes_uncached(self, token_id: int) -> list[int]:
        if self.tokenizer is None:
            return list(f"token_id:{token_id}".encode())
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            if isinstance(piece, str) and piece and all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(self._text(token_id).encode("utf-8"))


# ---- shared helpers ----------------------------------------------------------------------------


def make_sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise bad_request_from_value_error(exc) from None
    except TypeError as exc:  # a wrong type that slipped past the protocol layer
        raise APIError(400, str(exc)) from None


def _append_position(lp: CompletionLogProbs, text: str, token_id: int, entry, tokens: TokenText,
                     offset: int) -> int:
    """One position of a completions ``logprobs`` object (no ``entry``: no logprobs there); returns
    the next text offset."""
    chosen = entry.get(token_id) if entry is not None else None
    lp.tokens.append(text)
    lp.token_logprobs.append(None if chosen is None else max(chosen.logprob, -9999.0))
    top: dict[str, float] | None = None
    if entry is not None:
        top = {}
        for tid, l in sorted(entry.items(), key=lambda kv: kv[1].rank or 0):
            # Distinct ids can share a display string (partial UTF-8 shows as U+FFFD): keep the likelier.
            top.setdefault(tokens.text(tid, l.decoded_token), max(l.logprob, -9999.0))
    lp.top_logprobs.append(top)
    lp.text_offset.append(offset)
    return offset + len(text)


def _completion_logprobs(out: CompletionOutput, tokens: TokenText, start_offset: int) -> CompletionLogProbs:
    lp = CompletionLogProbs()
    offset = start_offset
    for token_id, entry in zip(out.token_ids, out.logprobs or []):
        chosen = entry.get(token_id)
        text = tokens.text(token_id, chosen.decoded_token if chosen else None)
        offset = _append_position(lp, text, token_id, entry, tokens, offset)
    return lp


def _prepend_prompt_logprobs(ro: RequestOutput, tokens: TokenText, generated: CompletionLogProbs) -> CompletionLogProbs:
    """``echo`` with ``logprobs``: the prompt's tokens come first, the first one without a logprob
    (nothing precedes it), as the OpenAI completions API reports them."""
    lp = CompletionLogProbs()
    offset = 0
    plp = ro.prompt_logprobs or []  # [None, {token: Logprob}, ...]
    for i, token_id in enumerate(ro.prompt_token_ids):
        entry = (plp[i] if i < len(plp) else None) or None  # the first position's None, or {}: no logprobs
        offset = _append_position(lp, tokens.text(token_id), token_id, entry, tokens, offset)
    lp.tokens += generated.tokens
    lp.token_logprobs += generated.token_logprobs
    lp.top_logprobs += generated.top_logprobs
    lp.text_offset += generated.text_offset
    return lp


def _chat_logprobs(out: CompletionOutput, tokens: TokenText, top_k: int) -> ChatLogProbs:
    content = []
    for token_id, entry in zip(out.token_ids, out.logprobs or []):
        chosen = entry.get(token_id)
        top = sorted((kv for kv in entry.items() if kv[1].rank is not None and kv[1].rank <= top_k),
                     key=lambda kv: kv[1].rank)[:top_k]
        content.append(ChatLogProbToken(
            token=tokens.text(token_id, chosen.decoded_token if chosen else None),
            logprob=max(chosen.logprob, -9999.0) if chosen else -9999.0,
            bytes=tokens.bytes(token_id),
            top_logprobs=[ChatLogProbTop(token=tokens.text(tid, l.decoded_token), logprob=max(l.logprob, -9999.0),
                                         bytes=tokens.bytes(tid)) for tid, l in top]))
    return ChatLogProbs(content=content)


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


async def _run_non_streaming(raw_request, generations: Generations) -> Optional[list[RequestOutput]]:
    """All final outputs, or None if the client left (the engine requests are aborted then)."""
    try:
        return await race_disconnect(raw_request.receive, generations.collect())
    except ClientDisconnected:
        return None
    finally:
        await generations.close()


async def _start(raw_request, generations: Generations) -> bool:
    """Prime a streaming request; False if the client left meanwhile. Raises APIError on bad input."""
    try:
        await race_disconnect(raw_request.receive, generations.start())
        return True
    except ClientDisconnected:
        await generations.close()
        return False


# ---- /v1/completions -----------------------------------------------------------------------------


class CompletionHandler:
    def __init__(self, state):
        self.state = state

    def _prepare(self, req: CompletionRequest) -> tuple[list[Any], SamplingParams]:
        state = self.state
        state.check_model(req.model)
        state.check_unsupported(req.unsupported())
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}",
                           param="prompt")
        engine_prompts = []
        for p in prompts:
            if isinstance(p, str):
                if state.tokenizer is None:
                    raise APIError(400, "prompt: this model has no tokenizer; send token ids", param="prompt")
                if not req.add_special_tokens:
                    p = {"prompt": p, "prompt_token_ids": state.tokenizer.encode(p, add_special_tokens=False)}
            engine_prompts.append(p)
        kw = req.sampling_kwargs()
        if req.echo and req.logprobs is not None:
            kw["prompt_logprobs"] = req.logprobs  # the echoed prompt gets its logprobs too
        params = make_sampling_params(dict(kw, max_tokens=req.max_tokens, logprobs=req.logprobs))
        return engine_prompts, params

    async def __call__(self, req: CompletionRequest, raw_request) -> Response:
        state = self.state
        state.check_alive()
        prompts, params = self._prepare(req)
        started = await _generate(self, state, raw_request, req, prompts, params, "cmpl")
        if isinstance(started, Response):
            return started
        outputs, request_id, created = started
        return JSONResponse(self._response(req, outputs, request_id, created).model_dump())

    def _echo_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.state.tokenizer
        return "" if tok is None else tok.decode(out.prompt_token_ids)

    def _response(self, req: CompletionRequest, outputs: list[RequestOutput], request_id: str,
                  created: int) -> CompletionResponse:
        choices = []
        prompt_tokens = completion_tokens = 0
        n = req.n
        for p_index, ro in enumerate(outputs):
            prompt_tokens += len(ro.prompt_token_ids)
            prefix = self._echo_text(ro) if req.echo else ""
            for out in ro.outputs:
                completion_tokens += len(out.token_ids)
                lp = None
                if req.logprobs is not None:
                    lp = _completion_logprobs(out, self.state.token_text, len(prefix))
                    if req.echo:
                        lp = _prepend_prompt_logprobs(ro, self.state.token_text, lp)
                choices.append(CompletionResponseChoice(
                    index=p_index * n + out.index, text=prefix + out.text, logprobs=lp,
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=request_id, created=created, model=self.state.model_name,
                                  choices=choices, usage=_usage(prompt_tokens, completion_tokens))

    async def _stream(self, req: CompletionRequest, generations: Generations, request_id: str, created: int,
                      include_usage: bool) -> AsyncIterator[str]:
        model = self.state.model_name
        n = req.n
        prompt_tokens = 0
        seen_prompts: set[int] = set()
        completion_tokens = 0
        offsets: dict[int, int] = {}  # choice index -> text_offset of its next token
        try:
            async for p_index, ro in generations:
                if p_index not in seen_prompts:
                    seen_prompts.add(p_index)
                    prompt_tokens += len(ro.prompt_token_ids)
                for out in ro.outputs:
                    index = p_index * n + out.index
                    completion_tokens += len(out.token_ids)
                    text = out.text
                    first_chunk = index not in offsets
                    if first_chunk:
                        prefix = self._echo_text(ro) if req.echo else ""
                        text = prefix + text
                        offsets[index] = len(prefix)
                    lp = None
                    if req.logprobs is not None and out.logprobs:
                        lp = _completion_logprobs(out, self.state.token_text, offsets[index])
                        offsets[index] = lp.text_offset[-1] + len(lp.tokens[-1])
                        if req.echo and first_chunk:
                            lp = _prepend_prompt_logprobs(ro, self.state.token_text, lp)
                    if not text and not out.token_ids and out.finish_reason is None:
                        continue  # one chunk per step with new tokens, even while their text is held back
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=model,
                        choices=[CompletionResponseChoice(index=index, text=text, logprobs=lp,
                                                          finish_reason=out.finish_reason,
                                                          stop_reason=out.stop_reason)])
                    yield _sse(chunk, include_usage)
            if include_usage:
                yield _sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                    usage=_usage(prompt_tokens, completion_tokens)))
        except APIError as exc:
            yield sse_error(exc)
        yield "data: [DONE]\n\n"


# ---- /v1/chat/completions ------------------------------------------------------------------------


def _message_dict(msg: ChatMessage) -> dict[str, Any]:
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


def render_chat(state, messages: list[ChatMessage], *, add_generation_prompt: bool,
                continue_final_message: bool, add_special_tokens: bool,
                chat_template_kwargs: Optional[dict[str, Any]]) -> tuple[str, list[int]]:
    """Apply the chat template; returns (prompt text, token ids)."""
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
    for reserved in ("conversation", "messages", "tokenize", "chat_template", "add_generation_prompt",
                     "continue_final_message", "return_dict", "tools", "documents"):
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


class ChatHandler:
    def __init__(self, state):
        self.state = state

    def _prepare(self, req: ChatCompletionRequest) -> tuple[dict, SamplingParams]:
        state = self.state
        state.check_model(req.model)
        state.check_unsupported(req.unsupported())
        text, ids = render_chat(state, req.messages, add_generation_prompt=req.add_generation_prompt,
                                continue_final_message=req.continue_final_message,
                                add_special_tokens=req.add_special_tokens,
                                chat_template_kwargs=req.chat_template_kwargs)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        kw = req.sampling_kwargs()
        params = make_sampling_params(dict(kw, max_tokens=req.effective_max_tokens(), logprobs=logprobs))
        return {"prompt": text, "prompt_token_ids": ids}, params

    async def __call__(self, req: ChatCompletionRequest, raw_request) -> Response:
        state = self.state
        state.check_alive()
        prompt, params = self._prepare(req)
        started = await _generate(self, state, raw_request, req, [prompt], params, "chatcmpl")
        if isinstance(started, Response):
            return started
        outputs, request_id, created = started
        ro = outputs[0]
        top_k = req.top_logprobs or 0
        choices = [ChatCompletionResponseChoice(
            index=out.index, message=ChatResponseMessage(content=out.text),
            logprobs=_chat_logprobs(out, state.token_text, top_k) if req.logprobs else None,
            finish_reason=out.finish_reason, stop_reason=out.stop_reason) for out in ro.outputs]
        choices.sort(key=lambda c: c.index)
        usage = _usage(len(ro.prompt_token_ids), sum(len(o.token_ids) for o in ro.outputs))
        return JSONResponse(ChatCompletionResponse(id=request_id, created=created, model=state.model_name,
                                                   choices=choices, usage=usage).model_dump())

    async def _stream(self, req: ChatCompletionRequest, generations: Generations, request_id: str,
                      created: int, include_usage: bool) -> AsyncIterator[str]:
        model = self.state.model_name
        top_k = req.top_logprobs or 0

        def chunk(choices, usage=None) -> str:
            return _sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                     choices=choices, usage=usage), include_usage)

        prompt_tokens = 0
        completion_tokens = 0
        try:
            for i in range(req.n):
                yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            async for _, ro in generations:
                prompt_tokens = len(ro.prompt_token_ids)
                for out in ro.outputs:
                    completion_tokens += len(out.token_ids)
                    lp = _chat_logprobs(out, self.state.token_text, top_k) if req.logprobs and out.logprobs else None
                    if not out.text and not out.token_ids and out.finish_reason is None:
                        continue
                    # A step whose text is held back (a partial character or stop string) still sends
                    # an empty delta, so chunk timing follows token timing.
                    delta = DeltaMessage(content=out.text) if out.text or out.finish_reason is None else DeltaMessage()
                    yield chunk([ChatCompletionStreamChoice(index=out.index, delta=delta, logprobs=lp,
                                                            finish_reason=out.finish_reason,
                                                            stop_reason=out.stop_reason)])
            if include_usage:
                yield chunk([], usage=_usage(prompt_tokens, completion_tokens))
        except APIError as exc:
            yield sse_error(exc)
        yield "data: [DONE]\n\n"


async def _generate(handler, state, raw_request, req, prompts, params, id_prefix: str):
    """Start the generations of one API request (completions or chat).

    Streaming: returns the SSE response at once. Otherwise waits for every output and returns
    ``(outputs, request_id, created)``; a client gone meanwhile gets CLIENT_CLOSED (its requests
    were aborted).
    """
    request_id = random_id(id_prefix)
    created = int(time.time())
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    generations = Generations(state.engine, prompts, params, request_id, kind,
                              priority=req.priority, cache_salt=req.cache_salt)
    if req.stream:
        if not await _start(raw_request, generations):
            return Response(status_code=CLIENT_CLOSED)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _SSEResponse(handler._stream(req, generations, request_id, created, include_usage), generations)
    outputs = await _run_non_streaming(raw_request, generations)
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED)
    return outputs, request_id, created
