"""What a caller gets back: ``RequestOutput`` with one ``CompletionOutput`` per sample (vLLM's shapes)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output when the request finishes (LLM.generate)


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per position: token id -> Logprob (the chosen token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Times in seconds on the monotonic clock; latencies are differences of them."""

    arrival_time: float
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
