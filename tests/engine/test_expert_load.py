"""Per-expert load: each step record of a MoE model counts the routed (token, expert) pairs of
its real tokens per expert, summed over the layers; the count equals a numpy bincount of the
top-k of transformers' router logits over the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from tests.models.paged_sequence import prompt
from tests.shapes import BACKEND_COMPARISON_SHAPE
from tests.tiny_models import TINY_MOE_CONFIGS, build_tiny_checkpoint

ARCH = "Qwen3MoeForCausalLM"
MAX_TOKENS = 4


def hf_expert_counts(folder: str, ids: list[int]) -> np.ndarray:
    """``[T, E]``: how many layers routed each position to each expert, from transformers' router
    logits (top-k of the softmax, as the checkpoint routes)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    cfg = TINY_MOE_CONFIGS[ARCH]
    counts = np.zeros((len(ids), cfg["num_experts"]), np.int64)
    for logits in out.router_logits:  # one [T, E] per layer
        top = np.argsort(-logits.reshape(len(ids), -1).numpy(), axis=-1, kind="stable")[:, : cfg["num_experts_per_tok"]]
        np.add.at(counts, (np.arange(len(ids))[:, None], top), 1)
    return counts


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "m", ARCH, seed=4, initializer_range=0.2))


def test_step_records_count_routed_pairs_per_expert(folder):
    ids = prompt(45, seed=7)  # 32-token steps: a chunk of 32, then 13 padded to a bucket, then decodes
    llm = LLM(folder, show_progress=False, record_steps=True, **BACKEND_COMPARISON_SHAPE)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                   ignore_eos=True), use_tqdm=False)
    tokens = ids + list(out[0].outputs[0].token_ids)
    want = hf_expert_counts(folder, tokens[:-1])  # the last sampled token is never fed
    records = [r for r in llm.get_step_records() if r.num_tokens]
    cfg = TINY_MOE_CONFIGS[ARCH]
    fed = 0
    for r in records:
        n = r.num_tokens
        assert r.expert_load is not None and len(r.expert_load) == cfg["num_experts"]
        # padding tokens route too, but are not counted
        assert sum(r.expert_load) == n * cfg["num_experts_per_tok"] * cfg["num_hidden_layers"]
        np.testing.assert_array_equal(r.expert_load, want[fed : fed + n].sum(axis=0))
        assert r.as_dict()["expert_load"] == r.expert_load
        fed += n
    assert fed == len(tokens) - 1
    # /metrics: the totals per expert over all steps
    name = "jaxserve:moe_expert_routed_tokens_total"
    samples = {m.labels["expert"]: m.value for m in llm.get_metrics() if m.name == name}
    assert samples == {str(e): float(want[:, e].sum()) for e in range(cfg["num_experts"])}
    assert any(r.token_bucket > r.num_tokens for r in records), "no padded step"
    assert len({tuple(r.expert_load) for r in records}) > 1


def test_dense_model_records_no_expert_load(tmp_path):
    folder = str(build_tiny_checkpoint(tmp_path / "llama", "LlamaForCausalLM", seed=1))
    llm = LLM(folder, show_progress=False, record_steps=True, **BACKEND_COMPARISON_SHAPE)
    llm.generate([{"prompt_token_ids": prompt(5)}], SamplingParams(max_tokens=2), use_tqdm=False)
    records = llm.get_step_records()
    assert records and all(r.expert_load is None for r in records)
