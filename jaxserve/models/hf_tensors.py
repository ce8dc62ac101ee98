"""The tensors a Hugging Face checkpoint of a ``ModelConfig`` holds, by name and shape: plain
Python, so that writing random weights (the demo model) imports no jax."""

from __future__ import annotations

from jaxserve.models.config import ModelConfig


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the checkpoint must hold, with its shape."""
    h, q, kv, inter, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
    names = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
        })
        if cfg.clamped_swiglu is not None:
            names.update(gpt_oss_moe_tensors(cfg, p))
        elif cfg.is_moe:
            names.update(moe_tensors(cfg, p))
        else:
            names.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                          p + "mlp.down_proj.weight": (h, inter)})
        if cfg.attention_bias:
            names.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                          p + "self_attn.v_proj.bias": (kv,)})
        if cfg.o_proj_bias:
            names[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            names.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                          p + "mlp.down_proj.bias": (h,)})
        if cfg.qk_norm:
            names.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if cfg.attention_sinks:
            names[p + "self_attn.sinks"] = (cfg.num_attention_heads,)
        if cfg.sandwich_norms:
            names.update({p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)})
    return names


def moe_names(cfg: ModelConfig) -> tuple[str, str, str, str]:
    """The MoE block's prefix and its experts' gate, up and down names (Mixtral's are w1, w3, w2)."""
    if cfg.architecture == "MixtralForCausalLM":
        return "block_sparse_moe.", "w1", "w3", "w2"
    return "mlp.", "gate_proj", "up_proj", "down_proj"


def moe_tensors(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """One layer's router and per-expert tensors, as the hub's checkpoints name them."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    block, gate, up, down = moe_names(cfg)
    names: dict[str, tuple[int, ...]] = {p + block + "gate.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        q = f"{p}{block}experts.{e}."
        names.update({q + gate + ".weight": (inter, h), q + up + ".weight": (inter, h),
                      q + down + ".weight": (h, inter)})
    return names


def gpt_oss_moe_tensors(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """gpt-oss's router and experts: one stacked tensor each, ``gate_up_proj [E, hidden, 2 * inter]``
    with gate and up interleaved (even and odd columns), biases beside them."""
    h, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    q = p + "mlp."
    return {q + "router.weight": (e, h), q + "router.bias": (e,),
            q + "experts.gate_up_proj": (e, h, 2 * inter), q + "experts.gate_up_proj_bias": (e, 2 * inter),
            q + "experts.down_proj": (e, inter, h), q + "experts.down_proj_bias": (e, h)}
