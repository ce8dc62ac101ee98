"""``EngineClient``: what a front end (the HTTP server) may use of an engine, as vLLM's
``vllm.engine.protocol.EngineClient``. ``AsyncLLM`` (one engine) and ``DPAsyncLLM`` (M replicas)
both satisfy it; the server is typed against it and reaches for nothing else."""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.core.lora_request import LoRARequest
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
    from jaxserve.engine.processor import PromptType
    from jaxserve.engine.step_records import StepRecord
    from jaxserve.engine.timeline import EntryTimes, RequestTimeline
    from jaxserve.models.config import ModelConfig


class EngineClient(Protocol):
    config: EngineConfig
    tokenizer: Any  # transformers' interface; None when prompts must be token ids
    model_config: ModelConfig
    max_model_len: int
    served_model_name: str
    model_root: str | None
    input_pool: concurrent.futures.ThreadPoolExecutor  # the one pool that tokenizes

    # ---- health
    @property
    def is_dead(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    def check_health(self) -> None: ...

    def num_waiting(self) -> int: ...

    # ---- requests
    def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, *,
                 priority: int = 0, cache_salt: str | None = None, output_kind: RequestOutputKind = ...,
                 entry_times: EntryTimes | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]: ...

    async def abort(self, request_id: str) -> None: ...

    def add_lora(self, lora_request: LoRARequest) -> None: ...

    def remove_lora(self, lora_name: str) -> None: ...

    # ---- introspection / lifecycle
    def render_metrics(self) -> bytes: ...

    def get_request_timeline(self, request_id: str) -> RequestTimeline | None: ...

    def recent_request_timelines(self, limit: int = 100) -> list[RequestTimeline]: ...

    def get_step_records(self, limit: int | None = None) -> list[StepRecord]: ...

    def build_trace(self, num_steps: int | None = None, num_requests: int = 100) -> dict: ...

    def stats(self) -> dict: ...

    def shutdown(self, timeout: float = 5.0) -> None: ...

