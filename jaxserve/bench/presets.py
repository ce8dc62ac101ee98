"""The model shapes the benchmarks name (``--random-model``, ``bench roofline --model``): Qwen3
configurations (a Qwen3-MoE, and Mistral-7B's sliding-window shape, where ``architecture`` says
so) as ``config.json`` dicts. Imports nothing of jax, so the command line can offer them without
loading it."""

from __future__ import annotations

# HF's model_type where it is not the architecture's lower-cased stem
_MODEL_TYPES = {"Qwen3MoeForCausalLM": "qwen3_moe"}

PRESETS = {
    "cpu-bench": dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=32, intermediate_size=768, tie_word_embeddings=True,
                      dtype="float32", max_position_embeddings=2048),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True,
                       dtype="bfloat16", max_position_embeddings=40960),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, tie_word_embeddings=False,
                     dtype="bfloat16", max_position_embeddings=40960),
    # Mistral-7B-v0.1: every layer windowed to 4096 positions, GQA 32/8, head_dim 128
    "mistral-7b": dict(architecture="MistralForCausalLM", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                       tie_word_embeddings=False, dtype="bfloat16", max_position_embeddings=32768,
                       sliding_window=4096, rope_theta=10000.0, rms_norm_eps=1e-5),
    # Qwen3-30B-A3B: 48 layers of 128 experts, 8 active (for the H200 compile check)
    "qwen3-30b-a3b": dict(architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, tie_word_embeddings=False, dtype="bfloat16",
                          max_position_embeddings=40960),
    # MiMo-7B: a Qwen2 (q/k/v biases) whose checkpoint adds one multi-token-prediction layer
    # (speculative method mtp; the compile check gives it a layer of this shape). The widths are
    # recalled, not read from a config.json here: the check tests structure, not MiMo's exact sizes.
    "mimo-7b": dict(architecture="MiMoForCausalLM", vocab_size=151680, hidden_size=4096, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, intermediate_size=11008, tie_word_embeddings=False,
                    dtype="bfloat16", max_position_embeddings=32768, rope_theta=640000.0, rms_norm_eps=1e-5,
                    num_nextn_predict_layers=1),
    # A small draft for qwen3 targets (their vocabulary), for the compile check of a speculating
    # engine: 4 layers of 256, GQA 4/2
    "qwen3-tiny-draft": dict(vocab_size=151936, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, intermediate_size=768, tie_word_embeddings=True,
                             dtype="bfloat16", max_position_embeddings=40960),
    # cpu-bench's shape with a mixture of 8 experts, 2 active: the active MLP width (2 x 384) is
    # cpu-bench's dense 768, so the two compare at equal active parameters
    "moe-bench": dict(architecture="Qwen3MoeForCausalLM", vocab_size=8192, hidden_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=768,
                      moe_intermediate_size=384, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      tie_word_embeddings=True, dtype="float32", max_position_embeddings=2048),
}


def preset_config(preset: str, **overrides) -> dict:
    """The ``config.json`` of a preset (a Qwen3 of that shape unless it names its architecture),
    with ``overrides`` (e.g. ``num_hidden_layers``) applied."""
    shape = {**PRESETS[preset], **overrides}
    arch = shape.pop("architecture", "Qwen3ForCausalLM")
    model_type = _MODEL_TYPES.get(arch, arch.removesuffix("ForCausalLM").lower())
    return {"architectures": [arch], "model_type": model_type, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "torch_dtype": shape["dtype"], "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", **{k: v for k, v in shape.items() if k not in ("dtype", "architecture")}}
