"""The FastAPI application: routes, auth and body-size middleware, OpenAI error bodies.

``build_app(engine, ...)`` takes a running ``AsyncLLM`` (or anything with its interface), so tests
can serve the same app in-process (httpx ``ASGITransport``) or through uvicorn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import jaxserve
from jaxserve import ConfigError

from .chat_output import ChatParsers
from .debug_endpoints import add_debug_endpoints
from .errors import ENGINE_DEAD, APIError, install_handlers
from .ignored_fields import report_ignored_fields
from .limits import DEFAULT_MAX_CHAT_MESSAGES, DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_REQUEST_BODY_TIMEOUT_S
from .lora import ServedLoRAs, add_lora_endpoints, parse_lora_modules
from .middleware import AuthMiddleware, BodyLimitMiddleware
from .openapi import error_responses, install_openapi
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    VersionResponse,
    tool_dicts,
)
from .serving_chat import OpenAIServingChat, render_chat
from .serving_completion import OpenAIServingCompletion
from .state import ServerState, dead_message
from .tokenizer_info import tokenizer_info

if TYPE_CHECKING:
    from jaxserve.engine.protocol import EngineClient

# One server-sent event of a stream: ``data`` is a JSON chunk, an error object, or ``[DONE]``.
SSE_EVENT_SCHEMA = {"type": "object", "required": ["data"],
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def generation_responses(body: type) -> dict:
    """The documented answers of a generation route: its JSON body, or a stream of events."""
    return {200: {"model": body, "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}},
            **error_responses(400, 404, 408, 413, 500, 503)}


def build_app(engine: EngineClient, *, served_model_name: str | None = None, api_key: str | None = None,
              chat_template: str | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              request_body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S,
              max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES, split_special_tokens_in_content: bool = False,
              model_root: str | None = None, enable_tokenizer_info_endpoint: bool = False,
              chat_parsers: ChatParsers | None = None, enable_debug_endpoints: bool = False,
              lora_modules: list[str] | None = None) -> FastAPI:
    state = ServerState(engine, served_model_name=served_model_name, chat_template=chat_template,
                        model_root=model_root, max_chat_messages=max_chat_messages,
                        split_special_tokens_in_content=split_special_tokens_in_content)
    app = FastAPI(title="jaxserve", version=jaxserve.__version__)
    app.state.jaxserve = state
    install_handlers(app)
    install_openapi(app, with_auth=bool(api_key))
    completions = OpenAIServingCompletion(state)
    chat = OpenAIServingChat(state, chat_parsers)

    if lora_modules and not engine.config.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    if engine.config.enable_lora:
        modules = parse_lora_modules(lora_modules, state.model_name)
        for module in modules:  # read and checked now: a bad folder stops the start, naming it
            engine.add_lora(module)
        state.loras = ServedLoRAs(modules)
        add_lora_endpoints(app, state)

    def model_card(model_id: str | None = None) -> ModelCard:
        lora = state.lora_for(model_id)
        if lora is not None:  # an adapter: its folder, and the model it adapts
            return ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or state.model_name,
                             max_model_len=state.max_model_len)
        return ModelCard(id=state.model_name, root=state.model_root, max_model_len=state.max_model_len)

    @app.get("/v1/models", responses={200: {"model": ModelList}})
    async def list_models():
        adapters = list(state.loras.by_name) if state.loras is not None else []
        return ModelList(data=[model_card()] + [model_card(n) for n in adapters]).model_dump()

    @app.get("/v1/models/{model_id:path}", responses={200: {"model": ModelCard}, **error_responses(404)})
    async def retrieve_model(model_id: str):
        state.check_model(model_id)
        return model_card(model_id).model_dump()

    @app.post("/v1/completions", responses=generation_responses(CompletionResponse))
    async def create_completion(body: CompletionRequest, raw_request: Request):
        return await completions(body, raw_request)

    @app.post("/v1/chat/completions", responses=generation_responses(ChatCompletionResponse))
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request):
        return await chat(body, raw_request)

    def tokenize_body(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        state.check_model(body.model)
        tok = state.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer")
        if isinstance(body, TokenizeChatRequest):
            _, ids, _ = render_chat(state, body.messages, add_generation_prompt=body.add_generation_prompt,
                                 continue_final_message=body.continue_final_message,
                                 add_special_tokens=body.add_special_tokens,
                                 chat_template_kwargs=body.chat_template_kwargs, tools=tool_dicts(body.tools))
        else:
            state.check_prompt_chars("prompt", len(body.prompt))
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **error_responses(400, 404, 408, 413)})
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest):
        answer = await state.off_loop(tokenize_body, body)
        return report_ignored_fields(body, JSONResponse(answer.model_dump()))

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **error_responses(400, 404, 408, 413)})
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
        @app.get("/tokenizer_info", responses={200: {"model": TokenizerInfoResponse}, **error_responses(400)})
        async def get_tokenizer_info():
            if state.tokenizer is None:
                raise APIError(400, "this model has no tokenizer")
            return tokenizer_info(state.tokenizer, state.chat_template).model_dump()

    if enable_debug_endpoints:
        add_debug_endpoints(app, engine)

    @app.get("/health", response_class=Response,
             responses={200: {"description": "The engine runs (an empty body)", "content": {}},
                        **error_responses(503)})
    async def health():
        if engine.is_dead:
            raise APIError(503, dead_message(engine), code=ENGINE_DEAD)
        return Response(status_code=200)

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus metrics, text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        return Response(engine.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", responses={200: {"model": VersionResponse}})
    async def version():
        return JSONResponse(VersionResponse(version=jaxserve.__version__).model_dump())

    # Outermost first: auth rejects without reading a body; then the body limit and timeout.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes, timeout_s=request_body_timeout_s)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key)
    return app
