"""The V1 scheduler: one token budget per step shared by prefill chunks and decodes."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from jaxserve.core.kv_cache_manager import KVCacheManager, KVCacheManagerInterface
from jaxserve.core.multimodal import EncoderCacheManager, EncoderSchedule, schedule_encoder_inputs
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.request_queue import create_request_queue
from jaxserve.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from jaxserve.core.schedule_record import (
    WAIT_ENCODER_BUDGET,
    WAIT_GRAMMAR,
    WAIT_KV_BLOCKS,
    WAIT_LORA_SLOTS,
    WAIT_MAX_NUM_SEQS,
    WAIT_PREEMPTION,
    WAIT_TOKEN_BUDGET,
)
from jaxserve.core.stats import SchedulerStats, SpecDecodingStats
from jaxserve.core.structured_outputs import GRAMMAR_READY, StructuredOutputHooks
from jaxserve.exceptions import InvalidRequestError

logger = logging.getLogger("jaxserve")

_NO_ENCODER = EncoderSchedule((), 0, 0)  # a request with no image to encode
# A draft the runner proposes on the device after a step still in flight (draft_placeholders).
DRAFT_PLACEHOLDER = -1


@dataclass
class SchedulerConfig:
    """``long_prefill_token_threshold`` > 0 caps the tokens one request gets per step (needs
    chunked prefill). ``history_size`` > 0 keeps that many per-step ``SchedulerStats``."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    history_size: int = 0
    async_scheduling: bool = False
    # Speculative decoding: at most this many drafts per request and step (0: off), and the
    # KV slots the proposer writes past the scheduled tokens.
    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0
    # With async scheduling: a request whose step is in flight is scheduled again at once with its
    # bonus token and the drafts the runner proposes after that step, all placeholders (vLLM's
    # async scheduling with speculation); see ``Scheduler.expect_drafts``.
    draft_placeholders: bool = False
    # EAGLE: prefix hits end one block short (the head's KV at a hit's last position depends on
    # the token after it, which may differ); the plain KV cache manager's use_eagle.
    use_eagle: bool = False
    # Images: encoder tokens one step may encode, and the encoder cache's size (0: the budget).
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0
    # LoRA: distinct adapters the running requests may use at once (the runner's device slots);
    # 0: LoRA off.
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be non-negative, "
                             f"got {self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold > 0 and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold requires enable_chunked_prefill")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.num_speculative_tokens < 0 or self.num_lookahead_tokens < 0:
            raise ValueError("num_speculative_tokens and num_lookahead_tokens must be non-negative")
        if self.draft_placeholders and not (self.async_scheduling and self.num_speculative_tokens):
            raise ValueError("draft_placeholders needs async_scheduling and num_speculative_tokens")
        if self.history_size < 0:
            raise ValueError(f"history_size must be non-negative, got {self.history_size}")
        if self.max_num_encoder_input_tokens < 0 or self.encoder_cache_size < 0:
            raise ValueError("max_num_encoder_input_tokens and encoder_cache_size must be non-negative")
        if 0 < self.encoder_cache_size < self.max_num_encoder_input_tokens:
            raise ValueError("encoder_cache_size must be at least max_num_encoder_input_tokens")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be non-negative, got {self.max_loras}")


