"""LLaVA end to end in the engine: a tiny random ``LlavaForConditionalGeneration`` written as a
real HF folder (weights, config, CLIP preprocessor, a trained tokenizer with ``<image>``), served
by ``LLM`` with images as PIL objects, against transformers' greedy tokens and logprobs. One engine
runs each prompt in one chunk, the other in chunks of 8 tokens that cut through the image; prefix
hits on a repeated image, no shared blocks for another image, and no compile after warm-up."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.exceptions import InvalidRequestError  # noqa: E402
from tests.compiles import backend_compiles  # noqa: E402

MAX_TOKENS = 6


def make_image(seed: int, h: int = 33, w: int = 41):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory):
    from tests.tiny_vlms import build_tiny_llava

    folder = tmp_path_factory.mktemp("tiny-llava")
    model, tok = build_tiny_llava(folder)
    return str(folder), model, tok


def hf_greedy(model, processor, ids: list[int], image) -> tuple[list[int], list[float]]:
    """Transformers' greedy tokens and their logprobs (full forward per token: tiny model)."""
    extra = {} if image is None else {
        "pixel_values": torch.from_numpy(processor(images=image, return_tensors="np")["pixel_values"])}
    ids = list(ids)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=torch.tensor([ids]), **extra).logits[0, -1]
            lp = torch.log_softmax(logits.double(), -1)
            t = int(lp.argmax())
            tokens.append(t)
            logprobs.append(float(lp[t]))
            ids.append(t)
    return tokens, logprobs


def check_against_hf(llava_folder, outputs, images):
    _, model, _ = llava_folder
    processor = transformers.CLIPImageProcessor.from_pretrained(llava_folder[0])
    for out, image in zip(outputs, images):
        ref_tokens, ref_lps = hf_greedy(model, processor, out.prompt_token_ids, image)
        comp = out.outputs[0]
        assert list(comp.token_ids) == ref_tokens
        ours = [next(iter(d.values())).logprob if not hasattr(d, "logprob") else d.logprob
                for d in (lp[t] for lp, t in zip(comp.logprobs, comp.token_ids))]
        np.testing.assert_allclose(ours, ref_lps, atol=2e-4)


PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)


_ENGINES: dict[int, LLM] = {}


@pytest.fixture(scope="module", autouse=True)
def _release_engines():
    yield
    for llm in _ENGINES.values():
        llm.llm_engine.shutdown()
    _ENGINES.clear()


def engine(folder: str, budget: int) -> LLM:
    """One engine per token budget for the module (each compiles its variants once)."""
    if budget not in _ENGINES:
        _ENGINES[budget] = LLM(folder, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=budget,
                               max_num_encoder_input_tokens=32, enable_prefix_caching=True,
                               async_scheduling=budget != 8, record_steps=True)  # both step loops
    return _ENGINES[budget]


def prompt(text: str, image) -> dict:
    return {"prompt": f"<image>\n{text}", "multi_modal_data": {"image": image}}


