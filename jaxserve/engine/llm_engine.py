"""LLMEngine: the frontend pieces around ``EngineCore`` shared by ``LLM`` and ``AsyncLLM``.

Input processing (tokenize, validate, fan out ``n``), the core step, output processing
(detokenize, stop strings) and metrics, in one synchronous object. ``LLM`` drives it in a loop;
``AsyncLLM`` drives it from one background thread.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Optional

from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.engine_core import EngineCore
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.engine.output_processor import OutputProcessor, ParentState
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.processor import InputProcessor, ProcessedRequest, PromptType
from jaxserve.exceptions import InvalidRequestError
from jaxserve.models.hub import resolve_model

logger = logging.getLogger("jaxserve")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None for a weights-only folder (token-id prompts only)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    if not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        logger.warning("no tokenizer files in %s: only token-id prompts, no detokenization", path)
        return None
    # trust_remote_code stays off: nothing from a checkpoint is executed.
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, show_progress: bool = True, record_steps: bool = False,
                 served_model_name: Optional[str] = None):
        self.config = config
        # A tokenizer given apart is looked up first, so a wrong name fails before any compile.
        tokenizer_source = resolve_model(config.tokenizer, weights=False) if config.tokenizer else None
        self.core = EngineCore(config, show_progress=show_progress, record_steps=record_steps)
        with self.core.startup.phase("tokenizer"):
            self.tokenizer = load_tokenizer(str((tokenizer_source or self.core.model_source).path))
        self.model_config = self.core.model_config
        self.max_model_len = self.core.max_model_len
        self.input_processor = InputProcessor(self.tokenizer, self.model_config, self.max_model_len, config)
        self.output_processor = OutputProcessor(self.tokenizer, on_finished=self._on_finished)
        self.served_model_name = served_model_name or (config.model or "jaxserve-demo")
        self.model_root = self.core.model_source.root  # the folder, or the hub id
        self.metrics = EngineMetrics(self.served_model_name, self.core.attention_backend)
        self.metrics.record_startup(self.core.startup.phases, self.core.runner.stats)
        self._report_startup(show_progress)

    def _report_startup(self, show_progress: bool) -> None:
        stats = self.core.runner.stats
        line = self.core.startup.summary(len(stats.compile_seconds_per_bucket), stats.persistent_cache_hits)
        logger.info(line)
        if show_progress and not logger.isEnabledFor(logging.INFO):  # no logging set up (a notebook)
            print(f"jaxserve: {line}", file=sys.stderr, flush=True)  # stdout may carry JSON

    # ---- requests ------------------------------------------------------------------------------

    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                        priority: int = 0, cache_salt: Optional[str] = None,
                        arrival_time: Optional[float] = None) -> ProcessedRequest:
        """Tokenize and validate (raises InvalidRequestError naming the field); touches no engine state."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        return self.input_processor.process(request_id, prompt, params, arrival, priority, cache_salt)

    def add_processed_request(self, processed: ProcessedRequest, *,
                              output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
                              queue: Any = None) -> ParentState:
        request_id = processed.request_id
        if request_id in self.output_processor.parents:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        parent = self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids,
            [r.request_id for r in processed.core_requests], [r.sampling_params for r in processed.core_requests],
            output_kind, processed.core_requests[0].arrival_time, queue)
        try:
            for req in processed.core_requests:
                self.core.add_request(req)
        except ValueError:
            self.abort_request([request_id])
            raise
        return parent

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY, priority: int = 0,
                    cache_salt: Optional[str] = None, queue: Any = None,
                    arrival_time: Optional[float] = None) -> ParentState:
        processed = self.process_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                         arrival_time=arrival_time)
        return self.add_processed_request(processed, output_kind=output_kind, queue=queue)

    def abort_request(self, request_ids: list[str]) -> None:
        self.core.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.core.has_unfinished_requests()

    def num_waiting_requests(self) -> int:
        """Requests waiting in the scheduler as of the last step."""
        return self.core.last_stats.num_waiting_reqs

    def forget_all_requests(self) -> list[Any]:
        """Drop every request's output state after a fatal error; returns their queues (the
        ``queue`` each was added with) so the caller can tell them. The core is not touched."""
        return [parent.queue for parent in self.output_processor.forget_all() if parent.queue is not None]

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[tuple[ParentState, RequestOutput]]:
        core_outputs = self.core.step()
        self._record_iteration(core_outputs, time.monotonic())
        delivered, stopped = self.output_processor.process_outputs(core_outputs)
        self.core.abort_requests(stopped)
        self.metrics.record_step(self.core.scheduler.make_stats(), self.core.compile_stats)  # after the aborts above
        return delivered

    def _record_iteration(self, core_outputs, now: float) -> None:
        """The step's token counts and latencies, read before the output processor stamps them."""
        num_tokens, num_prompt_tokens, itls, ttfts = 0, 0, [], []
        firsts: set[str] = set()
        child_to_parent = self.output_processor.child_to_parent
        for out in core_outputs:
            entry = child_to_parent.get(out.request_id)
            if entry is None or not out.new_token_ids:
                continue
            num_tokens += len(out.new_token_ids)
            parent = entry[0]
            m = parent.metrics
            if m.first_token_time is None:
                if parent.request_id not in firsts:  # n > 1: a parent's first token counts once
                    firsts.add(parent.request_id)
                    ttfts.append(now - m.arrival_time)
                    num_prompt_tokens += len(parent.prompt_token_ids)
            elif m.last_token_time is not None:
                itls.append(now - m.last_token_time)
        self.metrics.record_iteration(num_tokens, itls, ttfts, num_prompt_tokens)

    def _on_finished(self, parent: ParentState) -> None:
        reasons = [c.finish_reason for c in parent.children]
        reason = "abort" if "abort" in reasons else ("length" if "length" in reasons else "stop")
        self.metrics.record_finished(reason, parent.metrics.e2e_latency)

    # ---- introspection -------------------------------------------------------------------------

    def stats(self) -> dict:
        """Scheduler, cache and compile counters in one dict (also the basis of /metrics)."""
        return self.core.stats()

    @property
    def step_records(self):
        """Per-step records when built with ``record_steps=True``, else None."""
        return self.core.step_records

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()
