"""AsyncLLM: the engine loop in one background thread, requests as async streams of outputs.

The loop thread owns the ``LLMEngine``: it alone touches the scheduler, runner and output
processor. Callers on the asyncio side hand it work through a lock-protected inbox (add, abort)
and receive ``RequestOutput`` deltas on per-request ``asyncio.Queue``s, posted back with
``call_soon_threadsafe``. Aborts (a client gone, a stop string) reach the core between steps and
free the request's blocks in that step. Prompts are tokenized and validated on a small pool of
input threads (``process_request`` touches no engine state), so a long prompt never stalls the
caller's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import AsyncGenerator
from typing import Union

from jaxserve.config import EngineConfig
from jaxserve.core.lora_request import LoRARequest
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.processor import ProcessedRequest, PromptType, check_request_id
from jaxserve.engine.step_records import StepRecord
from jaxserve.engine.timeline import ABORT, CLIENT_DISCONNECT, EntryTimes, RequestTimeline
from jaxserve.exceptions import ConfigError, EngineDeadError, EngineOverloadedError

logger = logging.getLogger("jaxserve")
# The idle loop's longest sleep; it also bounds how late an idle multi-node engine sees a lost host.
IDLE_WAIT_S = 0.5
# Threads that tokenize and validate prompts off the caller's event loop.
DEFAULT_INPUT_WORKERS = 4


@dataclasses.dataclass(frozen=True)
class OutputTarget:
    """Where one request's outputs go: an asyncio queue, fed from the loop thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def deliver(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more


@dataclasses.dataclass(frozen=True)
class AddRequest:
    processed: ProcessedRequest
    output_kind: RequestOutputKind
    target: OutputTarget


@dataclasses.dataclass(frozen=True)
class AbortRequest:
    request_id: str
    cause: str = ABORT  # timeline finish cause: abort or client_disconnect


InboxItem = Union[AddRequest, AbortRequest]


