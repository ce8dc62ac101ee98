"""The JAX decoder against transformers (PyTorch, CPU) on the same tiny checkpoints."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxserve.models import load_model
from tests.models.paged_sequence import PagedSequence, prompt
from tests.tiny_models import ARCHITECTURES, build_tiny_checkpoint


def hf_logits(folder: str, ids: list[int]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(folder: str, ids: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("length", [1, 9, 70])
def test_logits_match_transformers(tiny_checkpoints, arch, length, scan_layers):
    folder = tiny_checkpoints[arch]
    ids = prompt(length, seed=length)
    model = load_model(folder, scan_layers=scan_layers)
    ours = PagedSequence(model).feed(ids)
    np.testing.assert_allclose(ours, hf_logits(folder, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_continuation_matches_transformers(tiny_checkpoints, arch, scan_layers):
    folder = tiny_checkpoints[arch]
    ids = prompt(13, seed=7)
    model = load_model(folder, scan_layers=scan_layers)
    seq = PagedSequence(model)
    logits = seq.feed(ids)
    ours = []
    for _ in range(32):
        ours.append(int(logits[-1].argmax()))
        logits = seq.feed([ours[-1]])
    assert ours == hf_greedy(folder, ids, 32)


def flat_arrays(module: nnx.Module) -> dict[tuple, np.ndarray]:
    return {path: np.asarray(var[...]) for path, var in nnx.to_flat_state(nnx.state(module))}


def test_scanned_and_unrolled_layouts_agree(qwen3_checkpoint):
    stacked = load_model(qwen3_checkpoint, scan_layers=True)
    per_layer = load_model(qwen3_checkpoint, scan_layers=False)
    assert stacked.scan_layers and not per_layer.scan_layers
    assert isinstance(per_layer.layers, nnx.List) and len(per_layer.layers) == stacked.config.num_hidden_layers
    stacks = flat_arrays(stacked.layers.stacked)
    for i, layer in enumerate(per_layer.layers):
        weights = flat_arrays(layer)
        assert weights.keys() == stacks.keys()
        for path, w in weights.items():
            np.testing.assert_array_equal(w, stacks[path][i])
    ids = prompt(37, seed=9)
    np.testing.assert_allclose(PagedSequence(per_layer).feed(ids), PagedSequence(stacked).feed(ids),
                               atol=1e-5, rtol=0)


def test_default_layout_by_depth():
    from jaxserve.models.llama import UNROLL_MAX_LAYERS, default_scan_layers

    assert not default_scan_layers(1) and not default_scan_layers(UNROLL_MAX_LAYERS)
    assert default_scan_layers(UNROLL_MAX_LAYERS + 1) and default_scan_layers(28)


def test_two_chunks_equal_one_pass(qwen3_checkpoint):
    model = load_model(qwen3_checkpoint)
    ids = prompt(45, seed=3)
    whole = PagedSequence(model).feed(ids)
    chunked = PagedSequence(model)
    first = chunked.feed(ids[:18])  # ends mid-block: the second chunk continues a partial page
    second = chunked.feed(ids[18:])
    np.testing.assert_allclose(np.concatenate([first, second]), whole, atol=1e-5, rtol=0)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    folder = str(build_tiny_checkpoint(tmp_path / "llama3", "LlamaForCausalLM", seed=2, rope_parameters=rope))
    model = load_model(folder)
    assert model.config.rope.rope_type == "llama3"
    ids = prompt(80, seed=5)
    np.testing.assert_allclose(PagedSequence(model).feed(ids), hf_logits(folder, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype,atol", [("bfloat16", 0.1), ("float16", 0.02)])
def test_half_precision_close_to_float32(qwen3_checkpoint, dtype, atol):
    ids = prompt(20, seed=11)
    model32 = load_model(qwen3_checkpoint)
    model16 = load_model(qwen3_checkpoint, dtype=dtype)
    assert model16.embed_tokens.embedding.dtype == jnp.dtype(dtype)
    ref = PagedSequence(model32).feed(ids)
    low = PagedSequence(model16).feed(ids)
    assert low.dtype == np.float32 and np.isfinite(low).all()
    assert np.abs(low - ref).max() < atol


def test_sharded_checkpoint_loads(tmp_path):
    folder = build_tiny_checkpoint(tmp_path / "sharded", "Qwen2ForCausalLM", seed=4, max_shard_bytes=60_000)
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    model = load_model(folder)
    ids = prompt(10, seed=1)
    np.testing.assert_allclose(PagedSequence(model).feed(ids), hf_logits(str(folder), ids), atol=1e-4, rtol=0)


def test_model_config_fields(tiny_checkpoints):
    from jaxserve.models import ModelConfig

    q3 = ModelConfig.from_pretrained(tiny_checkpoints["Qwen3ForCausalLM"])
    assert (q3.qk_norm, q3.tie_word_embeddings, q3.head_dim, q3.q_size) == (True, True, 32, 128)
    q2 = ModelConfig.from_pretrained(tiny_checkpoints["Qwen2ForCausalLM"])
    assert q2.attention_bias and not q2.o_proj_bias and not q2.qk_norm
    assert dataclasses.replace(q2, attention_bias=False) != q2
