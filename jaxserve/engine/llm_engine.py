"""LLMEngine: the frontend pieces around ``EngineCore`` shared by ``LLM`` and ``AsyncLLM``.

Input processing (tokenize, validate, fan out ``n``), the core step, output processing
(detokenize, stop strings) and metrics, in one synchronous object. ``LLM`` drives it in a loop;
``AsyncLLM`` drives it from one background thread.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.core.lora_request import LoRARequest
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.engine_core import EngineCore
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.engine.output_processor import OutputProcessor, ParentState
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.processor import InputProcessor, ProcessedRequest, PromptType, as_request_ids
from jaxserve.engine.step_records import StepRecord, last_records
from jaxserve.engine.timeline import ABORT, EntryTimes, RequestTimeline
from jaxserve.engine.trace import build_trace
from jaxserve.exceptions import ConfigError, InvalidRequestError
from jaxserve.models.gguf_cache import GGUFCache
from jaxserve.models.gguf_loader import is_gguf
from jaxserve.models.hub import resolve_model
from jaxserve.models.smollm2 import SERVED_NAME as SMOLLM2_NAME

logger = logging.getLogger("jaxserve")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(path: str) -> bool:
    return any((Path(path) / f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None for a weights-only folder (token-id prompts only; then
    transformers, which imports torch where torch is installed, is not imported at all)."""
    if not is_gguf(path) and not has_tokenizer_files(path):
        logger.warning("no tokenizer files in %s: only token-id prompts, no detokenization", path)
        return None
    from transformers import AutoTokenizer

    if is_gguf(path):  # transformers rebuilds the tokenizer and chat template from the metadata (seconds):
        file = Path(path)  # kept in the start-up cache, read back as a plain tokenizer folder
        return GGUFCache(file).tokenizer(lambda: AutoTokenizer.from_pretrained(
            str(file.parent), gguf_file=file.name, trust_remote_code=False))
    # trust_remote_code stays off: nothing from a checkpoint is executed.
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


