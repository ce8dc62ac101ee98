"""``OpenAIServing``: what /v1/completions and /v1/chat/completions share.

A request is checked and turned into prompts and ``SamplingParams`` by the endpoint
(``prepare``), run as engine generations here, and answered either as one JSON body once every
output is final (``response_body``) or as server-sent events, one per chunk the endpoint builds
(``stream_chunks``), ended by ``data: [DONE]``. The HTTP status is settled before the response
starts: a refused request is an error status, never a stream that opens and fails at once.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve import RequestOutput, RequestOutputKind, SamplingParams

from . import entry_times
from .errors import APIError, bad_request, sse_error
from .generation import ClientDisconnected, Generations, race_disconnect
from .ignored_fields import report_ignored_fields
from .protocol import UsageInfo, random_id
from .state import ServerState

logger = logging.getLogger("jaxserve.server")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"
# Status nginx uses for "client closed request"; nobody reads it, it only shows up in access logs.
CLIENT_CLOSED = 499


@dataclass(frozen=True)
class ResponseIds:
    """What every body and chunk of one response repeats."""

    id: str
    created: int  # unix seconds
    model: str


@dataclass(frozen=True)
class StreamUsage:
    """What a stream reports of its token counts (vLLM's stream_options)."""

    final: bool  # one usage chunk at the end (include_usage)
    continuous: bool  # the usage so far in every chunk (continuous_usage_stats, with include_usage)


def sse_event(chunk: BaseModel, include_usage: bool) -> str:
    """One ``data:`` event; without ``include_usage`` the chunk carries no ``usage`` key at all."""
    body = chunk.model_dump_json() if include_usage else chunk.model_dump_json(exclude={"usage"})
    return f"data: {body}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def make_sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    """``SamplingParams(**kwargs)``; what it refuses is the request's fault (400)."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise bad_request(exc) from None
    except TypeError as exc:  # a wrong type that slipped past the protocol layer
        raise APIError(400, str(exc)) from None


class SSEResponse(StreamingResponse):
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


class OpenAIServing(ABC):
    """Base of the generation endpoints; a subclass supplies the three endpoint-specific steps.

    ``__call__`` always answers with a ``Response``: a JSON body, an SSE stream, or
    ``CLIENT_CLOSED`` when the client left before the answer started (its engine requests are
    aborted then). Errors before that raise ``APIError``; errors mid-stream become an error event.
    """

    # Prefix of the response ids ("cmpl-...", "chatcmpl-...").
    id_prefix: str

    def __init__(self, state: ServerState):
        self.state = state

    def _tokens(self, req):
        """How logprob tokens are written: their text, or ``token_id:N`` when the request asks."""
        return self.state.token_id_text if req.return_tokens_as_token_ids else self.state.token_text

    @abstractmethod
    def prepare(self, req) -> tuple[list[Any], SamplingParams]:
        """Check the request; return the engine prompts and the sampling parameters for all of them."""

    @abstractmethod
    def response_body(self, req, outputs: list[RequestOutput], ids: ResponseIds) -> BaseModel:
        """The non-streaming body from every prompt's final output, in prompt order."""

    @abstractmethod
    def stream_chunks(self, req, generations: Generations, ids: ResponseIds,
                      usage: StreamUsage) -> AsyncGenerator[BaseModel, None]:
        """The chunks of a stream; with ``usage.final`` the usage chunk last, with
        ``usage.continuous`` the usage so far in every chunk too."""

    async def __call__(self, req, raw_request: Request) -> Response:
        return report_ignored_fields(req, await self._respond(req, raw_request))

    async def _respond(self, req, raw_request: Request) -> Response:
        self.state.check_alive()
        times = entry_times.start(raw_request.headers)
        prompts, params = await self.state.off_loop(self.prepare, req)  # templates and tokenizers take time
        lora = self.state.lora_for(req.model)  # None: the base model (the answer names what was asked)
        ids = ResponseIds(random_id(self.id_prefix), int(time.time()),
                          self.state.model_name if lora is None else lora.lora_name)
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        generations = Generations(self.state.engine, prompts, params, ids.id, kind,
                                  priority=req.priority, cache_salt=req.cache_salt, entry_times=times,
                                  lora_request=lora)
        if req.stream:
            return await self._streaming_response(req, raw_request, generations, ids)
        return await self._full_response(req, raw_request, generations, ids)

    async def _full_response(self, req, raw_request: Request, generations: Generations,
                             ids: ResponseIds) -> Response:
        try:
            outputs = await race_disconnect(raw_request.receive, generations.collect())
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            await generations.close()
        return JSONResponse(self.response_body(req, outputs, ids).model_dump())

    async def _streaming_response(self, req, raw_request: Request, generations: Generations,
                                  ids: ResponseIds) -> Response:
        # Every prompt's first output (or error) comes before the 200, so a refusal keeps its status.
        try:
            await race_disconnect(raw_request.receive, generations.start())
        except ClientDisconnected:
            await generations.close()
            return Response(status_code=CLIENT_CLOSED)
        final, continuous = req.include_usage()
        chunks = self.stream_chunks(req, generations, ids, StreamUsage(final, continuous))
        return SSEResponse(_sse_events(chunks, final), generations)


async def _sse_events(chunks: AsyncGenerator[BaseModel, None], include_usage: bool) -> AsyncIterator[str]:
    """Frame ``chunks`` as events; an error mid-stream (an ``APIError``, or a 500 for anything
    else) is sent as an error event, and a stream that runs to its end ends with ``[DONE]``."""
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield sse_event(chunk, include_usage)
        except APIError as exc:
            yield sse_error(exc)
        except Exception as exc:  # a bug building a chunk: this stream ends with an error, the server runs on
            logger.exception("a stream failed")
            yield sse_error(APIError(500, f"internal error while streaming: {type(exc).__name__}"))
    yield SSE_DONE
