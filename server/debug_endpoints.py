"""Debug routes behind ``--enable-debug-endpoints``: what the engine recorded, as JSON.

``GET /debug/requests/{id}``  one request's timeline (the id of its response, or ``<id>-<i>`` for
                              prompt ``i`` of a several-prompt completion), 404 once forgotten
``GET /debug/requests``       the newest finished requests' timelines, then the live ones
``GET /debug/steps``          the newest step records, oldest first
``GET /debug/trace``          a Chrome/Perfetto trace of both (``jaxserve trace URL`` saves it)
``GET /dashboard``            a live page (``dashboard.html``, no build step) that polls
                              ``/metrics`` and the routes above once a second

They expose prompts' shapes and timings (token ids too with ``--record-token-ids``), so they are
off by default, as vLLM's debug routes are.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse, JSONResponse

from .errors import APIError
from .openapi import error_responses

if TYPE_CHECKING:
    from jaxserve.engine.protocol import EngineClient

MAX_ITEMS = 10_000
DASHBOARD_PAGE = Path(__file__).parent / "dashboard.html"


def add_debug_endpoints(app: FastAPI, engine: EngineClient) -> None:
    """Register the routes; ``engine`` is an ``AsyncLLM`` (or has its timeline and step methods)."""

    @app.get("/debug/requests/{request_id:path}", responses=error_responses(404))
    async def request_timeline(request_id: str):
        timeline = engine.get_request_timeline(request_id)
        if timeline is None:
            raise APIError(404, f"no timeline for request {request_id!r} (unknown, or no longer kept: "
                                "see --max-request-timelines)", param="request_id")
        return JSONResponse(timeline.as_dict())

    @app.get("/debug/requests", responses=error_responses(400))
    async def recent_requests(limit: int = Query(100, ge=0, le=MAX_ITEMS)):
        return JSONResponse({"requests": [t.as_dict() for t in engine.recent_request_timelines(limit)]})

    @app.get("/debug/steps", responses=error_responses(400))
    async def recent_steps(last: int = Query(100, ge=0, le=MAX_ITEMS)):
        return JSONResponse({"steps": [r.as_dict() for r in engine.get_step_records(last)]})

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        return HTMLResponse(DASHBOARD_PAGE.read_text(encoding="utf-8"))

    @app.get("/debug/trace", responses=error_responses(400))
    async def trace(steps: int = Query(2000, ge=0, le=MAX_ITEMS), requests: int = Query(200, ge=0, le=MAX_ITEMS)):
        return JSONResponse(engine.build_trace(steps, requests))
