"""``jaxserve serve --tensor-parallel-size 8`` on eight fake CPU devices answers the openai client
with the tokens one device gives."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.parallel.tp_runs import XLA_FLAGS, build_checkpoint
from tests.server.server_testing import start_server, stop_server

SHAPE = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 16}
PROMPT = [3, 17, 29, 41, 53, 67, 79, 83, 97, 101]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_checkpoint(tmp_path_factory.mktemp("tp-serve"), "Qwen3ForCausalLM")


def test_serve_with_tensor_parallel_8_answers_the_openai_client(checkpoint, tmp_path, monkeypatch):
    import openai

    flags = [checkpoint, "--tensor-parallel-size", "8"]
    for key, value in SHAPE.items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    monkeypatch.setenv("XLA_FLAGS", XLA_FLAGS)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    server = start_server(flags, tmp_path / "server.log")
    try:
        with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120) as client:
            served = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                               max_tokens=6, temperature=0)
        assert "tensor parallel over 8 devices" in server.log_tail(200_000)
    finally:
        stop_server(server)
    assert "Traceback" not in server.log_tail(200_000), server.log_tail()
    local = LLM(checkpoint, show_progress=False, **SHAPE).generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert served.choices[0].text == local[0].outputs[0].text
    assert served.usage.completion_tokens == 6
