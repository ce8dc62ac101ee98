"""A request as the engine core sees it: token ids, progress counters and status."""

from __future__ import annotations

import enum
import time

from jaxserve.core import kv_cache_utils
from jaxserve.core.kv_cache_utils import BlockHash
from jaxserve.core.multimodal import MultiModalFeatureSpec
from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status after PREEMPTED is terminal."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # structured outputs: waiting for its grammar to compile
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()  # a fault of this request alone (hashing, detokenizing, ...)

    def __str__(self) -> str:
        # IntEnum prints its value ("1"); logs and clients read the name, as vLLM prints it.
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    # Ignored = too long to ever run; to the client that is a length problem.
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request (one sequence; ``n > 1`` is fanned out above the core).

    Invariants:
      * ``all_token_ids == prompt_token_ids + output_token_ids`` at all times.
      * ``num_computed_tokens`` counts tokens whose KV is written, or scheduled to be written this
        step (the scheduler advances it when it schedules them). It is ``< num_tokens`` except
        right after a step that computed every token and before its sampled token is appended.
      * When ``block_size`` is set, ``block_hashes[i]`` is the chained hash of full block ``i`` of
        ``all_token_ids``; the list grows as tokens are appended and never shrinks.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        block_size: int | None = None,
        lora_weights: object = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # LoRA: ``lora_name`` is the adapter's prefix-cache key (``name@sha256``, see
        # core.lora_request); ``lora_weights`` the loaded adapter, opaque here, for the runner.
        self.lora_name = lora_name
        self.lora_weights = lora_weights
        # Images, in prompt order; their hashes key the blocks their placeholders overlap.
        self.mm_features: list[MultiModalFeatureSpec] = list(mm_features or ())
        # A pooling request: finished by its prefill's pooled output, never sampled.
        self.pooling_params = pooling_params

        self.status = RequestStatus.WAITING_FOR_FSM if self.use_structured_output else RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Resolved against max_model_len by the scheduler when None.
        self.max_tokens: int | None = sampling_params.max_tokens

        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens sampled by dispatched steps whose results have not arrived yet.
        self.num_output_placeholders = 0
        # Speculative decoding: drafts proposed after the last step, verified by the next one.
        # Never part of ``all_token_ids``, so never hashed into the prefix cache.
        self.spec_token_ids: list[int] = []
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 = not scheduled yet
        self.num_preemptions = 0
        # Images: encoder runs for this request and its share of their seconds (set by the engine).
        self.num_encoded_images = 0
        self.encoder_seconds = 0.0

        # Engine-side timestamps use the monotonic clock: only their differences matter.
        self.queued_ts: float | None = None
        self.scheduled_ts: float | None = None  # first schedule
        self.first_token_ts: float | None = None
        self.preempted_ts: float | None = None  # last preemption
        self.finished_ts: float | None = None

        self.block_size: int | None = None
        self.block_hashes: list[BlockHash] = []
        self._next_full_block_end = float("inf")  # no hashing until a block size is known
        if block_size is not None:
            self.init_block_hashes(block_size)

    def init_block_hashes(self, block_size: int) -> None:
        """Start incremental hashing with ``block_size`` (idempotent for the same size)."""
        if self.block_size is not None:
            if self.block_size != block_size:
                raise ValueError(f"request {self.request_id} was hashed with block_size "
                                 f"{self.block_size}, the KV cache uses {block_size}")
            return
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        assert self.block_size is not None
        kv_cache_utils.update_block_hashes(self)
        # Token count at which the next block completes; a plain int compare per appended token.
        self._next_full_block_end = (len(self.block_hashes) + 1) * self.block_size

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        # Hash only when a block completes: the common decode step costs one comparison.
        if len(self.all_token_ids) >= self._next_full_block_end:
            self._update_block_hashes()

    def append_output_token_id(self, token_id: int) -> None:
        """One token: the decode hot path."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) >= self._next_full_block_end:
            self._update_block_hashes()

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def sort_key(self) -> tuple:
        """Scheduling order under the priority policy: lower value first, then earlier arrival.
        The request id makes it a total order, so ties never depend on container internals."""
        return (self.priority, self.arrival_time, self.request_id)

    def __lt__(self, other: Request) -> bool:
        return self.sort_key() < other.sort_key()

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
