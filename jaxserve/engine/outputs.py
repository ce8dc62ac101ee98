"""What a caller gets back: ``RequestOutput`` with one ``CompletionOutput`` per sample (vLLM's shapes)."""

from __future__ import annotations

import dataclasses
import enum


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output when the request finishes (LLM.generate)


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """A request's timeline (vLLM's ``RequestMetrics`` fields, plus the API-entry stages).

    Times are seconds on the monotonic clock (``time.monotonic()``); only their differences mean
    anything. In order, when set: ``received_time`` (the server read the request) <=
    ``templated_time`` (chat template rendered) <= ``tokenized_time`` (prompt tokens known and
    validated) <= ``queued_time`` (in the scheduler's waiting queue) <= ``first_scheduled_time``
    <= ``first_token_time`` <= ``last_token_time`` <= ``finished_time``. ``arrival_time`` is when
    the engine took the request (vLLM's meaning; TTFT and e2e latency count from it), after
    ``received_time``. Offline (``LLM``) there is no receive or template stage: those stay None.
    With ``n > 1`` the earliest sample's schedule and the preemptions of all samples count.
    """

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    received_time: float | None = None
    templated_time: float | None = None
    tokenized_time: float | None = None
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    time_in_queue: float | None = None  # first_scheduled_time - queued_time, as vLLM reports it
    num_preemptions: int = 0
    # Images: how many of the request's images the vision encoder ran on (again after an eviction),
    # and its share of those encoder batches' seconds.
    num_encoded_images: int = 0
    encoder_time: float = 0.0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["time_to_first_token"] = self.time_to_first_token
        d["e2e_latency"] = self.e2e_latency
        return d


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
