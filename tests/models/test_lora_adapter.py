"""PEFT adapters read with numpy: the deltas equal peft's own, and what cannot be applied is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.exceptions import ConfigError
from jaxserve.models.config import ModelConfig
from jaxserve.models.lora_adapter import PROJECTIONS, load_lora_adapter

ALL = list(PROJECTIONS)


def make_peft_adapter(base: str, out, seed: int, *, r: int = 8, targets=ALL, **lora_kwargs):
    """A random PEFT adapter (B non-zero) of ``base``, saved in PEFT's format; returns the peft model."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    conf = peft.LoraConfig(r=r, lora_alpha=lora_kwargs.pop("lora_alpha", 16), target_modules=targets,
                           init_lora_weights=False, **lora_kwargs)
    pm = peft.get_peft_model(model, conf)
    pm.save_pretrained(str(out))
    return pm


def peft_deltas(pm) -> dict[tuple[int, str], np.ndarray]:
    out = {}
    for name, module in pm.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            layer = int(name.split(".layers.")[1].split(".")[0])
            out[(layer, name.rsplit(".", 1)[1])] = module.get_delta_weight("default").detach().numpy()
    return out


@pytest.fixture(scope="module")
def llama(tiny_checkpoints) -> str:
    return tiny_checkpoints["LlamaForCausalLM"]


@pytest.mark.parametrize("kwargs", [dict(), dict(use_rslora=True, lora_alpha=7),
                                    dict(rank_pattern={"down_proj": 4}, alpha_pattern={"q_proj": 3.0})])
def test_deltas_equal_peft(llama, tmp_path, kwargs):
    pm = make_peft_adapter(llama, tmp_path / "a", seed=1, **kwargs)
    adapter = load_lora_adapter(tmp_path / "a", ModelConfig.from_pretrained(llama), max_lora_rank=16)
    want = peft_deltas(pm)
    assert set(adapter.weights) == set(want) and len(want) == 2 * len(ALL)
    for key, w in adapter.weights.items():
        np.testing.assert_allclose(w.b @ w.a, want[key], rtol=1e-5, atol=1e-6)
    if "rank_pattern" in kwargs:
        assert adapter.weights[(0, "down_proj")].rank == 4 and adapter.rank == 8


def test_digest_follows_the_weights(llama, tmp_path):
    cfg = ModelConfig.from_pretrained(llama)
    make_peft_adapter(llama, tmp_path / "a", seed=1, targets=["q_proj"])
    first = load_lora_adapter(tmp_path / "a", cfg, 8).digest
    assert load_lora_adapter(tmp_path / "a", cfg, 8).digest == first
    make_peft_adapter(llama, tmp_path / "a", seed=2, targets=["q_proj"])
    assert load_lora_adapter(tmp_path / "a", cfg, 8).digest != first


@pytest.mark.parametrize("field, value", [("use_dora", True), ("bias", "all"), ("fan_in_fan_out", True),
                                          ("modules_to_save", ["lm_head"]), ("peft_type", "IA3")])
def test_unsupported_config_fields_are_named(llama, tmp_path, field, value):
    make_peft_adapter(llama, tmp_path / "a", seed=1, targets=["q_proj"])
    conf_file = tmp_path / "a" / "adapter_config.json"
    conf = json.loads(conf_file.read_text())
    conf[field] = value
    conf_file.write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match=field):
        load_lora_adapter(tmp_path / "a", ModelConfig.from_pretrained(llama), 8)


def test_embedding_and_lm_head_targets_and_big_ranks_are_refused(llama, tmp_path):
    cfg = ModelConfig.from_pretrained(llama)
    make_peft_adapter(llama, tmp_path / "e", seed=1, targets=["embed_tokens", "q_proj"])
    with pytest.raises(ConfigError, match="embedding"):
        load_lora_adapter(tmp_path / "e", cfg, 8)
    make_peft_adapter(llama, tmp_path / "h", seed=1, targets=["lm_head", "q_proj"])
    with pytest.raises(ConfigError, match="LM head"):
        load_lora_adapter(tmp_path / "h", cfg, 8)
    make_peft_adapter(llama, tmp_path / "r", seed=1, r=16, targets=["q_proj"])
    with pytest.raises(ConfigError, match="max_lora_rank=8"):
        load_lora_adapter(tmp_path / "r", cfg, 8)
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        load_lora_adapter(tmp_path / "missing", cfg, 8)


def test_host_cache_keeps_max_cpu_loras_and_reloads_new_weights(llama, tmp_path):
    from jaxserve.models.lora_cache import LoRAAdapterCache

    cache = LoRAAdapterCache(ModelConfig.from_pretrained(llama), max_cpu_loras=2, max_lora_rank=8)
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        make_peft_adapter(llama, tmp_path / name, seed=seed, targets=["q_proj"])
    first = cache.get("a", tmp_path / "a")
    assert cache.get("a", tmp_path / "a") is first and cache.loads == 1
    old_b = cache.get("b", tmp_path / "b").digest
    cache.get("c", tmp_path / "c")
    assert cache.names() == ["b", "c"] and cache.loads == 3  # "a" evicted, least recently used
    make_peft_adapter(llama, tmp_path / "b", seed=9, targets=["q_proj"])
    new_b = cache.get("b", tmp_path / "b")  # the files were rewritten: read again
    assert new_b.digest != old_b and cache.loads == 4
    assert cache.get("b", tmp_path / "b") is new_b
    assert cache.get("b", tmp_path / "b", reload=True).digest == new_b.digest
    assert cache.remove("b") and not cache.remove("b") and cache.names() == ["c"]


def test_the_benchs_random_adapters_are_read_back_whole(llama, tmp_path):
    from jaxserve.bench.lora_bench import write_random_adapter

    cfg = ModelConfig.from_pretrained(llama)
    adapter = load_lora_adapter(write_random_adapter(tmp_path / "r", cfg, rank=4, seed=0), cfg, max_lora_rank=4)
    assert len(adapter.weights) == cfg.num_hidden_layers * len(ALL) and adapter.rank == 4
    w = adapter.weights[(0, "q_proj")]
    assert np.abs(w.b).max() > 0  # alpha / r = 2 folded into B: a delta that changes the output
