"""LLM behaviour on the demo model: compile counts, eager mode, sampling, stop handling, metrics."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jaxserve import LLM, AsyncLLM, SamplingParams
from tests.shapes import ENGINE_TESTS_SHAPE


@pytest.fixture(scope="module")
def llm(demo_model):
    return LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE)


def assert_pool_empty(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] - 1
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def random_prompts(n: int, seed: int, lo: int = 1, hi: int = 200) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 1000, int(k)).tolist()} for k in rng.integers(lo, hi, n)]


def test_no_compile_after_warm_up(llm):
    compiles = llm.stats()["compile_num_compiles"]
    assert compiles == len(llm.stats()["token_buckets"])
    for seed in range(3):
        llm.generate(random_prompts(7, seed), SamplingParams(temperature=0, max_tokens=int(5 + 9 * seed)),
                     use_tqdm=False)
    stats = llm.stats()
    assert stats["compile_num_compiles"] == compiles
    assert stats["compile_unexpected_compiles"] == 0
    assert 0.0 <= stats["compile_padding_ratio"] < 1.0
    assert_pool_empty(llm)


def test_default_layer_layout_follows_depth(llm):
    from jaxserve.models.llama import default_scan_layers

    depth = llm.llm_engine.model_config.num_hidden_layers
    assert llm.stats()["scan_layers"] is default_scan_layers(depth) is (depth > 8)


def test_eager_matches_compiled(llm, demo_model):
    prompts = random_prompts(5, seed=11, hi=90)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    compiled = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    eager = LLM(demo_model, show_progress=False, enforce_eager=True, **ENGINE_TESTS_SHAPE)
    assert eager.stats()["compile_num_compiles"] == 0
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)] == compiled


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    target = {"prompt_token_ids": [5, 17, 99, 200, 7]}
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(6, seed=3)
    mixed = llm.generate(others[:3] + [target] + others[3:],
                         [SamplingParams(temperature=0.7, max_tokens=20)] * 3 + [params]
                         + [SamplingParams(temperature=1.3, max_tokens=9)] * 3, use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    different = llm.generate([target], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=4321,
                                                      ignore_eos=True), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone
    assert_pool_empty(llm)


def test_parallel_sampling_n(llm):
    out = llm.generate(["The quick brown fox"], SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5,
                                                               ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_pool_empty(llm)


def test_max_tokens_min_tokens_and_stop_token_ids(llm):
    greedy = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    stop_id = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_id)
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == greedy.token_ids[: first + 1]
    late = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id],
                                                  min_tokens=first + 2), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) > first + 1
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 30


def test_stop_strings(llm):
    full = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    assert len(full) > 12
    stop = full[6:9]
    index = full.index(stop)
    cut = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == full[:index]
    kept = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, stop=stop,
                                                             include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full[: index + len(stop)]
    assert_pool_empty(llm)


def test_logprobs(llm):
    out = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3  # the chosen one is also the top-1
        values = sorted((lp.logprob for lp in entry.values()), reverse=True)
        assert values[0] <= 0.0
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(temperature=0, max_tokens=4),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt.startswith("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)


def test_chat_offers_tools_and_template_kwargs(llm):
    tools = [{"type": "function", "function": {"name": "now"}}]
    params = SamplingParams(temperature=0, max_tokens=4)
    out = llm.chat([{"role": "user", "content": "Time?"}], params, tools=tools,
                   chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0]
    assert '<tools>\n{"type": "function", "function": {"name": "now"}}\n</tools>' in out.prompt
    assert out.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 4  # the raw text: nothing parsed out offline, as in vLLM
    # a call and its result in the conversation: arguments (JSON text) render as an object
    conversation = [{"role": "user", "content": "Time?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    out = llm.chat(conversation, params, use_tqdm=False)[0]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n') in out.prompt
    bad = [conversation[0], {**conversation[1], "tool_calls": [
        {"type": "function", "function": {"name": "now", "arguments": "{not json"}}]}]
    with pytest.raises(ValueError, match="JSON"):
        llm.chat(bad, params, use_tqdm=False)


def test_bad_requests_name_the_field_and_leak_nothing(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 300}], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([{"prompt_token_ids": []}], SamplingParams(), use_tqdm=False)
    assert_pool_empty(llm)
    assert len(llm.generate(["still works"], SamplingParams(max_tokens=3), use_tqdm=False)) == 1


def test_a_request_id_must_be_a_string_at_every_entry_point(llm):
    """As in vLLM: ``LLMEngine.add_request``/``abort_request`` and ``AsyncLLM.generate``/``abort``
    refuse an id that is not a string; ``abort_request`` takes one id or several."""
    engine = llm.llm_engine
    for bad in (7, None, b"r"):
        with pytest.raises(TypeError, match="request_id must be a string"):
            engine.add_request(bad, "hi", SamplingParams(max_tokens=2))
        with pytest.raises(TypeError, match="request_id must be a string"):
            engine.abort_request([bad])
    engine.add_request("lone", "hi", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.abort_request("lone")  # one id, not the ids "l", "o", "n", "e"
    assert not engine.has_unfinished_requests()
    async_llm = AsyncLLM(engine)

    async def main():
        with pytest.raises(TypeError, match="request_id must be a string"):
            async for _ in async_llm.generate("hi", SamplingParams(max_tokens=2), 7):
                pass
        with pytest.raises(TypeError, match="request_id must be a string"):
            await async_llm.abort(7)

    try:
        asyncio.run(main())
    finally:
        async_llm.shutdown()
    assert_pool_empty(llm)


def test_metrics_have_vllm_names(llm):
    llm.generate(["metrics please"], SamplingParams(max_tokens=4), use_tqdm=False)
    names = {m.name for m in llm.get_metrics()}
    for expected in ("jaxserve:num_requests_running", "jaxserve:num_requests_waiting",
                     "jaxserve:kv_cache_usage_perc", "jaxserve:prefix_cache_queries_total",
                     "jaxserve:prefix_cache_hits_total", "jaxserve:num_preemptions_total",
                     "jaxserve:prompt_tokens_total", "jaxserve:generation_tokens_total",
                     "jaxserve:time_to_first_token_seconds", "jaxserve:inter_token_latency_seconds",
                     "jaxserve:e2e_request_latency_seconds"):
        assert expected in names, expected
    generated = next(m for m in llm.get_metrics() if m.name == "jaxserve:generation_tokens_total")
    assert generated.value >= 4
    backend = next(m for m in llm.get_metrics() if m.name == "jaxserve:attention_backend_info")
    assert backend.labels["backend"] == llm.stats()["attention_backend"] == "cpu" and backend.value == 1


def test_step_tokens_and_first_tokens_are_counted_once_per_parent(llm):
    def value(name):
        return sum(m.value for m in llm.get_metrics() if m.name == name)

    def count(name):
        return sum(m.count for m in llm.get_metrics() if m.name == name)

    tokens, prompt, ttft, itl = (value("jaxserve:generation_tokens_total"), value("jaxserve:prompt_tokens_total"),
                                 count("jaxserve:time_to_first_token_seconds"),
                                 count("jaxserve:inter_token_latency_seconds"))
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                       SamplingParams(n=2, max_tokens=5, ignore_eos=True, temperature=1.0, seed=3), use_tqdm=False)
    assert sum(len(c.token_ids) for c in out[0].outputs) == 10
    assert value("jaxserve:generation_tokens_total") - tokens == 10
    assert value("jaxserve:prompt_tokens_total") - prompt == 4  # one prompt, shared by both samples
    assert count("jaxserve:time_to_first_token_seconds") - ttft == 1
    assert count("jaxserve:inter_token_latency_seconds") - itl == 8  # 4 later tokens per sample


def test_kv_cache_sizing(demo_model):
    from jaxserve.config import EngineConfig
    from jaxserve.models import ModelConfig
    from jaxserve.runner.kv_cache import bytes_per_block, determine_num_blocks

    mc = ModelConfig.from_pretrained(demo_model)
    per_block = bytes_per_block(mc, 16)
    assert per_block == 2 * mc.num_hidden_layers * 16 * mc.num_key_value_heads * mc.head_dim * 4
    cfg = EngineConfig(kv_cache_memory=per_block * 37 + 5)
    assert determine_num_blocks(mc, cfg, 256) == 37
    assert determine_num_blocks(mc, EngineConfig(num_gpu_blocks_override=11), 256) == 11
    cpu_default = determine_num_blocks(mc, EngineConfig(max_num_seqs=4), 256)
    assert cpu_default == 4 * 16 + 1
    with pytest.raises(ValueError, match="kv cache"):
        determine_num_blocks(mc, EngineConfig(kv_cache_memory=per_block), 256)


def test_prompt_logprobs_match_transformers_across_chunks(llm, demo_model):
    import torch
    import transformers

    prompt = np.random.default_rng(21).integers(3, 1000, 90).tolist()  # 90 > the 64-token budget
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=2,
                                                                      prompt_logprobs=2), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1).numpy()
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        token = prompt[p]
        assert entry[token].logprob == pytest.approx(float(ref[p - 1, token]), abs=1e-4)
        assert entry[token].rank == int((ref[p - 1] > ref[p - 1, token]).sum()) + 1
        assert set(np.argsort(-ref[p - 1])[:2].tolist()) <= set(entry)  # the top-2 are listed too
    assert_pool_empty(llm)


def test_parallel_samples_share_the_prompt_blocks(llm):
    prompt = {"prompt_token_ids": np.random.default_rng(5).integers(3, 1000, 40).tolist()}  # 2 full blocks
    before = llm.stats()["prefix_cache_hits"]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=9), use_tqdm=False)[0]
    # the 2nd and 3rd samples find the first one's two full blocks in the cache
    assert llm.stats()["prefix_cache_hits"] - before == 2 * 32
    assert out.num_cached_tokens == 32
    assert_pool_empty(llm)


def test_async_scheduling_gives_the_sync_results(llm, demo_model):
    """Outputs arrive a step later, but every token, stop, logprob and seeded draw is the same
    (``llm`` schedules asynchronously, the default)."""
    prompts = random_prompts(12, seed=9, hi=120) + ["Once upon a time", "hello"]
    greedy = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    text = llm.generate(prompts[-2:-1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    params = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[greedy.token_ids[6]])]  # stops early
    params += [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=8 + i, logprobs=2) for i in range(6)]
    params += [SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True, presence_penalty=0.5)
               for i in range(5)]
    params += [SamplingParams(temperature=0, max_tokens=40, stop=[text[8:11]]),
               SamplingParams(temperature=0, max_tokens=1)]

    def run(engine):
        outs = engine.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text,
                 [sorted((t, round(lp.logprob, 4)) for t, lp in e.items()) for e in o.outputs[0].logprobs or []])
                for o in outs]

    assert llm.config.async_scheduling
    sync_llm = LLM(demo_model, show_progress=False, **{**ENGINE_TESTS_SHAPE, "async_scheduling": False})
    expected, got = run(sync_llm), run(llm)
    assert got == expected
    assert expected[0][1] == "stop" and expected[-2][1] == "stop"  # the early stops really happened
    assert llm.stats()["compile_unexpected_compiles"] == 0
    assert_pool_empty(llm)


def test_penalty_counts_of_a_reused_slot_start_from_zero(demo_model):
    """A request admitted into a slot that earlier penalized requests used sees only its own
    tokens: its greedy output equals the one it gets in a fresh slot."""
    llm = LLM(demo_model, show_progress=False, **{**ENGINE_TESTS_SHAPE, "max_num_seqs": 2})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=1.0, repetition_penalty=1.5)
    target, fillers = random_prompts(1, seed=21, hi=40), random_prompts(2, seed=22, hi=40)
    fresh = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    llm.generate(fillers, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=1.0),
                 use_tqdm=False)
    assert llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids == fresh
    assert_pool_empty(llm)
