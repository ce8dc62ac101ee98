"""What crosses between the scheduler and the model runner, and back to the engine (pure data).

Runner contract:
  * ``preempted_req_ids`` and ``finished_req_ids``: drop the request's state. Finished ids only
    name requests the runner holds (running when they finished or were aborted).
  * A preempted request comes back later as ``NewRequestData`` whose ``output_token_ids`` are its
    earlier outputs; its tokens are ``prompt_token_ids + output_token_ids``.
  * A request's tokens ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)`` are
    computed this step; a token is sampled only when that range reaches its last known token,
    otherwise (a partial prefill chunk) ``sampled_token_ids`` for it is ``[]``.
  * With ``scheduled_spec_decode_tokens[id]`` = K drafts, the range ends with those K drafts;
    the runner returns 1..K+1 tokens (the accepted drafts, then the target's own token).
  * ``scheduled_encoder_inputs`` are encoded before the step's forward; an image's output is then
    kept under its content hash until ``free_encoder_mm_hashes`` names it, and may serve several
    requests and steps (a chunk can end inside an image).
  * The runner writes all of a step's KV before the step's attention reads it: a request may hit
    prefix blocks another request fills in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxserve.core.multimodal import MultiModalFeatureSpec
from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.sampling_params import SamplingParams

# One position's logprobs: (token ids, logprobs, rank of the chosen token); index 0 is the chosen
# token, then the top-k in descending order.
LogprobsRow = tuple[list[int], list[float], int]


@dataclass
class NewRequestData:
    """A request the runner has not seen (first schedule, or resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]          # all blocks of the request so far (hybrid: a tuple, one per KV group)
    num_computed_tokens: int      # tokens already in the KV cache (prefix hit or 0)
    output_token_ids: list[int]   # non-empty only when resumed after preemption (recompute)
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)  # images, prompt order
    pooling_params: PoolingParams | None = None  # a pooling request: pooled after its prefill, never sampled
    lora_name: str | None = None  # the adapter's key (name@sha256), None for the base model
    lora_weights: object = None  # the loaded adapter the runner writes into a slot (opaque here)


@dataclass
class CachedRequestData:
    """Requests already in the runner's persistent batch, as parallel lists."""

    req_ids: list[str]
    new_block_ids: list[list[int]]   # blocks appended this step (hybrid: a tuple per request, one per group)
    num_computed_tokens: list[int]   # before this step's tokens

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]      # finished/aborted since the last step: the runner drops them
    preempted_req_ids: set[str]     # preempted this step: the runner drops them
    # Speculative decoding: the draft ids a request verifies this step. They are the last
    # ``len(drafts)`` of its ``num_scheduled_tokens``, right after its last known token.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Images: request id -> indices of its features to encode this step (before the forward);
    # content hashes whose encoder outputs the runner may drop (evicted from the encoder cache).
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # Speculative decoding: whether the runner proposes drafts once this step's tokens are in
    # (False when the step after it will not speculate: the auto-off rule said off).
    propose_drafts: bool = True

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Produced by the runner. ``sampled_token_ids[req_id_to_index[id]]`` is ``[]`` for a partial
    prefill chunk. ``logprobs``, if set, is indexed like ``sampled_token_ids``."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    # Speculative decoding: a request's entry is a list, one row per token of sampled_token_ids.
    logprobs: list[LogprobsRow | list[LogprobsRow] | None] | None = None
    prompt_logprobs_dict: dict[str, list[LogprobsRow]] = field(default_factory=dict)
    # Speculative decoding: per request (indexed like ``sampled_token_ids``), the drafts proposed
    # for the next step. With drafts scheduled, ``sampled_token_ids`` holds the accepted drafts
    # then one token of the target's own (at most K+1 tokens).
    spec_token_ids: list[list[int]] | None = None
    # Pooling: request id -> its pooled vector (a float array), for each request whose prefill
    # ended this step; a request whose prefill goes on (a chunk) is not in it.
    pooler_output: dict[str, Any] | None = None
    # Mixture of experts: routed (token, expert) pairs per expert this step, summed over the layers.
    expert_load: list[int] | None = None


@dataclass(slots=True)  # one per request per step: slots keep it small and cheap for the GC
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    new_logprobs: LogprobsRow | list[LogprobsRow] | None = None  # a list: one per token (speculative)
    new_prompt_logprobs: list[LogprobsRow] | None = None
    num_cached_tokens: int = 0
    pooling_output: Any = None  # a pooling request's vector (it finishes with it)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
