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
