"""DPAsyncLLM: ``data_parallel_size`` engine replicas in one process behind ``AsyncLLM``'s interface.

vLLM's data-parallel front end (a load-balancing client over engine cores, fed by a coordinator's
counts) in one process: each replica is a whole ``AsyncLLM`` (scheduler, KV pool, runner on its
own device group, loop thread). Their loop threads step concurrently: a step's device work runs
with the GIL released. This object tokenizes each prompt once, hashes its full blocks, asks the
router which replica takes it (prefix hits, then load, then KV usage: ``router``, through the
``ReplicaSet`` that ``LLM`` uses too) and streams that replica's outputs. It owns the request-id ->
replica map, so an abort reaches the right one and an id is unique across all of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING

from jaxserve.config import EngineConfig
from jaxserve.core.lora_request import LoRARequest
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.async_llm import DEFAULT_INPUT_WORKERS, AsyncLLM
from jaxserve.engine.dp.placement import start_replica_engines
from jaxserve.engine.dp.replica_set import ReplicaSet
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.processor import ProcessedRequest, PromptType, check_request_id
from jaxserve.engine.step_records import StepRecord
from jaxserve.engine.timeline import EntryTimes, RequestTimeline
from jaxserve.exceptions import EngineDeadError, EngineOverloadedError, InvalidRequestError


class DPAsyncLLM:
    """``AsyncLLM``'s public interface over M replicas.

    Invariants: ``_owner`` holds exactly the live requests (added before the first output, removed
    when the stream ends, however it ends); ``replica_set.live_seqs[i]`` is the number of sequences
    of the live requests owned by replica ``i``. Both are touched on the caller's event loop only.
    """

    def __init__(self, replicas: Sequence[AsyncLLM], *, max_waiting: int = 1024,
                 input_workers: int = DEFAULT_INPUT_WORKERS):
        if not replicas:
            raise ValueError("DPAsyncLLM needs at least one replica")
        self.replicas = list(replicas)
        first = self.replicas[0]
        self.config = first.config
        self.tokenizer = first.tokenizer
        self.model_config = first.model_config
        self.max_model_len = first.max_model_len
        self.served_model_name = first.served_model_name
        self.model_root = first.model_root
        self.max_waiting = max_waiting
        self.replica_set = ReplicaSet([r.engine for r in self.replicas])
        self._owner: dict[str, int] = {}
        self._processing = 0
        self.input_pool = concurrent.futures.ThreadPoolExecutor(input_workers, thread_name_prefix="jaxserve-input")

    @classmethod
    def from_config(cls, config: EngineConfig, *, served_model_name: str | None = None, max_waiting: int = 1024,
                    show_progress: bool = True) -> DPAsyncLLM:
        engines = start_replica_engines(config, served_model_name=served_model_name, show_progress=show_progress)
        # Each replica's own queue limit is the total (this object enforces it); prompts are
        # tokenized here, so a replica's own input pool stays idle: one thread.
        return cls([AsyncLLM(e, max_waiting=max_waiting, input_workers=1) for e in engines], max_waiting=max_waiting)

    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    # ---- health ------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        """One failed replica fails the whole server, as in vLLM: its requests are lost."""
        return any(r.is_dead for r in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        """The first failed replica's cause (``AsyncLLM.dead_reason``), None while all run."""
        return next((f"engine replica {i}: {r.dead_reason}" for i, r in enumerate(self.replicas) if r.is_dead), None)

    def check_health(self) -> None:
        for index, replica in enumerate(self.replicas):
            try:
                replica.check_health()
            except EngineDeadError as exc:
                raise EngineDeadError(f"engine replica {index}: {exc}") from None

    def num_waiting(self) -> int:
        """Requests waiting in any replica, or still being tokenized."""
        return sum(r.num_waiting() for r in self.replicas) + self._processing

    # ---- requests ------------------------------------------------------------------------------

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                       entry_times: EntryTimes | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """As ``AsyncLLM.generate``, on the replica the router picks."""
        check_request_id(request_id)
        self.check_health()
        if self.num_waiting() >= self.max_waiting:
            raise EngineOverloadedError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
        self._processing += 1
        try:
            processed = await asyncio.get_running_loop().run_in_executor(
                self.input_pool, functools.partial(self._process, request_id, prompt, sampling_params, priority,
                                                    cache_salt, time.monotonic(), entry_times, lora_request))
        finally:
            self._processing -= 1
        if request_id in self._owner:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        index = self.route(processed)
        num_seqs = self.replica_set.admit(index, processed)
        self._owner[request_id] = index
        try:
            async with contextlib.aclosing(self.replicas[index].generate_processed(processed, output_kind)) as stream:
                async for out in stream:
                    yield out
        finally:
            del self._owner[request_id]
            self.replica_set.release(index, num_seqs)

    def _process(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int,
                 cache_salt: str | None, arrival_time: float, entry_times: EntryTimes | None,
                 lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Tokenize and validate (any replica's processor: they are identical), then hash the
        prompt's full blocks for routing; runs on an input thread."""
        processed = self.replicas[0].engine.process_request(request_id, prompt, params, priority=priority,
                                                            cache_salt=cache_salt, arrival_time=arrival_time,
                                                            entry_times=entry_times, lora_request=lora_request)
        self.replica_set.prepare(processed)
        return processed

    def route(self, processed: ProcessedRequest) -> int:
        """The replica index that takes ``processed`` (see ``router`` for the policy)."""
        return self.replica_set.route(processed)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """As ``AsyncLLM.add_lora``: the first replica's processor reads adapters for all."""
        self.replicas[0].add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        self.replicas[0].remove_lora(lora_name)

    async def abort(self, request_id: str) -> None:
        check_request_id(request_id)
        index = self._owner.get(request_id)
        if index is not None:
            await self.replicas[index].abort(request_id)

    # ---- introspection / lifecycle -----------------------------------------------------------

    def render_metrics(self) -> bytes:
        """Every replica's samples (label ``engine``) and their totals (``engine="total"``)."""
        return self.replica_set.render_metrics()

    def get_request_timeline(self, request_id: str) -> RequestTimeline | None:
        return self.replica_set.get_request_timeline(request_id)

    def recent_request_timelines(self, limit: int = 100) -> list[RequestTimeline]:
        """The newest ``limit`` over all replicas, by arrival."""
        return self.replica_set.recent_request_timelines(limit)

    def get_step_records(self, limit: int | None = None) -> list[StepRecord]:
        """The newest ``limit`` step records of all replicas, oldest first (by start)."""
        return self.replica_set.get_step_records(limit)

    def build_trace(self, num_steps: int | None = None, num_requests: int = 100) -> dict:
        """A Chrome/Perfetto trace of the newest steps (all replicas) and requests."""
        return self.replica_set.build_trace(num_steps, num_requests)

    def stats(self) -> dict:
        """Totals over the replicas, and each replica's own under ``engines``."""
        return self.replica_set.merged_stats()

    def shutdown(self, timeout: float = 5.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)
        self.input_pool.shutdown(wait=False, cancel_futures=True)


if TYPE_CHECKING:
    from jaxserve.engine.protocol import EngineClient

    def _both_are_engine_clients(one: AsyncLLM, many: DPAsyncLLM) -> tuple[EngineClient, EngineClient]:
        return one, many  # mypy checks that each front end has the whole interface
