"""AsyncLLM: the engine loop in one background thread, requests as async streams of outputs.

The loop thread owns the ``LLMEngine``: it alone touches the scheduler, runner and output
processor. Callers on the asyncio side hand it work through a lock-protected inbox (add, abort)
and receive ``RequestOutput`` deltas on per-request ``asyncio.Queue``s, posted back with
``call_soon_threadsafe``. Aborts (a client gone, a stop string) reach the core between steps and
free the request's blocks in that step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any, AsyncIterator, Optional

from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.exceptions import EngineDeadError, EngineOverloadedError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.processor import PromptType

logger = logging.getLogger("jaxserve")


class AsyncLLM:
    def __init__(self, engine: LLMEngine, *, max_waiting: int = 1024):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_model_len = engine.max_model_len
        self.served_model_name = engine.served_model_name
        self.max_waiting = max_waiting
        self._inbox: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._dead: Optional[BaseException] = None
        self._pending_adds = 0
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, *, served_model_name: Optional[str] = None, max_waiting: int = 1024,
                    show_progress: bool = True) -> "AsyncLLM":
        return cls(LLMEngine(config, show_progress=show_progress, served_model_name=served_model_name),
                   max_waiting=max_waiting)

    # ---- health ------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def errored(self) -> bool:
        return self.is_dead

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop failed: {self._dead!r}")

    def num_waiting(self) -> int:
        return self.engine.core.last_stats.num_waiting_reqs + self._pending_adds

    # ---- requests ------------------------------------------------------------------------------

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: Optional[str] = None,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Raises ValueError (bad input) before the first output,
        EngineOverloadedError when the waiting queue is full, EngineDeadError if the loop failed.
        Leaving the iteration early (client gone, cancellation) aborts the request."""
        self.check_health()
        if self.num_waiting() >= self.max_waiting:
            raise EngineOverloadedError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
        processed = self.engine.process_request(request_id, prompt, sampling_params, priority=priority,
                                                cache_salt=cache_salt)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._submit(("add", processed, output_kind, (loop, queue)))
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
                self._submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def _submit(self, item: tuple) -> None:
        with self._lock:
            if item[0] == "add":
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
                        self._deliver(parent.queue, out)
                else:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, visibly
            logger.exception("engine loop failed")
            self._fail_all(exc)

    def _drain_inbox(self) -> None:
        while True:
            with self._lock:
                if not self._inbox:
                    return
                item = self._inbox.popleft()
                if item[0] == "add":
                    self._pending_adds -= 1
            if item[0] == "add":
                _, processed, kind, queue = item
                try:
                    self.engine.add_processed_request(processed, output_kind=kind, queue=queue)
                except ValueError as exc:
                    self._deliver(queue, exc)
            else:
                self.engine.abort_request([item[1]])

    @staticmethod
    def _deliver(target: Any, item: Any) -> None:
        if target is None:
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more

    def _fail_all(self, exc: BaseException) -> None:
        self._dead = exc
        error = EngineDeadError(f"the engine loop failed: {exc!r}")
        for parent in list(self.engine.output_processor.parents.values()):
            self._deliver(parent.queue, error)
        with self._lock:
            pending = list(self._inbox)
            self._inbox.clear()
            self._pending_adds = 0
        for item in pending:
            if item[0] == "add":
                self._deliver(item[3], error)

    # ---- introspection / lifecycle -----------------------------------------------------------

    def render_metrics(self) -> bytes:
        return self.engine.metrics.render()

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
