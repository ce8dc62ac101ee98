"""``--lora-modules`` as vLLM spells it: ``name=path`` or JSON, checked before the engine starts."""

from __future__ import annotations

import json

import pytest

from jaxserve import ConfigError
from server.lora import parse_lora_modules, runtime_updates_allowed


def test_both_forms_give_lora_requests_numbered_from_one():
    spec = json.dumps({"name": "b", "path": "/x/b", "base_model_name": "other"})
    a, b = parse_lora_modules(["a=/x/a", spec], "base")
    assert (a.lora_name, a.lora_int_id, a.lora_path, a.base_model_name) == ("a", 1, "/x/a", "base")
    assert (b.lora_name, b.lora_int_id, b.lora_path, b.base_model_name) == ("b", 2, "/x/b", "other")
    assert parse_lora_modules(None, "base") == []


@pytest.mark.parametrize("specs, message", [(["a"], "neither name=path nor JSON"), (["=/x"], "neither"),
                                            (['{"name": "a"}'], "not JSON with 'name' and 'path'"),
                                            (["a=/x", "a=/y"], "given twice"), (["base=/x"], "given twice")])
def test_bad_specs_are_config_errors(specs, message):
    with pytest.raises(ConfigError, match=message):
        parse_lora_modules(specs, "base")


@pytest.mark.parametrize("value, allowed", [("True", True), ("1", True), ("true", True), ("0", False), ("", False)])
def test_the_runtime_switch_reads_vllms_variable(monkeypatch, value, allowed):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
    assert runtime_updates_allowed() is allowed
