"""The images' settings: defaults, vLLM's ``{"image": N}`` limit, and refusals naming the field."""

from __future__ import annotations

import pytest

from jaxserve import ConfigError, EngineConfig


def test_defaults_and_vllm_limit_form():
    assert EngineConfig().limit_mm_per_prompt == 4 and EngineConfig().allowed_local_media_path == ""
    assert EngineConfig(limit_mm_per_prompt={"image": 2}).limit_mm_per_prompt == 2
    assert EngineConfig(limit_mm_per_prompt=1).multimodal_config.limit_mm_per_prompt == 1


@pytest.mark.parametrize("kwargs, field", [
    ({"limit_mm_per_prompt": {"video": 1}}, "limit_mm_per_prompt"),
    ({"limit_mm_per_prompt": -1}, "limit_mm_per_prompt"),
    ({"max_num_encoder_input_tokens": -1}, "max_num_encoder_input_tokens"),
    ({"max_num_encoder_input_tokens": 64, "encoder_cache_size": 32}, "encoder_cache_size"),
])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**kwargs)


def test_flags_parse():
    import argparse

    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    args = p.parse_args(["--limit-mm-per-prompt", "2", "--allowed-local-media-path", "/tmp",
                         "--max-num-encoder-input-tokens", "64", "--encoder-cache-size", "128"])
    config = EngineConfig.from_cli_args(args)
    assert (config.limit_mm_per_prompt, config.allowed_local_media_path) == (2, "/tmp")
    assert (config.max_num_encoder_input_tokens, config.encoder_cache_size) == (64, 128)


@pytest.mark.parametrize("value, expected", [("3", 3), ('{"image": 2}', 2), ('{"image":0}', 0)])
def test_server_flag_takes_an_integer_or_vllm_json(value, expected):
    from jaxserve_server.cli import build_parser

    args = build_parser().parse_args(["serve", "some-model", "--limit-mm-per-prompt", value])
    config = EngineConfig.from_cli_args(args, model=None)
    assert config.limit_mm_per_prompt == expected
    assert config.cli_flags() == ([] if expected == 4 else ["--limit-mm-per-prompt", str(expected)])


@pytest.mark.parametrize("value", ["two", "[1]", "true"])
def test_server_flag_refuses_other_values(value, capsys):
    from jaxserve_server.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--limit-mm-per-prompt", value])
    assert "--limit-mm-per-prompt" in capsys.readouterr().err


@pytest.mark.parametrize("value, message", [('{"video": 1}', "only 'image'"), ('{"image": "2"}', "integer"),
                                            ('{"image": -1}', ">= 0")])
def test_server_flag_json_checked_naming_the_field(value, message):
    from jaxserve_server.cli import build_parser

    args = build_parser().parse_args(["serve", "m", "--limit-mm-per-prompt", value])
    with pytest.raises(ConfigError, match=f"limit_mm_per_prompt.*{message}"):
        EngineConfig.from_cli_args(args, model=None)
