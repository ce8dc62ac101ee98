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
import time
from typing import Any, Callable, Optional

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sched_output import EngineCoreOutput
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.logprob_text import LogprobTokenText, TokenDecoder
from jaxserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, RequestOutputKind
from jaxserve.engine.stop_strings import find_new_stop, partial_stop_len


@dataclasses.dataclass
class ChildState:
    """One sample (one core request) of a parent request."""

    index: int
    core_id: str
    params: SamplingParams
    detok: Optional[IncrementalDetokenizer]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: Optional[list] = None
    logprob_text: Optional[LogprobTokenText] = None  # None: logprobs carry no decoded text
    cumulative_logprob: float = 0.0
    text: str = ""
    sent_text_len: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Any = None

    @property
    def stops(self) -> list[str]:
        """The stop strings (``SamplingParams`` keeps them as a list)."""
        return self.params.stop  # type: ignore[return-value]


@dataclasses.dataclass
class ParentState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    children: list[ChildState]
    metrics: RequestMetrics
    queue: Any = None  # per-request queue in AsyncLLM
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list] = None
    prompt_logprobs_sent: bool = False  # DELTA: they go out once, in the first output after they arrive

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer, on_finished: Optional[Callable[[ParentState], None]] = None):
        self.tokenizer = tokenizer
        self.token_decoder = None if tokenizer is None else TokenDecoder(tokenizer)
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, ChildState]] = {}
        self.on_finished = on_finished

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    child_ids: list[str], child_params: list[SamplingParams], output_kind: RequestOutputKind,
                    arrival_time: float, queue: Any = None) -> ParentState:
        children = []
        for i, (core_id, params) in enumerate(zip(child_ids, child_params)):
            detok = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                     if params.detokenize and self.tokenizer is not None else None)
            wants_logprobs = params.logprobs is not None
            children.append(ChildState(i, core_id, params, detok, logprobs=[] if wants_logprobs else None,
                                       logprob_text=self._logprob_text(params) if wants_logprobs else None))
        parent = ParentState(request_id, prompt, prompt_token_ids, output_kind, children,
                             RequestMetrics(arrival_time=arrival_time), queue)
        self.parents[request_id] = parent
        for child in children:
            self.child_to_parent[child.core_id] = (parent, child)
        return parent

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def forget_all(self) -> list[ParentState]:
        """Drop every request (the engine died); returns them."""
        parents = list(self.parents.values())
        self.parents.clear()
        self.child_to_parent.clear()
        return parents

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget parents; returns the core ids of their unfinished children (to abort in the core)."""
        core_ids = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            for child in parent.children:
                self.child_to_parent.pop(child.core_id, None)
                if child.finish_reason is None:
                    core_ids.append(child.core_id)
        return core_ids

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
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.new_prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = self._prompt_logprobs(parent, out.new_prompt_logprobs)
            self._update_metrics(parent.metrics, out, now)
            stopped_by_string = self._apply_tokens(child, out)
            if stopped_by_string:
                to_abort.append(child.core_id)
            ro = self._make_output(parent, child)
            if ro is not None:
                key = ((parent.request_id, child.index) if parent.output_kind == RequestOutputKind.DELTA
                       else parent.request_id)
                delivered[key] = (parent, ro)
            if parent.finished:
                parent.metrics.finished_time = now
                self.parents.pop(parent.request_id, None)
                for c in parent.children:
                    self.child_to_parent.pop(c.core_id, None)
                if self.on_finished is not None:
                    self.on_finished(parent)
        return list(delivered.values()), to_abort

    # ---- internals -----------------------------------------------------------------------------

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
            ids, values, rank = out.new_logprobs
            texts = child.logprob_text.position(ids) if child.logprob_text is not None else None
            child.logprobs.append(self._logprob_dict(ids, values, rank, texts))
            child.cumulative_logprob += values[0]
        if out.finish_reason is not None:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
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
        stops = child.stops
        if not stops or child.finish_reason == "abort" or len(child.token_ids) <= params.min_tokens:
            return False
        hit = find_new_stop(child.text, stops, searchable_from)
        if hit is None:
            return False
        index, stop = hit
        child.text = child.text[: index + len(stop)] if params.include_stop_str_in_output else child.text[:index]
        already_finished = child.finish_reason is not None
        child.finish_reason, child.stop_reason = "stop", stop
        return not already_finished

    def _logprob_text(self, params: SamplingParams) -> Optional[LogprobTokenText]:
        """Decoded texts for a sequence's logprobs; None without a tokenizer or with detokenize off."""
        if self.token_decoder is None or not params.detokenize:
            return None
        return self.token_decoder.sequence()

    @staticmethod
    def _logprob_dict(ids: list[int], values: list[float], rank: int,
                      texts: Optional[list[str]]) -> dict[int, Logprob]:
        """One position: the chosen token (its rank) first, then the top-N by rank."""
        shown: list[Optional[str]] = list(texts) if texts is not None else [None] * len(ids)
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
        if child.finish_reason is not None or not child.stops:
            return len(child.text)
        return len(child.text) - partial_stop_len(child.text, child.stops)

    def _make_output(self, parent: ParentState, child: ChildState) -> Optional[RequestOutput]:
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
                prompt_logprobs = None
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
