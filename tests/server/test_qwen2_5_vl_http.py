"""Qwen2.5-VL over HTTP: a real ``jaxserve serve`` of the tiny Qwen2.5-VL folder, the official
openai client sending a chat ``image_url`` part with a ``data:`` URL; the image part becomes
``<|vision_start|><|image_pad|><|vision_end|>``, and the tokens and logprobs equal transformers'
(fed the same patches, computing its own M-RoPE positions)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import openai
import pytest

from tests.engine.test_qwen2_5_vl_engine import hf_greedy, make_image, qwen_folder  # noqa: F401 - a fixture
from tests.server.server_testing import start_server, stop_server
from tests.server.test_llava_http import data_url, png

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # its own server, compiling the image and text variants
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def qwen_server(qwen_folder):  # noqa: F811
    log_path = Path(tempfile.mkdtemp(prefix="jaxserve-qwen25vl-")) / "server.log"
    handle = start_server([qwen_folder[0], "--served-model-name", "tiny-qwen-vl", "--max-model-len", "256",
                           "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                           "--limit-mm-per-prompt", '{"image": 1}'], log_path)
    client = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=120)
    yield handle, client
    client.close()
    stop_server(handle)
    assert "Traceback" not in handle.log_tail(200_000), handle.log_tail()


def test_data_url_equals_transformers(qwen_server, qwen_folder):  # noqa: F811
    _, client = qwen_server
    folder, model, pad = qwen_folder
    image = make_image(21, 24, 32)
    out = client.chat.completions.create(
        model="tiny-qwen-vl", max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                               {"type": "image_url", "image_url": {"url": data_url(png(image))}}]}],
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    content = out.choices[0].logprobs.content
    tokens, logprobs = [int(t.token.split(":")[1]) for t in content], [t.logprob for t in content]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>\n"
                                                                "what is it"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = []
    for t in tok.encode(text, add_special_tokens=False):
        ids += [t] * (30 if t == pad else 1)  # 24 x 32 pixels over max_pixels: 20 x 24, a 10 x 12 grid
    assert out.usage.prompt_tokens == len(ids)
    want_tokens, want_lps = hf_greedy(model, ids, image, pad)
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_lps, atol=2e-4)
