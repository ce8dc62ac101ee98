"""Multi-LoRA through the engine: greedy tokens and logprobs equal transformers + peft for the base
and two random adapters, alone and mixed in one batch, with chunked prefill, preemption and prefix
hits; more adapters than slots wait their turn; a reload under the same name never reuses stale KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.engine.otel import _attributes as span_attributes
from jaxserve.exceptions import InvalidRequestError
from tests.models.test_lora_adapter import make_peft_adapter

MAX_TOKENS = 8
LOGPROB_ATOL = 2e-4
# 24 usable blocks of 16 tokens cannot hold the 12 requests at once (preemption); 32-token
# steps cut every longer prompt into chunks.
SHAPE = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=32, num_gpu_blocks_override=25)


def make_prompts(n: int = 12) -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 500, 32).tolist()  # two full blocks: a prefix hit for a second request
    return [shared + rng.integers(3, 500, int(k)).tolist() for k in rng.integers(4, 60, n)]


def peft_greedy(pm, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs by transformers + peft (``pm`` with its adapter on or off),
    a plain argmax loop: EOS may be picked and is not stopped at, as with ``ignore_eos``."""
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            lp = torch.log_softmax(pm(torch.tensor([ids])).logits[0, -1].float(), -1)
            t = int(lp.argmax())
            tokens.append(t)
            logprobs.append(lp[t].item())
            ids.append(t)
    return tokens, logprobs


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, tmp_path_factory):
    """Two random adapters (all projections r=8; q/v/down r=4 with rsLoRA), their peft models,
    and one engine with two slots."""
    base = tiny_checkpoints["LlamaForCausalLM"]
    root = tmp_path_factory.mktemp("loras")
    pms = {"a0": make_peft_adapter(base, root / "a0", seed=3, r=8).eval(),
           "a1": make_peft_adapter(base, root / "a1", seed=4, r=4, targets=["q_proj", "v_proj", "down_proj"],
                                   use_rslora=True, lora_alpha=5).eval()}
    loras = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(pms)}
    llm = LLM(base, show_progress=False, record_steps=True, enable_lora=True, max_loras=2, max_lora_rank=8,
              **SHAPE)
    return base, root, pms, loras, llm


def reference(pms, prompt, adapter: str | None):
    pm = pms["a0" if adapter is None else adapter]
    if adapter is None:
        with pm.disable_adapter():
            return peft_greedy(pm, prompt)
    return peft_greedy(pm, prompt)


def run(llm, prompts, loras):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs]
    return toks, lps, outs


def assert_engine_clean(llm):
    stats = llm.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] - 1, "blocks leaked"
    assert stats["compile_unexpected_compiles"] == 0


