"""Block hashing for prefix caching.

A full block of ``block_size`` tokens is identified by
``hash_block_tokens(parent_hash, token_ids, extra_keys)``: SHA-256 over a canonical byte encoding,
chained through the parent so equal tokens after different prefixes never collide. The chain root
``NONE_HASH`` is random per process (so hashes cannot be predicted across processes and used to
probe another tenant's cache) unless ``JAXSERVE_HASH_SEED`` or ``set_seed`` fixes it.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from typing import Protocol

from jaxserve import envs
from jaxserve.core.multimodal import MultiModalFeatureSpec, mm_extra_keys

BlockHash = bytes


class HashedTokens(Protocol):
    """What hashing reads of a request (``Request`` is one): its tokens and its extra keys."""

    all_token_ids: list[int]
    block_size: int | None
    block_hashes: list[BlockHash]
    lora_name: str | None
    cache_salt: str | None
    mm_features: list[MultiModalFeatureSpec]

NONE_HASH: BlockHash = b""


def set_seed(seed: object | None = None) -> BlockHash:
    """(Re)derive ``NONE_HASH``. ``None`` → env ``JAXSERVE_HASH_SEED`` if set, else os.urandom.

    Hashes computed before the call become stale, so only call it before any request exists.
    """
    global NONE_HASH
    if seed is None:
        seed = envs.hash_seed()
    seed_bytes = os.urandom(32) if seed is None else _encode(seed)
    NONE_HASH = hashlib.sha256(b"jaxserve-none-hash\x00" + seed_bytes).digest()
    return NONE_HASH


def _encode(obj: object) -> bytes:
    """Canonical, self-delimiting encoding: type tag + length prefix, so no two values collide."""
    if obj is None:
        return b"N"
    if isinstance(obj, bool):
        return b"B1" if obj else b"B0"
    if isinstance(obj, int):
        raw = str(obj).encode()  # arbitrary size, unambiguous
        return b"I" + struct.pack("<I", len(raw)) + raw
    if isinstance(obj, str):
        # surrogatepass: a lone surrogate (never valid UTF-8) still encodes, distinctly, so hashing
        # never raises on the engine thread whatever string reaches it.
        raw = obj.encode("utf-8", "surrogatepass")
        return b"S" + struct.pack("<I", len(raw)) + raw
    if isinstance(obj, (bytes, bytearray)):
        return b"Y" + struct.pack("<I", len(obj)) + bytes(obj)
    if isinstance(obj, (tuple, list)):
        return b"T" + struct.pack("<I", len(obj)) + b"".join(_encode(x) for x in obj)
    raise TypeError(f"cannot hash extra key of type {type(obj).__name__}")


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """Hash of one full block given its parent's hash (``None`` for the first block)."""
    if parent_hash is None:
        parent_hash = NONE_HASH
    h = hashlib.sha256(parent_hash)  # always 32 bytes, so no length prefix needed
    n = len(token_ids)
    # Signed 64-bit little-endian: covers any vocabulary and is the same on every host.
    h.update(struct.pack(f"<I{n}q", n, *token_ids))
    h.update(_encode(extra_keys))
    return h.digest()


def generate_block_hash_extra_keys(request: HashedTokens, start: int, end: int) -> tuple | None:
    """Keys besides the tokens that decide whether a block's KV can be shared.

    The LoRA adapter changes every block's KV, so it keys every block. ``cache_salt`` keys only the
    first block: the chain carries it to all later blocks, isolating tenants at no extra cost.
    An image keys every block its placeholders overlap (:func:`.multimodal.mm_extra_keys`).
    """
    keys: list[tuple] = []
    if request.lora_name is not None:
        keys.append(("lora", request.lora_name))
    if request.mm_features:
        keys.extend(mm_extra_keys(request.mm_features, start, end))
    if start == 0 and request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    return tuple(keys) if keys else None


def update_block_hashes(request: HashedTokens) -> None:
    """Extend ``request.block_hashes`` over the newly completed full blocks of its tokens."""
    bs = request.block_size
    assert bs is not None, "hashing needs the request's block size"
    tokens = request.all_token_ids
    hashes = request.block_hashes
    parent = hashes[-1] if hashes else None
    start = len(hashes) * bs
    while start + bs <= len(tokens):
        end = start + bs
        parent = hash_block_tokens(parent, tokens[start:end],
                                   generate_block_hash_extra_keys(request, start, end))
        hashes.append(parent)
        start = end


def hash_request_tokens(block_size: int, request: HashedTokens) -> list[BlockHash]:
    """All full-block hashes of a request, from scratch (tests and tools)."""
    hashes: list[BlockHash] = []
    parent = None
    tokens = request.all_token_ids
    for start in range(0, len(tokens) - block_size + 1, block_size):
        end = start + block_size
        parent = hash_block_tokens(parent, tokens[start:end],
                                   generate_block_hash_extra_keys(request, start, end))
        hashes.append(parent)
    return hashes


def make_block_hash_with_group_id(block_hash: BlockHash, kv_cache_group_id: int) -> BlockHash:
    """The block pool's key for a block of one KV cache group (vLLM's ``BlockHashWithGroupId``).

    The same tokens have one block per group (each group's layers write their own pages), so the
    pool keys them apart. Group 0 keeps the plain hash: a single-group cache is keyed as before.
    Other groups append the id (4 bytes), so no key of one group equals another's.
    """
    if kv_cache_group_id == 0:
        return block_hash
    return block_hash + struct.pack("<I", kv_cache_group_id)


def cdiv(a: int, b: int) -> int:
    """Ceiling division; jaxserve's one copy (``pallas_kernels`` keeps its own: it never imports jaxserve)."""
    return -(-a // b)


set_seed()
