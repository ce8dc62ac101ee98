"""The built-in demo model: the same bytes every time, a Hugging Face folder that transformers loads
and whose logits jaxserve reproduces. That it builds and serves without torch is
``tests/test_without_torch.py``'s."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxserve.models.demo import CHATML_TEMPLATE, build_demo_checkpoint
from tests.models.hub_cache import folder_files


def test_built_twice_the_same_bytes(tmp_path, demo_model):
    first = folder_files(build_demo_checkpoint(tmp_path / "a"))
    second = folder_files(build_demo_checkpoint(tmp_path / "b"))
    assert sorted(first) == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                             "tokenizer.json", "tokenizer_config.json"]
    assert first == second
    # the cached demo model, built by another process: a change to these bytes needs a new DEMO_VERSION
    assert folder_files(Path(demo_model)) == first


def test_transformers_loads_it_and_jaxserve_matches_its_logits(tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    from jaxserve.models import load_model
    from tests.models.paged_sequence import PagedSequence

    folder = build_demo_checkpoint(tmp_path / "demo")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert (folder / "chat_template.jinja").read_text() == CHATML_TEMPLATE
    config = json.loads((folder / "config.json").read_text())
    assert tok.eos_token_id == config["eos_token_id"] and tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    ids = tok.encode("The scheduler budget decode prefill 日本語 😀 1234.")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    ours = PagedSequence(load_model(folder)).feed(ids)
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