@pytest.mark.parametrize("budget", [64, 8], ids=["one-chunk", "chunks-of-8"])
def test_greedy_equals_transformers_with_prefix_hits(llava_folder, budget):
    folder, _, tok = llava_folder
    llm = engine(folder, budget)
    runner = llm.llm_engine.core.runner
    images = [make_image(1), make_image(2, 50, 30), None]
    with backend_compiles() as compiles:
        first = llm.generate([prompt("what is it", images[0]), prompt("describe this", images[1]),
                              "a text-only prompt"], PARAMS, use_tqdm=False)
    assert compiles == []  # the engine's first requests, images included, compile nothing (XLA's count)
    image_id = tok.convert_tokens_to_ids("<image>")
    assert first[0].prompt_token_ids.count(image_id) == 16  # (28 / 7) ** 2 patches
    check_against_hf(llava_folder, first, images)
    assert runner.encoder.num_images_encoded == 2
    records = llm.get_step_records()
    first_chunk = next(r.scheduled[first[0].request_id] for r in records if first[0].request_id in r.scheduled)
    assert first_chunk == min(budget, len(first[0].prompt_token_ids))  # 8: the chunk ends inside the image
    # Encoder work: in the step records (the two images) and in each image request's timeline.
    assert sum(r.encoder_images for r in records) == 2 and sum(r.encoder_s for r in records) > 0
    assert all(r.encoder_s <= r.prepare_s for r in records)
    for out, n in zip(first, (1, 1, 0)):
        assert out.metrics.num_encoded_images == n and (out.metrics.encoder_time > 0) == (n > 0)
        timeline = llm.get_request_timeline(out.request_id)
        assert timeline is not None and timeline.as_dict()["metrics"]["num_encoded_images"] == n

    # The same image and text again: a prefix hit through the image's blocks, the same tokens.
    again = llm.generate([prompt("what is it", images[0])], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16
    assert again.outputs[0].token_ids == first[0].outputs[0].token_ids
    # An image after some text, sent twice: the hit ends inside the image, whose rows after it are
    # read from its (re-referenced or re-encoded) output.
    mid = {"prompt": "see <image>\nwhat is it", "multi_modal_data": {"image": images[1]}}
    once, twice = (llm.generate([mid], PARAMS, use_tqdm=False)[0] for _ in range(2))
    start = twice.prompt_token_ids.index(image_id)
    assert start < twice.num_cached_tokens < start + 16  # full blocks up to a point inside the image
    assert twice.outputs[0].token_ids == once.outputs[0].token_ids
    check_against_hf(llava_folder, [twice], [images[1]])
    # The same text with another image: no block shared (the image starts the prompt).
    other = make_image(3)
    diff = llm.generate([prompt("what is it", other)], PARAMS, use_tqdm=False)[0]
    assert diff.num_cached_tokens == 0
    check_against_hf(llava_folder, [diff], [other])
    # Every step ran a program compiled at warm-up: image steps their own variant, text steps the plain one.
    assert runner.stats.unexpected_compiles == 0
    assert any(v.mm for v in runner.variants()) and any(not v.mm for v in runner.variants())
    assert runner.encoder.num_compiled == len(runner.encoder.buckets)


def test_prompt_logprobs_of_image_prompts_equal_transformers(llava_folder):
    """As vLLM: a value at every prompt position after the first, ``<image>`` positions included,
    from the forward that saw the image rows (chunks of 8 cut through the image)."""
    folder, model, tok = llava_folder
    image = make_image(6)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    out = engine(folder, 8).generate([{"prompt": "look: <image>\nwhat is it", "multi_modal_data": {"image": image}}],
                                     params, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert ids.count(tok.convert_tokens_to_ids("<image>")) == 16 and out.prompt_logprobs[0] is None
    processor = transformers.CLIPImageProcessor.from_pretrained(folder)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]),
                       pixel_values=torch.from_numpy(processor(images=image, return_tensors="np")["pixel_values"]))
    ref = torch.log_softmax(logits.logits[0].double(), -1).numpy()
    assert len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert entry[ids[p]].logprob == pytest.approx(ref[p - 1, ids[p]], abs=2e-4)
        assert entry[ids[p]].rank == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert int(np.argmax(ref[p - 1])) in entry


def test_bad_images_are_named(llava_folder):
    folder = llava_folder[0]
    llm = engine(folder, 64)
    with pytest.raises(InvalidRequestError, match="expected a PIL image") as e:
        llm.generate([{"prompt": "<image>\nx", "multi_modal_data": {"image": [b"not an image"]}}], PARAMS,
                     use_tqdm=False)
    assert e.value.param == "multi_modal_data.image[0]"
    with pytest.raises(InvalidRequestError, match="image placeholders") as e:
        llm.generate([{"prompt": "no placeholder", "multi_modal_data": {"image": make_image(0)}}], PARAMS,
                     use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="only 'image'"):
        llm.generate([{"prompt": "<image>", "multi_modal_data": {"video": make_image(0)}}], PARAMS, use_tqdm=False)
    assert not math.isnan(llm.llm_engine.core.kv_cache_usage()) and llm.llm_engine.core.kv_cache_usage() == 0