class LLMEngine:
    """``model``: a model object served instead of ``config.model`` (see
    :mod:`jaxserve.models.contract`); ``tokenizer``: a tokenizer object used instead of loading
    ``config.tokenizer`` or the model's."""

    def __init__(self, config: EngineConfig, *, show_progress: bool = True, record_steps: bool = False,
                 served_model_name: str | None = None, model: Any = None, tokenizer: Any = None,
                 devices: Sequence[Any] | None = None, engine_index: int = 0):
        """``devices``: the jax devices the model runs on (default: the first
        ``tensor_parallel_size`` of ``jax.devices()``); ``engine_index``: its replica index under
        data parallelism (the metrics' ``engine`` label)."""
        self.config = config
        self.engine_index = engine_index
        if config.node_rank > 0:  # only rank 0 schedules; the others replay its steps
            raise ConfigError(f"node_rank: {config.node_rank} runs headless (jaxserve serve --node-rank "
                              f"{config.node_rank}, or jaxserve.run_headless), not an engine of its own")
        # A tokenizer given apart is looked up first, so a wrong name fails before any compile.
        tokenizer_source = resolve_model(config.tokenizer, weights=False) if config.tokenizer else None
        default_name = type(model).__name__ if model is not None else (config.model or SMOLLM2_NAME)
        self.served_model_name = served_model_name or default_name
        self.tracer = None
        if config.otlp_traces_endpoint:  # before the engine starts: a missing extra fails at once
            from jaxserve.engine.otel import RequestTracer

            self.tracer = RequestTracer(config.otlp_traces_endpoint, self.served_model_name)
        self.core = EngineCore(config, show_progress=show_progress, record_steps=record_steps, model=model,
                               devices=devices)
        source = self.core.model_source
        if served_model_name is None and source is not None and source.served_name:  # the demo, or its fallback
            self.served_model_name = source.served_name
        with self.core.startup.phase("tokenizer"):
            self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer(tokenizer_source)
        self.model_config = self.core.model_config
        self.max_model_len = self.core.max_model_len
        grammar_backend = self._grammar_backend()
        self.input_processor = InputProcessor(self.tokenizer, self.model_config, self.max_model_len, config,
                                              grammar_backend, mm_processor=self.core.mm_processor)
        self.output_processor = OutputProcessor(self.tokenizer, on_finished=self._on_finished,
                                                max_timelines=config.max_request_timelines,
                                                keep_token_ids=config.record_token_ids)
        if self.tracer is not None:
            self.output_processor.on_ended = self._export_span
        # The folder or the hub id; a model object has neither.
        self.model_root = self.core.model_source.root if self.core.model_source else self.served_model_name
        self.metrics = EngineMetrics(self.served_model_name, self.core.attention_backend, engine_index)
        self.metrics.record_startup(self.core.startup.phases, self.core.runner.stats)
        self.metrics.record_memory(self.core.runner.memory())
        self._report_startup(show_progress)
        self.core.runner.start_deferred_compiles()

    def _load_tokenizer(self, tokenizer_source):
        source = tokenizer_source or self.core.model_source
        if source is None:  # a model object and no tokenizer
            logger.warning("no tokenizer given with the model object: only token-id prompts, no detokenization")
            return None
        return load_tokenizer(str(source.path))

    def _grammar_backend(self):
        """Structured outputs' grammars for this tokenizer (its llguidance form is built on first
        use), or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        from jaxserve.structured.backend import GrammarBackend

        backend = GrammarBackend(self.tokenizer, self.config.structured_outputs_max_grammar_bytes,
                                 self.config.structured_outputs_any_whitespace)
        self.core.enable_structured_outputs(backend)
        return backend

    def _report_startup(self, show_progress: bool) -> None:
        stats = self.core.runner.stats
        line = self.core.startup.summary(len(stats.compile_seconds_per_bucket), stats.persistent_cache_hits)
        mem = self.core.runner.memory()
        line += (f"; weights {mem['weight_bytes'] / 2**20:.1f} MiB ({mem['quantization']}), "
                 f"KV cache {mem['kv_cache_bytes'] / 2**20:.1f} MiB ({mem['kv_cache_dtype']})")
        logger.info(line)
        if show_progress and not logger.isEnabledFor(logging.INFO):  # no logging set up (a notebook)
            print(f"jaxserve: {line}", file=sys.stderr, flush=True)  # stdout may carry JSON

    # ---- requests ------------------------------------------------------------------------------

    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                        priority: int = 0, cache_salt: str | None = None,
                        arrival_time: float | None = None,
                        entry_times: EntryTimes | None = None,
                        lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Tokenize and validate (raises InvalidRequestError naming the field); touches no engine state.
        ``entry_times``: the server's receive/template/tokenize times, for the request's timeline."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        processed = self.input_processor.process(request_id, prompt, params, arrival, priority, cache_salt,
                                                 lora_request)
        processed.entry = entry_times
        return processed

    def add_processed_request(self, processed: ProcessedRequest, *,
                              output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
                              queue: Any = None) -> ParentState:
        request_id = processed.request_id
        if request_id in self.output_processor.parents:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        parent = self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids,
            [r.request_id for r in processed.core_requests], [r.sampling_params for r in processed.core_requests],
            output_kind, processed.core_requests[0].arrival_time, queue,
            core_requests=processed.core_requests, entry=processed.entry, tokenized_time=processed.tokenized_time)
        if processed.lora_request is not None:
            parent.lora_name = processed.lora_request.lora_name
            parent.lora_key = processed.core_requests[0].lora_name
        added: list[str] = []
        try:
            for req in processed.core_requests:
                self.core.add_request(req)
                added.append(req.request_id)
        except Exception:
            # A refusal (id in use) or a fault of this request (hashing its prompt): it alone fails.
            self.output_processor.abort_requests([request_id])
            self.core.abort_requests(added)
            raise
        parent.metrics.queued_time = min(r.queued_ts or 0.0 for r in processed.core_requests)  # set by add_request
        return parent

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY, priority: int = 0,
                    cache_salt: str | None = None, queue: Any = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> ParentState:
        processed = self.process_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                         arrival_time=arrival_time, lora_request=lora_request)
        return self.add_processed_request(processed, output_kind=output_kind, queue=queue)

    def abort_request(self, request_ids: str | Iterable[str], cause: str = ABORT) -> None:
        """Abort one request or several; ``cause`` (abort, client_disconnect, error) is kept in
        their timelines. Each one counts as an aborted request in the metrics."""
        core_ids, aborted = self.output_processor.abort_requests(as_request_ids(request_ids), cause)
        self.core.abort_requests(core_ids)
        for parent in aborted:
            self.metrics.record_finished("abort", parent.metrics.e2e_latency)

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

    def _export_span(self, parent: ParentState) -> None:
        assert self.tracer is not None
        self.tracer.export(parent.timeline(keep_token_ids=False), trace_headers=parent.trace_headers)

    def check_nodes(self) -> None:
        """Raise ``NodeLostError`` if a host of a multi-node engine was lost (no-op on one host)."""
        self.core.check_nodes()

    def shutdown(self) -> None:
        """Send what is still buffered (spans), stop background exporters and compiles, release other
        hosts."""
        self.core.runner.steps.stop_background()
        if self.tracer is not None:
            self.tracer.shutdown()
        self.core.shutdown()

    def _on_finished(self, parent: ParentState) -> None:
        reasons = [c.finish_reason for c in parent.children]
        # The worst child names the request: an error, then an abort, then a length cap.
        reason = next((r for r in ("error", "abort", "length") if r in reasons), "stop")
        self.metrics.record_finished(reason, parent.metrics.e2e_latency)

    # ---- introspection -------------------------------------------------------------------------

    def stats(self) -> dict:
        """Scheduler, cache and compile counters in one dict (also the basis of /metrics)."""
        return self.core.stats()

    def get_request_timeline(self, request_id: str) -> RequestTimeline | None:
        """A request's timeline (live, or finished and still kept), or None."""
        return self.output_processor.get_timeline(request_id)

    def recent_request_timelines(self, limit: int = 100) -> list[RequestTimeline]:
        """The newest ``limit`` finished requests' timelines, then the live ones'."""
        return self.output_processor.recent_timelines(limit)

    @property
    def image_placeholder(self) -> str:
        """The text a chat image part becomes for this model (LLaVA's ``<image>``, Qwen2.5-VL's
        ``<|vision_start|><|image_pad|><|vision_end|>``)."""
        from jaxserve.engine.mm_processor import IMAGE_PLACEHOLDER

        return getattr(self.core.mm_processor, "placeholder", IMAGE_PLACEHOLDER)

    @property
    def step_records(self):
        """The ring of per-step records (``max_step_records`` of them), None when that is 0."""
        return self.core.step_records

    def get_step_records(self, limit: int | None = None) -> list[StepRecord]:
        """The newest ``limit`` step records (all kept with None), oldest first, each carrying this
        engine's replica index (the core that writes them knows no replicas)."""
        ring = self.core.step_records
        records = [] if ring is None else last_records(ring, limit)
        for record in records:
            record.engine_index = self.engine_index
        return records

    def build_trace(self, num_steps: int | None = None, num_requests: int = 100) -> dict:
        """A Chrome/Perfetto trace (JSON object) of the newest steps and requests."""
        return build_trace(self.get_step_records(num_steps), self.recent_request_timelines(num_requests))

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()
