"""The block tables of one KV cache group: full attention keeps every block, a sliding window
frees the blocks that fall out of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

from jaxserve.core.block_pool import BlockPool, KVCacheBlock
from jaxserve.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from jaxserve.core.kv_cache_utils import BlockHash, cdiv

if TYPE_CHECKING:
    from jaxserve.core.request import Request


class SingleTypeKVCacheManager:
    """``req_to_blocks`` of one group: each live request's blocks in token order.

    Invariants:
      * entry i covers the request's tokens ``[i * block_size, (i + 1) * block_size)``;
      * every non-null entry holds one reference for that request; the null block stands for a
        position this group no longer needs (sliding window) and holds none;
      * ``num_cached_block[req]`` leading entries are published in the prefix cache, skipped as
        duplicates, or null.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool,
                 kv_cache_group_id: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Blocks the pool must give up so the request covers ``num_tokens``: new ones, plus
        prefix hits that are free now (touching them takes them off the free queue)."""
        num_required = cdiv(num_tokens, self.block_size)
        held = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(0, num_required - len(new_computed_blocks) - held)
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable_hits

    def save_new_computed_blocks(self, request_id: str,
                                 new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Take the prefix hit (first allocation only): a reference on each non-null block."""
        if request_id in self.req_to_blocks:
            if new_computed_blocks:
                raise ValueError("prefix-hit blocks can only be added on a request's first allocation")
            return
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id] = list(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Blocks appended so the request covers ``num_tokens`` (the caller checked the pool)."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the blocks made full by the first ``num_tokens`` (all known) tokens."""
        request_id = request.request_id
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block.get(request_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(request, self.req_to_blocks[request_id],
                                              num_cached, num_full, self.kv_cache_group_id)
            self.num_cached_block[request_id] = num_full

    def free(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the request's blocks tail first. Blocks published past ``num_computed_tokens``
        (preempted in the step that scheduled them) leave the cache: their KV is never written."""
        blocks = self.req_to_blocks.pop(request_id, None)
        num_cached = self.num_cached_block.pop(request_id, 0)
        if not blocks:
            return
        num_written = num_computed_tokens // self.block_size
        if num_cached > num_written:
            self.block_pool.uncache_blocks(
                b for b in blocks[num_written:num_cached] if b.ref_cnt == 1 and not b.is_null)
        self.block_pool.free_blocks(reversed(blocks))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no later token attends to. Full attention needs them all."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_id: int, block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec) -> list[KVCacheBlock]:
        """The blocks of the longest prefix of at most ``max_length`` tokens this type can resume
        from (whole blocks); the null block where a position is not needed."""
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_id: int, block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec) -> list[KVCacheBlock]:
        """Every block of the prefix, left to right until the first miss. A prefix of a hit is a
        hit, so any shorter length the other groups settle on is one too."""
        blocks: list[KVCacheBlock] = []
        get = block_pool.get_cached_block
        for block_hash in block_hashes[:max_length // kv_cache_spec.block_size]:
            block = get(block_hash, kv_cache_group_id)
            if block is None:
                break
            blocks.append(block)
        return blocks


class SlidingWindowManager(SingleTypeKVCacheManager):

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool,
                 kv_cache_group_id: int) -> None:
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_id: int, block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec) -> list[KVCacheBlock]:
        """The longest prefix whose last ``cdiv(W - 1, block_size)`` blocks are cached (the
        window the next token reads), scanning from the right; a prefix shorter than that must
        be cached whole. Earlier positions come back as the null block.

        Unlike full attention, a prefix of a hit need not be a hit (its window may be evicted),
        which is why the coordinator looks again at every shorter length it settles on.
        """
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        null = block_pool.null_block
        window_blocks = cdiv(kv_cache_spec.sliding_window - 1, kv_cache_spec.block_size)
        max_num_blocks = min(max_length // kv_cache_spec.block_size, len(block_hashes))
        blocks = [null] * max_num_blocks
        if window_blocks == 0:
            return blocks  # a window of one token reads nothing cached
        run = 0
        get = block_pool.get_cached_block
        for i in range(max_num_blocks - 1, -1, -1):
            block = get(block_hashes[i], kv_cache_group_id)
            if block is None:
                run = 0
                continue
            blocks[i] = block
            run += 1
            if run >= window_blocks:
                del blocks[i + run:]
                return blocks
        # No full window anywhere: only a run from the very start can be resumed from.
        del blocks[run:]
        return blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Swap the null block in for blocks wholly before ``num_computed_tokens - W + 1``, the
        first position the next token reads, and free them (they stay cached until reused)."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_useful = num_computed_tokens - self.sliding_window + 1
        last_skipped = first_useful // self.block_size  # blocks [0, last_skipped) are skipped
        null = self.block_pool.null_block
        removed: list[KVCacheBlock] = []
        for i in range(min(last_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before it went in an earlier step
            removed.append(blocks[i])
            blocks[i] = null
        # Oldest first into the free queue, so the oldest is evicted first.
        self.block_pool.free_blocks(reversed(removed))


SingleTypeManagerClass = Union[type[FullAttentionManager], type[SlidingWindowManager]]


def manager_class_for(spec: KVCacheSpec) -> SingleTypeManagerClass:
    """vLLM's ``spec_manager_map``."""
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager
    return SlidingWindowManager
