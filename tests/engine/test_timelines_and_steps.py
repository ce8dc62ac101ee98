"""Request timelines, step records and the trace, from a live engine on the demo model.

One question per stage of a request's life: when did it queue, run and finish, was it served from
the prefix cache or preempted, with which parameters, why did it end; and per step: who ran with
how many prefill or decode tokens, who waited and why, the KV blocks, the runner's timings.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core.sched_output import EngineCoreOutput
from jaxserve.core.schedule_record import WAIT_MAX_NUM_SEQS, WAIT_PREEMPTION, WAIT_REASONS, WAIT_TOKEN_BUDGET
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.outputs import RequestOutputKind
from jaxserve.engine.timeline import ERROR, FINISH_CAUSES, TimelineStore
from tests.shapes import ENGINE_TESTS_SHAPE
from tests.trace_checks import check_chrome_trace

BLOCK = 16  # the default block size


@pytest.fixture(scope="module")
def llm(demo_model):
    return LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 1000, n).tolist()


def assert_stages_in_order(m) -> None:
    chain = [m.queued_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time]
    assert None not in chain, m
    assert chain == sorted(chain), m
    assert m.arrival_time <= m.tokenized_time <= m.queued_time
    assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.queued_time)
    assert m.time_to_first_token == pytest.approx(m.first_token_time - m.arrival_time)


def test_finish_causes_stages_and_effective_params(llm):
    p = prompt(1, 20)
    greedy = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    eos = llm.llm_engine.input_processor.eos_token_id
    text = greedy.text
    stop_char = next(c for c in text[1:] if c.strip())  # a visible character after the first
    params = {
        "length": SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        "stop_token": SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[greedy.token_ids[2]]),
        "stop_string": SamplingParams(temperature=0, max_tokens=8, stop=[stop_char]),
        "eos": SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}),
        "default_max_tokens": SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
    }
    outs = llm.generate([{"prompt_token_ids": p}] * len(params), list(params.values()), use_tqdm=False)
    for (name, sp), out in zip(params.items(), outs):
        timeline = llm.get_request_timeline(out.request_id)
        assert timeline is not None and timeline.finished
        (sample,) = timeline.samples
        assert sample.finish_reason == out.outputs[0].finish_reason
        assert sample.num_output_tokens == len(out.outputs[0].token_ids)
        expected = "length" if name == "default_max_tokens" else name
        assert sample.finish_cause == expected, (name, sample)
        assert timeline.metrics == out.metrics
        assert_stages_in_order(out.metrics)
        assert out.metrics.received_time is None and out.metrics.templated_time is None  # offline
        assert timeline.prompt_token_ids is None and sample.output_token_ids is None  # opt-in only
        # The effective parameters: as given, with max_tokens resolved against max_model_len.
        d = timeline.as_dict()["sampling_params"]
        assert d["temperature"] == sp.temperature and d["stop"] == (sp.stop or [])
        want_max = sp.max_tokens if sp.max_tokens is not None else ENGINE_TESTS_SHAPE["max_model_len"] - len(p)
        assert d["max_tokens"] == want_max
    assert outs[0].outputs[0].finish_reason == "length"
    assert outs[2].outputs[0].stop_reason == stop_char
    assert len(outs[4].outputs[0].token_ids) == ENGINE_TESTS_SHAPE["max_model_len"] - len(p)


def test_abort_is_a_finish_with_its_cause(llm):
    engine = llm.llm_engine
    engine.add_request("to-abort", {"prompt_token_ids": prompt(2, 30)},
                       SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       output_kind=RequestOutputKind.DELTA)
    for _ in range(3):
        engine.step()
    live = llm.get_request_timeline("to-abort")
    assert live is not None and not live.finished and live.metrics.first_scheduled_time is not None
    engine.abort_request(["to-abort"])
    done = llm.get_request_timeline("to-abort")
    assert done.finished and done.samples[0].finish_cause == "abort" and done.max_tokens == 50
    kept = engine.output_processor.timelines.get("to-abort")
    assert kept.core_requests == [] and all(c.detok is None for c in kept.children)  # only what timelines read
    assert done.metrics.finished_time >= done.metrics.first_scheduled_time
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.stats()["num_requests_running"] == 0


def test_prefix_hit_shows_in_timeline_and_step(llm):
    p = prompt(3, 100)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
    hit = (len(p) - 1) // BLOCK * BLOCK  # full blocks only; the last prompt token is always computed
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == hit
    assert llm.get_request_timeline(second.request_id).num_cached_tokens == hit
    admitted = [r for r in llm.get_step_records() if second.request_id in r.new_request_ids]
    assert admitted[-1].scheduled[second.request_id] == len(p) - hit
    assert second.request_id in admitted[-1].schedule.prefill_ids


def test_step_records_under_pressure_show_waits_and_preemptions(llm):
    """More requests than max_num_seqs, prompts longer than a step's budget and more KV than the
    pool holds: every kind of wait, and preemptions, with the records consistent throughout."""
    engine = llm.llm_engine
    before = llm.stats()["num_preemptions"]
    last_step = llm.get_step_records(1)[0].step
    n = ENGINE_TESTS_SHAPE["max_num_seqs"] + 4
    prompts = [{"prompt_token_ids": prompt(100 + i, 100)} for i in range(n)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=140, ignore_eos=True), use_tqdm=False)
    records = [r for r in llm.get_step_records() if r.step > last_step]
    preemptions = llm.stats()["num_preemptions"] - before
    assert preemptions > 0, "the workload must not fit the KV pool"

    # Preemptions: the step records, the request timelines and the counter agree.
    preempted = [rid for r in records for rid in r.preempted_ids]
    assert len(preempted) == preemptions
    per_request = {o.request_id: o.metrics.num_preemptions for o in outs}
    assert sum(per_request.values()) == preemptions
    assert all(per_request[rid] > 0 for rid in preempted)

    reasons = {r.schedule.waiting_reason for r in records if r.waiting_ids}
    assert {WAIT_TOKEN_BUDGET, WAIT_MAX_NUM_SEQS, WAIT_PREEMPTION} <= reasons <= set(WAIT_REASONS)
    assert all(r.schedule.waiting_reason == WAIT_PREEMPTION for r in records if r.preempted_ids and r.waiting_ids)
    assert records[0].waiting_ids == [o.request_id for o in outs[1:]]  # the first prompt takes the whole budget
    assert records[0].schedule.waiting_reason == WAIT_TOKEN_BUDGET

    budget = ENGINE_TESTS_SHAPE["max_num_batched_tokens"]
    for r in records:
        s = r.schedule
        assert sum(s.scheduled.values()) == s.num_scheduled_tokens == r.num_tokens <= budget
        assert s.num_prefill_tokens + s.num_decode_tokens == s.num_scheduled_tokens
        assert all(s.scheduled[rid] == 1 for rid in s.scheduled if rid not in s.prefill_ids)  # decodes
        assert s.num_blocks_used + s.num_blocks_free == s.num_blocks_total
        assert 0 <= s.num_blocks_cached_free <= s.num_blocks_free
        assert (s.waiting_reason is None) == (not s.waiting_ids)
        assert s.num_waiting == len(s.waiting_ids)  # a short queue: every id is kept
        if r.num_tokens:
            assert r.token_bucket == llm.llm_engine.core.runner.buckets.pick(r.num_tokens)
            assert r.start <= r.dispatched <= r.collect_start <= r.device_end <= r.end
            assert r.device_s > 0 and r.prepare_s > 0 and r.idle_gap_s >= 0
            assert r.backend == llm.stats()["attention_backend"] and r.compiled
        assert r.seconds == pytest.approx(r.schedule_s + r.prepare_s + r.wait_s + r.update_s)
    assert any(r.schedule.num_decode_tokens and r.schedule.num_prefill_tokens for r in records)  # mixed steps
    assert sum(len(t) for r in records for t in r.sampled.values()) >= sum(len(o.outputs[0].token_ids) for o in outs)

    # After the run the pool is empty, and the cached-free count matches the blocks themselves.
    pool = engine.core.scheduler.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_cached_free_blocks == sum(1 for b in pool.blocks[1:] if b.block_hash is not None) > 0

    trace = llm.export_trace(num_requests=len(outs))
    tracks = check_chrome_trace(trace)
    request_tracks = [events for (pid, _), events in tracks.items() if pid == 2]
    assert len(request_tracks) == len(outs)
    for events in request_tracks:
        outer, *stages = events
        assert outer["name"].startswith("request ")
        names = [e["name"] for e in stages]
        assert names == [s for s in ("tokenize", "to engine", "queue", "prefill", "decode") if s in names]
        assert {"queue", "prefill", "decode"} <= set(names)
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i" and e["name"] == "preempted"]
    assert len(instants) == preemptions


def test_export_trace_writes_the_file(llm, tmp_path):
    llm.generate({"prompt_token_ids": prompt(5, 10)}, SamplingParams(max_tokens=3), use_tqdm=False)
    path = tmp_path / "trace.json"
    trace = llm.export_trace(str(path), num_steps=5, num_requests=1)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))
    tracks = check_chrome_trace(trace)
    assert sum(1 for (pid, _) in tracks if pid == 2) == 1
    host = tracks[(1, 1)]
    assert sum(1 for e in host if e["name"].endswith("schedule+prepare")) == 5


def test_token_ids_are_opt_in_and_engine_failure_ends_in_error(tokenizer):
    ids = tokenizer.encode("hello world")
    for keep in (False, True):
        proc = OutputProcessor(tokenizer, keep_token_ids=keep)
        proc.add_request("r", None, ids, ["r"], [SamplingParams(max_tokens=4)], RequestOutputKind.DELTA, 0.0)
        proc.process_outputs([EngineCoreOutput("r", [5, 6])])
        t = proc.get_timeline("r")
        assert (t.prompt_token_ids, t.samples[0].output_token_ids) == ((ids, [5, 6]) if keep else (None, None))
        assert not t.finished
        proc.forget_all()  # the engine died
        t = proc.get_timeline("r")
        assert t.finished and t.samples[0].finish_cause == ERROR in FINISH_CAUSES


def test_timeline_store_keeps_the_newest():
    store = TimelineStore(2)
    for rid in "abc":
        store.add(rid, rid.upper())
    assert store.get("a") is None and store.get("c") == "C"
    assert store.recent(5) == ["B", "C"] and store.recent(1) == ["C"] and store.recent(0) == []
    off = TimelineStore(0)
    off.add("a", "A")
    assert off.get("a") is None
