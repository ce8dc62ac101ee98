"""The scheduler's side of structured outputs, in pure Python: a request waits as WAITING_FOR_FSM
without holding up others, its sampled tokens reach its grammar, and the grammar can end it."""

from __future__ import annotations

from jaxserve.core import RequestStatus
from jaxserve.core.structured_outputs import GRAMMAR_PENDING, GRAMMAR_READY, StructuredOutputsParams
from tests.core.core_testing import FakeRunner, assert_all_free, check_pool_invariants, make_request, make_scheduler


class SequenceGrammar:
    """A grammar that accepts exactly ``length`` tokens then the end token ``end`` (the hooks the
    real ``StructuredOutputManager`` implements), with readiness set by the test."""

    def __init__(self, length: int, end: int):
        self.length, self.end = length, end
        self.ready: set[str] = set()
        self.accepted: dict[str, list[int]] = {}
        self.released: list[str] = []

    def grammar_status(self, request_id: str) -> str:
        return GRAMMAR_READY if request_id in self.ready else GRAMMAR_PENDING

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        seen = self.accepted.setdefault(request_id, [])
        seen.extend(token_ids)
        return len(seen) > self.length and seen[-1] == self.end

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def constrained(prompt, req_id, **kw):
    return make_request(prompt, req_id=req_id, structured_outputs=StructuredOutputsParams(regex="x+"), **kw)


def step(sched, runner):
    so = sched.schedule()
    outs = sched.update_from_output(so, runner.execute(so))
    check_pool_invariants(sched)
    return so, {o.request_id: o for o in outs}


def test_a_compiling_grammar_waits_without_blocking_later_requests():
    sched = make_scheduler()
    grammar = sched.structured_outputs = SequenceGrammar(length=3, end=9)
    runner = FakeRunner(sched.block_size, lambda rid: 9)
    first, plain = constrained([1, 2, 3], "c"), make_request([4, 5], req_id="p")
    sched.add_request(first)
    sched.add_request(plain)
    assert first.status is RequestStatus.WAITING_FOR_FSM
    so, _ = step(sched, runner)
    assert set(so.num_scheduled_tokens) == {"p"} and first.status is RequestStatus.WAITING_FOR_FSM
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert sched.waiting_reason == "grammar"  # the step record says why it waits
    grammar.ready.add("c")
    so, _ = step(sched, runner)
    assert "c" in so.num_scheduled_tokens and first.status is RequestStatus.RUNNING


def test_the_grammar_sees_every_token_and_ends_the_request():
    sched = make_scheduler()
    grammar = sched.structured_outputs = SequenceGrammar(length=3, end=9)
    grammar.ready.add("c")
    runner = FakeRunner(sched.block_size, lambda rid: 9)
    # ignore_eos: only the grammar can end it before max_tokens
    request = constrained([1, 2, 3], "c", eos=9, ignore_eos=True, max_tokens=10)
    sched.add_request(request)
    outs = {}
    while sched.has_requests():
        outs.update(step(sched, runner)[1])
    assert outs["c"].finish_reason == "stop" and request.output_token_ids == [9] * 4
    assert grammar.accepted["c"] == request.output_token_ids and grammar.released == ["c"]
    assert_all_free(sched)


def test_abort_releases_and_a_stop_check_wins():
    sched = make_scheduler()
    grammar = sched.structured_outputs = SequenceGrammar(length=100, end=9)
    grammar.ready.update({"a", "b"})
    runner = FakeRunner(sched.block_size, lambda rid: 7)
    sched.add_request(constrained([1, 2], "a"))
    sched.add_request(constrained([1, 2], "b", max_tokens=2))
    step(sched, runner)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    _, outs = step(sched, runner)
    assert outs["b"].finish_reason == "length"  # the grammar is not done: max_tokens ends it
    assert sorted(grammar.released) == ["a", "b"] and grammar.accepted["b"] == [7, 7]
    assert_all_free(sched)