class AsyncLLM:
    def __init__(self, engine: LLMEngine, *, max_waiting: int = 1024, input_workers: int = DEFAULT_INPUT_WORKERS):
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_model_len = engine.max_model_len
        self.served_model_name = engine.served_model_name
        self.model_root = engine.model_root
        self.image_placeholder = engine.image_placeholder
        self.max_waiting = max_waiting
        self._inbox: collections.deque[InboxItem] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._dead: BaseException | None = None
        self._pending_adds = 0
        self._processing = 0  # requests being tokenized (touched on the callers' event loop only)
        # The one pool that tokenizes: prompts here, chat templates and tokenizing for the server.
        self.input_pool = concurrent.futures.ThreadPoolExecutor(input_workers, thread_name_prefix="jaxserve-input")
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, *, served_model_name: str | None = None, max_waiting: int = 1024,
                    show_progress: bool = True) -> AsyncLLM:
        if config.data_parallel_size > 1:  # one engine here would silently ignore the other replicas
            raise ConfigError(f"data_parallel_size={config.data_parallel_size}: use DPAsyncLLM.from_config, "
                              "which starts that many engines")
        return cls(LLMEngine(config, show_progress=show_progress, served_model_name=served_model_name),
                   max_waiting=max_waiting)

    # ---- health ------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine loop failed (the error's message), or None while it runs."""
        return None if self._dead is None else f"{type(self._dead).__name__}: {self._dead}"

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop failed: {self._dead!r}")

    def num_waiting(self) -> int:
        """Requests waiting in the scheduler, in the inbox, or still being tokenized."""
        return self.engine.num_waiting_requests() + self._pending_adds + self._processing

    # ---- requests ------------------------------------------------------------------------------

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                       entry_times: EntryTimes | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream outputs of one request (with the LoRA adapter ``lora_request``, if given).
        Raises InvalidRequestError (bad input) before the first output,
        EngineOverloadedError when the waiting queue is full, EngineDeadError if the loop failed.
        Leaving the iteration early (client gone, cancellation) aborts the request; its timeline
        says ``client_disconnect``. ``entry_times``: what the server measured before the engine."""
        check_request_id(request_id)
        self.check_health()
        if self.num_waiting() >= self.max_waiting:
            raise EngineOverloadedError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
        # Tokenizing a long prompt takes seconds: a worker thread does it, the event loop serves on.
        self._processing += 1  # counted as waiting from now, so the queue limit holds meanwhile
        try:
            processed = await asyncio.get_running_loop().run_in_executor(
                self.input_pool, functools.partial(self.engine.process_request, request_id, prompt,
                                                    sampling_params, priority=priority, cache_salt=cache_salt,
                                                    arrival_time=time.monotonic(), entry_times=entry_times,
                                                    lora_request=lora_request))
        finally:
            self._processing -= 1
        # aclosing: leaving early closes the inner stream now (its abort), not when it is collected.
        async with contextlib.aclosing(self.generate_processed(processed, output_kind)) as stream:
            async for out in stream:
                yield out

    async def generate_processed(self, processed: ProcessedRequest,
                                 output_kind: RequestOutputKind = RequestOutputKind.DELTA
                                 ) -> AsyncGenerator[RequestOutput, None]:
        """``generate`` after tokenizing: hand the request to the loop thread and stream its outputs.
        Leaving the iteration early aborts the request (``client_disconnect``)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._submit(AddRequest(processed, output_kind, OutputTarget(asyncio.get_running_loop(), queue)))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            if not finished:
                self._submit(AbortRequest(processed.request_id, CLIENT_DISCONNECT))

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (``InvalidRequestError`` naming ``lora_request``), as
        vLLM's ``add_lora``; requests naming it later find it loaded. Safe from any thread."""
        self.engine.input_processor.resolve_lora(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        """Forget a loaded adapter's weights (running requests keep theirs to the end)."""
        self.engine.input_processor.forget_lora(lora_name)

    async def abort(self, request_id: str) -> None:
        check_request_id(request_id)
        self._submit(AbortRequest(request_id))

    def _submit(self, item: InboxItem) -> None:
        with self._lock:
            if isinstance(item, AddRequest):
                self._pending_adds += 1
            self._inbox.append(item)
        self._wake.set()

    # ---- the loop thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if self.engine.has_unfinished_requests():
                    for parent, out in self.engine.step():
                        parent.queue.deliver(out)
                else:
                    self._wake.wait(timeout=IDLE_WAIT_S)
                    self._wake.clear()
                    self.engine.check_nodes()  # a lost host fails the engine even while idle
        except BaseException as exc:
            logger.exception("engine loop failed")
            self._fail_all(exc)

    def _drain_inbox(self) -> None:
        while True:
            with self._lock:
                if not self._inbox:
                    return
                item = self._inbox.popleft()
                if isinstance(item, AddRequest):
                    self._pending_adds -= 1
            if isinstance(item, AddRequest):
                try:
                    self.engine.add_processed_request(item.processed, output_kind=item.output_kind,
                                                      queue=item.target)
                except Exception as exc:  # a refusal, or a fault of this request alone
                    if not isinstance(exc, ValueError):
                        logger.exception("request %s failed on admission", item.processed.request_id)
                    item.target.deliver(exc)
            else:
                self.engine.abort_request([item.request_id], item.cause)

    def _fail_all(self, exc: BaseException) -> None:
        self._dead = exc
        self.engine.metrics.record_dead()
        error = EngineDeadError(f"the engine loop failed: {exc!r}")
        for target in self.engine.forget_all_requests():
            target.deliver(error)
        with self._lock:
            pending = list(self._inbox)
            self._inbox.clear()
            self._pending_adds = 0
        for item in pending:
            if isinstance(item, AddRequest):
                item.target.deliver(error)

    # ---- introspection / lifecycle -----------------------------------------------------------

    def render_metrics(self) -> bytes:
        return self.engine.metrics.render()

    # Read from the caller's thread while the loop thread writes: a record or timeline may be
    # one step behind, never torn (the ring and the stores are copied under the GIL or a lock).
    def get_request_timeline(self, request_id: str) -> RequestTimeline | None:
        return self.engine.get_request_timeline(request_id)

    def recent_request_timelines(self, limit: int = 100) -> list[RequestTimeline]:
        return self.engine.recent_request_timelines(limit)

    def get_step_records(self, limit: int | None = None) -> list[StepRecord]:
        return self.engine.get_step_records(limit)

    def build_trace(self, num_steps: int | None = None, num_requests: int = 100) -> dict:
        """A Chrome/Perfetto trace (JSON object) of the newest steps and requests."""
        return self.engine.build_trace(num_steps, num_requests)

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        self.engine.shutdown()
        self.input_pool.shutdown(wait=False, cancel_futures=True)