def test_mixed_batch_with_chunks_preemption_and_prefix_hits_matches_peft(setup):
    _, _, pms, loras, llm = setup
    prompts = make_prompts()
    names = [None, "a0", "a1"] * 4
    # Adapters on the layers only: no LM-head or embedding table, so the steps are the ones of before.
    assert set(llm.llm_engine.core.runner.lora.tables[0]) == {"qkv", "o", "gate_up", "down"}
    before = llm.stats()
    toks, lps, outs = run(llm, prompts, [None if n is None else loras[n] for n in names])
    for prompt, name, t, lp in zip(prompts, names, toks, lps):
        want_t, want_lp = reference(pms, prompt, name)
        assert t == want_t, name
        np.testing.assert_allclose(lp, want_lp, atol=LOGPROB_ATOL)
    stats = llm.stats()
    assert stats["num_preemptions"] > before["num_preemptions"]
    assert stats["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert any(len({k for k in r.schedule.scheduled}) > 2 and r.schedule.prefill_ids for r in llm.step_records)
    assert_engine_clean(llm)


@pytest.mark.parametrize("name", ["a0", "a1", None])
def test_one_adapter_for_every_prompt_matches_peft(setup, name):
    _, _, pms, loras, llm = setup
    prompts = make_prompts(3)
    toks, lps, _ = run(llm, prompts, None if name is None else loras[name])
    for prompt, t, lp in zip(prompts, toks, lps):
        want_t, want_lp = reference(pms, prompt, name)
        assert t == want_t
        np.testing.assert_allclose(lp, want_lp, atol=LOGPROB_ATOL)
    assert_engine_clean(llm)


def test_more_adapters_than_slots_wait_their_turn(setup):
    base, root, pms, loras, llm = setup
    pm2 = make_peft_adapter(base, root / "a2", seed=5, r=2, targets=["o_proj", "gate_proj", "up_proj"]).eval()
    third = LoRARequest("a2", 3, str(root / "a2"))
    prompts = make_prompts(6)
    adapters = [loras["a0"], loras["a1"], third] * 2
    start = len(llm.step_records)
    toks, _, _ = run(llm, prompts, adapters)
    for prompt, lora, t in zip(prompts, adapters, toks):
        pm = pm2 if lora is third else pms[lora.lora_name]
        assert t == peft_greedy(pm, prompt)[0]
    records = list(llm.step_records)[start:]
    assert any(r.schedule.waiting_reason == "lora_slots" for r in records)
    for r in records:  # never more than max_loras adapters in one step, and the record names them
        assert len(set(r.schedule.lora_adapters.values())) <= 2
        assert {k.split("@")[0] for k in r.schedule.lora_adapters.values()} <= {"a0", "a1", "a2"}
    assert any(len(set(r.schedule.lora_adapters.values())) == 2 for r in records)
    info = [m for m in llm.get_metrics() if m.name == "jaxserve:lora_requests_info"]
    assert len(info) == 1 and info[0].labels["max_lora"] == "2" and info[0].value > 0
    assert_engine_clean(llm)


def test_reload_under_the_same_name_never_reuses_stale_kv(setup, tmp_path):
    base, _, _, _, llm = setup
    folder = tmp_path / "sql"
    make_peft_adapter(base, folder, seed=11, r=8)
    sql = LoRARequest("sql", 7, str(folder))
    prompt = make_prompts(1)
    first, _, outs = run(llm, prompt, sql)
    again, _, outs_again = run(llm, prompt, sql)
    assert again == first and outs_again[0].num_cached_tokens >= 32  # same weights: a prefix hit
    new_pm = make_peft_adapter(base, folder, seed=12, r=8).eval()  # new weights, same name and path
    toks, lps, outs_new = run(llm, prompt, sql)
    assert outs_new[0].num_cached_tokens == 0  # the old adapter's blocks are another key
    want_t, want_lp = peft_greedy(new_pm, prompt[0])
    assert toks[0] == want_t and toks[0] != first[0]
    np.testing.assert_allclose(lps[0], want_lp, atol=LOGPROB_ATOL)
    assert_engine_clean(llm)


def test_bad_lora_requests_fail_alone(setup, tmp_path):
    base, _, _, loras, llm = setup
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(InvalidRequestError, match="lora_request.*no adapter_config.json"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False, lora_request=LoRARequest("x", 9, str(tmp_path / "none")))
    make_peft_adapter(base, tmp_path / "big", seed=1, r=16, targets=["q_proj"])
    with pytest.raises(InvalidRequestError, match="max_lora_rank=8"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False, lora_request=LoRARequest("big", 9, str(tmp_path / "big")))
    with pytest.raises(InvalidRequestError, match="2 adapters for 1 prompts"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False, lora_request=[loras["a0"], None])
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False, lora_request=loras["a0"])  # the engine goes on
    assert len(out[0].outputs[0].token_ids) == 2
    assert_engine_clean(llm)


def test_an_engine_without_enable_lora_refuses_adapters(tiny_checkpoints, tmp_path):
    llm = LLM(tiny_checkpoints["LlamaForCausalLM"], show_progress=False, **SHAPE)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("a", 1, str(tmp_path)))


def test_timeline_trace_and_step_records_name_the_adapter(setup):
    _, _, _, loras, llm = setup
    prompts = make_prompts(2)
    start = len(llm.step_records)
    _, _, outs = run(llm, prompts, [loras["a1"], None])
    on_a1, on_base = (llm.get_request_timeline(o.request_id) for o in outs)
    assert on_a1.lora_name == "a1" and on_a1.lora_key.startswith("a1@")
    assert on_base.lora_name is None and on_base.lora_key is None
    assert on_a1.as_dict()["lora_name"] == "a1" and on_base.as_dict()["lora_name"] is None
    assert span_attributes(on_a1, "m")["jaxserve.lora_name"] == "a1"  # the OpenTelemetry span
    assert "jaxserve.lora_name" not in span_attributes(on_base, "m")
    records = list(llm.step_records)[start:]
    # Every step that ran the a1 request says so, with the key the timeline has; the base one is absent.
    core_ids = {r for rec in records for r in rec.schedule.scheduled}
    a1_ids = {r for r in core_ids if r.endswith(outs[0].request_id)}
    assert a1_ids and all(rec.as_dict()["lora_adapters"] == {r: on_a1.lora_key for r in rec.schedule.scheduled
                                                             if r in a1_ids} for rec in records)
    trace = llm.export_trace(num_steps=len(records), num_requests=2)
    spans = {e["name"]: e["args"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("request ")}
    assert spans[f"request {outs[0].request_id}"]["lora"] == "a1"
    assert spans[f"request {outs[1].request_id}"]["lora"] is None
    steps = [e["args"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].endswith("schedule+prepare")]
    assert any(a["lora_adapters"] == ["a1"] for a in steps)
    assert_engine_clean(llm)
