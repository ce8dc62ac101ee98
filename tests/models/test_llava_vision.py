"""LLaVA's image side against transformers on a tiny random checkpoint built here: the CLIP
preprocessing (pixels), the tower and projector (image features), and the prompt's embeddings
with the features merged at the expanded placeholders (the language model's logits)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PIL_Image = pytest.importorskip("PIL.Image")

import jax.numpy as jnp  # noqa: E402

from jaxserve.models.clip_image_processor import CLIPImageProcessorConfig, preprocess_clip_image  # noqa: E402
from jaxserve.models.llava_vision import (  # noqa: E402
    LlavaVisionConfig,
    expand_image_placeholders,
    load_llava_image_encoder_from_folder,
    merge_image_embeddings,
)

IMAGE_TOKEN = 250


def _image(seed: int, h: int, w: int):
    return PIL_Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("shape", [(40, 60), (60, 40), (28, 28), (10, 50)])
def test_preprocessing_equals_transformers(shape):
    hf = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 28, "width": 28})
    img = _image(1, *shape)
    ref = hf(images=img, return_tensors="np")["pixel_values"][0]
    ours = preprocess_clip_image(img, CLIPImageProcessorConfig.from_dict(hf.to_dict()))
    assert ours.shape == ref.shape == (3, 28, 28)
    np.testing.assert_allclose(ours, ref, atol=1e-6)


@pytest.fixture(scope="module", params=["default", "full"])
def tiny_llava(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            image_size=28, patch_size=7, projection_dim=16),
        text_config=transformers.LlamaConfig(
            vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2),
        image_token_index=IMAGE_TOKEN, vision_feature_select_strategy=request.param,
    )
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    folder = tmp_path_factory.mktemp(f"llava-{request.param}")
    model.save_pretrained(folder)
    return model, str(folder)


def test_image_features_and_logits_equal_transformers(tiny_llava):
    model, folder = tiny_llava
    cfg, encoder = load_llava_image_encoder_from_folder(folder)
    assert cfg.tokens_per_image == 16 + (cfg.select_strategy == "full")
    proc = CLIPImageProcessorConfig(shortest_edge=28, crop_height=28, crop_width=28)
    pixels = np.stack([preprocess_clip_image(_image(s, 30 + 7 * s, 40), proc) for s in range(2)])

    with torch.no_grad():
        tower = model.model.vision_tower(torch.from_numpy(pixels), output_hidden_states=True)
        feats = tower.hidden_states[cfg.vision_feature_layer]
        if cfg.select_strategy == "default":
            feats = feats[:, 1:]
        ref = model.model.multi_modal_projector(feats).numpy()
    ours = np.asarray(encoder(jnp.asarray(pixels)))
    assert ours.shape == ref.shape == (2, cfg.tokens_per_image, 48)
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=1e-4)

    # The prompt with two images: expand each placeholder, merge the features, run HF's language
    # model on those embeddings; it must equal HF's whole LLaVA fed the pixels.
    prompt = [1, 5, IMAGE_TOKEN, 9, 17, IMAGE_TOKEN, 3]
    ids = expand_image_placeholders(prompt, IMAGE_TOKEN, cfg.tokens_per_image)
    assert len(ids) == len(prompt) + 2 * (cfg.tokens_per_image - 1)
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        full = model(input_ids=ids_t, pixel_values=torch.from_numpy(pixels)).logits[0].numpy()
        text_embeds = model.get_input_embeddings()(ids_t)[0].numpy()
    merged = merge_image_embeddings(jnp.asarray(text_embeds), jnp.asarray(ids), jnp.asarray(ours.reshape(-1, 48)),
                                    IMAGE_TOKEN)
    with torch.no_grad():
        ours_logits = model(inputs_embeds=torch.from_numpy(np.array(merged))[None]).logits[0].numpy()
    np.testing.assert_allclose(ours_logits, full, atol=1e-4, rtol=1e-4)


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="vision_feature_select_strategy"):
        LlavaVisionConfig.from_hf({"vision_config": {}, "text_config": {}, "vision_feature_select_strategy": "x"})


@pytest.mark.parametrize("split", [None, 7], ids=["one-chunk", "chunk-inside-image"])
def test_jaxserve_llava_logits_equal_transformers(tiny_llava, split):
    """Our image encoder and our paged decoder (fed the merged embeddings, in one chunk or two
    that cut through the image) against HF's whole LLaVA."""
    from jaxserve.models.llava import load_llava_language_model
    from tests.models.paged_sequence import PagedSequence

    model, folder = tiny_llava
    cfg, encoder = load_llava_image_encoder_from_folder(folder)
    lm = load_llava_language_model(folder, scan_layers=False)
    proc = CLIPImageProcessorConfig(shortest_edge=28, crop_height=28, crop_width=28)
    pixels = preprocess_clip_image(_image(3, 33, 41), proc)[None]
    ids = expand_image_placeholders([1, 5, 9, IMAGE_TOKEN, 17, 3], IMAGE_TOKEN, cfg.tokens_per_image)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(pixels)).logits[0].numpy()

    feats = np.asarray(encoder(jnp.asarray(pixels))).reshape(-1, 48)
    mm = np.zeros((len(ids), 48), np.float32)
    mask = np.asarray(ids) == IMAGE_TOKEN
    mm[mask] = feats
    seq = PagedSequence(lm)
    import jax
    from flax import nnx

    import pallas_kernels

    def step(state, ids_, kv, md, e, m):
        mod = nnx.merge(seq.graphdef, state)
        hidden, kv = mod(ids_, kv, md, pallas_kernels.ragged_paged_attention_reference, mm_embeds=e, mm_mask=m)
        return mod.compute_logits(hidden), kv

    step = jax.jit(step)
    out = []
    for lo, hi in ([(0, len(ids))] if split is None else [(0, split), (split, len(ids))]):
        chunk_ids, md = seq.inputs(ids[lo:hi])
        logits, seq.kv = step(seq.state, chunk_ids, seq.kv, md, jnp.asarray(mm[lo:hi]), jnp.asarray(mask[lo:hi]))
        seq.num_computed += hi - lo
        out.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(out), ref, atol=1e-4, rtol=1e-4)
