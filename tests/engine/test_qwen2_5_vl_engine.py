"""Qwen2.5-VL end to end offline: a tiny random ``Qwen2_5_VLForConditionalGeneration`` written as
a real HF folder (weights, config, preprocessor config, a trained tokenizer with its vision tokens)
served by ``LLM`` with images as PIL objects. Greedy tokens and logprobs equal transformers' (fed
the same patches, computing its own M-RoPE positions) in one chunk and in chunks of 8 that cut
through the image; the same image again is a prefix hit with the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.exceptions import InvalidRequestError  # noqa: E402
from tests.compiles import backend_compiles  # noqa: E402

MAX_TOKENS = 6
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    from tests.tiny_vlms import build_tiny_qwen2_5_vl

    folder = tmp_path_factory.mktemp("tiny-qwen25vl")
    model, pad = build_tiny_qwen2_5_vl(folder)
    return str(folder), model, pad


def hf_greedy(model, ids: list[int], image=None, pad: int = -1, max_tokens: int = MAX_TOKENS
              ) -> tuple[list[int], list[float]]:
    """Transformers' greedy tokens and logprobs (full forward per token), fed our patches."""
    from jaxserve.models.qwen2_vl_image_processor import Qwen2VLImageProcessorConfig, preprocess_qwen2_vl_image

    extra = {}
    images = [] if image is None else image if isinstance(image, list) else [image]
    if images:
        cfg = Qwen2VLImageProcessorConfig(min_pixels=64, max_pixels=576, patch_size=2, merge_size=2)
        done = [preprocess_qwen2_vl_image(im, cfg) for im in images]
        extra = {"pixel_values": torch.from_numpy(np.concatenate([p for p, _ in done])),
                 "image_grid_thw": torch.tensor([list(g) for _, g in done])}
    ids = list(ids)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            t_ids = torch.tensor([ids])
            kw = dict(extra, mm_token_type_ids=(t_ids == pad).int()) if extra else {}
            lp = torch.log_softmax(model(input_ids=t_ids, **kw).logits[0, -1].double(), -1)
            t = int(lp.argmax())
            tokens.append(t)
            logprobs.append(float(lp[t]))
            ids.append(t)
    return tokens, logprobs


def make_image(seed: int, h: int = 20, w: int = 28):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def image_prompt(text: str, image) -> dict:
    return {"prompt": f"<|vision_start|><|image_pad|><|vision_end|>{text}", "multi_modal_data": {"image": image}}


def check(model, pad, outs, images, max_tokens: int = MAX_TOKENS):
    for out, image in zip(outs, images):
        ref_tokens, ref_lps = hf_greedy(model, out.prompt_token_ids, image, pad, max_tokens)
        comp = out.outputs[0]
        assert list(comp.token_ids) == ref_tokens
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)], ref_lps,
                                   atol=2e-4)


