"""EngineCore: owns the scheduler and the model runner; one ``step()`` = schedule, execute, update.

With ``async_scheduling`` the three calls overlap across steps: schedule and dispatch step N+1,
then collect step N and update from it. The host's scheduling and input building for N+1 run
while the device computes step N, instead of between steps.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Optional

from jaxserve.config import EngineConfig
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.core.stats import SchedulerStats
from jaxserve.engine.startup import StartupTimes
from jaxserve.exceptions import ConfigError
from jaxserve.models.hub import ModelSource, resolve_model

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import InFlightStep

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass
class StepRecord:
    """What one step did, for notebooks and debugging (kept only when ``record_steps`` is on)."""

    step: int
    scheduled: dict[str, int]  # request id -> tokens this step
    new_request_ids: list[str]
    preempted_ids: list[str]
    waiting_ids: list[str]
    token_bucket: int
    padding_ratio: float
    sampled: dict[str, list[int]]
    finished: dict[str, str]
    kv_cache_usage: float
    seconds: float


def resolve_model_source(config: EngineConfig) -> ModelSource:
    """The model's files: ``config.model`` as a folder or a hub id, or the demo model."""
    if config.model:
        return resolve_model(config.model, revision=config.revision, download_dir=config.download_dir)
    from jaxserve.models.demo import demo_model_path

    path = demo_model_path()
    return ModelSource(path, str(path))


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int) -> int:
    if config.max_model_len is None:
        return max_position_embeddings
    if config.max_model_len > max_position_embeddings:
        raise ConfigError(
            f"max_model_len: {config.max_model_len} exceeds the model's max_position_embeddings "
            f"({max_position_embeddings})")
    return config.max_model_len


class EngineCore:
    def __init__(self, config: EngineConfig, *, show_progress: bool = True, record_steps: bool = False):
        self.config = config
        self.startup = StartupTimes()
        with self.startup.phase("model"):  # before jax is imported: a wrong name fails fast
            self.model_source = resolve_model_source(config)
        self.model_path = str(self.model_source.path)

        from jaxserve.models import load_model
        from jaxserve.runner.compilation import enable_persistent_compilation_cache
        from jaxserve.runner.kv_cache import configure_xla_allocator
        from jaxserve.runner.model_runner import ModelRunner

        configure_xla_allocator(config.gpu_memory_utilization)  # before JAX starts a GPU backend
        if not config.enforce_eager:  # eager mode's per-op programs are not worth caching on disk
            enable_persistent_compilation_cache(config.resolved_compilation_cache_dir())
        with self.startup.phase("weights"):
            model = load_model(self.model_path, config.dtype, config.scan_layers)
        self.model_config = model.config
        self.max_model_len = resolve_max_model_len(config, model.config.max_position_embeddings)
        with self.startup.phase("runner"):
            self.runner = ModelRunner(config, model, self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                policy=config.scheduling_policy, async_scheduling=config.async_scheduling),
            num_blocks=self.runner.num_blocks, block_size=config.block_size,
            enable_caching=config.enable_prefix_caching)
        self.step_records: Optional[collections.deque[StepRecord]] = (
            collections.deque(maxlen=10_000) if record_steps else None)
        self.last_stats: SchedulerStats = self.scheduler.make_stats()
        self._in_flight: Optional[InFlightStep] = None  # async scheduling: dispatched, not yet collected
        self.runner.warm_up(show_progress)
        self.startup.add("compile", self.runner.stats.warm_up_compile_seconds)
        self.startup.add("first_runs", self.runner.stats.warm_up_run_seconds)

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort in any state; blocks are freed now, the runner forgets them next step."""
        if request_ids:
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests() or self._in_flight is not None

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        if self.config.async_scheduling:
            return self._step_async()
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.last_stats = self.scheduler.make_stats()
        if self.step_records is not None:
            self._record(scheduler_output, runner_output, outputs, time.perf_counter() - start)
        return outputs

    def _step_async(self) -> list[EngineCoreOutput]:
        """Dispatch step N+1, then collect step N: returns step N's outputs (none on the first)."""
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        dispatched = self.runner.dispatch(scheduler_output)  # an empty one only updates request states
        previous, self._in_flight = self._in_flight, (dispatched if dispatched.out is not None else None)
        outputs: list[EngineCoreOutput] = []
        if previous is not None:
            runner_output = self.runner.collect(previous)
            outputs = self.scheduler.update_from_output(previous.scheduler_output, runner_output)
            if self.step_records is not None:
                self._record(previous.scheduler_output, runner_output, outputs, time.perf_counter() - start)
        self.last_stats = self.scheduler.make_stats()
        return outputs

    def _record(self, so: SchedulerOutput, ro: ModelRunnerOutput, outputs: list[EngineCoreOutput],
                seconds: float) -> None:
        assert self.step_records is not None
        tokens = so.total_num_scheduled_tokens
        bucket = self.runner.buckets.pick(tokens) if tokens else 0
        self.step_records.append(StepRecord(
            step=self.last_stats.step,
            scheduled=dict(so.num_scheduled_tokens),
            new_request_ids=[r.req_id for r in so.scheduled_new_reqs],
            preempted_ids=sorted(so.preempted_req_ids),
            waiting_ids=[r.request_id for r in self.scheduler.waiting],
            token_bucket=bucket,
            padding_ratio=1.0 - tokens / bucket if tokens else 0.0,
            sampled={r: t for r, t in zip(ro.req_ids, ro.sampled_token_ids) if t},
            finished={o.request_id: o.finish_reason for o in outputs if o.finish_reason},
            kv_cache_usage=self.last_stats.kv_cache_usage,
            seconds=seconds,
        ))

    # ---- introspection -------------------------------------------------------------------------

    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_manager.usage

    @property
    def attention_backend(self) -> str:
        return self.runner.attention_backend

    @property
    def compile_stats(self):
        return self.runner.stats

    def stats(self) -> dict:
        """Scheduler, cache and runner counters in one flat dict."""
        s = self.scheduler.make_stats()
        return {
            "num_requests_running": s.num_running_reqs,
            "num_requests_waiting": s.num_waiting_reqs,
            "kv_cache_usage_perc": s.kv_cache_usage,
            "num_free_blocks": s.num_free_blocks,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "num_preemptions": s.num_preemptions,
            **self.runner.describe(),
            **{f"compile_{k}": v for k, v in self.runner.stats.as_dict().items()},
            **{f"startup_{k}_seconds": v for k, v in self.startup.phases.items()},
        }

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()
