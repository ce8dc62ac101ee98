"""Model configuration read from a Hugging Face ``config.json``.

Two dialects of the same file exist in the wild: checkpoints written by transformers 5
(``rope_parameters``, ``dtype``) and the hub's older form (``rope_theta``, ``rope_scaling``,
``torch_dtype``). Both normalise to one ``ModelConfig``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jaxserve.exceptions import ConfigError
from jaxserve.layers.rope_config import RopeConfig

# Weight quantization methods (--quantization), vLLM's names; one list for the config and the loader:
# int8 and fp8 quantize a float checkpoint online; gguf keeps a .gguf file's quant blocks as stored;
# compressed-tensors loads a pre-quantized checkpoint's int8/fp8 weights (also detected unasked).
ONLINE_QUANTIZATION_METHODS = ("int8", "fp8")
QUANTIZATION_METHODS = (*ONLINE_QUANTIZATION_METHODS, "gguf", "compressed-tensors")

_DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


_LLAVA_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM"}


def llava_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A LLaVA ``config.json``'s ``text_config`` as a text model's config dict."""
    text = dict(hf.get("text_config") or {})
    model_type = text.get("model_type", "llama")
    if model_type not in _LLAVA_TEXT_ARCHITECTURES:
        raise ConfigError(f"text_config.model_type: {model_type!r} is not one of {sorted(_LLAVA_TEXT_ARCHITECTURES)}")
    text.setdefault("architectures", [_LLAVA_TEXT_ARCHITECTURES[model_type]])
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    for key in ("torch_dtype", "dtype"):  # transformers writes the dtype at the top level
        if key in hf:
            text.setdefault(key, hf[key])
    return text


def qwen2_5_vl_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A Qwen2.5-VL ``config.json``'s language model as a Qwen2 config dict: transformers 5 nests it
    in ``text_config``, the hub's older files keep its fields at the top level."""
    text = {**hf, **(hf.get("text_config") or {})}
    text.pop("text_config", None)
    text.pop("vision_config", None)
    text["architectures"] = ["Qwen2ForCausalLM"]  # the same decoder (q/k/v bias), with M-RoPE
    for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
        if key in hf:
            text.setdefault(key, hf[key])
    return text


