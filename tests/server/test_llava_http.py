"""Images over HTTP: a real ``jaxserve serve`` of the tiny LLaVA folder, the official openai
client sending chat content parts with a ``data:`` URL image (tokens and logprobs equal
transformers'), a ``file://`` image under ``--allowed-local-media-path`` (the same answer), and
the refusals as OpenAI-style 400s naming the part: a remote URL, a file outside the folder, a
truncated image, a non-image media type, and more images than ``--limit-mm-per-prompt``."""

from __future__ import annotations

import base64
import io
import tempfile
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.engine.test_llava_engine import hf_greedy, llava_folder, make_image  # noqa: F401 - a fixture
from tests.server.server_testing import assert_error, start_server, stop_server

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # its own server, compiling the image and text variants (~1 min at load 6)
MAX_TOKENS = 6


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def llava_server(llava_folder, tmp_path_factory):  # noqa: F811
    folder = llava_folder[0]
    media = tmp_path_factory.mktemp("media")
    log_path = Path(tempfile.mkdtemp(prefix="jaxserve-llava-")) / "server.log"
    handle = start_server([folder, "--served-model-name", "tiny-llava", "--max-model-len", "256",
                           "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                           "--max-num-encoder-input-tokens", "32",
                           "--limit-mm-per-prompt", "1", "--allowed-local-media-path", str(media)], log_path)
    client = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=120)
    yield handle, client, media
    client.close()
    stop_server(handle)
    assert "Traceback" not in handle.log_tail(200_000), handle.log_tail()


def chat(client, url: str):
    out = client.chat.completions.create(
        model="tiny-llava", max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                               {"type": "image_url", "image_url": {"url": url}}]}],
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    content = out.choices[0].logprobs.content
    return [int(t.token.split(":")[1]) for t in content], [t.logprob for t in content], out.usage.prompt_tokens


def test_data_and_file_urls_equal_transformers(llava_server, llava_folder):  # noqa: F811
    _, client, media = llava_server
    folder, model, tok = llava_folder
    image = make_image(21, 36, 44)
    tokens, logprobs, n_prompt = chat(client, data_url(png(image)))
    text = tok.apply_chat_template([{"role": "user", "content": "<image>\nwhat is it"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = []
    for t in tok.encode(text, add_special_tokens=False):
        ids += [t] * (16 if t == model.config.image_token_index else 1)
    assert n_prompt == len(ids)
    processor = transformers.CLIPImageProcessor.from_pretrained(folder)
    want_tokens, want_lps = hf_greedy(model, processor, ids, image)
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_lps, atol=2e-4)

    (media / "cat.png").write_bytes(png(image))
    assert chat(client, f"file://{media / 'cat.png'}")[0] == want_tokens


@pytest.mark.parametrize("url, part, needle", [
    ("https://example.org/cat.png", "messages[0].content[1].image_url", "not fetched"),
    ("file:///etc/hostname", "messages[0].content[1].image_url", "allowed-local-media-path"),
    ("data:text/plain;base64,aGVsbG8=", "messages[0].content[1].image_url", "not an image"),
    ("TRUNCATED", "messages[0].content[1].image_url", "not a decodable image"),
])
def test_bad_images_are_400s_naming_the_part(llava_server, url, part, needle):
    handle, *_ = llava_server
    if url == "TRUNCATED":
        url = data_url(png(make_image(5))[:200])
    body = {"model": "tiny-llava", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    assert_error(httpx.post(f"{handle.url}/chat/completions", json=body, timeout=60), 400, param=part, contains=needle)


def test_limit_mm_per_prompt(llava_server):
    handle, *_ = llava_server
    url = data_url(png(make_image(6)))
    body = {"model": "tiny-llava", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "image_url", "image_url": {"url": url}}]}]}
    assert_error(httpx.post(f"{handle.url}/chat/completions", json=body, timeout=60), 400,
                 param="multi_modal_data", contains="limit-mm-per-prompt")
    ok = httpx.post(f"{handle.url}/chat/completions", timeout=60, json=dict(body, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]))
    assert ok.status_code == 200, ok.text
