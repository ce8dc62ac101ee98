"""The FastAPI application: routes, auth and body-size middleware, OpenAI error bodies.

``build_app(engine, ...)`` takes a running ``AsyncLLM`` (or anything with its interface), so tests
can serve the same app in-process (httpx ``ASGITransport``) or through uvicorn.
"""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import jaxserve

from .errors import ENGINE_DEAD, APIError, install_handlers
from .ignored_fields import report_ignored_fields
from .limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from .middleware import AuthMiddleware, BodyLimitMiddleware
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from .serving_chat import OpenAIServingChat, render_chat
from .serving_completion import OpenAIServingCompletion
from .state import ServerState
from .tokenizer_info import tokenizer_info


def build_app(engine, *, served_model_name: Optional[str] = None, api_key: Optional[str] = None,
              chat_template: Optional[str] = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              model_root: Optional[str] = None, enable_tokenizer_info_endpoint: bool = False) -> FastAPI:
    state = ServerState(engine, served_model_name=served_model_name, chat_template=chat_template,
                        model_root=model_root)
    app = FastAPI(title="jaxserve", version=jaxserve.__version__)
    app.state.jaxserve = state
    install_handlers(app)
    completions = OpenAIServingCompletion(state)
    chat = OpenAIServingChat(state)

    def model_card() -> ModelCard:
        return ModelCard(id=state.model_name, root=state.model_root, max_model_len=state.max_model_len)

    @app.get("/v1/models")
    async def list_models():
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        state.check_model(model_id)
        return model_card().model_dump()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request):
        return await completions(body, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request):
        return await chat(body, raw_request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest):
        state.check_model(body.model)
        tok = state.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer")
        if isinstance(body, TokenizeChatRequest):
            _, ids = render_chat(state, body.messages, add_generation_prompt=body.add_generation_prompt,
                                 continue_final_message=body.continue_final_message,
                                 add_special_tokens=body.add_special_tokens,
                                 chat_template_kwargs=body.chat_template_kwargs)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        answer = TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)
        return report_ignored_fields(body, JSONResponse(answer.model_dump()))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                           param="tokens")
        answer = DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))
        return report_ignored_fields(body, JSONResponse(answer.model_dump()))

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info():
            if state.tokenizer is None:
                raise APIError(400, "this model has no tokenizer")
            return tokenizer_info(state.tokenizer, state.chat_template).model_dump()

    @app.get("/health")
    async def health():
        if engine.is_dead:
            raise APIError(503, "the engine is dead (its loop failed)", code=ENGINE_DEAD)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": jaxserve.__version__})

    # Outermost first: auth rejects without reading a body; then the body limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key)
    return app
