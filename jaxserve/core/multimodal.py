"""Multimodal inputs as the core sees them: where each image's placeholder tokens sit in the
prompt, its content hash, the encoder cache (vLLM's ``EncoderCacheManager``) and the scheduler's
choice of which images to encode this step under the encoder budget.

Pure Python over plain data: the features themselves (device arrays) live in the model runner,
keyed by the same content hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PlaceholderRange:
    """``length`` placeholder tokens starting at prompt position ``offset``."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class MultiModalFeatureSpec:
    """One image of a request: its content hash (``identifier``, hex SHA-256 of the processed
    pixels) and its placeholder range. Equal hashes mean equal encoder outputs."""

    identifier: str
    placeholder: PlaceholderRange
    modality: str = "image"
    # The encoder's input (the processed pixels), carried to the runner with the request; opaque
    # to the core, and never part of equality: the identifier stands for it.
    data: Any = field(default=None, compare=False, repr=False)

    @property
    def num_encoder_tokens(self) -> int:
        return self.placeholder.length


def mm_extra_keys(features: Sequence[MultiModalFeatureSpec], start: int, end: int) -> list[tuple]:
    """Block-hash keys of the images whose placeholders overlap tokens ``[start, end)``: the content
    hash and the placeholder's offset relative to the block, so the same text with another image
    (or the same image at another place) never shares a block, and the same image again does."""
    return [("mm", f.identifier, f.placeholder.offset - start) for f in features
            if f.placeholder.offset < end and f.placeholder.end > start]


class EncoderCacheManager:
    """Which images' encoder outputs are held, in units of encoder tokens (vLLM's design).

    An output is shared by every request holding the same image (by content hash). When no running
    request references it any more it becomes *freeable*: kept, so a later request with the same
    image reuses it, until space is needed, then evicted oldest first. ``get_freed_mm_hashes``
    tells the model runner which outputs to drop.
    """

    def __init__(self, cache_size: int):
        self.cache_size = cache_size
        self.num_free_slots = cache_size  # holding no output
        self.num_freeable_slots = cache_size  # free, plus those of unreferenced (evictable) outputs
        self.cached: dict[str, set[str]] = {}  # hash -> ids of the requests referencing it
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced hash -> its tokens
        self.freed: list[str] = []

    def check_and_update_cache(self, request_id: str, feature: MultiModalFeatureSpec) -> bool:
        """True if the output is held (and now referenced by ``request_id``)."""
        refs = self.cached.get(feature.identifier)
        if refs is None:
            return False
        if not refs:  # unreferenced until now: no longer evictable
            self.freeable.pop(feature.identifier)
            self.num_freeable_slots -= feature.num_encoder_tokens
        refs.add(request_id)
        return True

    def can_allocate(self, feature: MultiModalFeatureSpec, encoder_budget: int, tokens_to_schedule: int = 0) -> bool:
        """Whether ``feature`` fits the step's remaining encoder budget and the cache besides the
        ``tokens_to_schedule`` chosen (not yet allocated) before it, evicting unreferenced outputs
        (oldest first) to make room."""
        n = feature.num_encoder_tokens + tokens_to_schedule
        if feature.num_encoder_tokens > encoder_budget or n > self.num_freeable_slots:
            return False
        while n > self.num_free_slots:
            mm_hash, size = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += size
        return True

    def allocate(self, request_id: str, feature: MultiModalFeatureSpec) -> None:
        self.cached.setdefault(feature.identifier, set()).add(request_id)
        self.num_free_slots -= feature.num_encoder_tokens
        self.num_freeable_slots -= feature.num_encoder_tokens

    def free_encoder_input(self, request_id: str, feature: MultiModalFeatureSpec) -> None:
        """``request_id`` no longer needs the output (its tokens are in the KV cache, or it ended)."""
        refs = self.cached.get(feature.identifier)
        if refs is None or request_id not in refs:
            return
        refs.discard(request_id)
        if not refs:
            self.freeable[feature.identifier] = feature.num_encoder_tokens
            self.num_freeable_slots += feature.num_encoder_tokens  # still occupied, but evictable

    def free(self, request_id: str, features: Sequence[MultiModalFeatureSpec]) -> None:
        for f in features:
            self.free_encoder_input(request_id, f)

    def get_freed_mm_hashes(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed


@dataclass(frozen=True)
class EncoderSchedule:
    """The scheduler's decision for one request this step."""

    to_encode: tuple[int, ...]  # indices into the request's features, to allocate once the KV fits
    num_new_tokens: int
    encoder_budget_left: int


def schedule_encoder_inputs(request_id: str, features: Sequence[MultiModalFeatureSpec], num_computed_tokens: int,
                            num_new_tokens: int, encoder_budget: int, cache: EncoderCacheManager) -> EncoderSchedule:
    """Which images the tokens ``[num_computed_tokens, + num_new_tokens)`` need encoded, and how
    many of those tokens can run. An image whose placeholders the chunk reaches is encoded whole
    (its output waits in the cache), so a chunk may end inside an image; an image that does not
    fit the budget or the cache cuts the chunk just before its first placeholder. Images held in
    the cache are referenced for ``request_id`` here; those to encode are allocated by the caller
    (:meth:`EncoderCacheManager.allocate`) once the step's KV blocks are granted."""
    to_encode: list[int] = []
    scheduled_tokens = 0
    end = num_computed_tokens + num_new_tokens
    for i, f in enumerate(features):
        start = f.placeholder.offset
        if start >= end:
            break  # not reached this step
        if f.placeholder.end <= num_computed_tokens:
            continue  # already in the KV cache
        if cache.check_and_update_cache(request_id, f):
            continue
        if any(features[j].identifier == f.identifier for j in to_encode):
            continue  # the same image twice in one prompt is encoded once
        if not cache.can_allocate(f, encoder_budget, scheduled_tokens):
            # Tokens before the image run now; a chunk never starts inside an image it cannot encode.
            num_new_tokens = max(0, start - num_computed_tokens)
            break
        to_encode.append(i)
        scheduled_tokens += f.num_encoder_tokens
        encoder_budget -= f.num_encoder_tokens
    return EncoderSchedule(tuple(to_encode), num_new_tokens, encoder_budget)
