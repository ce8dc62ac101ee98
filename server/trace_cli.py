"""``jaxserve trace URL``: save a running server's Chrome/Perfetto trace to a file.

The server must run with ``--enable-debug-endpoints``. The file opens in ui.perfetto.dev or
chrome://tracing: the engine's steps on its host and device tracks, one track per request.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.parse
import urllib.request

from jaxserve import ConfigError


def add_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is ignored)")
    p.add_argument("-o", "--output", default="jaxserve-trace.json", help="file to write (default: jaxserve-trace.json)")
    p.add_argument("--steps", type=int, default=2000, help="newest engine steps to include (default: 2000)")
    p.add_argument("--requests", type=int, default=200, help="newest requests to include (default: 200)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")


def server_root(url: str) -> str:
    """The server's base URL from what a user pastes (with or without /v1 or a trailing slash)."""
    root = url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def get_json(url: str, api_key: str | None = None, timeout: float = 30.0):
    """GET a JSON document; a server that cannot answer is a one-line ``ConfigError``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        hint = " (start the server with --enable-debug-endpoints)" if exc.code == 404 else ""
        raise ConfigError(f"{url}: HTTP {exc.code}{hint}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ConfigError(f"{url}: cannot reach the server: {exc}") from exc


def run_trace_cli(args: argparse.Namespace) -> dict:
    query = urllib.parse.urlencode({"steps": args.steps, "requests": args.requests})
    trace = get_json(f"{server_root(args.url)}/debug/trace?{query}", args.api_key)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    events = trace.get("traceEvents", [])
    return {"output": args.output, "events": len(events),
            "steps": sum(1 for e in events if e.get("ph") == "X" and e.get("name", "").endswith("schedule+prepare")),
            "requests": sum(1 for e in events if e.get("ph") == "X" and e.get("name", "").startswith("request "))}
