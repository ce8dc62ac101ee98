"""One block pool, one ``SingleTypeKVCacheManager`` per KV cache group, and the prefix hit they
all agree on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxserve.core.block_pool import BlockPool, KVCacheBlock
from jaxserve.core.kv_cache_spec import KVCacheConfig
from jaxserve.core.kv_cache_utils import BlockHash
from jaxserve.core.single_type_kv_cache_manager import SingleTypeKVCacheManager, manager_class_for

if TYPE_CHECKING:
    from jaxserve.core.request import Request

GroupBlocks = tuple[list[KVCacheBlock], ...]  # one list per KV cache group, in group order


class HybridKVCacheCoordinator:
    """vLLM's coordinator of the KV cache groups (any number, any mix of types).

    Invariants (besides each group manager's own):
      * a live request has an entry in every group, each covering the same tokens: entry i of
        every group is tokens ``[i * block_size, (i + 1) * block_size)``;
      * the groups draw from one pool, and a block belongs to at most one group (the pool keys
        each group's cached blocks apart, ``make_block_hash_with_group_id``).
    """

    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool = True) -> None:
        self.kv_cache_config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            manager_class_for(g.kv_cache_spec)(g.kv_cache_spec, self.block_pool, gid)
            for gid, g in enumerate(kv_cache_config.kv_cache_groups))

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[GroupBlocks, int]:
        """The longest prefix (whole blocks, at most ``max_cache_hit_length`` tokens) that every
        group can resume from, with each group's blocks for it.

        Each group finds its longest hit no longer than the length the groups before it left;
        the pass repeats at the new length until one pass leaves it unchanged, since a sliding
        window's hit does not shrink to a shorter one (its window there may be gone). The length
        only falls, so this ends (at 0 at worst, where every group agrees).
        """
        length = max_cache_hit_length
        pool = self.block_pool
        while True:
            hits: list[list[KVCacheBlock]] = []
            current = length
            for mgr in self.single_type_managers:
                blocks = type(mgr).find_longest_cache_hit(
                    block_hashes, current, mgr.kv_cache_group_id, pool, mgr.kv_cache_spec)
                current = len(blocks) * self.block_size
                hits.append(blocks)
            if all(len(blocks) * self.block_size == current for blocks in hits):
                return tuple(hits), current
            length = current

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: GroupBlocks) -> int:
        return sum(mgr.get_num_blocks_to_allocate(request_id, num_tokens, blocks)
                   for mgr, blocks in zip(self.single_type_managers, new_computed_blocks))

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: GroupBlocks) -> None:
        for mgr, blocks in zip(self.single_type_managers, new_computed_blocks):
            mgr.save_new_computed_blocks(request_id, blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> GroupBlocks:
        return tuple(mgr.allocate_new_blocks(request_id, num_tokens)
                     for mgr in self.single_type_managers)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for mgr in self.single_type_managers:
            mgr.cache_blocks(request, num_tokens)

    def free(self, request_id: str, num_computed_tokens: int) -> None:
        for mgr in self.single_type_managers:
            mgr.free(request_id, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for mgr in self.single_type_managers:
            mgr.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple(list(mgr.req_to_blocks.get(request_id, ())) for mgr in self.single_type_managers)

    def empty_blocks(self) -> GroupBlocks:
        return tuple([] for _ in self.single_type_managers)
