"""Exactness on real weights: SmolLM2-135M-Instruct (Q4_1 GGUF, 30 layers) served by jaxserve
against transformers' own load of the same ``.gguf`` (dequantized to float32).

One transformers reference run (greedy tokens and their logprobs) serves every engine; one engine
per CPU attention backend runs all prompts at once with a small token budget (chunked prefill),
a shared system prompt (prefix-cache hits) and a small KV pool (preemptions), and must give the
reference's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.models.smollm2 import smollm2_gguf_path

MAX_TOKENS = 64
SYSTEM = "You are a concise assistant. Answer in plain English, in a few sentences at most."
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "What is 12 times 7?",
    "Give me a tip for learning to cook.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "List the days of the week.",
    "What is photosynthesis?",
]
# The max |logprob difference| of the chosen tokens against transformers' float32 run measured
# 3.1e-5 (xla backend, this test); the bound is a few times above it.
LOGPROB_ATOL = 2e-4
# Chunked prefill (a 32-token budget), a pool too small for every request at once (preemptions).
ENGINE = dict(max_model_len=256, max_num_seqs=10, max_num_batched_tokens=32, num_gpu_blocks_override=18,
              block_size=16)


@pytest.fixture(scope="module")
def gguf_file():
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def prompts(gguf_file):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    chats = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=False) for q in QUESTIONS[:8]]
    plain = ["The history of the printing press begins", "def fibonacci(n):\n"]
    return [tok(p, add_special_tokens=False)["input_ids"] for p in chats + plain]


@pytest.fixture(scope="module")
def reference(gguf_file, prompts):
    """transformers' greedy tokens and their logprobs, one prompt at a time (no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                 dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=2)
            tokens = gen.sequences[0, len(ids):].tolist()
            logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.scores, tokens)]
            out.append((tokens, logprobs))
    return out


@pytest.fixture(scope="module", params=["xla", "cpu"])
def run(request, gguf_file, prompts):
    """One engine per CPU attention backend; all prompts at once."""
    llm = LLM(str(gguf_file), attention_backend=request.param, show_progress=False, **ENGINE)
    assert llm.stats()["attention_backend"] == request.param
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


def test_greedy_tokens_match_transformers(run, reference):
    _, outs = run
    for i, (out, (tokens, _)) in enumerate(zip(outs, reference)):
        got = list(out.outputs[0].token_ids)
        assert got == tokens[: len(got)], (i, got, tokens)
        # Stopping early is only right at the model's EOS (<|im_end|>).
        assert len(got) == len(tokens) or tokens[len(got) - 1] == 2


def test_logprobs_match_transformers(run, reference):
    _, outs = run
    worst = 0.0
    for out, (_, ref_logprobs) in zip(outs, reference):
        comp = out.outputs[0]
        got = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]
        worst = max(worst, float(np.max(np.abs(np.array(got) - np.array(ref_logprobs[: len(got)])))))
    assert worst <= LOGPROB_ATOL, worst


def test_the_run_chunked_hit_the_prefix_cache_and_preempted(run, prompts):
    llm, _ = run
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_preemptions"] > 0
    assert max(len(p) for p in prompts) > ENGINE["max_num_batched_tokens"]  # prefills ran in chunks


def test_the_chat_answer_is_right(run, reference):
    """The model is trained: the first question gets the right answer, not noise."""
    llm, outs = run
    assert "Paris" in outs[0].outputs[0].text
