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


# Known families not served yet, with why (named in the error instead of the bare list).
NOT_YET_SUPPORTED = {
    "Gemma3ForCausalLM": "Gemma 3 interleaves sliding-window and global layers, which needs several KV cache "
                         "groups (one block table each) in the runner; not implemented yet",
}


def resolve_architecture(architectures: list[str] | None) -> str:
    for name in architectures or []:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    for name in architectures or []:
        if name in NOT_YET_SUPPORTED:
            raise ConfigError(f"architecture {name}: {NOT_YET_SUPPORTED[name]}")
    raise ConfigError(
        f"unsupported model architecture {architectures!r}; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
