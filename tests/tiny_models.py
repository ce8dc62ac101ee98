"""The tiny test checkpoints, one per supported architecture: their shapes and builders.

Built with the demo model's builder (:mod:`jaxserve.models.demo`): real HF folders, random weights
drawn with numpy from a fixed seed, a locally trained tokenizer; no torch. The root conftest
imports this module only inside its fixtures, so that the core tests import nothing of the models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxserve.models.demo import DEMO_ARCH, DEMO_SHAPE, build_checkpoint

# Shapes of the tiny test models; each architecture exercises its own quirk.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2),
    "MistralForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
    "Qwen2ForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2),
    DEMO_ARCH: DEMO_SHAPE,
}

# Mixture-of-experts shapes, kept apart from TINY_CONFIGS (whose every entry the dense-family tests
# run): 8 experts, 2 per token, as in the real checkpoints' ratio.
TINY_MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3MoeForCausalLM": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "MixtralForCausalLM": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                               num_experts_per_tok=2, sliding_window=None),
}


# Hybrid attention: Gemma 3's five sliding-window layers per global one (its default pattern), a
# window of 20 tokens, its own query scale and a final logit soft-cap (Gemma 2's 30; Gemma 3's
# checkpoints leave it unset), so that each of them shows in the logits.
TINY_HYBRID_CONFIGS: dict[str, dict[str, Any]] = {
    "Gemma3ForCausalLM": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, sliding_window=20, query_pre_attn_scalar=24,
                              final_logit_softcapping=30.0),
    # gpt-oss: sliding and full layers alternating (a 12-token window), attention sinks, 8 biased
    # experts with 2 per token and the clamped SwiGLU; transformers' default rope: the checkpoints' yarn
    "GptOssForCausalLM": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, sliding_window=12, num_local_experts=8,
                              num_experts_per_tok=2),
}


def build_tiny_checkpoint(folder: str | Path, architecture: str = DEMO_ARCH, **kwargs: Any) -> Path:
    """A random-init checkpoint of ``architecture``'s tiny shape (keywords: ``build_checkpoint``'s)."""
    shape = {**TINY_CONFIGS, **TINY_MOE_CONFIGS, **TINY_HYBRID_CONFIGS}[architecture]
    return build_checkpoint(folder, architecture, shape, **kwargs)


ARCHITECTURES = tuple(TINY_CONFIGS)


def build_tiny_checkpoints(root: Path) -> dict[str, str]:
    """One random-init checkpoint folder per supported architecture, under ``root``."""
    return {arch: str(build_tiny_checkpoint(root / arch, arch, seed=1)) for arch in ARCHITECTURES}
