"""KV cache blocks, the free-block LRU queue and the block pool with its prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from jaxserve.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

if TYPE_CHECKING:
    from jaxserve.core.request import Request


class KVCacheBlock:
    """Metadata of one physical KV page.

    ``ref_cnt`` is the number of live requests whose block table holds the block. A block is in the
    free queue iff ``ref_cnt == 0`` (the null block excepted: it is never free nor referenced).
    A block keeps its ``block_hash`` after being freed, so it can still be hit, until the pool hands
    it out again (lazy eviction).
    """

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "prev_free_block", "next_free_block",
                 "is_null")

    def __init__(self, block_id: int, ref_cnt: int = 0, block_hash: BlockHash | None = None,
                 prev_free_block: KVCacheBlock | None = None,
                 next_free_block: KVCacheBlock | None = None, is_null: bool = False) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self._block_hash = block_hash
        self.prev_free_block = prev_free_block
        self.next_free_block = next_free_block
        self.is_null = is_null

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
        assert self._block_hash is None, f"block {self.block_id} already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        # Not the dataclass repr: following prev/next would print the whole queue.
        h = self._block_hash.hex()[:8] if self._block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks; the head is evicted first.

    Sentinel head/tail nodes mean no ``None`` checks on insert/remove. A block is in the queue iff
    its ``prev_free_block`` is set, which gives O(1) membership tests and O(1) ``remove`` (needed
    when a prefix hit revives a free block from the middle of the queue).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        self.fake_head.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = self.fake_head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self.fake_head.next_free_block
        if block is None or block is self.fake_tail:
            raise ValueError("no free blocks available")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is None, f"block {block.block_id} is already free"
        last = self.fake_tail.prev_free_block
        assert last is not None  # the tail is always linked (to the head when empty)
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free queue"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free_block is not None

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Free blocks head (next evicted) to tail. O(n): for tests and debugging."""
        out = []
        block = self.fake_head.next_free_block
        while block is not None and block is not self.fake_tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """All KV blocks of the cache, handed out and taken back by ref count.

    Block 0 is the null block: never handed out, never freed; the runner points padding slots at it.
    Free blocks are evicted least-recently-freed first. ``cached_block_hash_to_block`` maps each
    hash to exactly one block whose ``block_hash`` is that hash (a second block computing the same
    content stays unhashed, so the map never needs duplicates). ``num_cached_free_blocks`` counts
    the free blocks that still hold a hash (a prefix hit can revive them until they are reused).
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be at least 2 (one is the null block), "
                             f"got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.num_cached_free_blocks = 0
        assert self.null_block.block_id == 0

    def get_cached_block(self, block_hash: BlockHash,
                         kv_cache_group_id: int = 0) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(
            make_block_hash_with_group_id(block_hash, kv_cache_group_id))

    def cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int,
                          kv_cache_group_id: int = 0) -> None:
        """Publish ``blocks[num_cached_blocks:num_full_blocks]`` under the request's block hashes
        (keyed by KV cache group, ``make_block_hash_with_group_id``).

        Blocks that already carry a hash (prefix hits) are skipped; so is a block whose hash
        another block already serves, and the null block (a sliding window's skipped positions).
        """
        if num_full_blocks <= num_cached_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks, "block hashes lag the tokens"
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            block_hash = make_block_hash_with_group_id(request.block_hashes[i], kv_cache_group_id)
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Withdraw blocks from the prefix cache (their KV will not be written after all)."""
        for block in blocks:
            if self._maybe_evict_cached_block(block) and block.ref_cnt == 0:
                self.num_cached_free_blocks -= 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` LRU free blocks with ``ref_cnt = 1``, evicting their hashes now."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool, "
                             f"only {self.free_block_queue.num_free_blocks} are free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0
            if self.enable_caching and self._maybe_evict_cached_block(block):
                self.num_cached_free_blocks -= 1
            block.ref_cnt = 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        if self.cached_block_hash_to_block.get(block_hash) is block:
            del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free queue (no eviction)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail in the
        given order. Callers pass a request's blocks tail-first so its last blocks (least likely
        shared by other prompts) are evicted before its first ones."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is in use (else returns False):
        running requests' blocks would otherwise be half-tracked."""
        if self.get_num_free_blocks() != self.num_gpu_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        self.num_cached_free_blocks = 0
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable (non-null) blocks in use; cached-but-free blocks count as free."""
        usable = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable
