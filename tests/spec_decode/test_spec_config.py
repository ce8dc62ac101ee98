"""``speculative_config`` as an engine field: a dict offline, JSON text on the command line, checked
by name when the configuration is built, with vLLM's names."""

import argparse
import json

import pytest

from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.exceptions import ConfigError

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def test_dict_and_flag_give_the_same_config():
    config = EngineConfig(speculative_config=NGRAM)
    assert config.spec_decode_config.spec == SpeculativeConfig("ngram", 3, 4, 2)
    assert json.loads(config.speculative_config) == NGRAM
    assert config.spec_decode_config.num_speculative_tokens == 3
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert EngineConfig.from_cli_args(args).spec_decode_config.spec == config.spec_decode_config.spec
    # The generated flags give the configuration back.
    again = EngineConfig.from_cli_args(parser.parse_args(config.cli_flags()))
    assert again.spec_decode_config.spec == config.spec_decode_config.spec
    assert EngineConfig().spec_decode_config.spec is None
    assert EngineConfig().spec_decode_config.num_speculative_tokens == 0


@pytest.mark.parametrize("value, words", [
    ({"method": "medusa", "num_speculative_tokens": 2}, r"method='medusa' is not supported"),
    ({"method": "mtp", "model": "/m", "num_speculative_tokens": 2}, r"speculative_config\.model: method mtp"),
    ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, r"prompt_lookup_min is for method ngram"),
    ({"method": "mtp", "num_speculative_tokens": 2, "quantization": "int8"},
     r"speculative_config\.quantization: method mtp"),
    ({"method": "mtp", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1.0},
     r"draft_tensor_parallel_size must be an integer >= 1, got 1\.0"),
    ({"method": "eagle", "num_speculative_tokens": 2}, r"speculative_config\.model: method eagle needs"),
    ({"method": "eagle3", "model": "/m", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     r"prompt_lookup_max is for method ngram, not eagle3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, r"model is for methods draft_model, eagle"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
    ("{not json", "JSON"),
])
def test_bad_values_are_refused_by_name(value, words):
    with pytest.raises(ConfigError, match=words):
        EngineConfig(speculative_config=value)


def test_pooling_runner_refuses_speculation():
    with pytest.raises(ConfigError, match="speculative_config.*pooling"):
        EngineConfig(speculative_config=NGRAM, runner="pooling")


def test_auto_off_flag_needs_speculation():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM), "--speculative-auto-off"])
    assert EngineConfig.from_cli_args(args).spec_decode_config.speculative_auto_off is True
    assert EngineConfig(speculative_config=NGRAM).spec_decode_config.speculative_auto_off is False
    with pytest.raises(ConfigError, match="speculative_auto_off needs speculative_config"):
        EngineConfig(speculative_auto_off=True)


def test_draft_model_config_and_vllm_older_form():
    new = EngineConfig(speculative_config={"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 4})
    spec = new.spec_decode_config.spec
    assert (spec.method, spec.model, spec.num_speculative_tokens, spec.quantization) == \
        ("draft_model", "/m/draft", 4, None)
    # vLLM's older form: no method, a model; the canonical JSON parses back to the same config.
    old = EngineConfig(speculative_config=json.dumps({"model": "/m/draft", "num_speculative_tokens": 4}))
    assert old.spec_decode_config.spec == spec
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    again = EngineConfig.from_cli_args(parser.parse_args(new.cli_flags()))
    assert again.spec_decode_config.spec == spec
    q = EngineConfig(speculative_config={"model": "/m/d.gguf", "num_speculative_tokens": 2, "quantization": "gguf"})
    assert q.spec_decode_config.spec.quantization == "gguf"


@pytest.mark.parametrize("value, words", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative_config\.model"),
    ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     r"speculative_config\.prompt_lookup_max"),
    ({"method": "ngram", "model": "/m", "num_speculative_tokens": 2}, r"speculative_config\.model"),
    ({"model": "/m", "num_speculative_tokens": 2, "quantization": "q3"}, r"speculative_config\.quantization"),
])
def test_draft_model_bad_values_are_refused_by_name(value, words):
    with pytest.raises(ConfigError, match=words):
        EngineConfig(speculative_config=value)


def test_eagle_config_round_trips():
    config = EngineConfig(speculative_config={"method": "eagle3", "model": "/m/head", "num_speculative_tokens": 3})
    spec = config.spec_decode_config.spec
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("eagle3", "/m/head", 3)
    assert EngineConfig(speculative_config=spec.to_dict()).spec_decode_config.spec == spec


def test_mtp_config_needs_no_model():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'])
    spec = EngineConfig.from_cli_args(args).spec_decode_config.spec
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("mtp", None, 1)
    assert spec.to_dict() == {"method": "mtp", "num_speculative_tokens": 1}
    assert EngineConfig(speculative_config=spec.to_dict()).spec_decode_config.spec == spec


def _spec(method: str) -> dict:
    return {"method": method, "num_speculative_tokens": 2, **({} if method == "mtp" else {"model": "/m"})}


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3", "mtp"])
def test_a_draft_runs_at_tensor_parallel_sizes_of_one_host(method):
    spec = _spec(method)
    assert EngineConfig(speculative_config=spec, tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=f"method={method}.*nnodes 2"):
        EngineConfig(speculative_config=spec, tensor_parallel_size=2, nnodes=2)


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "mtp"])
def test_draft_tensor_parallel_size_is_one_or_the_targets(method):
    spec = _spec(method)
    for size in (1, 4):
        config = EngineConfig(speculative_config={**spec, "draft_tensor_parallel_size": size}, tensor_parallel_size=4)
        assert config.spec_decode_config.spec.draft_tensor_parallel_size == size
        again = EngineConfig(speculative_config=config.speculative_config, tensor_parallel_size=4)
        assert again.spec_decode_config.spec == config.spec_decode_config.spec  # the canonical JSON keeps it
    with pytest.raises(ConfigError, match=r"draft_tensor_parallel_size must be 1 or tensor_parallel_size \(4\), got 2"):
        EngineConfig(speculative_config={**spec, "draft_tensor_parallel_size": 2}, tensor_parallel_size=4)
    with pytest.raises(ConfigError, match=r"draft_tensor_parallel_size must be an integer >= 1, got 0"):
        EngineConfig(speculative_config={**spec, "draft_tensor_parallel_size": 0})

