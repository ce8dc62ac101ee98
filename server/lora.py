"""LoRA adapters over HTTP, as vLLM serves them: ``--lora-modules`` at start, a request's ``model``
naming an adapter, ``/v1/models`` listing each adapter with its parent, and
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` only when the environment sets
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (vLLM's switch, read once when the app is built)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from jaxserve import ConfigError, InvalidRequestError, LoRARequest

from .errors import APIError
from .openapi import error_responses

logger = logging.getLogger("jaxserve.server")
RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


def parse_lora_modules(specs: list[str] | None, base_model_name: str) -> list[LoRARequest]:
    """``--lora-modules`` values: ``name=path`` or vLLM's JSON form; ids from 1 in order."""
    out: list[LoRARequest] = []
    for spec in specs or []:
        if spec.lstrip().startswith("{"):
            try:
                d = json.loads(spec)
                name, path, parent = d["name"], d["path"], d.get("base_model_name")
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"--lora-modules: {spec!r} is not JSON with 'name' and 'path' ({exc})") from None
        else:
            name, sep, path = spec.partition("=")
            parent = None
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules: {spec!r} is neither name=path nor JSON")
        if any(r.lora_name == name for r in out) or name == base_model_name:
            raise ConfigError(f"--lora-modules: the name {name!r} is given twice")
        out.append(LoRARequest(name, len(out) + 1, path, base_model_name=parent or base_model_name))
    return out


class ServedLoRAs:
    """The adapters a request may name, by name."""

    def __init__(self, modules: list[LoRARequest]):
        self.by_name = {r.lora_name: r for r in modules}
        self._next_id = len(modules) + 1

    def new_request(self, name: str, path: str, parent: str) -> LoRARequest:
        request = LoRARequest(name, self._next_id, path, base_model_name=parent)
        self._next_id += 1
        return request


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool = False  # vLLM's: replace an adapter of the same name (new weights, new KV)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str | None = None
    lora_int_id: int | None = None


def add_lora_endpoints(app: FastAPI, state: Any) -> None:
    """The runtime routes, when the switch is on; ``state``: the app's ``ServerState`` (which
    imports this module's ``ServedLoRAs``)."""
    if not runtime_updates_allowed():
        return
    logger.warning("%s is set: LoRA adapters can be loaded and unloaded at run time", RUNTIME_UPDATES_ENV)

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
              responses={200: {"content": {"text/plain": {}}}, **error_responses(400)})
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        loras = state.require_loras()
        if not body.lora_name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        if body.lora_name in loras.by_name and not body.load_inplace:
            raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
        if body.lora_name == state.model_name:
            raise APIError(400, f"'{body.lora_name}' is the base model's name", param="lora_name")
        request = loras.new_request(body.lora_name, body.lora_path, state.model_name)
        try:  # read and checked now: a bad folder fails here, not on the first request
            await state.off_loop(state.engine.add_lora, request)
        except InvalidRequestError as exc:
            raise APIError(400, exc.reason, param="lora_path") from None
        loras.by_name[body.lora_name] = request
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
              responses={200: {"content": {"text/plain": {}}}, **error_responses(400, 404)})
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        loras = state.require_loras()
        if not body.lora_name and body.lora_int_id is None:
            raise APIError(400, "Either 'lora_name' or 'lora_int_id' must be provided.", param="lora_name")
        name = body.lora_name or next((n for n, r in loras.by_name.items() if r.lora_int_id == body.lora_int_id), "")
        if name not in loras.by_name:
            raise APIError(404, f"The lora adapter '{body.lora_name or body.lora_int_id}' cannot be found.",
                           param="lora_name", code="not_found")
        del loras.by_name[name]
        state.engine.remove_lora(name)  # running requests finish with it; new ones cannot name it
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
