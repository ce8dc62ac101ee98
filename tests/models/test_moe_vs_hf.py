"""Qwen3-MoE and Mixtral against transformers on tiny random checkpoints (8 experts, 2 per
token): logits over two chunks, greedy decoding, scanned and unrolled; the grouped matmul
(``ragged_dot``) against the dense one-hot form; each checkpoint's routing normalization."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.exceptions import ConfigError
from jaxserve.models import ModelConfig, load_model
from jaxserve.models.moe import dense_moe, grouped_moe, route
from jaxserve.models.tp_layout import check_tensor_parallel_size
from tests.models.paged_sequence import PagedSequence, prompt
from tests.models.test_model_vs_hf import hf_greedy, hf_logits
from tests.tiny_models import TINY_MOE_CONFIGS, build_tiny_checkpoint

MOE_ARCHITECTURES = tuple(TINY_MOE_CONFIGS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    # initializer_range 0.2: routers far from uniform, so a wrong expert choice shows in the logits.
    return {arch: str(build_tiny_checkpoint(root / arch, arch, seed=4, initializer_range=0.2))
            for arch in MOE_ARCHITECTURES}


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_logits_and_greedy_match_transformers(checkpoints, arch, scan_layers):
    folder = checkpoints[arch]
    model = load_model(folder, scan_layers=scan_layers)
    assert model.config.is_moe and model.config.num_experts == 8
    ids = prompt(37, seed=3)
    seq = PagedSequence(model)
    parts = [seq.feed(ids[:22]), seq.feed(ids[22:])]  # chunked: the second starts mid-block
    np.testing.assert_allclose(np.concatenate(parts), hf_logits(folder, ids), atol=2e-4, rtol=0)
    ours, logits = [], parts[-1]
    for _ in range(10):
        ours.append(int(logits[-1].argmax()))
        logits = seq.feed([ours[-1]])
    assert ours == hf_greedy(folder, ids, 10)


def test_ragged_dot_model_matches_transformers(checkpoints):
    """The model with ``ragged_dot`` experts (the non-CPU default) on the CPU, against transformers."""
    folder = checkpoints["Qwen3MoeForCausalLM"]
    model = load_model(folder, scan_layers=False)
    for layer in model.layers:
        layer.mlp.grouped = True
    ids = prompt(19, seed=5)
    np.testing.assert_allclose(PagedSequence(model).feed(ids), hf_logits(folder, ids), atol=2e-4, rtol=0)


def test_grouped_equals_dense():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((13, 16)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((6, 16, 2 * 8)), jnp.float32)
    down = jnp.asarray(rng.standard_normal((6, 8, 16)), jnp.float32)
    weights, ids = route(jnp.asarray(rng.standard_normal((13, 6)), jnp.float32), 2, normalize=True)
    grouped = jax.jit(grouped_moe)(x, weights, ids, gate_up, down)
    np.testing.assert_allclose(grouped, dense_moe(x, weights, ids, gate_up, down), atol=1e-4, rtol=1e-5)
    # One token alone: each of its two experts' rows, weighted.
    h = x[0] @ gate_up[ids[0]]  # [2, 16]
    act = jax.nn.silu(h[:, :8]) * h[:, 8:]
    want = sum(weights[0, j] * act[j] @ down[ids[0, j]] for j in range(2))
    np.testing.assert_allclose(grouped[0], want, atol=1e-4, rtol=1e-5)


def test_routing_normalization():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route(logits, 2, normalize=True)
    assert ids.tolist() == [[0, 1]]
    np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-6)
    raw, _ = route(logits, 2, normalize=False)  # Qwen3-MoE with norm_topk_prob false: softmax over all
    np.testing.assert_allclose(raw, jax.nn.softmax(logits)[:, :2], rtol=1e-6)


def test_unnormalized_qwen3_moe_matches_transformers(tmp_path):
    folder = str(build_tiny_checkpoint(tmp_path / "q", "Qwen3MoeForCausalLM", seed=6, initializer_range=0.2,
                                       norm_topk_prob=False))
    model = load_model(folder)
    assert not model.config.norm_topk_prob
    ids = prompt(11, seed=2)
    np.testing.assert_allclose(PagedSequence(model).feed(ids), hf_logits(folder, ids), atol=2e-4, rtol=0)


def test_unsupported_moe_configs(checkpoints):
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 4, "mlp_only_layers": [1]}
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        ModelConfig.from_dict(cfg)
    split = ModelConfig.from_dict({**cfg, "mlp_only_layers": [], "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "num_experts": 6})
    with pytest.raises(ValueError, match="does not divide the model's 6 experts"):
        check_tensor_parallel_size(split, 4)


def test_tensor_parallel_moe_needs_expert_parallelism(checkpoints):
    """Expert parallelism is how a MoE model is split; without the flag the engine refuses before
    reading a weight, naming it. (Split runs: tests/parallel/test_tp_engine.py.)"""
    from jaxserve import LLM
    from jaxserve.config import EngineConfig

    assert EngineConfig(enable_expert_parallel=True).enable_expert_parallel  # a dense model ignores it
    with pytest.raises(ConfigError, match="enable_expert_parallel"):
        LLM(checkpoints["MixtralForCausalLM"], tensor_parallel_size=2)
    model = load_model(checkpoints["MixtralForCausalLM"], tensor_parallel_size=2)  # the layout only
    assert model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8
