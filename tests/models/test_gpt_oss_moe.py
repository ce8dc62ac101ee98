"""gpt-oss's MoE block (router with bias, softmax over the top-k logits, experts with biases, the
clamped SwiGLU) against transformers' ``GptOssMLP`` on random weights; the grouped and the dense
forms, with the checkpoint's interleaved gate/up columns split into jaxserve's ``[gate | up]``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import GptOssConfig
from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss

from jaxserve.models.moe import SparseMoeBlock

H, INTER, E, K = 16, 8, 6, 2


def _hf_mlp(limit: float) -> torch.nn.Module:
    cfg = GptOssConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K,
                       swiglu_limit=limit, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=8, vocab_size=32)
    mlp = gpt_oss.GptOssMLP(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # std 1: some gate/up values pass the limit, so the clamp shows
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return mlp


def _deinterleave(a: np.ndarray) -> np.ndarray:
    """transformers' ``[..., 2 * inter]`` with gate at even and up at odd columns -> ``[gate | up]``."""
    return np.concatenate([a[..., ::2], a[..., 1::2]], axis=-1)


def _ours(mlp, limit: float, grouped: bool) -> SparseMoeBlock:
    block = SparseMoeBlock(H, INTER, E, K, True, param_dtype=jnp.float32, rngs=nnx.Rngs(0), grouped=grouped,
                           clamped_swiglu=(float(mlp.experts.alpha), limit))
    t = {n: p.detach().numpy() for n, p in mlp.named_parameters()}
    block.gate.kernel[...] = jnp.asarray(t["router.weight"].T)
    block.gate.bias[...] = jnp.asarray(t["router.bias"])
    block.experts.gate_up_proj[...] = jnp.asarray(_deinterleave(t["experts.gate_up_proj"]))
    block.experts.gate_up_proj_bias[...] = jnp.asarray(_deinterleave(t["experts.gate_up_proj_bias"]))
    block.experts.down_proj[...] = jnp.asarray(t["experts.down_proj"])
    block.experts.down_proj_bias[...] = jnp.asarray(t["experts.down_proj_bias"])
    return block


@pytest.mark.parametrize("grouped", [False, True])
def test_gpt_oss_moe_matches_transformers(grouped):
    limit = 1.5
    mlp = _hf_mlp(limit)
    x = np.random.default_rng(1).standard_normal((11, H)).astype(np.float32)
    with torch.no_grad():
        want, scores = mlp(torch.from_numpy(x)[None])
    block = _ours(mlp, limit, grouped)
    got, ids = block.forward(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want[0].numpy(), rtol=1e-4, atol=1e-4)
    _, hf_ids = torch.topk(mlp.router(torch.from_numpy(x))[0], K)
    np.testing.assert_array_equal(np.sort(np.asarray(ids), 1), np.sort(hf_ids.numpy(), 1))
    # the clamp was active: without it (a limit far above every value) the output differs
    unclamped = _ours(mlp, 1e6, grouped).forward(jnp.asarray(x))[0]
    assert np.abs(np.asarray(unclamped) - want[0].numpy()).max() > 1e-2