def normalize_dtype_name(name: Any) -> str:
    """Map the spellings found in configs and CLI flags (``torch.bfloat16``, ``bf16``) to one name."""
    text = str(name).removeprefix("torch.").lower()
    if text not in _DTYPE_NAMES:
        raise ConfigError(f"dtype: unsupported value {name!r}; expected float32, bfloat16 or float16")
    return _DTYPE_NAMES[text]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str
    attention_bias: bool  # bias on q/k/v (Qwen2 always, Llama when attention_bias=true)
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None
    # Per layer, "sliding_attention" (the window above) or "full_attention"; None: every layer alike
    # (all sliding when sliding_window is set). Gemma 3, Qwen with max_window_layers, gpt-oss.
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Qwen3-MoE, Mixtral); num_experts 0: a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's width
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to one
    # Gemma 3 (the defaults are the Llama family's).
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_pytorch_tanh"
    norm_offset: float = 0.0  # every RMSNorm scales by offset + w (Gemma stores w - 1: offset 1)
    embed_scale: float | None = None  # the token embeddings times this (Gemma: sqrt(hidden_size))
    sandwich_norms: bool = False  # norms after attention and around the MLP (Gemma's four per layer)
    query_pre_attn_scalar: float | None = None  # attention scale 1 / sqrt(this); None: head_dim
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    local_rope: RopeConfig | None = None  # the sliding layers' own rotary (rope_local_base_freq); None: rope
    # gpt-oss: a learned per-head logit in each attention's softmax denominator (attention sinks)
    attention_sinks: bool = False
    # gpt-oss's experts: (alpha, limit) of its clamped SwiGLU, with biased router and experts; None: SwiGLU
    clamped_swiglu: tuple[float, float] | None = None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_hidden_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint folder {path}")
        cfg = json.loads(file.read_text())
        if "LlavaForConditionalGeneration" in (cfg.get("architectures") or []):
            cfg = llava_text_config(cfg)  # a LLaVA folder: its language model's config
        elif "Qwen2_5_VLForConditionalGeneration" in (cfg.get("architectures") or []):
            cfg = qwen2_5_vl_text_config(cfg)
        return cls.from_dict(cfg)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        from jaxserve.models.registry import resolve_architecture

        arch = resolve_architecture(cfg.get("architectures"))
        method = (cfg.get("quantization_config") or {}).get("quant_method")
        if arch == "GptOssForCausalLM" and method is not None:  # the hub's gpt-oss ships its experts in MXFP4
            raise ConfigError(f"config.json: gpt-oss quantization_config {method!r} is not supported (bf16/float32 "
                              "checkpoints only)")
        heads = _required(cfg, "num_attention_heads")
        hidden = _required(cfg, "hidden_size")
        head_dim = cfg.get("head_dim") or hidden // heads
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False)) or is_qwen2
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        qwen = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        if arch in qwen and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=_required(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(cfg, "intermediate_size"),
            num_hidden_layers=_required(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            **_rope_fields(arch, cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=normalize_dtype_name(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            attention_bias=attention_bias,
            # Qwen2 has biases on q/k/v only; Llama's attention_bias covers o_proj too.
            o_proj_bias=bool(cfg.get("attention_bias", False)) and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=sliding,
            layer_types=_layer_types(arch, cfg, sliding),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_fields(arch, cfg),
            **_gemma3_fields(arch, cfg),
        )


_LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_types(arch: str, cfg: dict[str, Any], sliding: int | None) -> tuple[str, ...] | None:
    """config.json's ``layer_types``; for a Qwen window without them, transformers' rule (layers
    from ``max_window_layers`` on slide). None when every layer is alike."""
    if sliding is None:
        return None
    layers = int(_required(cfg, "num_hidden_layers"))
    types = cfg.get("layer_types")
    if types is None and arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        first = int(cfg.get("max_window_layers", layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if types is None and arch == "Gemma3ForCausalLM":  # the hub's form: every pattern-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if types is None:
        return None
    if len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise ConfigError(f"config.json: layer_types must name {layers} layers, each one of {_LAYER_TYPES}; "
                          f"got {types!r}")
    return None if all(t == "sliding_attention" for t in types) else tuple(types)


def _gemma3_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's differences from the Llama decoder. Its ``attn_logit_softcapping`` is not read:
    transformers' Gemma 3 attention does not apply it either."""
    if arch != "Gemma3ForCausalLM":
        return {}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "silu"):
        raise ConfigError(f"config.json: hidden_activation {act!r} is not supported (gelu_pytorch_tanh, silu)")
    scalar = cfg.get("query_pre_attn_scalar")
    cap = cfg.get("final_logit_softcapping")
    return dict(hidden_act=act, norm_offset=1.0, embed_scale=float(cfg["hidden_size"]) ** 0.5, sandwich_norms=True,
                query_pre_attn_scalar=None if scalar is None else float(scalar),
                final_logit_softcapping=None if cap is None else float(cap))


def _rope_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``rope``, and for Gemma 3 the sliding layers' ``local_rope``."""
    if arch != "Gemma3ForCausalLM":
        return dict(rope=_parse_rope(cfg))
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one rope per layer type
        rope = _parse_rope({**cfg, "rope_parameters": params["full_attention"], "rope_scaling": None})
        local = _parse_rope({**cfg, "rope_parameters": params.get("sliding_attention") or {}, "rope_scaling": None,
                             "rope_theta": 10000.0})
    else:  # the hub's form: rope_theta and rope_scaling for the global layers, a base for the local ones
        rope = _parse_rope(cfg)
        local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    return dict(rope=rope, local_rope=local)


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The experts of a MoE checkpoint: Mixtral names them ``num_local_experts`` (its
    ``intermediate_size`` is the experts'), Qwen3-MoE ``num_experts`` (``moe_intermediate_size``)."""
    if arch == "GptOssForCausalLM":
        return dict(num_experts=_required(cfg, "num_local_experts"),
                    num_experts_per_tok=_required(cfg, "num_experts_per_tok"),
                    moe_intermediate_size=_required(cfg, "intermediate_size"), norm_topk_prob=True,
                    attention_sinks=True,
                    clamped_swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))))
    if arch == "MixtralForCausalLM":
        return dict(num_experts=_required(cfg, "num_local_experts"),
                    num_experts_per_tok=_required(cfg, "num_experts_per_tok"),
                    moe_intermediate_size=_required(cfg, "intermediate_size"), norm_topk_prob=True)
    if arch != "Qwen3MoeForCausalLM":
        return {}
    # Dense layers between sparse ones would make layers of two kinds, which the scanned stack can't hold.
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise ConfigError("config.json: Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                          "is not supported")
    # transformers 5 writes Qwen3-MoE's count as num_local_experts too.
    count = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not count:
        raise ConfigError("config.json: missing required field 'num_experts'")
    return dict(num_experts=count, num_experts_per_tok=_required(cfg, "num_experts_per_tok"),
                moe_intermediate_size=_required(cfg, "moe_intermediate_size"),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def _required(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"config.json: missing required field {key!r}")
    return cfg[key]


def _parse_yarn(cfg: dict[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
    """YaRN as transformers reads it: ``factor`` (default: the context over the original one) and
    ``attention_factor`` (default: ``0.1 * ln(factor) + 1``, or the ``mscale`` ratio when both are set)."""
    original = int(_required(params, "original_max_position_embeddings"))
    factor = float(params.get("factor") or int(cfg.get("max_position_embeddings", original)) / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeConfig(theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                      beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                      truncate=bool(params.get("truncate", True)), attention_factor=float(attention))


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 puts theta and scaling in rope_parameters; the hub form splits them.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    mrope_section = tuple(int(n) for n in params.get("mrope_section") or ())
    if rope_type == "mrope":  # the hub's older spelling of Qwen2-VL's default rotary with sections
        rope_type = "default"
    if rope_type not in ("default", "llama3", "linear", "yarn"):
        raise ConfigError(f"config.json: rope type {rope_type!r} is not supported (supported: default, llama3, linear, "
                          "yarn)")
    if rope_type == "default":
        return RopeConfig(theta=float(theta), mrope_section=mrope_section)
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), rope_type="linear", factor=float(params["factor"]))
    if rope_type == "yarn":
        return _parse_yarn(cfg, params, float(theta))
    return RopeConfig(
        theta=float(theta),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )
