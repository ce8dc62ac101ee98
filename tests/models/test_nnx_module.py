"""The decoder as an NNX module: its parameters are the checkpoint's tensors, it runs on the
engine's inputs when called directly, and a user's module can take the place of one of its parts."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from jaxserve.models import load_model
from jaxserve.models.safetensors_io import open_checkpoint_files
from tests.models.paged_sequence import PagedSequence, prompt
from tests.tiny_models import ARCHITECTURES

LAYOUTS = pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])


def hf_tensors_of(model) -> dict[str, np.ndarray]:
    """The module's parameters under their Hugging Face names: fused projections split apart and
    kernels transposed back to ``[out, in]``."""
    cfg = model.config
    get = lambda var: np.asarray(var[...])  # noqa: E731
    out = {"model.embed_tokens.weight": get(model.embed_tokens.embedding),
           "model.norm.weight": get(model.norm.scale)}
    if model.lm_head is not None:
        out["lm_head.weight"] = get(model.lm_head.kernel).T
    qkv_split = [cfg.q_size, cfg.q_size + cfg.kv_size]
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        out[p + "input_layernorm.weight"] = get(layer.input_layernorm.scale)
        out[p + "post_attention_layernorm.weight"] = get(layer.post_attention_layernorm.scale)
        for name, w in zip("qkv", np.split(get(attn.qkv_proj.kernel), qkv_split, axis=1)):
            out[p + f"self_attn.{name}_proj.weight"] = w.T
        if attn.qkv_proj.bias is not None:
            for name, b in zip("qkv", np.split(get(attn.qkv_proj.bias), qkv_split)):
                out[p + f"self_attn.{name}_proj.bias"] = b
        out[p + "self_attn.o_proj.weight"] = get(attn.o_proj.kernel).T
        if attn.o_proj.bias is not None:
            out[p + "self_attn.o_proj.bias"] = get(attn.o_proj.bias)
        if attn.q_norm is not None:
            out[p + "self_attn.q_norm.weight"] = get(attn.q_norm.scale)
            out[p + "self_attn.k_norm.weight"] = get(attn.k_norm.scale)
        gate, up = np.split(get(mlp.gate_up_proj.kernel), 2, axis=1)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate.T, up.T
        out[p + "mlp.down_proj.weight"] = get(mlp.down_proj.kernel).T
        if mlp.down_proj.bias is not None:
            gate_b, up_b = np.split(get(mlp.gate_up_proj.bias), 2)
            out[p + "mlp.gate_proj.bias"], out[p + "mlp.up_proj.bias"] = gate_b, up_b
            out[p + "mlp.down_proj.bias"] = get(mlp.down_proj.bias)
    return out


@LAYOUTS
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_parameters_are_the_checkpoint_tensors(tiny_checkpoints, arch, scan_layers):
    folder = tiny_checkpoints[arch]
    model = load_model(folder, scan_layers=scan_layers)
    assert model.scan_layers is scan_layers
    files = open_checkpoint_files(folder)
    checkpoint = {name: np.asarray(f.get(name)) for name, f in files.items()
                  if not (name == "lm_head.weight" and model.config.tie_word_embeddings)}
    ours = hf_tensors_of(model)
    assert sorted(ours) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert ours[name].dtype == tensor.dtype, name
        np.testing.assert_array_equal(ours[name], tensor, err_msg=name)


@LAYOUTS
def test_module_called_directly_matches_the_split_and_jitted_step(qwen3_checkpoint, scan_layers):
    model = load_model(qwen3_checkpoint, scan_layers=scan_layers)
    ids = prompt(11, seed=2)
    seq = PagedSequence(model)
    token_ids, md = seq.inputs(ids)
    hidden, _ = model(token_ids, seq.kv, md, pallas_kernels.ragged_paged_attention_reference)
    direct = np.asarray(model.compute_logits(hidden))
    np.testing.assert_allclose(direct, seq.feed(ids), atol=1e-5, rtol=0)


class Scaled(nnx.Module):
    """A user's module: the wrapped one's output times ``factor``."""

    def __init__(self, inner: nnx.Module, factor: float):
        self.inner = inner
        self.factor = factor

    def __call__(self, x):
        return self.inner(x) * self.factor


@LAYOUTS
def test_a_wrapped_norm_takes_part_in_the_forward(qwen3_checkpoint, scan_layers):
    model = load_model(qwen3_checkpoint, scan_layers=scan_layers)
    ids = prompt(12, seed=4)
    reference = PagedSequence(model).feed(ids)
    # Unrolled, one layer's norm is replaced; scanned, the stack's (every layer's at once).
    owner = model.layers.stacked if scan_layers else model.layers[1]
    wrapper = Scaled(owner.post_attention_layernorm, factor=1.0)
    owner.post_attention_layernorm = wrapper
    np.testing.assert_allclose(PagedSequence(model).feed(ids), reference, atol=1e-6, rtol=0)
    wrapper.factor = 4.0
    changed = PagedSequence(model).feed(ids)
    assert np.abs(changed - reference).max() > 1e-2


class SkipLayer(nnx.Module):
    """A user's decoder layer that passes the residual stream and the KV pools through."""

    def __call__(self, hidden, kv, layer, ctx):
        return hidden, kv


def test_a_replaced_layer_takes_part_in_the_forward(qwen3_checkpoint):
    model = load_model(qwen3_checkpoint, scan_layers=False)
    ids = prompt(12, seed=5)
    reference = PagedSequence(model).feed(ids)
    model.layers[1] = SkipLayer()
    skipped = PagedSequence(model).feed(ids)
    assert np.abs(skipped - reference).max() > 1e-2
    assert not any(path[:2] == ("layers", 1) for path, _ in nnx.to_flat_state(nnx.state(model)))


def test_scanned_layer_index_returns_that_layers_slice(qwen3_checkpoint):
    model = load_model(qwen3_checkpoint, scan_layers=True)
    last = model.layers[-1]
    np.testing.assert_array_equal(last.mlp.down_proj.kernel[...], model.layers.stacked.mlp.down_proj.kernel[...][-1])
    with pytest.raises(IndexError):
        model.layers[len(model.layers)]
