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
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxserve import ConfigError, EngineConfig, envs

from .frontend_args import FrontendArgs

if TYPE_CHECKING:
    from jaxserve.engine.protocol import EngineClient

logger = logging.getLogger("jaxserve.server")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    FrontendArgs.add_cli_args(parser)


def chat_parsers(frontend: FrontendArgs, reasoning_parser: str | None):
    """The parser flags as ``ChatParsers``, checked: an unknown name is a start-up error.
    ``--reasoning-parser`` is the engine's flag (``EngineConfig.reasoning_parser``): the engine
    reads it for structured outputs, the server for the reasoning split."""
    from .chat_output import ChatParsers

    parsers = ChatParsers(enable_auto_tool_choice=frontend.enable_auto_tool_choice,
                          tool_call_parser=frontend.tool_call_parser, reasoning_parser=reasoning_parser)
    try:
        parsers.check()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return parsers


def load_chat_template(value: str | None) -> str | None:
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


def run_serve(args: argparse.Namespace, started: float | None = None) -> int:
    """Serve until interrupted; ``started`` (``time.monotonic()``) is when the command began."""
    started = time.monotonic() if started is None else started
    frontend = FrontendArgs.from_cli_args(args)
    try:
        chat_template = load_chat_template(frontend.chat_template)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    # The parser names first: their error names the flags (--reasoning-parser) as the user typed them.
    parsers = chat_parsers(frontend, args.reasoning_parser)
    config = EngineConfig.from_cli_args(args, model=args.model)
    api_key = frontend.api_key or envs.api_key()
    if config.is_multi_node and config.node_rank > 0:
        return run_headless_node(config)
    sock = bind_socket(frontend.host, frontend.port)
    try:
        _serve(frontend, config, sock, chat_template, api_key, parsers, started)
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


def _serve(args: FrontendArgs, config: EngineConfig, sock: socket.socket, chat_template: str | None,
           api_key: str | None, parsers, started: float) -> None:
    import uvicorn

    from jaxserve import AsyncLLM, DPAsyncLLM, pooling_task_of, with_startup_lora_slots

    from .app import build_app
    from .gc_heap import freeze_startup_heap
    from .header_timeout import header_timeout_protocol
    from .lora import parse_lora_modules

    task = pooling_task_of(config)
    if task is not None:
        _serve_pooling(args, config, task, sock, api_key, started)
        return
    # The LM-head / embedding LoRA slots a startup adapter needs are allocated with the engine.
    config = with_startup_lora_slots(config, parse_lora_modules(args.lora_modules, ""))
    engine_class = DPAsyncLLM if config.data_parallel_size > 1 else AsyncLLM
    engine: EngineClient = engine_class.from_config(config, served_model_name=args.served_model_name,
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
                        enable_debug_endpoints=args.enable_debug_endpoints, lora_modules=args.lora_modules)
        uv_config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_keep_alive=args.timeout_keep_alive,
                                   lifespan="off", http=header_timeout_protocol(args.request_header_timeout))
        server = _make_server(uv_config, app.state.jaxserve.model_name, started, stop_engine)
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        stop_engine()


def _serve_pooling(args, config, task: str, sock: socket.socket, api_key: str | None, started: float) -> None:
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
