"""Bridge from HTTP handlers to ``AsyncLLM.generate``.

``Generations`` runs one engine request per prompt and merges their outputs into one stream of
``(prompt_index, RequestOutput)``. ``start()`` waits until every prompt has produced its first
output (or failed), because ``generate`` reports bad input, a full queue or a dead engine only
when it is first iterated: the HTTP status must be known before the response starts. Closing
(``close()``, a cancelled handler, a disconnect) closes each engine stream, which aborts the
request in the engine and frees its KV blocks.

``race_disconnect`` runs a coroutine against the client's ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from typing import TYPE_CHECKING, Any

from jaxserve import EntryTimes, RequestOutput, RequestOutputKind, SamplingParams

from .errors import APIError, engine_error

if TYPE_CHECKING:
    from jaxserve.engine.protocol import EngineClient

_DONE = object()  # queued by a prompt's pump once its engine stream has ended
# How long wait_for_disconnect sleeps after an unexpected message, so that it never spins.
_RECEIVE_RETRY_S = 0.01


def check_not_failed(out: RequestOutput) -> None:
    """A request that failed in the engine (finish reason "error") is a 500 for its client alone,
    as in vLLM; every other request runs on."""
    if any(o.finish_reason == "error" for o in out.outputs):
        raise APIError(500, f"request {out.request_id} failed inside the engine; other requests are unaffected",
                       code="generation_error")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


class Generations:
    """The engine requests of one API request, one per prompt. Their ids are ``request_id`` for a
    single prompt and ``request_id-<i>`` for several; outputs are ``(prompt_index, output)``."""

    def __init__(self, engine: EngineClient, prompts: Sequence[Any], params: SamplingParams, request_id: str,
                 kind: RequestOutputKind, *, priority: int = 0, cache_salt: str | None = None,
                 entry_times: EntryTimes | None = None, lora_request: Any = None):
        self.request_ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffered: list[tuple[int, Any]] = []
        self._open = len(prompts)
        self._closed = False
        # Passed only when an adapter is asked for: an engine client without LoRA keeps its signature.
        lora = {"lora_request": lora_request} if lora_request is not None else {}
        self._tasks = [
            asyncio.create_task(self._pump(i, engine.generate(p, params, rid, priority=priority,
                                                              cache_salt=cache_salt, output_kind=kind,
                                                              entry_times=entry_times, **lora)))
            for i, (p, rid) in enumerate(zip(prompts, self.request_ids))
        ]

    async def _pump(self, index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((index, out))
            self._queue.put_nowait((index, _DONE))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
            self._queue.put_nowait((index, exc))
        finally:
            await stream.aclose()  # no-op when finished; aborts the request otherwise

    async def start(self) -> None:
        """Wait for every prompt's first output; raise ``APIError`` (and close all) if any failed."""
        seen: set[int] = set()
        try:
            while len(seen) < len(self._tasks):
                index, item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise engine_error(item)
                # A short prompt may finish (its end marker queued) before another's first output.
                if item is not _DONE:
                    check_not_failed(item)
                seen.add(index)
                self._buffered.append((index, item))
        except BaseException:
            await self.close()
            raise

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield outputs in arrival order until every prompt is done; errors raise ``APIError``."""
        while self._open > 0:
            if self._buffered:
                index, item = self._buffered.pop(0)
            else:
                index, item = await self._queue.get()
            if item is _DONE:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                raise engine_error(item)
            check_not_failed(item)
            yield index, item

    async def collect(self) -> list[RequestOutput]:
        """Non-streaming: the last output of every prompt, in prompt order."""
        last: list[RequestOutput | None] = [None] * len(self._tasks)
        async for index, out in self:
            last[index] = out
        return [out for out in last if out is not None]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def wait_for_disconnect(receive) -> None:
    """Return once the client has disconnected (the request body must already be consumed)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(_RECEIVE_RETRY_S)  # not expected after the body


async def race_disconnect(receive, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client disconnects first, cancel it and raise ``ClientDisconnected``."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work_task.cancel()
        watcher.cancel()
        await asyncio.gather(work_task, watcher, return_exceptions=True)
        raise
    if work_task in done:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        return work_task.result()
    work_task.cancel()
    await asyncio.gather(work_task, return_exceptions=True)
    raise ClientDisconnected()
