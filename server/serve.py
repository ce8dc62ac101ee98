"""``jaxserve serve [MODEL]``: server flags, engine start-up, uvicorn.

Engine flags (``--max-model-len`` ...) are added by ``jaxserve_server.cli`` from ``EngineConfig``;
this module adds the server's own and runs the server. The listening socket is bound before the
engine starts, so a busy port fails at once, and uvicorn serves on that socket. ``--port 0`` picks a
free port; the URL line printed once the server accepts connections carries the real one. A
setting that cannot work raises ``ConfigError``, which the command reports in one line.

With ``--nnodes N``, rank 0 serves as above and ranks 1 to N - 1 run headless: no HTTP server at
all, only the engine steps rank 0 sends them. Rank 0's ``/health`` speaks for the whole group (503
once any host is lost), and a headless rank exits when rank 0 stops or vanishes (code 0 on rank 0's
shutdown, 1 when it was lost), which is what a process supervisor watches; a second health endpoint
per host would only repeat rank 0's answer.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import socket
import time
from typing import Callable, Optional

from jaxserve import ConfigError, EngineConfig, envs

from .limits import (
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_CHAT_MESSAGES,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
    DEFAULT_REQUEST_HEADER_TIMEOUT_S,
)

logger = logging.getLogger("jaxserve.server")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (default: 8000)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients send and responses carry (default: the model path, "
                        "'SmolLM2-135M-Instruct' for the default demo, 'jaxserve-demo' for the random tiny one)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every route except /health, /metrics "
                        "and /version (default: JAXSERVE_API_KEY from the environment, else no auth)")
    g.add_argument("--chat-template", default=None,
                   help="chat template: a file path or the Jinja template itself (default: the tokenizer's)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: info)")
    g.add_argument("--max-waiting", type=int, default=1024,
                   help="most requests waiting for the engine; beyond that new requests get 503 (default: 1024)")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help=f"largest request body; larger ones get 413 (default: {DEFAULT_MAX_REQUEST_BODY_BYTES})")
    g.add_argument("--request-body-timeout", type=float, default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
                   help="seconds a client has to send its request body; slower ones get 408 and the connection "
                        f"is closed (default: {DEFAULT_REQUEST_BODY_TIMEOUT_S:g})")
    g.add_argument("--request-header-timeout", type=float, default=DEFAULT_REQUEST_HEADER_TIMEOUT_S,
                   help="seconds a client has to send a request's line and headers, from its connection or its "
                        "request's first byte; slower ones get 408 and the connection is closed "
                        f"(default: {DEFAULT_REQUEST_HEADER_TIMEOUT_S:g})")
    g.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                   help=f"seconds an idle keep-alive connection stays open (default: {DEFAULT_KEEP_ALIVE_TIMEOUT_S})")
    g.add_argument("--max-chat-messages", type=int, default=DEFAULT_MAX_CHAT_MESSAGES,
                   help=f"most messages in one chat request (default: {DEFAULT_MAX_CHAT_MESSAGES})")
    g.add_argument("--split-special-tokens-in-content", action="store_true",
                   help="tokenize the text of chat messages with special-token strings (<|im_start|> ...) split "
                        "into ordinary tokens, so that no client text becomes a control token; only the template's "
                        "own text does (default: off, as in vLLM)")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve /tokenizer_info (the tokenizer's configuration and chat template), which "
                        "clients such as lm-eval use to tokenize through the server (default: off, as in vLLM)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide when to call tools (tool_choice 'auto', also the default when a "
                        "request has tools); needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None,
                   help="how tool calls are read from the model's text for tool_choice 'auto': 'hermes' "
                        "(<tool_call>{...}</tool_call>, Qwen2.5/Qwen3/Hermes) (default: none)")
    g.add_argument("--enable-debug-endpoints", action="store_true",
                   help="serve /debug/requests/{id} (a request's timeline), /debug/requests, /debug/steps "
                        "(the newest step records) and /debug/trace (a Chrome/Perfetto trace) (default: off)")


def chat_parsers(args: argparse.Namespace):
    """The parser flags as ``ChatParsers``, checked: an unknown name is a start-up error.
    ``--reasoning-parser`` is the engine's flag (``EngineConfig.reasoning_parser``): the engine
    reads it for structured outputs, the server for the reasoning split."""
    from .chat_output import ChatParsers

    parsers = ChatParsers(enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    try:
        parsers.check()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return parsers


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """A file path, or an inline Jinja template; anything else is a start-up error."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening address, bound now: a busy port is reported before any weight is loaded, and
    uvicorn serves on this very socket (no second bind that could race another process)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no obstacle
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise ConfigError(f"--host/--port: cannot listen on {host}:{port}: {reason}") from exc
    return sock


