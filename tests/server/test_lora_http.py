"""LoRA over HTTP on a real ``jaxserve serve`` with the official openai client: ``--lora-modules``
(both forms), ``model`` picking an adapter, ``/v1/models`` listing adapters with their parent,
greedy tokens and logprobs equal to transformers + peft in one mixed batch (an LM-head and
embedding adapter among them: a startup adapter allocates those slots), and vLLM's runtime
load / unload / reload behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``."""

from __future__ import annotations

import concurrent.futures
import json
import os
import tempfile
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.engine.test_lora_engine import MAX_TOKENS, make_prompts, peft_greedy
from tests.models.test_lora_adapter import make_peft_adapter
from tests.server.server_testing import assert_error, start_server, stop_server

pytestmark = pytest.mark.slow  # its own server, compiling the LoRA and the base variants (~1 min of CPU)


@pytest.fixture(scope="module")
def lora_server(tiny_checkpoints, tmp_path_factory):
    base = tiny_checkpoints["LlamaForCausalLM"]
    root = tmp_path_factory.mktemp("http_loras")
    pms = {"a0": make_peft_adapter(base, root / "a0", seed=3, r=8).eval(),
           "a1": make_peft_adapter(base, root / "a1", seed=4, r=4, targets=["q_proj", "v_proj"]).eval(),
           "h": make_peft_adapter(base, root / "h", seed=8, r=4, targets=["lm_head", "embed_tokens", "k_proj"]).eval()}
    pms["h"].save_pretrained(str(root / "h"), save_embedding_layers=False)  # LoRA pairs, no base copy
    a1 = json.dumps({"name": "a1", "path": str(root / "a1"), "base_model_name": "tiny"})
    log_path = Path(tempfile.mkdtemp(prefix="jaxserve-lora-")) / "server.log"
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # the child process reads it
    try:
        handle = start_server([base, "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
                               "--max-cpu-loras", "4", "--max-lora-rank", "8",
                               "--lora-modules", f"a0={root / 'a0'}", a1, f"h={root / 'h'}"], log_path)
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    client = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=120)
    yield handle, client, base, root, pms
    client.close()
    stop_server(handle)
    assert "Traceback" not in handle.log_tail(200_000), handle.log_tail()


def complete(client, model: str, prompt: list[int]):
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    assert out.model == model
    return [int(t.split(":")[1]) for t in lp.tokens], lp.token_logprobs


def test_models_lists_the_adapters_with_their_parent(lora_server):
    handle, client, *_ = lora_server
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "a0", "a1", "h"}
    assert cards["a0"].parent == "tiny" and cards["a1"].parent == "tiny" and cards["a0"].root.endswith("a0")
    assert client.models.retrieve("a1").id == "a1"


def test_a_mixed_batch_matches_peft(lora_server):
    _, client, _, _, pms = lora_server
    prompts = make_prompts(8)
    models = ["tiny", "a0", "a1", "h"] * 2
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # in flight together: one mixed batch
        got = list(pool.map(lambda mp: complete(client, *mp), zip(models, prompts)))
    for model, prompt, (tokens, logprobs) in zip(models, prompts, got):
        if model == "tiny":
            with pms["a0"].disable_adapter():
                want_t, want_lp = peft_greedy(pms["a0"], prompt)
        else:
            want_t, want_lp = peft_greedy(pms[model], prompt)
        assert tokens == want_t, model
        np.testing.assert_allclose(logprobs, want_lp, atol=2e-4)
    metrics = httpx.get(f"{lora_server[0].base}/metrics").text
    assert 'jaxserve:lora_requests_info{' in metrics and 'max_lora="2"' in metrics


def test_load_unload_and_reload_at_run_time(lora_server):
    handle, client, base, root, _ = lora_server
    prompt = make_prompts(1)[0]
    pm = make_peft_adapter(base, root / "a2", seed=5, r=8).eval()
    with httpx.Client(base_url=handle.base, timeout=120) as http:
        with pytest.raises(openai.NotFoundError):
            complete(client, "a2", prompt)
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(root / "a2")})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' added successfully."
        assert complete(client, "a2", prompt)[0] == peft_greedy(pm, prompt)[0]
        assert "a2" in {m.id for m in client.models.list().data}
        assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(root / "a2")}),
                     400, contains="already been loaded")
        assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(root / "none")}),
                     400, param="lora_path", contains="no adapter_config.json")
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status_code == 200 and "removed successfully" in r.text
        assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}), 404, contains="cannot be found")
        with pytest.raises(openai.NotFoundError):
            complete(client, "a2", prompt)
        # A reload under the same name with new weights answers with them, never the old KV.
        new_pm = make_peft_adapter(base, root / "a2", seed=6, r=8).eval()
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(root / "a2")}).is_success
        tokens, logprobs = complete(client, "a2", prompt)
        want_t, want_lp = peft_greedy(new_pm, prompt)
        assert tokens == want_t
        np.testing.assert_allclose(logprobs, want_lp, atol=2e-4)