@pytest.mark.parametrize("budget", [64, 8], ids=["one-chunk", "chunks-of-8"])
def test_greedy_equals_transformers_with_images(qwen_folder, budget):
    folder, model, pad = qwen_folder
    llm = LLM(folder, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=budget,
              max_num_encoder_input_tokens=64, enable_prefix_caching=True, record_steps=True)
    try:
        assert llm.llm_engine.core.model_config.rope.mrope_section == (2, 3, 3)
        images = [make_image(1), make_image(2, 28, 16), None]
        outs = llm.generate([image_prompt("describe it", images[0]), image_prompt("what is this", images[1]),
                             "a text-only prompt with words"], PARAMS, use_tqdm=False)
        assert outs[0].prompt_token_ids.count(pad) == 35 and outs[1].prompt_token_ids.count(pad) == 28
        check(model, pad, outs, images)
        if budget == 8:  # the first chunk ends inside the first image
            records = llm.get_step_records()
            assert next(r.scheduled[outs[0].request_id] for r in records if outs[0].request_id in r.scheduled) == 8
        again = llm.generate([image_prompt("describe it", images[0])], PARAMS, use_tqdm=False)[0]
        assert again.num_cached_tokens >= 32
        assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
        other = llm.generate([image_prompt("describe it", make_image(3))], PARAMS, use_tqdm=False)[0]
        assert other.num_cached_tokens == 0  # another image: no block past the image start is shared
        check(model, pad, [other], [make_image(3)])
        if budget == 64:  # LLM.chat: an image part becomes <|vision_start|><|image_pad|><|vision_end|>
            chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": images[1]},
                                                          {"type": "text", "text": "what is this"}]}],
                            PARAMS, use_tqdm=False)[0]
            assert chat.prompt_token_ids.count(pad) == 28
            check(model, pad, [chat], [images[1]])
        with pytest.raises(InvalidRequestError, match="multi_modal_data"):
            llm.generate([{"prompt": "no placeholder", "multi_modal_data": {"image": images[0]}}], PARAMS,
                         use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def test_images_of_new_grids_compile_nothing_after_warm_up(qwen_folder):
    """The tower is compiled at start per patch-count bucket (16, 32, 64 tokens: the encoder budget
    bounds the largest); seven images of seven grids, several to a step (the two small ones in one
    call), then compile nothing (counted at XLA's backend) and still equal transformers."""

    folder, model, pad = qwen_folder
    llm = LLM(folder, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
              max_num_encoder_input_tokens=64, enable_prefix_caching=False, record_steps=True)
    try:
        runner = llm.llm_engine.core.runner
        assert runner.encoder.buckets == [16, 32, 64] and runner.encoder.num_compiled == 3
        # two small grids (4x4, 4x6: first, so one step encodes both, in one call), then 8x8, 10x14,
        # 6x10, 14x8 and 4x18
        sizes = [(8, 8), (8, 12), (16, 16), (20, 28), (12, 20), (28, 16), (8, 36)]
        images = [make_image(20 + i, h, w) for i, (h, w) in enumerate(sizes)]
        with backend_compiles() as compiles:
            outs = llm.generate([image_prompt(f"picture {i}", im) for i, im in enumerate(images)], PARAMS,
                                use_tqdm=False)
        assert compiles == [] and runner.stats.unexpected_compiles == 0 and runner.encoder.num_compiled == 3
        assert max(r.encoder_images for r in llm.get_step_records()) >= 2  # some step packs several images
        assert sorted(o.prompt_token_ids.count(pad) for o in outs) == [4, 6, 15, 16, 18, 28, 35]
        assert runner.encoder.num_calls < runner.encoder.num_images_encoded == 7
        check(model, pad, outs, images)
    finally:
        llm.llm_engine.shutdown()


def test_prompt_logprobs_of_image_prompts_equal_transformers(qwen_folder):
    """As vLLM: every prompt position after the first has a value, placeholder positions included
    (the logprob of ``<|image_pad|>`` given what precedes it), read from the forward that saw the
    image rows, in chunks of 8 cutting through the image; the same image twice."""
    from jaxserve.models.qwen2_vl_image_processor import Qwen2VLImageProcessorConfig, preprocess_qwen2_vl_image

    folder, model, pad = qwen_folder
    llm = LLM(folder, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=8,
              max_num_encoder_input_tokens=64, enable_prefix_caching=True)
    try:
        image = make_image(5, 16, 24)
        params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
        outs = llm.generate([image_prompt("what is in the picture", image), image_prompt("again", image)],
                            params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    cfg = Qwen2VLImageProcessorConfig(min_pixels=64, max_pixels=576, patch_size=2, merge_size=2)
    patches, grid = preprocess_qwen2_vl_image(image, cfg)
    for out in outs:
        ids = out.prompt_token_ids
        assert ids.count(pad) == 24 and len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        t_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=t_ids, pixel_values=torch.from_numpy(patches),
                           image_grid_thw=torch.tensor([list(grid)]), mm_token_type_ids=(t_ids == pad).int()).logits
        ref = torch.log_softmax(logits[0].double(), -1).numpy()
        for p in range(1, len(ids)):
            entry = out.prompt_logprobs[p]
            assert entry[ids[p]].logprob == pytest.approx(ref[p - 1, ids[p]], abs=2e-4)
            assert entry[ids[p]].rank == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
            assert set(np.argsort(-ref[p - 1])[:2].tolist()) <= set(entry)


def test_processor_refuses_naming_the_image(qwen_folder):
    from jaxserve.engine.mm_processor import Qwen25VLMultiModalProcessor

    folder, _, pad = qwen_folder
    proc = Qwen25VLMultiModalProcessor.from_qwen_folder(folder, 2, max_image_tokens=30)
    ids, feats = proc.process([5, pad, 7], [make_image(1, 16, 16)])  # 8 x 8 patches: 16 tokens
    assert ids == [5] + [pad] * 16 + [7] and feats[0].placeholder.offset == 1 and feats[0].data[1] == (1, 8, 8)
    with pytest.raises(InvalidRequestError, match=r"image\[0\].*35 image tokens.*budget of 30"):
        proc.process([5, pad, 7], [make_image(1)])
    with pytest.raises(InvalidRequestError, match="2 images"):
        proc.process([5, pad, 7], [make_image(1, 16, 16)] * 2)
    with pytest.raises(InvalidRequestError, match="3 images, more than the limit"):
        proc.process([5, pad, 7], [make_image(1, 16, 16)] * 3)
    # Equal pixels in another grid are another image.
    assert proc.process([pad], [make_image(1, 16, 24)])[1][0].identifier != feats[0].identifier


@pytest.mark.slow  # its own engine and 32 full transformers forwards (~80 s at load 11)
def test_preempted_request_recomputes_its_positions(qwen_folder):
    """Preemption drops a request's runner state; re-admitted, its M-RoPE positions and delta are
    computed again from its images, and its tokens still equal transformers'. Two requests (one
    image, two images) grow past the few KV blocks, so the later one is preempted."""
    folder, model, pad = qwen_folder
    llm = LLM(folder, max_model_len=96, max_num_seqs=2, max_num_batched_tokens=64, num_gpu_blocks_override=7,
              block_size=16, max_num_encoder_input_tokens=64, enable_prefix_caching=False, async_scheduling=False)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, ignore_eos=True)
        images = [[make_image(10, 16, 16)], [make_image(11, 16, 16), make_image(12, 16, 24)]]
        tag = "<|vision_start|><|image_pad|><|vision_end|>"
        outs = llm.generate([{"prompt": f"{tag}what is it", "multi_modal_data": {"image": images[0]}},
                             {"prompt": f"{tag}and {tag}what are they", "multi_modal_data": {"image": images[1]}}],
                            params, use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
        check(model, pad, outs, images, max_tokens=16)
        assert llm.llm_engine.core.kv_cache_usage() == 0
    finally:
        llm.llm_engine.shutdown()


def test_quantization_is_refused_by_name(qwen_folder):
    from jaxserve.exceptions import ConfigError

    with pytest.raises(ConfigError, match=r"Qwen2.5-VL.*quantization and enable_lora are not supported"):
        LLM(qwen_folder[0], max_model_len=128, quantization="int8")
