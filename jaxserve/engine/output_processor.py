"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (detokenize, stop strings, n > 1, metrics).

It runs in the frontend (the ``LLM`` loop or the ``AsyncLLM`` thread). A request finished by a stop
string is only known here, so ``process_outputs`` returns those ids for the caller to abort in the
core, which frees their blocks in the same step.

As in vLLM: the token that stopped a request (EOS or a stop id) stays in ``token_ids`` but adds
no text unless ``include_stop_str_in_output``; a stop string only counts in the text of outputs
after the first ``min_tokens``; a DELTA stream carries the prompt logprobs once, in its first
output.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sched_output import EngineCoreOutput
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.logprob_text import LogprobTokenText, TokenDecoder
from jaxserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, RequestOutputKind
from jaxserve.engine.stop_strings import StopMatcher
from jaxserve.engine.timeline import (
    ERROR,
    EntryTimes,
    RequestTimeline,
    SampleTimeline,
    TimelineStore,
    finish_cause,
)

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass
class ChildState:
    """One sample (one core request) of a parent request."""

    index: int
    core_id: str
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    logprob_text: LogprobTokenText | None = None  # None: logprobs carry no decoded text
    cumulative_logprob: float = 0.0
    text: str = ""
    sent_text_len: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: Any = None
    finish_cause: str | None = None  # timeline.FINISH_CAUSES
    stop_matcher: StopMatcher | None = None  # None: no stop strings


@dataclasses.dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    children: list[ChildState]
    metrics: RequestMetrics
    queue: Any = None  # per-request queue in AsyncLLM
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False  # DELTA: they go out once, in the first output after they arrive
    # The core's requests, read (never written) for their schedule times, preemptions, max_tokens;
    # dropped once the request ended (``release``), with what the timeline still needs kept.
    core_requests: list = dataclasses.field(default_factory=list)
    max_tokens: int | None = None  # resolved by the scheduler; kept when the core requests go
    trace_headers: dict[str, str] | None = None  # the caller's W3C trace context, for the span
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    lora_key: str | None = None  # that adapter's prefix-cache key (name@sha256)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def sync_core_times(self, m: RequestMetrics | None = None) -> None:
        """Copy the core's first-schedule time and preemption count into the metrics, or into
        ``m`` (a copy, when another thread reads a timeline). Done at the first token, at the end
        and when a timeline is read: not on every output."""
        m = self.metrics if m is None else m
        reqs = self.core_requests
        if not reqs:
            return
        if m.first_scheduled_time is None:
            scheduled = [r.scheduled_ts for r in reqs if r.scheduled_ts is not None]
            if scheduled:
                m.first_scheduled_time = min(scheduled)
                if m.queued_time is not None:
                    m.time_in_queue = m.first_scheduled_time - m.queued_time
        m.num_preemptions = reqs[0].num_preemptions if len(reqs) == 1 else sum(r.num_preemptions for r in reqs)
        m.num_encoded_images = sum(r.num_encoded_images for r in reqs)
        m.encoder_time = sum(r.encoder_seconds for r in reqs)

    def release(self) -> None:
        """The request ended: keep what its timeline reads, drop the core requests (their token and
        hash lists), detokenizers and logprobs, so kept timelines stay small."""
        self.sync_core_times()
        if self.core_requests:
            self.max_tokens = self.core_requests[0].max_tokens
        self.core_requests = []
        self.prompt_logprobs = None
        for child in self.children:
            child.detok, child.logprobs, child.logprob_text = None, None, None

    def timeline(self, keep_token_ids: bool) -> RequestTimeline:
        metrics = dataclasses.replace(self.metrics)
        self.sync_core_times(metrics)
        samples = [SampleTimeline(c.index, len(c.token_ids), c.finish_reason, c.finish_cause, c.stop_reason,
                                  list(c.token_ids) if keep_token_ids else None) for c in self.children]
        reqs = self.core_requests
        return RequestTimeline(
            request_id=self.request_id, finished=self.finished, num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens, metrics=metrics, sampling_params=self.children[0].params,
            max_tokens=reqs[0].max_tokens if reqs else self.max_tokens,
            samples=samples, prompt_token_ids=list(self.prompt_token_ids) if keep_token_ids else None,
            lora_name=self.lora_name, lora_key=self.lora_key)


class OutputProcessor:
    """Also the home of request timelines: live ones are its parents, finished ones (the newest
    ``max_timelines``) stay in ``timelines``; token ids show in them only with ``keep_token_ids``."""

    def __init__(self, tokenizer, on_finished: Callable[[ParentState], None] | None = None, *,
                 max_timelines: int = 1024, keep_token_ids: bool = False):
        self.tokenizer = tokenizer
        self.token_decoder = None if tokenizer is None else TokenDecoder(tokenizer)
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, ChildState]] = {}
        self.on_finished = on_finished
        self.timelines = TimelineStore(max_timelines)
        self.keep_token_ids = keep_token_ids
        self.on_ended: Callable[[ParentState], None] | None = None  # finished, aborted or failed

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    child_ids: list[str], child_params: list[SamplingParams], output_kind: RequestOutputKind,
                    arrival_time: float, queue: Any = None, *, core_requests: list | None = None,
                    entry: EntryTimes | None = None, tokenized_time: float | None = None) -> ParentState:
        children = []
        for i, (core_id, params) in enumerate(zip(child_ids, child_params)):
            detok = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                     if params.detokenize and self.tokenizer is not None else None)
            wants_logprobs = params.logprobs is not None
            children.append(ChildState(i, core_id, params, detok, logprobs=[] if wants_logprobs else None,
                                       logprob_text=self._logprob_text(params) if wants_logprobs else None,
                                       stop_matcher=self._stop_matcher(params)))
        metrics = RequestMetrics(arrival_time=arrival_time, tokenized_time=tokenized_time)
        if entry is not None:
            metrics.received_time, metrics.templated_time = entry.received, entry.templated
            if entry.tokenized is not None:  # the server tokenized (a chat): the engine only validated
                metrics.tokenized_time = entry.tokenized
        parent = ParentState(request_id, prompt, prompt_token_ids, output_kind, children, metrics, queue,
                             core_requests=list(core_requests or []),
                             trace_headers=None if entry is None else entry.trace_headers)
        self.parents[request_id] = parent
        for child in children:
            self.child_to_parent[child.core_id] = (parent, child)
        return parent

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def forget_all(self) -> list[ParentState]:
        """Drop every request (the engine died); returns them. Their timelines end in ``error``."""
        parents = list(self.parents.values())
        self.parents.clear()
        self.child_to_parent.clear()
        now = time.monotonic()
        for parent in parents:
            self._end_unfinished(parent, ERROR, now)
        return parents

    def abort_requests(self, request_ids: list[str], cause: str = "abort") -> tuple[list[str], list[ParentState]]:
        """Forget parents; returns the core ids of their unfinished children (to abort in the core)
        and the parents forgotten (each one an aborted request). ``cause`` (a timeline finish cause:
        abort, client_disconnect, error) goes in their timelines."""
        core_ids = []
        aborted = []
        now = time.monotonic()
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            for child in parent.children:
                self.child_to_parent.pop(child.core_id, None)
                if child.finish_reason is None:
                    core_ids.append(child.core_id)
            aborted.append(parent)
            self._end_unfinished(parent, cause, now)  # sets its finished time
        return core_ids, aborted

    def _end_unfinished(self, parent: ParentState, cause: str, now: float) -> None:
        for child in parent.children:
            if child.finish_reason is None:
                child.finish_reason, child.finish_cause = "abort", cause
        parent.metrics.finished_time = now
        self._ended(parent)

    def _ended(self, parent: ParentState) -> None:
        parent.release()
        self.timelines.add(parent.request_id, parent)
        if self.on_ended is not None:
            self.on_ended(parent)

    def get_timeline(self, request_id: str) -> RequestTimeline | None:
        """A live request's timeline so far, or a finished one's while the store keeps it."""
        parent = self.parents.get(request_id) or self.timelines.get(request_id)
        return None if parent is None else parent.timeline(self.keep_token_ids)

    def recent_timelines(self, limit: int) -> list[RequestTimeline]:
        """The newest ``limit`` finished requests' timelines, then every live one's."""
        parents = self.timelines.recent(limit) + list(self.parents.values())
        return [p.timeline(self.keep_token_ids) for p in parents]

    def process_outputs(
            self, outputs: list[EngineCoreOutput]) -> tuple[list[tuple[ParentState, RequestOutput]], list[str]]:
        """Returns ``(request outputs to deliver, core ids stopped by a stop string)``."""
        now = time.monotonic()
        # DELTA outputs carry one child each, so two children advancing in one step are two
        # deliveries; the other kinds carry every child and keep only the parent's latest.
        delivered: dict[Any, tuple[ParentState, RequestOutput]] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self.child_to_parent.get(out.request_id)
            if entry is None:
                continue
            parent, child = entry
            try:
                if self._take_output(parent, child, out, now):
                    to_abort.append(child.core_id)
                ro = self._make_output(parent, child)
            except Exception:  # this request's fault: it alone fails
                logger.exception("request %s failed while its output was processed", parent.request_id)
                if self._fail_child(child, out):
                    to_abort.append(child.core_id)
                ro = self._error_output(parent, child)
            if ro is not None:
                key = ((parent.request_id, child.index) if parent.output_kind == RequestOutputKind.DELTA
                       else parent.request_id)
                delivered[key] = (parent, ro)
            if parent.finished:
                parent.metrics.finished_time = now
                self.parents.pop(parent.request_id, None)
                for c in parent.children:
                    self.child_to_parent.pop(c.core_id, None)
                self._ended(parent)
                if self.on_finished is not None:
                    self.on_finished(parent)
        return list(delivered.values()), to_abort

    # ---- internals -----------------------------------------------------------------------------

    def _take_output(self, parent: ParentState, child: ChildState, out: EngineCoreOutput, now: float) -> bool:
        """Take in one core output; True if a stop string finished the child just now."""
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.new_prompt_logprobs is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = self._prompt_logprobs(parent, out.new_prompt_logprobs)
        if out.new_token_ids and parent.metrics.first_token_time is None:
            parent.sync_core_times()
        self._update_metrics(parent.metrics, out, now)
        return self._apply_tokens(child, out)

    @staticmethod
    def _fail_child(child: ChildState, out: EngineCoreOutput) -> bool:
        """Finish a child with "error"; True if the core still runs it (the caller aborts it):
        only the core's own finish reason says it stopped there (a stop string is found here)."""
        child.finish_reason, child.stop_reason, child.finish_cause = ERROR, None, ERROR
        return out.finish_reason is None

    def _error_output(self, parent: ParentState, child: ChildState) -> RequestOutput | None:
        """The output that reports a failed child; a bare one if even building the usual fails."""
        try:
            return self._make_output(parent, child)
        except Exception:  # noqa: BLE001 - the request has already failed; report it plainly
            failed = CompletionOutput(child.index, "", [], None, None, ERROR, None)
            return RequestOutput(request_id=parent.request_id, prompt=parent.prompt,
                                 prompt_token_ids=parent.prompt_token_ids, outputs=[failed],
                                 finished=parent.finished, metrics=parent.metrics)

    @staticmethod
    def _update_metrics(m: RequestMetrics, out: EngineCoreOutput, now: float) -> None:
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.num_generation_tokens += len(out.new_token_ids)

    def _apply_tokens(self, child: ChildState, out: EngineCoreOutput) -> bool:
        """Take in one core output; True if a stop string finished the child just now."""
        num_before = len(child.token_ids)
        child.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and child.logprobs is not None:
            # Speculative decoding brings one row per token, a plain step one row.
            rows = out.new_logprobs if isinstance(out.new_logprobs, list) else [out.new_logprobs]
            for ids, values, rank in rows:
                texts = child.logprob_text.position(ids) if child.logprob_text is not None else None
                child.logprobs.append(self._logprob_dict(ids, values, rank, texts))
                child.cumulative_logprob += values[0]
        if out.finish_reason is not None:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            child.finish_cause = finish_cause(out.finish_reason, out.stop_reason)
        if child.detok is None:
            return False
        params = child.params
        text_ids = out.new_token_ids
        if out.finish_reason == "stop" and text_ids and not params.include_stop_str_in_output:
            text_ids = text_ids[:-1]  # the stop token (EOS or a stop id) adds no text
        # Text of the first min_tokens outputs is never searched for a stop string.
        early = min(len(text_ids), max(0, params.min_tokens - num_before))
        child.text += child.detok.update(text_ids[:early])
        searchable_from = len(child.text)
        child.text += child.detok.update(text_ids[early:])
        if child.finish_reason is not None:
            child.text += child.detok.flush()
        matcher = child.stop_matcher
        if matcher is None or child.finish_reason == "abort" or len(child.token_ids) <= params.min_tokens:
            return False
        hit = matcher.find(child.text, searchable_from)
        if hit is None:
            return False
        index, stop = hit
        child.text = child.text[: index + len(stop)] if params.include_stop_str_in_output else child.text[:index]
        already_finished = child.finish_reason is not None
        child.finish_reason, child.stop_reason = "stop", stop
        child.finish_cause = finish_cause("stop", stop)
        return not already_finished

    @staticmethod
    def _stop_matcher(params: SamplingParams) -> StopMatcher | None:
        return StopMatcher(params.stop) if isinstance(params.stop, list) and params.stop else None

    def _logprob_text(self, params: SamplingParams) -> LogprobTokenText | None:
        """Decoded texts for a sequence's logprobs; None without a tokenizer or with detokenize off."""
        if self.token_decoder is None or not params.detokenize:
            return None
        return self.token_decoder.sequence()

    @staticmethod
    def _logprob_dict(ids: list[int], values: list[float], rank: int,
                      texts: list[str] | None) -> dict[int, Logprob]:
        """One position: the chosen token (its rank) first, then the top-N by rank."""
        shown: list[str | None] = list(texts) if texts is not None else [None] * len(ids)
        entry = {ids[0]: Logprob(values[0], rank, shown[0])}
        for r, (tid, val, text) in enumerate(zip(ids[1:], values[1:], shown[1:]), start=1):
            entry.setdefault(tid, Logprob(val, r, text))
        return entry

    def _prompt_logprobs(self, parent: ParentState, rows: list) -> list:
        """``[None, {token: Logprob}, ...]``: one dict per prompt position after the first."""
        texts = self._logprob_text(parent.children[0].params)
        if texts is not None and parent.prompt_token_ids:
            texts.position(parent.prompt_token_ids[:1])  # a character may start in the first token
        result: list = [None]
        for ids, values, rank in rows:
            result.append(self._logprob_dict(ids, values, rank, None if texts is None else texts.position(ids)))
        return result

    def _visible_text_len(self, child: ChildState) -> int:
        if child.finish_reason is not None or child.stop_matcher is None:
            return len(child.text)
        return len(child.text) - child.stop_matcher.partial_len(child.text)

    def _make_output(self, parent: ParentState, child: ChildState) -> RequestOutput | None:
        kind = parent.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            if not parent.finished:
                return None
            outs = [self._completion(c, cumulative=True) for c in parent.children]
        elif kind == RequestOutputKind.CUMULATIVE:
            outs = [self._completion(c, cumulative=True) for c in parent.children]
        else:
            outs = [self._completion(child, cumulative=False)]
        prompt_logprobs = parent.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            if parent.prompt_logprobs_sent:
                prompt_logprobs = []  # vLLM's: sent already, so none new (None means not asked for)
            elif prompt_logprobs is not None:
                parent.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            outputs=outs, finished=parent.finished, prompt_logprobs=prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens, metrics=parent.metrics)

    def _completion(self, c: ChildState, cumulative: bool) -> CompletionOutput:
        visible = self._visible_text_len(c)
        cum_lp = c.cumulative_logprob if c.logprobs is not None else None
        if cumulative:
            return CompletionOutput(c.index, c.text[:visible], list(c.token_ids), cum_lp,
                                    None if c.logprobs is None else list(c.logprobs), c.finish_reason, c.stop_reason)
        text = c.text[c.sent_text_len : visible]
        tokens = c.token_ids[c.sent_tokens :]
        lps = None if c.logprobs is None else c.logprobs[c.sent_logprobs :]
        c.sent_text_len = max(c.sent_text_len, visible)
        c.sent_tokens = len(c.token_ids)
        c.sent_logprobs = 0 if c.logprobs is None else len(c.logprobs)
        return CompletionOutput(c.index, text, tokens, cum_lp, lps, c.finish_reason, c.stop_reason)
