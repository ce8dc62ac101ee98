"""LoRA on the LM head and the token embedding through the engine: greedy tokens, logprobs and
prompt logprobs equal transformers + peft in one batch mixing a head adapter, an embedding adapter,
a layers-only adapter and the base model (chunked prefill, preemption); the same with n-gram
speculation, whose verified positions each carry their row's slot; no compile after warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxserve import LLM, LoRARequest, SamplingParams
from tests.engine.test_lora_engine import LOGPROB_ATOL, SHAPE, assert_engine_clean, make_prompts, peft_greedy
from tests.models.test_lora_adapter import make_peft_adapter

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ADAPTERS = {  # name -> (seed, rank, target_modules, extra LoraConfig fields)
    "head": (31, 4, ["q_proj", "lm_head"], {}),
    "emb": (32, 8, ["embed_tokens", "v_proj"], {"use_rslora": True, "lora_alpha": 6}),
    "plain": (33, 8, ["o_proj", "down_proj"], {}),
}


@pytest.fixture(scope="module")
def loras(tiny_checkpoints, tmp_path_factory):
    """The three adapters as PEFT folders (the head and embedding ones without a copy of the base
    weights) and their peft models."""
    base = tiny_checkpoints["LlamaForCausalLM"]
    root = tmp_path_factory.mktemp("head_loras")
    pms = {}
    for name, (seed, r, targets, extra) in ADAPTERS.items():
        pms[name] = make_peft_adapter(base, root / name, seed=seed, r=r, targets=targets, **extra).eval()
        pms[name].save_pretrained(str(root / name), save_embedding_layers=False)
    requests = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(pms)}
    return base, pms, requests


def engine(base: str, **kwargs) -> LLM:
    return LLM(base, show_progress=False, enable_lora=True, max_loras=3, max_lora_rank=8, lora_lm_head=True,
               lora_embedding=True, **SHAPE, **kwargs)


@pytest.fixture(scope="module")
def llm(loras):
    return engine(loras[0])


def reference(pms, name: str | None, prompt: list[int]):
    pm = pms["head" if name is None else name]
    if name is None:
        with pm.disable_adapter():
            return peft_greedy(pm, prompt)
    return peft_greedy(pm, prompt)


def assert_matches_peft(llm, pms, requests, prompts, names):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[None if n is None else requests[n] for n in names])
    for prompt, name, out in zip(prompts, names, outs):
        want_t, want_lp = reference(pms, name, prompt)
        assert out.outputs[0].token_ids == want_t, name
        got_lp = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        np.testing.assert_allclose(got_lp, want_lp, atol=LOGPROB_ATOL, err_msg=str(name))
    return outs


def test_the_adapters_change_the_output(loras):
    """Each module's delta alone moves the logits, so the parity below would catch a dropped one."""
    _, pms, _ = loras
    ids = torch.tensor([make_prompts(1)[0]])
    with torch.no_grad():
        with pms["head"].disable_adapter():
            base = pms["head"](ids).logits
        for name in ("head", "emb"):
            assert not torch.allclose(pms[name](ids).logits, base, atol=1e-3), name


def test_mixed_batch_matches_peft(loras, llm):
    _, pms, requests = loras
    prompts = make_prompts(12)
    names = [None, "head", "emb", "plain"] * 3
    assert {"lm_head", "embed"} <= set(llm.llm_engine.core.runner.lora.tables[0])
    before = llm.stats()
    assert_matches_peft(llm, pms, requests, prompts, names)
    assert llm.stats()["num_preemptions"] > before["num_preemptions"]
    assert_engine_clean(llm)


def test_prompt_logprobs_carry_the_head_and_embedding_slots(loras, llm):
    _, pms, requests = loras
    prompts = make_prompts(4)
    names = ["head", "emb", None, "plain"]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[None if n is None else requests[n] for n in names])
    for prompt, name, out in zip(prompts, names, outs):
        pm = pms["head" if name is None else name]
        with torch.no_grad():
            if name is None:
                with pm.disable_adapter():
                    logits = pm(torch.tensor([prompt])).logits[0]
            else:
                logits = pm(torch.tensor([prompt])).logits[0]
        want = torch.log_softmax(logits.float(), -1)[torch.arange(len(prompt) - 1), prompt[1:]].numpy()
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        got = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL, err_msg=str(name))
    assert_engine_clean(llm)


def test_speculative_rows_carry_their_slot(loras):
    """With n-gram drafts verified, each verified position's logits row adds its row's head delta."""
    base, pms, requests = loras
    spec = engine(base, speculative_config=NGRAM)
    stats = spec.llm_engine.core.scheduler.spec_decoding_stats
    rng = np.random.default_rng(1)
    # copy-heavy prompts, so the proposer finds drafts
    prompts = [(phrase * 3 + phrase[:2]) for phrase in (rng.integers(3, 500, 6).tolist() for _ in range(8))]
    names = ["head", "emb", None, "plain"] * 2
    assert_matches_peft(spec, pms, requests, prompts, names)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert_engine_clean(spec)
