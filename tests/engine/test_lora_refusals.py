"""What LoRA does not cover is refused by name, never ignored: an adapter on a mixture-of-experts
model's MLP (the experts take no delta), an expert's own projections, DoRA, an LM-head or embedding
adapter on an engine without those slots, and those slots under tensor parallelism; startup
adapters allocate the slots they need. No model runs: the input processor reads hand-written PEFT
folders."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import EngineConfig, LoRARequest, with_startup_lora_slots
from jaxserve.engine.processor import InputProcessor
from jaxserve.exceptions import ConfigError, InvalidRequestError
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


def resolve(cfg: dict, folder: str, **engine_kwargs):
    engine = EngineConfig(enable_lora=True, max_loras=1, max_lora_rank=8, **engine_kwargs)
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


DENSE = {**{k: v for k, v in MOE.items() if "expert" not in k and k != "moe_intermediate_size"},
         "architectures": ["Qwen3ForCausalLM"]}


def whole_module_folder(path, lm_head: bool, embedding: bool) -> str:
    """A PEFT folder with q_proj and, as asked, an LM-head and an embedding pair (PEFT's key names)."""
    folder = peft_folder(path, {"self_attn.q_proj": (HIDDEN, 8)})
    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    vocab = DENSE["vocab_size"]
    if lm_head:
        tensors["base_model.model.lm_head.lora_A.weight"] = np.ones((RANK, HIDDEN), np.float32)
        tensors["base_model.model.lm_head.lora_B.weight"] = np.ones((vocab, RANK), np.float32)
    if embedding:
        tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = np.ones((RANK, vocab), np.float32)
        tensors["base_model.model.model.embed_tokens.lora_embedding_B"] = np.ones((HIDDEN, RANK), np.float32)
    save_file(tensors, str(weights))
    return folder


def test_head_and_embedding_adapters_need_their_slots(tmp_path):
    head = whole_module_folder(tmp_path / "h", lm_head=True, embedding=False)
    emb = whole_module_folder(tmp_path / "e", lm_head=False, embedding=True)
    with pytest.raises(InvalidRequestError, match="target_modules lm_head needs lora_lm_head=True") as err:
        resolve(DENSE, head)
    assert err.value.param == "lora_request"
    with pytest.raises(InvalidRequestError, match="target_modules embed_tokens needs lora_embedding=True"):
        resolve(DENSE, emb, lora_lm_head=True)  # the head's slots do not serve the embedding
    _, adapter = resolve(DENSE, head, lora_lm_head=True)
    assert adapter.lm_head is not None and adapter.lm_head.b.shape == (DENSE["vocab_size"], RANK)
    _, adapter = resolve(DENSE, emb, lora_embedding=True)
    assert adapter.embedding is not None and adapter.embedding.a.shape == (RANK, DENSE["vocab_size"])


@pytest.mark.parametrize("flag", ["lora_lm_head", "lora_embedding"])
def test_head_and_embedding_slots_need_lora_and_take_tensor_parallelism(flag):
    assert getattr(EngineConfig(enable_lora=True, tensor_parallel_size=2, **{flag: True}), flag)
    with pytest.raises(ConfigError, match=f"{flag}: needs enable_lora"):
        EngineConfig(tensor_parallel_size=2, **{flag: True})


def test_startup_adapters_allocate_the_slots_they_need(tmp_path):
    plain = LoRARequest("p", 1, peft_folder(tmp_path / "p", {"self_attn.q_proj": (HIDDEN, 8)}))
    head = LoRARequest("h", 2, whole_module_folder(tmp_path / "h", lm_head=True, embedding=False))
    both = LoRARequest("b", 3, whole_module_folder(tmp_path / "b", lm_head=True, embedding=True))
    missing = LoRARequest("m", 4, str(tmp_path / "none"))
    config = EngineConfig(enable_lora=True)
    unchanged = with_startup_lora_slots(config, [plain, missing])
    assert unchanged is config and not config.lora_lm_head and not config.lora_embedding
    with_head = with_startup_lora_slots(config, [plain, head])
    assert with_head.lora_lm_head and not with_head.lora_embedding and not config.lora_lm_head
    with_both = with_startup_lora_slots(config, [both])
    assert with_both.lora_lm_head and with_both.lora_embedding
    assert not with_startup_lora_slots(EngineConfig(), [both]).lora_lm_head  # LoRA off: nothing allocated
    split = with_startup_lora_slots(EngineConfig(enable_lora=True, tensor_parallel_size=2), [head])
    assert split.lora_lm_head and split.tensor_parallel_size == 2
