"""A fault of one request fails that request alone: the others finish with the tokens they get
without it, every block is freed and the engine loop lives on.

Faults are injected at each per-request point of the loop (hashing a block at admission and
during decode, detokenizing, stop-string matching) by a small callable patched in for the test;
the victim is picked out by a property only it has.
"""

from __future__ import annotations

import asyncio

import pytest

from jaxserve import LLM, AsyncLLM, InvalidRequestError, SamplingParams
from jaxserve.core import kv_cache_utils
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.stop_strings import StopMatcher
from tests.shapes import ENGINE_TESTS_SHAPE

VICTIM = "victim"
PROMPTS = {"a": [5, 17, 99, 200, 7, 31], "b": [44, 45, 46, 47, 48, 49, 50, 51], VICTIM: [300, 301, 302, 303]}
# Long enough for a second KV block (16 tokens) to complete during decode, so it is hashed then.
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def llm(demo_model):
    return LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE)


@pytest.fixture
def engine(llm):
    """The LLM's engine driven by an AsyncLLM loop thread, as the server drives it."""
    async_llm = AsyncLLM(llm.llm_engine)
    yield async_llm
    async_llm.shutdown()


def params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


async def collect(engine: AsyncLLM, request_id: str, sampling: SamplingParams, **kw):
    """(token ids, finish reason) of one request, or the exception it raised."""
    tokens: list[int] = []
    try:
        async for out in engine.generate({"prompt_token_ids": PROMPTS[request_id]}, sampling, request_id, **kw):
            tokens += out.outputs[0].token_ids
            reason = out.outputs[0].finish_reason
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return exc
    return tokens, reason


def run_all(engine: AsyncLLM, victim_params: SamplingParams) -> dict:
    async def main():
        names = list(PROMPTS)
        results = await asyncio.gather(*(collect(engine, n, victim_params if n == VICTIM else params())
                                         for n in names))
        return dict(zip(names, results))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def baseline(llm):
    async_llm = AsyncLLM(llm.llm_engine)
    try:
        return run_all(async_llm, params())
    finally:
        async_llm.shutdown()


def assert_only_the_victim_failed(engine: AsyncLLM, results: dict, baseline: dict) -> None:
    for name in PROMPTS:
        if name != VICTIM:
            assert results[name] == baseline[name], name
    assert not engine.is_dead
    stats = engine.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["kv_cache_usage_perc"] == 0.0
    # The loop still serves: the victim's prompt, asked again without the fault, runs as before.
    assert run_all(engine, params())[VICTIM] == baseline[VICTIM]


def test_a_hashing_fault_during_decode_fails_only_its_request(engine, baseline, monkeypatch):
    original = kv_cache_utils.generate_block_hash_extra_keys

    def faulty(request, start, end):
        if request.request_id == VICTIM and start > 0:  # the block completed during decode
            raise RuntimeError("injected hashing fault")
        return original(request, start, end)

    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", faulty)
    results = run_all(engine, params())
    tokens, reason = results[VICTIM]
    assert reason == "error" and len(tokens) < MAX_TOKENS
    monkeypatch.undo()
    assert_only_the_victim_failed(engine, results, baseline)


def test_a_hashing_fault_at_admission_fails_only_its_request(engine, baseline, monkeypatch):
    original = kv_cache_utils.generate_block_hash_extra_keys

    def faulty(request, start, end):
        if request.request_id == VICTIM:
            raise RuntimeError("injected hashing fault")
        return original(request, start, end)

    long_prompt = dict(PROMPTS)
    monkeypatch.setitem(PROMPTS, VICTIM, long_prompt[VICTIM] * 5)  # a full block: hashed on admission
    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", faulty)
    results = run_all(engine, params())
    assert isinstance(results[VICTIM], RuntimeError)
    monkeypatch.undo()
    assert_only_the_victim_failed(engine, results, baseline)


