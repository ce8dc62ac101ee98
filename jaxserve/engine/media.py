"""Images from requests: where they may come from, how they are checked, and how a prompt's image
placeholders become the core's ``MultiModalFeatureSpec`` list.

As vLLM: ``data:`` URLs always; ``file://`` only under ``allowed_local_media_path``; every other
URL (http, https, ...) is refused, since this server fetches nothing. An image that does not decode
(truncated, not an image, too many pixels) is an ``InvalidRequestError`` naming its part, raised
before anything reaches the engine.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np

from jaxserve.core.multimodal import MultiModalFeatureSpec, PlaceholderRange
from jaxserve.exceptions import InvalidRequestError

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # a larger image is refused, not decoded (a decompression bomb)
MAX_IMAGE_BYTES = 32 * 1024 * 1024


def _pil():
    try:
        import PIL.Image
    except ImportError as e:  # the optional "vision" extra
        raise InvalidRequestError("image", "image inputs need Pillow (pip install 'jaxserve[vision]')") from e
    return PIL.Image


def decode_image(data: bytes, part: str) -> Any:
    """Bytes -> an RGB PIL image, fully decoded now so that a truncated file fails here."""
    pil = _pil()
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(part, f"image is {len(data)} bytes, more than {MAX_IMAGE_BYTES}")
    try:
        image = pil.open(io.BytesIO(data))
        w, h = image.size
        if w * h > MAX_IMAGE_PIXELS:
            raise InvalidRequestError(part, f"image is {w}x{h} pixels, more than {MAX_IMAGE_PIXELS}")
        image.load()
        return image.convert("RGB")
    except InvalidRequestError:
        raise
    except (OSError, ValueError, SyntaxError, pil.DecompressionBombError) as e:
        raise InvalidRequestError(part, f"not a decodable image ({type(e).__name__}: {e})") from e


def check_image(image: Any, part: str) -> Any:
    """An image given offline (``multi_modal_data``) -> an RGB PIL image, or an
    ``InvalidRequestError`` naming ``part``: not a PIL image, too many pixels, or undecodable."""
    pil = _pil()
    if not isinstance(image, pil.Image):
        raise InvalidRequestError(part, f"expected a PIL image, got {type(image).__name__}")
    w, h = image.size
    if w * h > MAX_IMAGE_PIXELS:
        raise InvalidRequestError(part, f"image is {w}x{h} pixels, more than {MAX_IMAGE_PIXELS}")
    if w == 0 or h == 0:
        raise InvalidRequestError(part, f"image is {w}x{h} pixels: empty")
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise InvalidRequestError(part, f"not a decodable image ({type(e).__name__}: {e})") from e


def load_image_url(url: Any, part: str, allowed_local_media_path: str = "") -> Any:
    """An ``image_url``'s ``url`` -> a PIL image, or an ``InvalidRequestError`` naming ``part``."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(part, "must be a non-empty string URL")
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        header, sep, payload = url[5:].partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidRequestError(part, "a data URL must be data:<type>;base64,<data>")
        media_type = header[: -len(";base64")]
        if media_type and not media_type.startswith("image/"):
            raise InvalidRequestError(part, f"media type {media_type!r} is not an image")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise InvalidRequestError(part, f"bad base64 data ({e})") from e
        return decode_image(data, part)
    if scheme == "file":
        if not allowed_local_media_path:
            raise InvalidRequestError(part, "file:// URLs need --allowed-local-media-path")
        path = os.path.realpath(unquote(urlparse(url).path))
        root = os.path.realpath(allowed_local_media_path)
        if os.path.commonpath([path, root]) != root:
            raise InvalidRequestError(part, f"file is not under --allowed-local-media-path ({root})")
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_IMAGE_BYTES + 1)
        except OSError as e:
            raise InvalidRequestError(part, f"cannot read the file ({e.strerror})") from e
        return decode_image(data, part)
    raise InvalidRequestError(part, f"{scheme or 'this'} URLs are not fetched by this server; "
                                    "send the image as a data: URL")


def image_hash(pixel_values: np.ndarray) -> str:
    """Content hash of a processed image: equal pixels (and shape) give an equal encoder output."""
    h = hashlib.sha256(str((pixel_values.shape, str(pixel_values.dtype))).encode())
    h.update(np.ascontiguousarray(pixel_values).tobytes())
    return h.hexdigest()


def expand_placeholders(token_ids: Sequence[int], image_token_id: int, tokens_per_image: int,
                        image_hashes: Sequence[str], limit: int) -> tuple[list[int], list[MultiModalFeatureSpec]]:
    """Repeat each image placeholder ``tokens_per_image`` times, recording where each image sits.

    The prompt must hold one placeholder per image, and at most ``limit`` images
    (``--limit-mm-per-prompt``)."""
    if len(image_hashes) > limit:
        raise InvalidRequestError("multi_modal_data", f"{len(image_hashes)} images, more than the "
                                  f"limit of {limit} per prompt (--limit-mm-per-prompt)")
    found = sum(1 for t in token_ids if t == image_token_id)
    if found != len(image_hashes):
        raise InvalidRequestError("prompt", f"has {found} image placeholders for {len(image_hashes)} images")
    out: list[int] = []
    features: list[MultiModalFeatureSpec] = []
    for t in token_ids:
        if t == image_token_id:
            placeholder = PlaceholderRange(len(out), tokens_per_image)
            features.append(MultiModalFeatureSpec(image_hashes[len(features)], placeholder))
            out.extend([t] * tokens_per_image)
        else:
            out.append(t)
    return out, features


def chat_images(messages: Sequence[dict[str, Any]], allowed_local_media_path: str = "",
                placeholder: str = "<image>", limit: int | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """OpenAI chat messages with content parts -> messages whose content is text (what chat
    templates take) and their images in prompt order. An ``image_url`` part (or an offline
    ``image_pil`` part holding a PIL image) becomes ``placeholder``; as vLLM lays out a LLaVA
    message, a message's placeholders come first, each on its own line, then its text parts
    joined by newlines. A bad part is an ``InvalidRequestError`` naming it; more than ``limit``
    images are refused before any is decoded."""
    if limit is not None:
        count = sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
                    for p in m["content"] if isinstance(p, dict) and p.get("type") in ("image_url", "image_pil"))
        if count > limit:
            raise InvalidRequestError("multi_modal_data", f"{count} images, more than the limit of {limit} per "
                                                          "prompt (--limit-mm-per-prompt)")
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        texts: list[str] = []
        marks: list[str] = []
        for j, part in enumerate(content):
            name = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(str(part.get("text") or ""))
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(load_image_url(url, f"{name}.image_url", allowed_local_media_path))
                marks.append(placeholder)
            elif kind == "image_pil":
                images.append(check_image(part.get("image_pil"), f"{name}.image_pil"))
                marks.append(placeholder)
            else:
                raise InvalidRequestError(name, f"content parts of type {kind!r} are not supported "
                                                "(text, image_url, image_pil)")
        out.append(dict(message, content="\n".join(marks + texts)))
    return out, images
