"""Pooling configuration: Sentence-Transformers files, --pooler-config, runner/convert detection."""

import argparse
import json

import pytest

from jaxserve.config import EngineConfig
from jaxserve.exceptions import ConfigError
from jaxserve.models.pooling_config import (
    PoolerConfig,
    parse_pooler_config,
    resolve_pooler_config,
    resolve_pooling_task,
    sentence_transformers_pooling,
)


def write_st_folder(folder, mode: str | None, normalize: bool, pooling_dir="1_Pooling"):
    """The files Sentence-Transformers' ``save`` writes, as a real model folder has them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if mode is not None:
        modules.append({"idx": 1, "name": "1", "path": pooling_dir, "type": "sentence_transformers.models.Pooling"})
        (folder / pooling_dir).mkdir()
        config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
                  "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                  "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                  "pooling_mode_lasttoken": False, "include_prompt": True}
        config[mode] = True
        (folder / pooling_dir / "config.json").write_text(json.dumps(config))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


@pytest.mark.parametrize("mode,kind", [("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
                                       ("pooling_mode_cls_token", "CLS")])
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_transformers_files(tmp_path, mode, kind, normalize):
    write_st_folder(tmp_path, mode, normalize)
    assert sentence_transformers_pooling(str(tmp_path)) == {"pooling_type": kind, "normalize": normalize}
    assert resolve_pooler_config("embed", str(tmp_path), None) == PoolerConfig(kind, normalize)
    # classify keeps the checkpoint's pooling but never normalizes the head's input by it.
    assert resolve_pooler_config("classify", str(tmp_path), None).pooling_type == kind


def test_unsupported_sentence_transformers_mode_names_the_file(tmp_path):
    write_st_folder(tmp_path, "pooling_mode_max_tokens", True)
    with pytest.raises(ConfigError, match="1_Pooling.*pooling_mode_max_tokens"):
        sentence_transformers_pooling(str(tmp_path))


def test_defaults_without_files(tmp_path):
    assert sentence_transformers_pooling(str(tmp_path)) == {}
    assert resolve_pooler_config("embed", str(tmp_path), None) == PoolerConfig("LAST", True)
    assert resolve_pooler_config("classify", None, None) == PoolerConfig("LAST", True)


def test_pooler_config_overrides_the_files(tmp_path):
    write_st_folder(tmp_path, "pooling_mode_cls_token", True)
    got = resolve_pooler_config("embed", str(tmp_path), '{"pooling_type": "mean", "dimensions": 32}')
    assert got == PoolerConfig("MEAN", True, 32)
    got = resolve_pooler_config("embed", str(tmp_path), '{"normalize": false}')
    assert got == PoolerConfig("CLS", False)


@pytest.mark.parametrize("text,field", [("not json", "not JSON"), ("[1]", "JSON object"),
                                        ('{"pooling": "MEAN"}', "unknown key"),
                                        ('{"pooling_type": "MAX"}', "pooling_type"),
                                        ('{"dimensions": 0}', "dimensions"),
                                        ('{"normalize": "yes"}', "normalize")])
def test_bad_pooler_config_is_a_config_error(text, field):
    with pytest.raises(ConfigError, match=field):
        parse_pooler_config(text)
    with pytest.raises(ConfigError, match=field):
        EngineConfig(pooler_config=text)


@pytest.mark.parametrize("archs,runner,convert,want", [
    (["Qwen3ForCausalLM"], "auto", "auto", None),
    (["Qwen3ForCausalLM"], "pooling", "auto", "embed"),
    (["Qwen3ForCausalLM"], "auto", "embed", "embed"),
    (["Qwen3ForCausalLM"], "auto", "classify", "classify"),
    (["Qwen3ForSequenceClassification"], "auto", "auto", "classify"),
    (["BertForSequenceClassification"], "pooling", "none", "classify"),
    (["BertModel"], "auto", "auto", "embed"),
    (["Qwen3Model"], "auto", "auto", "embed"),
])
def test_task_detection(archs, runner, convert, want):
    assert resolve_pooling_task(archs, None, runner, convert) == want


def test_sentence_transformers_folder_embeds_a_causal_lm(tmp_path):
    write_st_folder(tmp_path, "pooling_mode_lasttoken", True)
    assert resolve_pooling_task(["Qwen3ForCausalLM"], str(tmp_path), "auto", "auto") == "embed"


def test_refused_combinations_name_the_setting():
    with pytest.raises(ConfigError, match="convert"):
        resolve_pooling_task(["Qwen3ForCausalLM"], None, "generate", "embed")
    with pytest.raises(ConfigError, match="runner.*cannot generate"):
        resolve_pooling_task(["BertModel"], None, "generate", "auto")
    with pytest.raises(ConfigError, match="convert"):
        EngineConfig(runner="generate", convert="classify")
    with pytest.raises(ConfigError, match="runner"):
        EngineConfig(runner="embedding")


def test_flags_follow_vllm_names():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--runner", "pooling", "--convert", "embed",
                              "--pooler-config", '{"pooling_type": "MEAN"}'])
    config = EngineConfig.from_cli_args(args)
    assert (config.runner, config.convert) == ("pooling", "embed")
    assert config.cli_flags() == ["--runner", "pooling", "--convert", "embed",
                                  "--pooler-config", '{"pooling_type": "MEAN"}']
