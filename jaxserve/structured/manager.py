"""The structured-output requests of one engine: their grammars compiling in a thread pool, their
matchers, and each step's token bitmask (vLLM V1's ``StructuredOutputManager``).

Invariants:
  * a request is tracked from ``add_request`` until ``release`` (the scheduler calls it when the
    request finishes) or until ``take_failed`` hands it back because its grammar failed;
  * between steps, a ready request's matcher has consumed exactly the request's output tokens
    after its reasoning (preemption keeps them, so it never rolls back; within a step, tokens fed
    ``accept_ahead`` of the scheduler that the scheduler then does not take are rolled back by
    ``settle``);
  * with a ``reasoner`` (the engine's ``reasoning_parser``), a request whose prompt does not end
    its reasoning is *thinking*: its row is not masked and its tokens are not fed to the matcher
    until it generates the end tag; the first token after the tag is the first constrained one;
  * a request ends on the end (EOS) token that its complete grammar forces, so its output, like
    vLLM's, ends with that token, which adds no text;
  * a bitmask row is all ones (every token allowed) for a row without a matcher; a constrained row
    allows only the tokens its grammar allows next, and never a token id past the tokenizer's
    vocabulary (the model's padded vocabulary).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy as llnp
import numpy as np

from jaxserve.core.structured_outputs import GRAMMAR_FAILED, GRAMMAR_PENDING, GRAMMAR_READY, StructuredOutputsParams
from jaxserve.structured.backend import GrammarBackend, GrammarError
from jaxserve.structured.reasoner import Reasoner

logger = logging.getLogger("jaxserve")


# Constrained rows from which a step's masks are filled in llguidance's thread pool (vLLM's
# threshold): below it a pool's hand-off can cost more than the masks themselves.
PARALLEL_FILL_MIN_ROWS = 128


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one bitmask row (32 tokens per word); the compiled step's bitmask input has
    this width for the model's vocabulary."""
    return (vocab_size + 31) // 32


@dataclasses.dataclass
class Advanced:
    """What feeding ``token_ids`` to a request did: whether it must stop, how many tokens its
    matcher consumed, and its thinking tail before (None: it was not thinking), for an undo."""

    token_ids: list[int]
    stop: bool
    consumed: int
    thinking: list[int] | None


@dataclasses.dataclass
class GrammarState:
    """One request's grammar: compiling (``future``), ready (``matcher``) or failed (``error``)."""

    future: Future | None
    submitted: float
    matcher: llguidance.LLMatcher | None = None
    error: str | None = None


