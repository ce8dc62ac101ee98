"""Images from requests: data and file URLs, refused remote URLs, bad images named by their part,
content hashes and placeholder expansion. Images are made here with numpy and PIL."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from jaxserve.engine.media import decode_image, expand_placeholders, image_hash, load_image_url
from jaxserve.exceptions import InvalidRequestError

Image = pytest.importorskip("PIL.Image")
PART = "messages[0].content[1].image_url"


def png_bytes(seed: int = 0, size=(12, 9), fmt="PNG") -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media="image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def test_data_url_decodes_to_the_same_pixels():
    data = png_bytes(1)
    img = load_image_url(data_url(data), PART)
    assert img.size == (12, 9) and img.mode == "RGB"
    assert np.array_equal(np.asarray(img), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


@pytest.mark.parametrize("url, needle", [
    ("https://example.org/cat.png", "not fetched"),
    ("http://127.0.0.1/cat.png", "not fetched"),
    ("data:image/png;base64,@@@", "bad base64"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png,raw", "data:<type>;base64"),
    ("", "non-empty"),
])
def test_refused_urls_name_the_part(url, needle):
    with pytest.raises(InvalidRequestError, match=needle) as e:
        load_image_url(url, PART)
    assert e.value.param == PART


def test_truncated_and_non_image_data_are_refused():
    data = png_bytes(2, size=(64, 64))
    for bad in (data[: len(data) // 2], b"GIF89a but not really", b"plain text"):
        with pytest.raises(InvalidRequestError, match="not a decodable image") as e:
            load_image_url(data_url(bad), PART)
        assert e.value.param == PART


def test_huge_image_is_refused_before_decoding(monkeypatch):
    import jaxserve.engine.media as media
    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(InvalidRequestError, match="12x9 pixels"):
        decode_image(png_bytes(), PART)


def test_file_urls_only_under_the_allowed_path(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png_bytes(3))
    (tmp_path / "secret.png").write_bytes(png_bytes(4))
    assert load_image_url(f"file://{allowed}/a.png", PART, str(allowed)).size == (12, 9)
    with pytest.raises(InvalidRequestError, match="allowed-local-media-path"):
        load_image_url(f"file://{allowed}/a.png", PART)  # no path allowed
    with pytest.raises(InvalidRequestError, match="not under"):
        load_image_url(f"file://{allowed}/../secret.png", PART, str(allowed))
    with pytest.raises(InvalidRequestError, match="cannot read"):
        load_image_url(f"file://{allowed}/missing.png", PART, str(allowed))


def test_hash_follows_the_pixels():
    a = np.zeros((3, 4, 4), np.float32)
    b = a.copy()
    b[0, 0, 0] = 1e-3
    assert image_hash(a) == image_hash(a.copy()) != image_hash(b)
    assert image_hash(a) != image_hash(a.reshape(3, 2, 8))


def test_expand_placeholders_records_offsets_and_checks_counts():
    ids, feats = expand_placeholders([1, 7, 2, 7, 3], 7, 4, ["h1", "h2"], limit=2)
    assert ids == [1, 7, 7, 7, 7, 2, 7, 7, 7, 7, 3]
    assert [(f.identifier, f.placeholder.offset, f.placeholder.length) for f in feats] == [("h1", 1, 4), ("h2", 6, 4)]
    with pytest.raises(InvalidRequestError, match="limit-mm-per-prompt"):
        expand_placeholders([7, 7], 7, 4, ["a", "b"], limit=1)
    with pytest.raises(InvalidRequestError, match="1 image placeholders for 2 images"):
        expand_placeholders([7, 1], 7, 4, ["a", "b"], limit=4)


def test_chat_images_refuses_too_many_before_decoding():
    from jaxserve.engine.media import chat_images

    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}  # never decoded
    with pytest.raises(InvalidRequestError, match="limit-mm-per-prompt") as e:
        chat_images([{"role": "user", "content": [bad, bad, {"type": "text", "text": "x"}]}], limit=1)
    assert e.value.param == "multi_modal_data"
    good = {"type": "image_url", "image_url": {"url": data_url(png_bytes(3))}}
    messages, images = chat_images([{"role": "user", "content": [{"type": "text", "text": "x"}, good]},
                                    {"role": "assistant", "content": "ok"}], limit=1)
    assert messages[0]["content"] == "<image>\nx" and messages[1]["content"] == "ok" and len(images) == 1


def test_offline_images_are_checked_naming_the_part(monkeypatch):
    from jaxserve.engine import media
    from jaxserve.engine.media import check_image

    part = "multi_modal_data.image[1]"
    truncated = Image.open(io.BytesIO(png_bytes(4, size=(64, 64))[:300]))  # opens lazily; fails on load
    with pytest.raises(InvalidRequestError, match="not a decodable image") as e:
        check_image(truncated, part)
    assert e.value.param == part
    with pytest.raises(InvalidRequestError, match="expected a PIL image"):
        check_image(np.zeros((4, 4, 3), np.uint8), part)
    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(InvalidRequestError, match="more than 100"):
        check_image(Image.new("RGB", (11, 10)), part)
    assert check_image(Image.new("L", (10, 10)), part).mode == "RGB"