def data_url(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_image_parts_equals_generate(llava_folder):
    folder, _, tok = llava_folder
    llm = engine(folder, 64)
    image = make_image(7, 30, 30)
    parts = [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    chat = llm.chat([{"role": "user", "content": parts}], PARAMS, use_tqdm=False)[0]
    text = tok.apply_chat_template([{"role": "user", "content": "<image>\nwhat is it"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    plain = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}], PARAMS,
                         use_tqdm=False)[0]
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    check_against_hf(llava_folder, [chat], [image])
    pil = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                 {"type": "text", "text": "what is it"}]}], PARAMS, use_tqdm=False)[0]
    assert pil.outputs[0].token_ids == chat.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="not fetched") as e:
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}]}],
                 PARAMS, use_tqdm=False)
    assert e.value.param == "messages[0].content[0].image_url"
    truncated = data_url(image)[:-40]
    with pytest.raises(InvalidRequestError) as e:
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "x"},
                                               {"type": "image_url", "image_url": {"url": truncated}}]}],
                 PARAMS, use_tqdm=False)
    assert e.value.param == "messages[0].content[1].image_url"


@pytest.mark.slow  # two engines of their own (~10 s each at load 6)
@pytest.mark.parametrize("cache_tokens", [64, 16], ids=["outputs-kept", "outputs-evicted"])
def test_preempted_requests_keep_or_recompute_encoder_outputs(llava_folder, cache_tokens):
    """Preemption recomputes a request's KV; its images' encoder outputs stay in the encoder cache
    (unreferenced, evictable). While the cache holds them they are reused (no new encode); once
    evicted they are encoded again. Either way the tokens equal transformers'.

    A (one image, 21 tokens) and V (two images, 37 tokens) fill 5 of the 6 usable blocks; both
    grow past a block boundary and V, admitted last, is preempted. The encoder budget is one image
    a step, so V's first image is encoded, then its second; a 16-token cache then holds only the
    second, and V's resumption encodes both again."""
    folder = llava_folder[0]
    llm = LLM(folder, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=7,
              max_num_encoder_input_tokens=16, encoder_cache_size=cache_tokens, enable_prefix_caching=False,
              async_scheduling=False)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, ignore_eos=True)
    images = [[make_image(10)], [make_image(11), make_image(12, 40, 28)]]
    prompts = [prompt("what is it", images[0]),
               {"prompt": "<image><image>\nwhat is it", "multi_modal_data": {"image": images[1]}}]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    encoded = llm.llm_engine.core.runner.encoder.num_images_encoded
    assert encoded == 3 if cache_tokens == 64 else encoded > 3
    global MAX_TOKENS
    saved, MAX_TOKENS = MAX_TOKENS, 16
    try:
        check_against_hf(llava_folder, outs, images)
    finally:
        MAX_TOKENS = saved
    assert llm.llm_engine.core.kv_cache_usage() == 0


@pytest.mark.slow  # its own engine (~10 s at load 6)
def test_mm_bench_reports_every_mode(llava_folder):
    import argparse

    from jaxserve.bench.mm_bench import MODES, run_mm_bench

    args = argparse.Namespace(num_prompts=2, output_len=2, image_size=30, num_iters=1, bench_seed=0)
    out = run_mm_bench(args, llava_folder[0], dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32))
    assert set(out["modes"]) == set(MODES) and out["unexpected_compiles"] == 0
    # Warm-up's two, then the distinct images; the one-image mode reuses the first of them, which
    # the encoder cache still holds.
    assert out["images_encoded"] == 2 + 2
    assert out["modes"]["text_only"]["encoder_share"]["median"] == 0
    assert all(r["requests_per_s"]["median"] > 0 for r in out["modes"].values())


@pytest.mark.parametrize("option", [dict(quantization="int8"), dict(enable_lora=True)])
def test_unsupported_engine_options_are_refused_by_name(llava_folder, option):
    from jaxserve.exceptions import ConfigError

    with pytest.raises(ConfigError, match=r"LLaVA.*quantization and enable_lora are not supported"):
        LLM(llava_folder[0], max_model_len=128, **option)
