"""Qwen2.5-VL served text only: a tiny random ``Qwen2_5_VLForConditionalGeneration`` written as a
real HF folder (weights, config, a trained tokenizer with its vision tokens) loads as its M-RoPE
language model, and its greedy tokens and logprobs equal transformers' in one chunk and in chunks
of 8; an image is refused naming the field (no image processing is joined yet)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.exceptions import InvalidRequestError  # noqa: E402

MAX_TOKENS = 6
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    from jaxserve.models.demo import build_tokenizer

    folder = tmp_path_factory.mktemp("tiny-qwen25vl")
    tok = build_tokenizer(folder, vocab_size=320, added_tokens=VISION_TOKENS)
    start, end, pad, video = (tok.convert_tokens_to_ids(t) for t in VISION_TOKENS)
    torch.manual_seed(0)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
                           patch_size=2, temporal_patch_size=2, spatial_merge_size=2, window_size=8,
                           fullatt_block_indexes=[1]),
        image_token_id=pad, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    model.save_pretrained(folder)
    return str(folder), model


def hf_greedy(model, ids: list[int]) -> tuple[list[int], list[float]]:
    ids = list(ids)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
            t = int(lp.argmax())
            tokens.append(t)
            logprobs.append(float(lp[t]))
            ids.append(t)
    return tokens, logprobs


@pytest.mark.parametrize("budget", [64, 8], ids=["one-chunk", "chunks-of-8"])
def test_text_greedy_equals_transformers(qwen_folder, budget):
    folder, model = qwen_folder
    llm = LLM(folder, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=budget, enable_prefix_caching=True)
    try:
        assert llm.llm_engine.core.model_config.rope.mrope_section == (2, 3, 3)
        outs = llm.generate(["describe the picture in words", "a second, somewhat longer prompt here"], PARAMS,
                            use_tqdm=False)
        for out in outs:
            ref_tokens, ref_lps = hf_greedy(model, out.prompt_token_ids)
            comp = out.outputs[0]
            assert list(comp.token_ids) == ref_tokens
            np.testing.assert_allclose([lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)], ref_lps,
                                       atol=2e-4)
        image = Image.fromarray(np.zeros((8, 8, 3), np.uint8))
        with pytest.raises(InvalidRequestError, match="multi_modal_data"):
            llm.generate([{"prompt": "<|vision_start|><|image_pad|><|vision_end|>hi",
                           "multi_modal_data": {"image": image}}], PARAMS, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
