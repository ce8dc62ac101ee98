"""The HTTP app of a pooling model: ``/v1/embeddings``, ``/pooling``, ``/classify``, score and rerank.

Bodies follow vLLM's (OpenAI's for embeddings; Jina/Cohere's for rerank). The pooling model runs
one batch at a time off the event loop; generation routes answer 400, as vLLM's do for a pooler.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jaxserve import InvalidRequestError

from .errors import APIError, install_handlers, invalid_request


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None, required: bool = False) -> Any:
    if name not in body or body[name] is None:
        if required:
            raise APIError(400, f"{name}: required", param=name)
        return default
    value = body[name]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise APIError(400, f"{name}: must be {' or '.join(k.__name__ for k in kinds)}", param=name)
    return value


def _inputs(body: dict, name: str) -> list:
    """A string, a list of strings, token ids, or a list of token-id lists (OpenAI's ``input``)."""
    value = _field(body, name, (str, list), required=True)
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, f"{name}: must not be empty", param=name)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [value]
    for v in value:
        if not (isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(t, int) for t in v))):
            raise APIError(400, f"{name}: each item must be a string or a list of token ids", param=name)
    return value


def build_pooling_app(pooling, *, served_model_name: str | None = None) -> FastAPI:
    app = FastAPI(title="jaxserve")
    install_handlers(app)
    name = served_model_name or "model"
    lock = asyncio.Lock()

    async def run(fn, *args):
        async with lock:
            try:
                return await asyncio.to_thread(fn, *args)
            except InvalidRequestError as e:
                raise invalid_request(e) from None

    async def read(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return body

    def usage(outputs) -> dict:
        n = sum(len(o.prompt_token_ids) for o in outputs)
        return {"prompt_tokens": n, "total_tokens": n}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "jaxserve",
                                            "created": int(time.time()), "root": name}]}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    for route in ("/v1/completions", "/v1/chat/completions"):
        @app.post(route)
        async def refuse_generation():
            raise APIError(400, f"this is a pooling model ({pooling.task}); it does not generate", param="model")

    async def embed(body: dict):
        fmt = _field(body, "encoding_format", (str,), "float")
        if fmt not in ("float", "base64"):
            raise APIError(400, "encoding_format: must be 'float' or 'base64'", param="encoding_format")
        outs = await run(pooling.embed, _inputs(body, "input"), _field(body, "truncate_prompt_tokens", (int,)),
                         _field(body, "dimensions", (int,)))
        data = []
        for i, o in enumerate(outs):
            vec: Any = o.outputs.embedding
            if fmt == "base64":  # OpenAI's: little-endian float32 bytes
                vec = base64.b64encode(np.asarray(vec, "<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": vec})
        return {"object": "list", "model": name, "data": data, "usage": usage(outs)}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return JSONResponse(await embed(await read(request)))

    @app.post("/pooling")
    async def pooling_route(request: Request):
        body = await read(request)
        if pooling.task == "classify":
            return await classify_body(body)
        answer = await embed(body)
        for item in answer["data"]:
            item["object"] = "pooling"
            item["data"] = item.pop("embedding")
        return JSONResponse(answer)

    async def classify_body(body: dict):
        outs = await run(pooling.classify, _inputs(body, "input"), _field(body, "truncate_prompt_tokens", (int,)))
        data = [{"index": i, "label": str(int(np.argmax(o.outputs.probs))), "probs": o.outputs.probs,
                 "num_classes": o.outputs.num_classes} for i, o in enumerate(outs)]
        return JSONResponse({"object": "list", "model": name, "data": data, "usage": usage(outs)})

    @app.post("/classify")
    async def classify(request: Request):
        return await classify_body(await read(request))

    async def score_pairs(query: str, docs: list, truncate: int | None):
        if not docs or not all(isinstance(d, str) for d in docs):
            raise APIError(400, "documents: must be a non-empty list of strings", param="documents")
        return await run(pooling.score, query, docs, truncate)

    async def score(request: Request):
        body = await read(request)
        query = _field(body, "text_1", (str,)) or _field(body, "queries", (str,), required=True)
        docs = _field(body, "text_2", (str, list)) or _field(body, "documents", (str, list), required=True)
        outs = await score_pairs(query, [docs] if isinstance(docs, str) else docs,
                                 _field(body, "truncate_prompt_tokens", (int,)))
        data = [{"index": i, "object": "score", "score": o.outputs.score} for i, o in enumerate(outs)]
        return JSONResponse({"object": "list", "model": name, "data": data, "usage": usage(outs)})

    async def rerank(request: Request):
        body = await read(request)
        query = _field(body, "query", (str,), required=True)
        docs = _field(body, "documents", (list,), required=True)
        outs = await score_pairs(query, docs, _field(body, "truncate_prompt_tokens", (int,)))
        top_n = _field(body, "top_n", (int,), len(docs))
        if top_n < 1:
            raise APIError(400, "top_n: must be >= 1", param="top_n")
        ranked = sorted(range(len(outs)), key=lambda i: -outs[i].outputs.score)[:top_n]
        with_docs = _field(body, "return_documents", (bool,), True)
        results = [{"index": i, "relevance_score": outs[i].outputs.score,
                    **({"document": {"text": docs[i]}} if with_docs else {})} for i in ranked]
        return JSONResponse({"id": f"rerank-{time.monotonic_ns()}", "model": name, "results": results,
                             "usage": {"total_tokens": usage(outs)["total_tokens"]}})

    for route in ("/score", "/v1/score"):
        app.post(route)(score)
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(route)(rerank)
    return app