def test_a_detokenizer_fault_fails_only_its_request(engine, baseline, monkeypatch):
    original = IncrementalDetokenizer.update

    def faulty(self, new_token_ids):
        if not self.skip_special_tokens:  # only the victim asks for this
            raise RuntimeError("injected detokenizer fault")
        return original(self, new_token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "update", faulty)
    results = run_all(engine, params(skip_special_tokens=False))
    assert results[VICTIM][1] == "error"
    monkeypatch.undo()
    assert_only_the_victim_failed(engine, results, baseline)


def test_a_stop_string_fault_fails_only_its_request(engine, baseline, monkeypatch):
    original = StopMatcher.find

    def faulty(self, text, new_from):
        if "never-in-the-output" in self.stops:
            raise RuntimeError("injected stop-matching fault")
        return original(self, text, new_from)

    monkeypatch.setattr(StopMatcher, "find", faulty)
    results = run_all(engine, params(stop=["never-in-the-output"]))
    assert results[VICTIM][1] == "error"
    monkeypatch.undo()
    assert_only_the_victim_failed(engine, results, baseline)


def test_a_failed_request_is_counted_as_an_error(engine, llm, monkeypatch):
    def failed() -> float:
        return sum(m.value for m in llm.get_metrics()
                   if m.name == "jaxserve:request_success_total" and m.labels.get("finished_reason") == "error")

    before = failed()
    monkeypatch.setattr(StopMatcher, "find", lambda self, text, new_from: 1 / 0)
    results = run_all(engine, params(stop=["x"]))
    assert results[VICTIM][1] == "error"
    assert failed() == before + 1


def test_a_lone_surrogate_cache_salt_is_refused_and_kills_nothing(engine, baseline, llm):
    """The salt keys the first full block: with a short prompt that block completes during decode,
    on the engine thread, where its UTF-8 encoding used to raise and kill the loop."""
    results = run_all(engine, params())
    bad = asyncio.run(collect(engine, VICTIM, params(), cache_salt="\ud800"))
    assert isinstance(bad, InvalidRequestError) and bad.param == "cache_salt"
    assert not engine.is_dead
    assert results == baseline
    with pytest.raises(InvalidRequestError, match="surrogate"):
        llm.generate({"prompt_token_ids": PROMPTS[VICTIM], "cache_salt": "a\udfffb"}, params(), use_tqdm=False)


def test_hashing_never_raises_on_a_lone_surrogate():
    a = kv_cache_utils.hash_block_tokens(None, [1, 2], (("salt", "\ud800"),))
    b = kv_cache_utils.hash_block_tokens(None, [1, 2], (("salt", "\ud801"),))
    assert a != b


def test_the_work_a_request_asks_for_is_bounded(llm):
    prompt = {"prompt_token_ids": PROMPTS["a"]}
    with pytest.raises(InvalidRequestError, match="max_stop_strings") as info:
        llm.generate(prompt, params(stop=[f"s{i}" for i in range(65)]), use_tqdm=False)
    assert info.value.param == "stop"
    with pytest.raises(InvalidRequestError, match="max_stop_str_chars"):
        llm.generate(prompt, params(stop=["x" * 1025]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_prompt_chars"):
        llm.generate("x" * 1_000_001, params(), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_n"):
        llm.generate(prompt, params(n=129), use_tqdm=False)


def test_a_fault_of_the_step_is_fatal_and_the_gauges_say_so(llm, monkeypatch):
    """Last in this file: the engine's metrics keep saying it died."""
    async_llm = AsyncLLM(llm.llm_engine)
    try:
        monkeypatch.setattr(llm.llm_engine.core, "step", lambda: 1 / 0)
        result = asyncio.run(collect(async_llm, "a", params()))
        assert type(result).__name__ == "EngineDeadError"
        assert async_llm.is_dead
        gauges = {m.name: m.value for m in llm.get_metrics()}
        assert gauges["jaxserve:engine_dead"] == 1
        assert gauges["jaxserve:num_requests_running"] == 0 and gauges["jaxserve:num_requests_waiting"] == 0
        assert gauges["jaxserve:kv_cache_usage_perc"] != gauges["jaxserve:kv_cache_usage_perc"]  # NaN: unknown
    finally:
        async_llm.shutdown()
