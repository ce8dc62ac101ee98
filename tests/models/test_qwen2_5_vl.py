"""Qwen2.5-VL's language model with M-RoPE, joined to its vision tower, against transformers'
whole model on a tiny random checkpoint saved as a real HF folder: the config read, placeholder
expansion, M-RoPE positions (through the image and decode's per-request delta), and logits and
greedy tokens with a prefill cut inside the image."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PIL_Image = pytest.importorskip("PIL.Image")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import pallas_kernels  # noqa: E402
from jaxserve.models.config import ModelConfig, qwen2_5_vl_text_config  # noqa: E402
from jaxserve.models.mrope import mrope_positions  # noqa: E402
from jaxserve.models.qwen2_5_vl import (  # noqa: E402
    Qwen25VLTokens,
    load_qwen2_5_vl_language_model,
    load_qwen2_5_vl_vision_from_folder,
)
from jaxserve.models.qwen2_vl_image_processor import Qwen2VLImageProcessorConfig, preprocess_qwen2_vl_image  # noqa: E402
from tests.models.paged_sequence import PagedSequence  # noqa: E402

PAD, START, END, HIDDEN = 290, 288, 289, 64


@pytest.fixture(scope="module")
def tiny_qwen25_vl(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=300, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=HIDDEN,
                           patch_size=2, temporal_patch_size=2, spatial_merge_size=2, window_size=8,
                           fullatt_block_indexes=[1]),
        image_token_id=PAD, video_token_id=291, vision_start_token_id=START, vision_end_token_id=END)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    folder = tmp_path_factory.mktemp("qwen25vl")
    model.save_pretrained(folder)
    return model, str(folder)


def test_config_read_both_forms(tiny_qwen25_vl):
    _, folder = tiny_qwen25_vl
    cfg = ModelConfig.from_pretrained(folder)
    assert (cfg.architecture, cfg.hidden_size, cfg.attention_bias) == ("Qwen2ForCausalLM", HIDDEN, True)
    assert cfg.rope.mrope_section == (2, 3, 3)
    # The hub's older file: text fields at the top level, rope_scaling {"type": "mrope"}.
    hf = json.loads(open(f"{folder}/config.json").read())
    old = {**hf.pop("text_config"), **hf}
    old.pop("rope_parameters")
    old.update(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=10000.0)
    old_cfg = ModelConfig.from_dict(qwen2_5_vl_text_config(old))
    assert (old_cfg.rope.mrope_section, old_cfg.num_hidden_layers) == ((2, 3, 3), 2)


def test_expand_placeholders_names_mismatch():
    tokens = Qwen25VLTokens(PAD, START, END, 2)
    ids, offsets = tokens.expand([5, START, PAD, END, 7], [(1, 4, 6)])
    assert ids == [5, START] + [PAD] * 6 + [END, 7] and offsets == [2]
    with pytest.raises(ValueError, match="2 images"):
        tokens.expand([5, START, PAD, END], [(1, 4, 6), (1, 4, 4)])


def _image(seed: int, h: int, w: int):
    return PIL_Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("split", [None, 9], ids=["one-chunk", "chunk-inside-image"])
def test_logits_and_greedy_tokens_equal_transformers(tiny_qwen25_vl, split):
    model, folder = tiny_qwen25_vl
    hf = json.loads(open(f"{folder}/config.json").read())
    tokens = Qwen25VLTokens.from_hf(hf)
    vcfg, tower = load_qwen2_5_vl_vision_from_folder(folder)
    lm = load_qwen2_5_vl_language_model(folder, scan_layers=False)
    proc = Qwen2VLImageProcessorConfig(min_pixels=64, max_pixels=24 * 24, patch_size=2, merge_size=2)
    patches, grid = preprocess_qwen2_vl_image(_image(4, 20, 28), proc)
    assert grid == (1, 10, 14)
    ids, offsets = tokens.expand([1, 5, 7, START, PAD, END, 9, 11, 13], [grid])
    n_img = tokens.num_image_tokens(grid)
    assert n_img == 35 and offsets == [4]

    feats = np.asarray(tower(jnp.asarray(patches), grid[1], grid[2]))
    assert feats.shape == (n_img, HIDDEN)
    # HF greedy continuation of 4 tokens, then one HF forward over prompt + continuation.
    pix, thw = torch.from_numpy(patches), torch.tensor([list(grid)])
    with torch.no_grad():
        # mm_token_type_ids (1: image) is what makes transformers compute M-RoPE positions.
        out = model.generate(input_ids=torch.tensor([ids]), pixel_values=pix, image_grid_thw=thw,
                             mm_token_type_ids=(torch.tensor([ids]) == PAD).int(), max_new_tokens=4, do_sample=False)
        full = out[0].tolist()
        ref = model(input_ids=out, pixel_values=pix, image_grid_thw=thw,
                    mm_token_type_ids=(out == PAD).int()).logits[0].numpy()

    pos, delta = mrope_positions(len(ids), [(offsets[0], grid)], tokens.merge_size)
    assert delta == -(n_img - max(grid[1], grid[2]) // 2)  # the image advances positions by its longer side
    mm = np.zeros((len(ids), HIDDEN), np.float32)
    mm[offsets[0]:offsets[0] + n_img] = feats
    mask = np.asarray(ids) == PAD

    seq = PagedSequence(lm)

    def step(state, ids_, kv, md, e, m, p):
        mod = nnx.merge(seq.graphdef, state)
        hidden, kv = mod(ids_, kv, md, pallas_kernels.ragged_paged_attention_reference, mm_embeds=e, mm_mask=m,
                         mrope_positions=p)
        return mod.compute_logits(hidden), kv

    step = jax.jit(step)
    logits = []
    cuts = [0, len(ids)] if split is None else [0, split, len(ids)]
    for lo, hi in zip(cuts, cuts[1:]):
        chunk, md = seq.inputs(ids[lo:hi])
        out_l, seq.kv = step(seq.state, chunk, seq.kv, md, jnp.asarray(mm[lo:hi]), jnp.asarray(mask[lo:hi]),
                             jnp.asarray(pos[:, lo:hi]))
        seq.num_computed += hi - lo
        logits.append(np.asarray(out_l))
    ours_tokens = [int(np.argmax(logits[-1][-1]))]
    for i in range(len(ids), len(full) - 1):  # decode: every axis at i + delta
        chunk, md = seq.inputs([full[i]])
        out_l, seq.kv = step(seq.state, chunk, seq.kv, md, jnp.zeros((1, HIDDEN)), jnp.zeros((1,), bool),
                             jnp.full((3, 1), i + delta, jnp.int32))
        seq.num_computed += 1
        logits.append(np.asarray(out_l))
        ours_tokens.append(int(np.argmax(logits[-1][-1])))
    ours = np.concatenate(logits)
    np.testing.assert_allclose(ours, ref[:-1], atol=1e-4, rtol=1e-4)
    assert ours_tokens == full[len(ids):]
    lp = jax.nn.log_softmax(jnp.asarray(ours), -1)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(jax.nn.log_softmax(jnp.asarray(ref[:-1]), -1)), atol=1e-4)
