"""What LoRA does not cover is refused by name, never ignored: an adapter on a mixture-of-experts
model's MLP (the experts take no delta), an expert's own projections, and DoRA. No model runs: the
input processor reads hand-written PEFT folders."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve import EngineConfig, LoRARequest
from jaxserve.engine.processor import InputProcessor
from jaxserve.exceptions import InvalidRequestError
from jaxserve.models.config import ModelConfig

HIDDEN, RANK = 8, 2
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": HIDDEN, "intermediate_size": 16,
       "moe_intermediate_size": 4, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1,
       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "rms_norm_eps": 1e-6,
       "max_position_embeddings": 64, "eos_token_id": 2, "torch_dtype": "float32"}


def peft_folder(path, modules: dict[str, tuple[int, int]], **config) -> str:
    """A PEFT folder with rank-``RANK`` weights for ``modules`` (path under layer 0: (in, out))."""
    path.mkdir()
    prefix = "base_model.model.model.layers.0."
    tensors = {}
    for module, (d_in, d_out) in modules.items():
        tensors[f"{prefix}{module}.lora_A.weight"] = np.ones((RANK, d_in), np.float32)
        tensors[f"{prefix}{module}.lora_B.weight"] = np.ones((d_out, RANK), np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    targets = sorted({m.rsplit(".", 1)[1] for m in modules})
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": 4,
                                                          "target_modules": targets, **config}))
    return str(path)


def resolve(cfg: dict, folder: str):
    engine = EngineConfig(enable_lora=True, max_loras=1, max_lora_rank=8)
    return InputProcessor(None, ModelConfig.from_dict(cfg), 32, engine).resolve_lora(LoRARequest("a", 1, folder))


def test_attention_adapters_serve_a_moe_model(tmp_path):
    key, adapter = resolve(MOE, peft_folder(tmp_path / "a", {"self_attn.q_proj": (HIDDEN, 8)}))
    assert key.startswith("a@") and set(adapter.weights) == {(0, "q_proj")}


def test_the_moe_mlp_is_refused_naming_target_modules(tmp_path):
    folder = peft_folder(tmp_path / "a", {"self_attn.q_proj": (HIDDEN, 8), "mlp.gate_proj": (HIDDEN, 16),
                                          "mlp.up_proj": (HIDDEN, 16)})
    with pytest.raises(InvalidRequestError, match="target_modules gate_proj, up_proj.*mixture-of-experts") as err:
        resolve(MOE, folder)
    assert err.value.param == "lora_request"


def test_an_experts_projection_is_refused_naming_the_tensor(tmp_path):
    folder = peft_folder(tmp_path / "a", {"mlp.experts.0.gate_proj": (HIDDEN, 4)})
    with pytest.raises(InvalidRequestError, match=r"mlp\.experts\.0\.gate_proj.*unsupported"):
        resolve(MOE, folder)


def test_dora_is_refused_naming_use_dora(tmp_path):
    folder = peft_folder(tmp_path / "a", {"self_attn.q_proj": (HIDDEN, 8)}, use_dora=True)
    with pytest.raises(InvalidRequestError, match="use_dora"):
        resolve({**MOE, "architectures": ["Qwen3ForCausalLM"]}, folder)
