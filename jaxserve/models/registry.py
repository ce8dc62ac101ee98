"""Which Hugging Face ``architectures`` entries jaxserve can run.

All four are the same Llama-family decoder; the differences (q/k/v bias, q/k norm, explicit
head_dim, tied embeddings) are read from the config, so one implementation serves them all.
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
)


def resolve_architecture(architectures: list[str] | None) -> str:
    for name in architectures or []:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ConfigError(
        f"unsupported model architecture {architectures!r}; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