class Scheduler:
    """Decides, each step, which requests advance by how many tokens.

    Invariants:
      * a request is in exactly one of ``waiting`` (WAITING/PREEMPTED, holding no blocks) or
        ``running`` (RUNNING, holding its blocks), or is gone (finished, blocks freed);
      * ``len(running) <= max_num_seqs``; scheduled tokens per step <= ``max_num_batched_tokens``;
      * a step that preempted admits no waiting request (its blocks would be taken straight back).
    Structured outputs: with ``structured_outputs`` hooks set, a constrained request waits as
    WAITING_FOR_FSM until its grammar is ready, passed over without holding up the requests
    behind it; each token it appends advances its matcher, and it stops (``stop``) once its
    grammar is complete. Preemption keeps the matcher: the recomputed tokens are the ones it
    already accepted.
    Async scheduling (vLLM's ``async_scheduling``): step N+1 is scheduled while step N runs, so a
    request may be scheduled before its last sampled token is known. That token is counted in
    ``num_output_placeholders`` (the runner feeds it from the device), and a request whose
    in-flight tokens already reach ``max_tokens`` or ``max_model_len`` is not scheduled again.
    Speculative decoding: a running request's drafts (``spec_token_ids``) are scheduled tokens,
    after its last known token and within the one budget; a short budget takes a prefix of them,
    and drafts that could only produce tokens past ``max_tokens``/``max_model_len`` are cut. The
    runner returns the accepted drafts plus one token; rejected drafts roll back by arithmetic
    on ``num_computed_tokens`` (their slots stay allocated and are overwritten). Drafts are never
    in ``all_token_ids``, so they are never hashed into the prefix cache.
    Both together: a request whose drafts are in flight has ``num_computed_tokens`` past its
    known tokens plus the placeholder, so it is not scheduled again until that step's output
    (and with it the accepted count) is in; a request with a token in flight gets no drafts.
    Unless ``draft_placeholders``: then a step books its bonus token and its d drafts (1 + d
    placeholders), as if every draft were accepted, so the request is scheduled again at once
    for its bonus token and, after ``expect_drafts``, K placeholder drafts (``DRAFT_PLACEHOLDER``,
    which the runner fills on the device with the drafts it proposed after the step in flight,
    and whose positions it moves back by that step's rejected count). When the output comes, the
    rejected drafts roll back ``num_computed_tokens`` and the placeholders by arithmetic as
    above. Invariant: ``num_computed_tokens`` = the computed known tokens + the placeholders
    - 1 while a sampled token is in flight (its own position is computed by the next step), and
    the drafts booked are never more than ``max_tokens``/``max_model_len`` leave room for with
    every placeholder accepted; a finished request's placeholder step is discarded by id.
    Preemption victim: the newest running request (fcfs) or the largest
    (priority, arrival_time, request_id) (priority). The oldest/best request is never a victim
    while another runs, so it always progresses: with a pool holding ``max_model_len`` tokens,
    every request finishes.
    """

    def __init__(self, scheduler_config: SchedulerConfig,
                 kv_cache_manager: KVCacheManagerInterface | None = None, *,
                 num_blocks: int | None = None, block_size: int = 16,
                 enable_caching: bool = True, log_stats: bool = True) -> None:
        cfg = scheduler_config
        if kv_cache_manager is None:
            if num_blocks is None:
                raise ValueError("pass a kv_cache_manager or num_blocks")
            kv_cache_manager = KVCacheManager(num_blocks, block_size, cfg.max_model_len,
                                              enable_caching, log_stats, use_eagle=cfg.use_eagle)
        elif cfg.use_eagle and not getattr(kv_cache_manager, "use_eagle", False):
            raise ValueError("use_eagle needs a KV cache manager that drops a prefix hit's last block")
        if kv_cache_manager.max_model_len != cfg.max_model_len:
            raise ValueError(f"kv_cache_manager.max_model_len={kv_cache_manager.max_model_len} "
                             f"!= scheduler max_model_len={cfg.max_model_len}")
        needed = kv_cache_manager.max_num_blocks_per_req  # over all KV cache groups
        if kv_cache_manager.num_blocks - 1 < needed:
            raise ValueError(
                f"max_model_len={cfg.max_model_len} needs {needed} KV blocks of "
                f"{kv_cache_manager.block_size} tokens, the cache has only "
                f"{kv_cache_manager.num_blocks - 1}; lower max_model_len or give it more memory")
        self.scheduler_config = cfg
        self.kv_cache_manager: KVCacheManagerInterface = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_model_len = cfg.max_model_len
        self.max_num_seqs = cfg.max_num_seqs
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.policy = cfg.policy

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(cfg.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(); shipped to the runner in the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()
        # The grammar engine, set by the engine core when it serves structured outputs.
        self.structured_outputs: StructuredOutputHooks | None = None

        self.step_counter = 0
        self.num_preemptions = 0
        self.num_finished_reqs = 0
        self.spec_decoding_stats: SpecDecodingStats | None = (
            SpecDecodingStats(cfg.num_speculative_tokens) if cfg.num_speculative_tokens else None)
        # Set per step by the engine's auto-off rule: False schedules no drafts (they are dropped
        # and proposed again after the step), so the step runs as a plain decode.
        self.speculate = True
        # With speculate: at most this many requests get drafts, the oldest first (0: all); the
        # rule's probes measure acceptance on a few rows.
        self.speculate_rows = 0
        self._last_num_scheduled_tokens = 0
        self._last_num_scheduled_reqs = 0
        self._last_num_preempted = 0
        self.history: deque[SchedulerStats] | None = (
            deque(maxlen=cfg.history_size) if cfg.history_size else None)
        # Why the last schedule() left waiting requests waiting (a schedule_record.WAIT_* value).
        self.waiting_reason: str | None = None
        # Images: which encoder outputs the runner holds (None: a text-only model).
        cache_size = cfg.encoder_cache_size or cfg.max_num_encoder_input_tokens
        self.encoder_cache_manager: EncoderCacheManager | None = (
            EncoderCacheManager(cache_size) if cache_size else None)

    # ------------------------------------------------------------------ requests in

    def add_request(self, request: Request) -> None:
        """Queue a request.

        Preconditions, checked by the engine's input processor (the one place that validates
        requests): ``0 < num_prompt_tokens < max_model_len``, and without chunked prefill
        ``num_prompt_tokens <= max_num_batched_tokens``. Only a request id already in use, a
        conflict with this scheduler's state, raises (``InvalidRequestError``)."""
        n = request.num_prompt_tokens
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        # A pooling prompt may fill max_model_len: it needs no room for an output token.
        room = 0 if request.pooling_params is not None else 1
        assert 0 < n <= self.max_model_len - room, f"prompt of {n} tokens with max_model_len={self.max_model_len}"
        assert self.scheduler_config.enable_chunked_prefill or n <= self.max_num_batched_tokens, (
            f"prompt of {n} tokens over max_num_batched_tokens={self.max_num_batched_tokens} without chunking")
        if request.max_tokens is None:
            request.max_tokens = self.max_model_len - n
        if self.kv_cache_manager.enable_caching:
            request.init_block_hashes(self.block_size)
        request.status = (RequestStatus.WAITING_FOR_FSM
                          if request.use_structured_output and self.structured_outputs is not None
                          else RequestStatus.WAITING)
        request.queued_ts = time.monotonic()
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus) -> None:
        """Finish (typically abort) requests in any state; unknown/finished ids are ignored.
        Blocks are released at once."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        from_running: list[Request] = []
        from_waiting: list[Request] = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            (from_running if request.status == RequestStatus.RUNNING else from_waiting).append(
                request)
        if from_running:
            drop = set(map(id, from_running))
            self.running = [r for r in self.running if id(r) not in drop]
        if from_waiting:
            self.waiting.remove_requests(from_waiting)
        for request in from_running:
            self._free_request(request, finished_status, known_to_runner=True)
        for request in from_waiting:
            # Never sent to the runner, or already dropped by it as preempted.
            self._free_request(request, finished_status, known_to_runner=False)

    def _free_request(self, request: Request, status: RequestStatus,
                      known_to_runner: bool) -> None:
        if known_to_runner:
            self.finished_req_ids.add(request.request_id)
        request.status = status
        request.finished_ts = time.monotonic()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.num_finished_reqs += 1
        if request.use_structured_output and self.structured_outputs is not None:
            self.structured_outputs.release(request.request_id)
        if self.encoder_cache_manager is not None and request.mm_features:
            self.encoder_cache_manager.free(request.request_id, request.mm_features)

    def _plan_encoder(self, request: Request, num_new: int, encoder_budget: int) -> tuple[EncoderSchedule, int]:
        """The images ``request``'s next ``num_new`` tokens need encoded; the tokens that can run."""
        enc = self.encoder_cache_manager
        if enc is None or not request.mm_features:
            return _NO_ENCODER, num_new
        plan = schedule_encoder_inputs(request.request_id, request.mm_features, request.num_computed_tokens,
                                       num_new, encoder_budget, enc)
        return plan, plan.num_new_tokens

    def _book_encoder(self, request: Request, plan: EncoderSchedule, out: dict[str, list[int]]) -> None:
        """The request got its KV blocks: its planned images are encoded this step."""
        if plan.to_encode:
            assert self.encoder_cache_manager is not None
            for i in plan.to_encode:
                self.encoder_cache_manager.allocate(request.request_id, request.mm_features[i])
            out[request.request_id] = list(plan.to_encode)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        cfg = self.scheduler_config
        threshold = cfg.long_prefill_token_threshold
        kv = self.kv_cache_manager
        now = time.monotonic()
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_blocks_of: dict[str, Any] = {}  # the manager's block lists (one per KV group, or one)
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        preempted: list[Request] = []
        spec_tokens: dict[str, list[int]] = {}
        lookahead = cfg.num_lookahead_tokens
        encoder_budget = cfg.max_num_encoder_input_tokens
        encoder_inputs: dict[str, list[int]] = {}

        # 1. Running requests, oldest first.
        req_index = 0
        draft_rows_left = self.speculate_rows or len(self.running)
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            pending = request.num_output_placeholders
            if pending and self._pending_tokens_finish(request):
                req_index += 1  # its in-flight token ends it: computing another would be wasted
                continue
            num_new = len(request.all_token_ids) + pending - request.num_computed_tokens
            drafts = request.spec_token_ids
            follows = drafts[:1] == [DRAFT_PLACEHOLDER] if pending else drafts[:1] != [DRAFT_PLACEHOLDER]
            if drafts and (not follows or not self.speculate or draft_rows_left <= 0):
                # Off, past the step's draft rows, or a token in flight that the drafts were not
                # proposed after (they would not follow it): a plain decode.
                request.spec_token_ids = drafts = []
            if drafts:
                drafts = self._trim_drafts(request, drafts)
                num_new += len(drafts)
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > token_budget:
                num_new = token_budget
            plan, num_new = self._plan_encoder(request, num_new, encoder_budget)
            if num_new <= 0:  # nothing to compute (the runner owes it a token, or no encoder budget)
                req_index += 1
                continue
            while True:
                new_blocks = kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
                if new_blocks is not None:
                    break
                victim_index = self._pick_victim_index()
                victim = self.running.pop(victim_index)
                if victim_index < req_index:
                    req_index -= 1
                if victim.request_id in num_scheduled_tokens:
                    # Already scheduled this step (priority policy): take its work back.
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    del new_blocks_of[victim.request_id]
                    if spec_tokens.pop(victim.request_id, None) is not None:
                        draft_rows_left += 1
                    scheduled_running.remove(victim)
                self._preempt(victim, now)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                # It was the victim itself: the worst left (priority; fcfs: the last). Its blocks
                # are free now, so better-ranked requests after it may still fit.
                continue
            self._book_encoder(request, plan, encoder_inputs)
            encoder_budget = plan.encoder_budget_left if plan.to_encode else encoder_budget
            scheduled_running.append(request)
            num_scheduled_tokens[request.request_id] = num_new
            new_blocks_of[request.request_id] = new_blocks
            token_budget -= num_new
            req_index += 1
            if drafts:
                # The budget may have cut the step short: the drafts it reaches, in order.
                num_spec = request.num_computed_tokens + num_new - len(request.all_token_ids) - pending
                if num_spec > 0:
                    spec_tokens[request.request_id] = drafts[:num_spec]
                    draft_rows_left -= 1
                request.spec_token_ids = []  # verified (or dropped) now; new ones come back

        # 2. Waiting requests, unless this step preempted.
        grammar_pending: list[Request] = []
        lora_waits = False
        # As in vLLM, the running requests' adapters all hold a device slot: a waiting request
        # with another adapter waits while max_loras are in use (the ones behind it go on).
        loras = {r.lora_name for r in self.running if r.lora_name is not None} if cfg.max_loras else set()
        blocked: str | None = WAIT_PREEMPTION if preempted else None
        if not preempted:
            while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting.peek_request()
                if request.status is RequestStatus.WAITING_FOR_FSM:
                    if not self._grammar_ready(request):
                        grammar_pending.append(self.waiting.pop_request())  # the ones behind it go on
                        continue
                    request.status = RequestStatus.WAITING
                lora = request.lora_name
                if lora is not None and lora not in loras and len(loras) >= cfg.max_loras:
                    grammar_pending.append(self.waiting.pop_request())  # passed over, like a grammar
                    lora_waits = True
                    continue
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request, record_stats=False)
                num_new = request.num_tokens - num_hit_tokens
                if 0 < threshold < num_new:
                    num_new = threshold
                if (not cfg.enable_chunked_prefill and num_new > token_budget
                        and num_new <= self.max_num_batched_tokens):
                    # Whole prompt or nothing; head-of-line waits so FCFS order holds. (A resumed
                    # request longer than a whole step is chunked: it could never run otherwise.)
                    blocked = WAIT_TOKEN_BUDGET
                    break
                num_new = min(num_new, token_budget)
                request.num_computed_tokens = num_hit_tokens  # where the encoder plan starts
                plan, num_new = self._plan_encoder(request, num_new, encoder_budget)
                request.num_computed_tokens = 0
                if num_new <= 0:
                    self._release_encoder_refs(request)
                    blocked = WAIT_ENCODER_BUDGET
                    break
                new_blocks = kv.allocate_slots(request, num_new, num_hit_tokens, hit_blocks,
                                               num_lookahead_tokens=lookahead)
                if new_blocks is None:
                    self._release_encoder_refs(request)
                    blocked = WAIT_KV_BLOCKS
                    break
                self._book_encoder(request, plan, encoder_inputs)
                encoder_budget = plan.encoder_budget_left if plan.to_encode else encoder_budget
                self.waiting.pop_request()
                if kv.log_stats and kv.reads_prefix_cache(request):
                    # Booked on admission only: a head that waits would be counted every step. As
                    # in vLLM, a lookup that never reads the cache (caching off) is no query.
                    kv.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
                self.running.append(request)
                if lora is not None:
                    loras.add(lora)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_hit_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                if request.scheduled_ts is None:
                    request.scheduled_ts = now
                scheduled_new.append(request)
                num_scheduled_tokens[request.request_id] = num_new
                new_blocks_of[request.request_id] = new_blocks
                token_budget -= num_new
        for request in reversed(grammar_pending):  # back at the front, in their order
            self.waiting.prepend_request(request)
        if self.waiting and blocked is None:
            if token_budget <= 0:
                blocked = WAIT_TOKEN_BUDGET
            elif len(self.running) >= self.max_num_seqs:
                blocked = WAIT_MAX_NUM_SEQS
            elif lora_waits:
                blocked = WAIT_LORA_SLOTS
            else:  # everyone left waits for a grammar
                blocked = WAIT_GRAMMAR
        self.waiting_reason = blocked if self.waiting else None

        total = self.max_num_batched_tokens - token_budget
        assert len(self.running) <= self.max_num_seqs

        new_reqs_data = [
            NewRequestData(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                           sampling_params=r.sampling_params,
                           block_ids=kv.get_block_ids(r.request_id),
                           num_computed_tokens=r.num_computed_tokens,
                           output_token_ids=list(r.output_token_ids),
                           mm_features=r.mm_features, pooling_params=r.pooling_params, lora_name=r.lora_name,
                           lora_weights=r.lora_weights)
            for r in scheduled_new]
        cached_reqs_data = CachedRequestData(
            req_ids=[r.request_id for r in scheduled_running],
            new_block_ids=[kv.new_block_ids(new_blocks_of[r.request_id])
                           for r in scheduled_running],
            num_computed_tokens=[r.num_computed_tokens for r in scheduled_running])

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            scheduled_spec_decode_tokens=spec_tokens,
            scheduled_encoder_inputs=encoder_inputs,
            free_encoder_mm_hashes=(self.encoder_cache_manager.get_freed_mm_hashes()
                                    if self.encoder_cache_manager is not None else []))
        self.finished_req_ids = set()

        # As in vLLM, progress is booked at schedule time: the next schedule() must not hand the
        # same tokens out again, even before this step's output arrives.
        requests = self.requests
        placeholders = self.scheduler_config.async_scheduling
        for req_id, n in num_scheduled_tokens.items():
            request = requests[req_id]
            request.num_computed_tokens += n
            if request.mm_features and self.encoder_cache_manager is not None:
                # An image whose tokens are all scheduled is no longer needed by this request.
                for f in request.mm_features:
                    if f.placeholder.end <= request.num_computed_tokens:
                        self.encoder_cache_manager.free_encoder_input(req_id, f)
            if placeholders and request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                # this step samples a token we will not see yet (with draft placeholders, every
                # draft it verifies counts as one too until the accepted count is in)
                request.num_output_placeholders += 1 + self._num_booked_drafts(spec_tokens, req_id)

        self.step_counter += 1
        self._last_num_scheduled_tokens = total
        self._last_num_scheduled_reqs = len(num_scheduled_tokens)
        self._last_num_preempted = len(preempted)
        if self.history is not None:
            self.history.append(self.make_stats())
        return output

    def _num_booked_drafts(self, spec_tokens: dict[str, list[int]], req_id: str) -> int:
        """Drafts a step's placeholders count for ``req_id``: its verified ones with
        ``draft_placeholders``, none otherwise (the request waits for their verification)."""
        return len(spec_tokens.get(req_id, ())) if self.scheduler_config.draft_placeholders else 0

    def expect_drafts(self, scheduler_output: SchedulerOutput) -> None:
        """The runner proposes drafts on the device after the step just scheduled: each of its
        requests that samples there (unconstrained: a grammar checks drafts on the host) gets K
        placeholder drafts, which the next step verifies while this one is still in flight.
        Needs ``draft_placeholders``."""
        assert self.scheduler_config.draft_placeholders
        placeholders = [DRAFT_PLACEHOLDER] * self.scheduler_config.num_speculative_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            if (request.status is RequestStatus.RUNNING and request.num_computed_tokens >= request.num_tokens
                    and not request.use_structured_output):
                request.spec_token_ids = placeholders

    def _release_encoder_refs(self, request: Request) -> None:
        """A request that stays waiting holds no encoder output (they stay cached, evictable)."""
        if self.encoder_cache_manager is not None and request.mm_features:
            self.encoder_cache_manager.free(request.request_id, request.mm_features)

    def _grammar_ready(self, request: Request) -> bool:
        hooks = self.structured_outputs
        return hooks is None or hooks.grammar_status(request.request_id) == GRAMMAR_READY

    def _pending_tokens_finish(self, request: Request) -> bool:
        """True if the tokens in flight reach ``max_tokens`` or ``max_model_len``."""
        pending = request.num_output_placeholders
        assert request.max_tokens is not None  # resolved by add_request
        return (request.num_output_tokens + pending >= request.max_tokens
                or request.num_tokens + pending >= self.max_model_len)

    def _valid_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the request's grammar rejects (all, without one)."""
        hooks = self.structured_outputs
        if not request.use_structured_output or hooks is None:
            return list(drafts)
        return list(drafts[:hooks.validate_tokens(request.request_id, list(drafts))])

    def _trim_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The drafts whose acceptance could still produce a kept token: with T tokens, K drafts
        yield up to K+1 new tokens, and no more than ``max_tokens`` outputs and
        ``max_model_len`` tokens in all are ever kept. Tokens in flight count as if all came."""
        assert request.max_tokens is not None  # resolved by add_request
        pending = request.num_output_placeholders
        room = min(request.max_tokens - request.num_output_tokens - pending,
                   self.max_model_len - request.num_tokens - pending) - 1
        return drafts if len(drafts) <= room else drafts[:max(room, 0)]

    def _pick_victim_index(self) -> int:
        """Index in ``running`` of the request to preempt: the newest (fcfs) or the worst by
        (priority, arrival_time, request_id) (priority, possibly one already scheduled)."""
        if self.policy == "priority":
            return max(range(len(self.running)), key=lambda i: self.running[i].sort_key())
        return len(self.running) - 1

    def _preempt(self, request: Request, now: float) -> None:
        # Free while num_computed_tokens still says which blocks hold written KV.
        self.kv_cache_manager.free(request)
        # Its KV is recomputed; its images' encoder outputs stay cached (unreferenced, so evictable
        # under pressure) and are reused when it resumes.
        self._release_encoder_refs(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # proposed for a context it will recompute: propose again
        request.num_preemptions += 1
        request.preempted_ts = now
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    # ------------------------------------------------------------------ results in

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop checks, release finished requests.

        Returns one output per request that got tokens, prompt logprobs or a finish. An exception
        while one request takes its tokens (hashing a block, say) finishes that request alone with
        ``FINISHED_ERROR`` (finish reason "error") and frees its blocks; the step goes on.
        """
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        sampled = model_runner_output.sampled_token_ids
        index_of = model_runner_output.req_id_to_index
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs_dict
        scheduled_spec = scheduler_output.scheduled_spec_decode_tokens
        new_drafts = model_runner_output.spec_token_ids
        spec_stats = self.spec_decoding_stats
        pooled_of = model_runner_output.pooler_output or {}
        requests = self.requests
        running_status = RequestStatus.RUNNING
        now = None
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None:
                continue  # finished or aborted after this step was scheduled
            idx = index_of.get(req_id, -1)
            tokens = sampled[idx] if idx >= 0 else []
            if tokens and request.num_output_placeholders:
                request.num_output_placeholders -= 1 + self._num_booked_drafts(scheduled_spec, req_id)
                if request.status is RequestStatus.PREEMPTED:
                    # Async: preempted while this token was in flight. It is valid; keep it.
                    drafts = scheduled_spec.get(req_id) if scheduled_spec else None
                    if drafts and spec_stats is not None:
                        spec_stats.observe_draft(len(drafts), len(tokens) - 1)
                    kept: list[int] = []
                    try:
                        finished = self._append_to_waiting(request, tokens, kept)
                    except Exception:  # this request's fault: it alone fails
                        logger.exception("request %s failed while taking its token", req_id)
                        self.waiting.remove_requests([request])
                        self._free_request(request, RequestStatus.FINISHED_ERROR, known_to_runner=False)
                        finished = True
                    row = logprobs[idx] if logprobs is not None else None
                    outputs.append(EngineCoreOutput(
                        req_id, kept, request.get_finished_reason() if finished else None,
                        request.stop_reason, row[: len(kept)] if isinstance(row, list) else row, None,
                        max(request.num_cached_tokens, 0)))
                    continue
            if request.status is not running_status:
                continue  # preempted after this step was scheduled
            pooled = pooled_of.get(req_id)
            if pooled is not None:  # a pooling request ends with its prefill (vLLM: stopped)
                request.status = RequestStatus.FINISHED_STOPPED
                stopped.append(request)
                outputs.append(EngineCoreOutput(req_id, [], "stop", None, None, None,
                                                max(request.num_cached_tokens, 0), pooled))
                continue
            drafts = scheduled_spec.get(req_id) if scheduled_spec else None
            if drafts and tokens:
                # K drafts, accepted a of them: a+1 tokens came back, K-a positions roll back.
                num_accepted = len(tokens) - 1
                assert 0 <= num_accepted <= len(drafts), (req_id, len(tokens), len(drafts))
                request.num_computed_tokens -= len(drafts) - num_accepted
                if spec_stats is not None:
                    spec_stats.observe_draft(len(drafts), num_accepted)
            new_token_ids: list[int] = []
            finished = False
            # A partial prefill chunk samples nothing; ignore a token the runner sent anyway.
            if tokens and request.num_computed_tokens >= len(request.all_token_ids):
                try:
                    finished = self._take_tokens(request, tokens, new_token_ids)
                except Exception:  # this request's fault (a hash, its grammar): it alone fails
                    logger.exception("request %s failed while taking its tokens", req_id)
                    request.status = RequestStatus.FINISHED_ERROR
                    finished = True
                if new_token_ids and request.first_token_ts is None:
                    now = now or time.monotonic()
                    request.first_token_ts = now
            req_prompt_logprobs = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if not (new_token_ids or finished or req_prompt_logprobs is not None):
                continue
            if finished:
                stopped.append(request)
            else:
                self._take_drafts(request, new_drafts[idx] if new_drafts is not None and idx >= 0 else None)
            row_logprobs = logprobs[idx] if logprobs is not None and new_token_ids else None
            if isinstance(row_logprobs, list):  # speculative: one row per token, the kept ones
                row_logprobs = row_logprobs[: len(new_token_ids)]
            outputs.append(EngineCoreOutput(
                req_id, new_token_ids,
                request.get_finished_reason() if finished else None,
                request.stop_reason,
                row_logprobs,
                req_prompt_logprobs,
                request.num_cached_tokens if request.num_cached_tokens > 0 else 0))
        if stopped:
            drop = set(map(id, stopped))
            self.running = [r for r in self.running if id(r) not in drop]
            for request in stopped:
                self._free_request(request, request.status, known_to_runner=True)
        return outputs

    def _take_drafts(self, request: Request, drafts: list[int] | None) -> None:
        """The drafts the runner proposed after a step, for the request's next one. With
        ``draft_placeholders`` and a later step in flight, that step already verifies them on the
        device (its placeholders stay); otherwise they replace placeholders that no step used."""
        if self.scheduler_config.draft_placeholders:
            if request.num_output_placeholders:
                return
            if request.spec_token_ids[:1] == [DRAFT_PLACEHOLDER]:
                request.spec_token_ids = []
        if drafts:
            request.spec_token_ids = self._valid_drafts(request, drafts)

    def _take_tokens(self, request: Request, token_ids: list[int], kept: list[int]) -> bool:
        """Append ``token_ids`` (one, or accepted drafts and one) to ``request`` up to a stop, each
        into ``kept`` too; True if they finished it (a stop, or its grammar completed)."""
        stop = False
        for token_id in token_ids:
            request.append_output_token_id(token_id)  # hashes a block when one completes
            kept.append(token_id)
            if self._check_stop(request, token_id):
                stop = True
                break
        if request.use_structured_output and self._advance_grammar(request, kept):
            stop = True
        return stop

    def _append_to_waiting(self, request: Request, token_ids: list[int], kept: list[int]) -> bool:
        """Append late tokens (one, or accepted drafts and one) to a preempted request, up to a
        stop, into ``kept`` too; True if they finished it (then it is freed)."""
        stop = self._take_tokens(request, token_ids, kept)
        if request.first_token_ts is None:
            request.first_token_ts = time.monotonic()
        if not stop:
            return False
        self.waiting.remove_requests([request])
        self._free_request(request, request.status, known_to_runner=False)
        return True

    def _advance_grammar(self, request: Request, token_ids: list[int]) -> bool:
        """Feed the tokens to the request's matcher; True if its grammar ends the request (then
        the status is set, unless a stop check already set it)."""
        hooks = self.structured_outputs
        if hooks is None or not token_ids or not hooks.accept_tokens(request.request_id, token_ids):
            return False
        if not request.is_finished():
            request.status = RequestStatus.FINISHED_STOPPED
        return True

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Stop checks, in order: min_tokens, EOS, stop_token_ids, max_tokens, max_model_len.
        Sets status/stop_reason. ``max_model_len`` caps even before ``min_tokens`` is reached:
        there is no room left. (min_tokens <= max_tokens, so max_tokens cannot hit earlier.)"""
        params = request.sampling_params
        if len(request.output_token_ids) >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
            if len(request.output_token_ids) >= request.max_tokens:  # type: ignore[operator]  # set in add_request
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                return True
        if len(request.all_token_ids) >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # ------------------------------------------------------------------ queries

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """Finished ids not yet shipped to the runner: keep stepping until they are."""
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        pc = kv.prefix_cache_stats
        return SchedulerStats(
            step=self.step_counter,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_scheduled_tokens=self._last_num_scheduled_tokens,
            num_scheduled_reqs=self._last_num_scheduled_reqs,
            num_preempted_reqs=self._last_num_preempted,
            num_preemptions=self.num_preemptions,
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_requests=pc.requests,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            num_finished_reqs=self.num_finished_reqs,
            spec_decoding=self.spec_decoding_stats.copy() if self.spec_decoding_stats is not None else None,
            **(self._lora_stats() if self.scheduler_config.max_loras else {}))

    def _lora_stats(self) -> dict:
        """Requests per adapter name (the key's part before ``@sha256``), running and waiting."""
        def count(requests: Iterable[Request]) -> dict[str, int]:
            out: dict[str, int] = {}
            for r in requests:
                if r.lora_name is not None:
                    name = r.lora_name.split("@", 1)[0]
                    out[name] = out.get(name, 0) + 1
            return out

        return {"max_loras": self.scheduler_config.max_loras, "running_lora_adapters": count(self.running),
                "waiting_lora_adapters": count(self.waiting)}