def run_serve(args: argparse.Namespace, started: Optional[float] = None) -> int:
    """Serve until interrupted; ``started`` (``time.monotonic()``) is when the command began."""
    started = time.monotonic() if started is None else started
    if args.max_waiting < 1:
        raise ConfigError("--max-waiting must be at least 1")
    if args.max_request_body_bytes < 1:
        raise ConfigError("--max-request-body-bytes must be at least 1")
    if not args.request_body_timeout > 0:
        raise ConfigError("--request-body-timeout must be positive")
    if not args.request_header_timeout > 0:
        raise ConfigError("--request-header-timeout must be positive")
    if args.timeout_keep_alive < 1:
        raise ConfigError("--timeout-keep-alive must be at least 1")
    if args.max_chat_messages < 1:
        raise ConfigError("--max-chat-messages must be at least 1")
    try:
        chat_template = load_chat_template(args.chat_template)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    parsers = chat_parsers(args)
    api_key = args.api_key or envs.api_key()
    config = EngineConfig.from_cli_args(args, model=args.model)
    if config.is_multi_node and config.node_rank > 0:
        return run_headless_node(config)
    sock = bind_socket(args.host, args.port)
    try:
        _serve(args, config, sock, chat_template, api_key, parsers, started)
    finally:
        sock.close()
    return 0


def run_headless_node(config: EngineConfig) -> int:
    """A rank > 0: follow rank 0's steps; 0 when rank 0 shut down, 1 when it was lost."""
    from jaxserve import NodeLostError, run_headless

    print(f"jaxserve: node {config.node_rank} of {config.nnodes} starting headless (no API server); "
          f"rank 0 at {config.coordinator_address()}", flush=True)
    try:
        steps = run_headless(config)
    except NodeLostError as exc:
        print(f"jaxserve: node {config.node_rank}: {exc}", flush=True)
        return 1
    print(f"jaxserve: node {config.node_rank}: rank 0 shut down after {steps} steps", flush=True)
    return 0


def _serve(args, config, sock: socket.socket, chat_template: Optional[str], api_key: Optional[str],
           parsers, started: float) -> None:
    import uvicorn

    from jaxserve import AsyncLLM, DPAsyncLLM, pooling_task_of

    from .app import build_app
    from .gc_heap import freeze_startup_heap
    from .header_timeout import header_timeout_protocol

    task = pooling_task_of(config)
    if task is not None:
        _serve_pooling(args, config, task, sock, api_key, started)
        return
    engine_class = DPAsyncLLM if config.data_parallel_size > 1 else AsyncLLM
    engine = engine_class.from_config(config, served_model_name=args.served_model_name,
                                      max_waiting=args.max_waiting, show_progress=True)
    freeze_startup_heap()
    stopped = False

    def stop_engine() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            engine.shutdown()

    try:
        app = build_app(engine, served_model_name=args.served_model_name, api_key=api_key,
                        chat_template=chat_template, max_request_body_bytes=args.max_request_body_bytes,
                        request_body_timeout_s=args.request_body_timeout, max_chat_messages=args.max_chat_messages,
                        split_special_tokens_in_content=args.split_special_tokens_in_content,
                        model_root=engine.model_root,
                        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint, chat_parsers=parsers,
                        enable_debug_endpoints=args.enable_debug_endpoints)
        uv_config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_keep_alive=args.timeout_keep_alive,
                                   lifespan="off", http=header_timeout_protocol(args.request_header_timeout))
        server = _make_server(uv_config, app.state.jaxserve.model_name, started, stop_engine)
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        stop_engine()


def _serve_pooling(args, config, task: str, sock: socket.socket, api_key: Optional[str], started: float) -> None:
    """A pooling model (issue 34): its own app (embeddings, classify, score, rerank), no generating engine."""
    import uvicorn

    from jaxserve import PoolingLLM

    from .middleware import AuthMiddleware
    from .pooling_app import build_pooling_app

    name = args.served_model_name or config.model
    app = build_pooling_app(PoolingLLM(config, task), served_model_name=name)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key)
    uv_config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_keep_alive=args.timeout_keep_alive,
                               lifespan="off")
    asyncio.run(_make_server(uv_config, name, started, lambda: None).serve(sockets=[sock]))


def _make_server(config, model_name: str, started: float, on_shutdown: Callable[[], None]):
    """A uvicorn.Server that announces the URL (with the bound port) once it accepts connections,
    and stops the engine as its own shutdown ends: after a SIGTERM, uvicorn raises the signal
    again once it is done, which ends the process before any ``finally`` of the caller runs (the
    other hosts of a multi-node engine would never hear of it)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            await super().shutdown(sockets=sockets)
            on_shutdown()

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.should_exit or not self.servers:
                return
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            print(f"jaxserve: serving {model_name} at http://{shown}:{port}/v1 "
                  f"(ready {time.monotonic() - started:.1f} s after the command started)", flush=True)

    return Server(config)
