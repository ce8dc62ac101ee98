"""Which Hugging Face ``architectures`` entries jaxserve can run.

All are the same Llama-family decoder; the differences (q/k/v bias, q/k norm, explicit head_dim,
tied embeddings, experts, per-layer windows, Gemma 3's norms, embedding scale and rotary bases)
are read from the config, so one implementation serves them all.
"""

from __future__ import annotations

from jaxserve.exceptions import ConfigError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",  # the same decoder with a sparse MoE MLP (jaxserve.models.moe)
    "MixtralForCausalLM",
    "Gemma3ForCausalLM",  # local/global layers, sandwich norms, scaled embeddings (config fields)
    "GptOssForCausalLM",  # attention sinks; biased router and experts, clamped SwiGLU (bf16/f32 weights only)
)


# Architectures that are one of the above with extra tensors the decoder does not read: served as
# that decoder. MiMo: Qwen2 plus its multi-token-prediction layers (``model.mtp_layers.*``), which
# only speculative decoding's method mtp reads (jaxserve.models.mtp).
ALIASES: dict[str, str] = {"MiMoForCausalLM": "Qwen2ForCausalLM"}


# Known families not served yet, with why (named in the error instead of the bare list).
NOT_YET_SUPPORTED: dict[str, str] = {}


def resolve_architecture(architectures: list[str] | None) -> str:
    for name in architectures or []:
        if name in SUPPORTED_ARCHITECTURES:
            return name
        if name in ALIASES:
            return ALIASES[name]
    for name in architectures or []:
        if name in NOT_YET_SUPPORTED:
            raise ConfigError(f"architecture {name}: {NOT_YET_SUPPORTED[name]}")
    raise ConfigError(
        f"unsupported model architecture {architectures!r}; "
        f"supported architectures: {', '.join((*SUPPORTED_ARCHITECTURES, *ALIASES))}"
    )