class StructuredOutputManager:
    """Implements the scheduler's ``StructuredOutputHooks``; the engine core asks it for each
    step's bitmask. ``model_vocab_size`` is the width of the model's logits."""

    def __init__(self, backend: GrammarBackend, model_vocab_size: int, compile_timeout_s: float,
                 compile_threads: int = 2, mask_threads: int | None = None,
                 reasoner: Reasoner | None = None):
        self.backend = backend
        self.reasoner = reasoner
        self.model_vocab_size = model_vocab_size
        self.width = bitmask_width(model_vocab_size)
        self.compile_timeout_s = compile_timeout_s
        self._pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="jaxserve-grammar")
        # Masks of up to PARALLEL_FILL_MIN_ROWS rows are filled on the engine thread; larger batches
        # in llguidance's pool of this many threads, made on first use (vLLM's sizes).
        self._mask_threads = mask_threads or max(1, min((os.cpu_count() or 2) // 2, 8))
        self._executor: llguidance.LLExecutor | None = None
        self._states: dict[str, GrammarState] = {}
        self._matchers: dict[str, llguidance.LLMatcher] = {}  # the ready ones (the per-step lookups)
        # Requests still thinking -> their last tokens (an end tag of several tokens may straddle
        # two steps); from add_request until the end tag.
        self._thinking: dict[str, list[int]] = {}
        self._ahead: dict[str, Advanced] = {}  # tokens fed ahead of the scheduler (``accept_ahead``)

    # ---- lifecycle -----------------------------------------------------------------------------

    def add_request(self, request_id: str, params: StructuredOutputsParams,
                    prompt_token_ids: Sequence[int] = ()) -> None:
        """Start compiling the request's grammar (a cached grammar is only copied). With a
        reasoner, the request starts thinking unless its prompt already ended the reasoning."""
        future = self._pool.submit(self.backend.compile, params)
        self._states[request_id] = GrammarState(future, time.monotonic())
        if self.reasoner is not None and not self.reasoner.is_reasoning_end(prompt_token_ids):
            self._thinking[request_id] = []

    def grammar_status(self, request_id: str) -> str:
        state = self._states.get(request_id)
        if state is None:
            return GRAMMAR_FAILED
        if state.matcher is not None:
            return GRAMMAR_READY
        if state.error is None:
            self._poll(request_id, state)
        return GRAMMAR_READY if state.matcher is not None else (GRAMMAR_PENDING if state.error is None
                                                                 else GRAMMAR_FAILED)

    def _poll(self, request_id: str, state: GrammarState) -> None:
        future = state.future
        assert future is not None
        if future.done():
            try:
                state.matcher = future.result()
                self._matchers[request_id] = state.matcher
            except GrammarError as e:
                state.error = str(e)
            except Exception as e:  # any compile failure fails this request only
                logger.exception("request %s: compiling its grammar failed", request_id)
                state.error = f"compiling the grammar failed: {e}"
            state.future = None
        elif time.monotonic() - state.submitted > self.compile_timeout_s:
            state.error = (f"the grammar did not compile within {self.compile_timeout_s:g} s "
                           "(structured_outputs_compile_timeout_s)")

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, reason) of every request whose grammar failed or timed out; they are no
        longer tracked. Cheap when nothing is compiling."""
        failed = []
        for request_id, state in self._states.items():
            if state.matcher is None and state.error is None:
                self._poll(request_id, state)
            if state.error is not None:
                failed.append((request_id, state.error))
        for request_id, _ in failed:
            del self._states[request_id]
            self._thinking.pop(request_id, None)
        return failed

    def release(self, request_id: str) -> None:
        self._ahead.pop(request_id, None)
        self._states.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._thinking.pop(request_id, None)

    def tracks(self, request_id: str) -> bool:
        """True while the request has a ready matcher."""
        return request_id in self._matchers

    def is_thinking(self, request_id: str) -> bool:
        """True while the request's reasoning has not ended (its grammar does not apply yet)."""
        return request_id in self._thinking

    @property
    def num_active(self) -> int:
        return len(self._matchers)

    # ---- tokens --------------------------------------------------------------------------------

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        ahead = self._ahead.pop(request_id, None)
        if ahead is not None:
            if ahead.token_ids == token_ids:
                return ahead.stop
            self._undo(request_id, ahead)  # the scheduler took other tokens than were fed ahead
        return self._advance(request_id, token_ids).stop

    def validate_tokens(self, request_id: str, token_ids: list[int]) -> int:
        """The valid prefix's length of drafts. While the request thinks, none: a draft crossing
        the end tag would need the grammar from the middle of the draft (not built)."""
        matcher = self._matchers.get(request_id)
        if matcher is None or request_id in self._thinking or request_id in self._ahead:
            return 0
        if matcher.is_error():
            return 0
        return int(matcher.validate_tokens(token_ids))

    def accept_ahead(self, sampled: dict[str, int]) -> None:
        """Feed a step's sampled tokens (request id -> token) to the matchers before the scheduler
        takes them, so that the next step's bitmask is filled, and the step launched, first. The
        scheduler's ``accept_tokens`` of the same tokens then only returns the result; ``settle``
        after its update undoes what it did not take."""
        matchers, ahead = self._matchers, self._ahead
        for request_id, token_id in sampled.items():
            if request_id in matchers:
                try:
                    ahead[request_id] = self._advance(request_id, [token_id])
                except Exception:  # the scheduler's own accept of it then fails this request alone
                    logger.exception("request %s: feeding its token ahead failed", request_id)

    def settle(self) -> None:
        """Undo the tokens fed ahead that the scheduler did not take (a request it dropped the
        token of), so every matcher has consumed exactly its request's tokens again."""
        for request_id, ahead in self._ahead.items():
            self._undo(request_id, ahead)
        self._ahead.clear()

    def _advance(self, request_id: str, token_ids: list[int]) -> Advanced:
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return Advanced(token_ids, False, 0, None)
        thinking = self._thinking.get(request_id)
        if thinking is not None:
            token_ids_after = self._after_reasoning(request_id, token_ids)
            if not token_ids_after:
                return Advanced(token_ids, False, 0, thinking)
        else:
            token_ids_after = token_ids
        stop, consumed = self._consume(request_id, matcher, token_ids_after)
        return Advanced(token_ids, stop, consumed, thinking)

    def _consume(self, request_id: str, matcher: llguidance.LLMatcher, token_ids: list[int]) -> tuple[bool, int]:
        """(stop, how many tokens the matcher consumed)."""
        end_tokens = self.backend.end_tokens
        for k, token_id in enumerate(token_ids):
            # A complete grammar allows only the end token next (as in vLLM the request then stops
            # on it like on any EOS); a request that ignores EOS stops on it too.
            if matcher.is_stopped():
                if token_id not in end_tokens:
                    self._warn_rejected(request_id, token_id, "after the grammar completed")
                return True, k
            if not matcher.consume_token(token_id):
                # The mask allowed only grammatical tokens, so this is a bug, not a request error:
                # stop the request rather than let its output leave the grammar.
                self._warn_rejected(request_id, token_id, matcher.get_error())
                return True, k
        return matcher.is_stopped() and token_ids[-1] in end_tokens, len(token_ids)

    def _undo(self, request_id: str, ahead: Advanced) -> None:
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        if ahead.consumed and not matcher.is_error():
            matcher.rollback(ahead.consumed)
        if ahead.thinking is not None:
            self._thinking[request_id] = ahead.thinking

    def _after_reasoning(self, request_id: str, token_ids: list[int]) -> list[int]:
        """The tokens that follow the end tag, if ``token_ids`` complete it (the request then stops
        thinking); none while the reasoning goes on."""
        assert self.reasoner is not None
        tail = self._thinking[request_id]
        ended = self.reasoner.end_in(tail, token_ids)
        if ended is None:
            keep = len(self.reasoner.end) - 1
            self._thinking[request_id] = (tail + token_ids)[-keep:] if keep else []
            return []
        del self._thinking[request_id]
        return token_ids[ended:]

    @staticmethod
    def _warn_rejected(request_id: str, token_id: int, why: str) -> None:
        logger.warning("request %s: the grammar rejected token %d (%s); the request stops", request_id, token_id, why)

    def grammar_bitmask(self, req_ids: list[str], num_rows: int,
                        drafts: Sequence[Sequence[int]] | None = None) -> np.ndarray | None:
        """The step's bitmask [num_rows, width] for rows ``req_ids`` (then padding rows), or None
        when no row is constrained (the step then needs none).

        With ``drafts`` (a speculative step: each row's drafts), the step has one mask row per
        verified position, the rows' d+1 positions end to end: position j of a row is masked by
        its grammar after its drafts before j (fed to the matcher, then rolled back). The
        scheduler keeps only drafts the grammar accepts (``validate_tokens``)."""
        if not self._matchers:
            return None
        matchers, thinking = self._matchers, self._thinking
        where = list(range(len(req_ids)))
        if drafts is not None:  # each row's first position
            where = np.concatenate([[0], np.cumsum([len(d) + 1 for d in drafts])[:-1]]).astype(int).tolist()
        rows = [(matchers[r], where[i]) for i, r in enumerate(req_ids) if r in matchers and r not in thinking]
        if not rows:
            return None
        bitmask = np.full((num_rows, self.width), -1, np.int32)
        # constrained rows with drafts: (matcher, drafts, first position)
        drafted = [] if drafts is None else [
            (matchers[r], list(d), where[i]) for i, (r, d) in enumerate(zip(req_ids, drafts))
            if d and r in matchers and r not in thinking]
        for _, d, first in drafted:  # their later positions (the first ones are in ``rows``)
            bitmask[first + 1 : first + 1 + len(d)] = 0
        bitmask[[i for _, i in rows]] = 0  # ids past the tokenizer's vocabulary stay illegal
        if len(rows) < PARALLEL_FILL_MIN_ROWS:
            self._fill_here(rows, bitmask)
        else:
            self._fill_parallel(rows, bitmask)
        for matcher, d, first in drafted:
            self._fill_after_drafts(matcher, d, first, bitmask)
        return bitmask

    def _fill_after_drafts(self, matcher: llguidance.LLMatcher, drafts: list[int], first: int,
                           bitmask: np.ndarray) -> None:
        """Rows ``first + 1 ..``: the masks after each prefix of ``drafts``; the matcher is rolled
        back to where it was."""
        consumed = 0
        try:
            for j, token_id in enumerate(drafts):
                if not matcher.consume_token(token_id):  # validated before: a bug, not the request's
                    bitmask[first + 1 + j : first + 1 + len(drafts)] = 0  # nothing allowed past it
                    break
                consumed += 1
                self._fill_here([(matcher, first + 1 + j)], bitmask)
        finally:
            if consumed:
                matcher.rollback(consumed)

    def _fill_here(self, rows: list[tuple[llguidance.LLMatcher, int]], bitmask: np.ndarray) -> None:
        """Each row's mask computed on this thread, written straight into the row's first words
        (the tokenizer's width); no hand-off to a pool thread, which a busy host may wake late."""
        base, row_bytes = bitmask.ctypes.data, bitmask.shape[1] * 4
        tok_bytes = bitmask_width(self.backend.vocab_size) * 4
        for matcher, i in rows:
            matcher.unsafe_compute_mask_ptr(base + i * row_bytes, tok_bytes)

    def _fill_parallel(self, rows: list[tuple[llguidance.LLMatcher, int]], bitmask: np.ndarray) -> None:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._mask_threads)
        tok_width = bitmask_width(self.backend.vocab_size)
        if tok_width == self.width:
            llnp.fill_next_token_bitmask_par(self._executor, rows, bitmask)
            return
        # llguidance's pool writes rows of the tokenizer's width: fill compactly, then place them.
        compact = np.zeros((len(rows), tok_width), np.int32)
        llnp.fill_next_token_bitmask_par(self._executor, [(m, k) for k, (m, _) in enumerate(rows)], compact)
        n = min(tok_width, self.width)
        bitmask[[i for _, i in rows], :n] = compact[:, :n]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
