"""Per-request block tables on top of the block pool: prefix lookup, allocation, release.

``KVCacheManager``: one group of full-attention layers. ``HybridKVCacheManager``: any KV cache
groups (sliding windows, several attention types), the same interface."""

from __future__ import annotations

from typing import Any, Protocol

from jaxserve.core.block_pool import BlockPool, KVCacheBlock
from jaxserve.core.kv_cache_coordinator import GroupBlocks, HybridKVCacheCoordinator
from jaxserve.core.kv_cache_spec import KVCacheConfig
from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.core.request import Request
from jaxserve.core.stats import PrefixCacheStats


class KVCacheManagerInterface(Protocol):
    """What the scheduler uses of a KV cache manager. Block lists and ids are the manager's own
    shape (one list, or one per KV cache group), passed through unread."""

    block_size: int
    max_model_len: int
    max_num_blocks_per_req: int
    enable_caching: bool
    log_stats: bool
    block_pool: BlockPool
    prefix_cache_stats: PrefixCacheStats

    @property
    def num_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @property
    def num_free_blocks(self) -> int: ...
    def reads_prefix_cache(self, request: Request) -> bool: ...
    def get_computed_blocks(self, request: Request, record_stats: bool = True) -> tuple[Any, int]: ...
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0) -> Any: ...
    def free(self, request: Request) -> None: ...
    def get_block_ids(self, request_id: str) -> Any: ...
    def new_block_ids(self, blocks: Any) -> Any: ...
    def reset_prefix_cache(self) -> bool: ...


class _BlockPoolViews:
    """What both managers read the same way off their block pool."""

    block_pool: BlockPool
    enable_caching: bool
    log_stats: bool
    prefix_cache_stats: PrefixCacheStats

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_gpu_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def reads_prefix_cache(self, request: Request) -> bool:
        """Whether a lookup for ``request`` consults the cache (and counts as a query)."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok and self.log_stats:
            self.prefix_cache_stats.num_resets += 1
        return ok


class KVCacheManager(_BlockPoolViews):
    """Owns ``req_to_blocks``: each live request's block table, in token order.

    Invariants:
      * every block in a request's table holds one reference for that request;
      * a running request's table has exactly ``cdiv(num_computed_tokens, block_size)`` blocks
        once the scheduler has advanced ``num_computed_tokens`` for the step;
      * ``num_cached_block[req]`` blocks of its table are published in the prefix cache
        (or were skipped as duplicates); only blocks whose tokens are all known get published.
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True, log_stats: bool = True, *, use_eagle: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.use_eagle = use_eagle
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.max_num_blocks_per_req = cdiv(max_model_len, block_size)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    def get_computed_blocks(self, request: Request,
                            record_stats: bool = True) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of whole blocks, as ``(blocks, num_tokens)``.

        The hit stops one token short of ``request.num_tokens`` at the latest: the last token must
        be computed to get logits. Requests asking for prompt logprobs skip the cache (cached
        positions would have no logits). With ``use_eagle`` the hit's last block is left out too
        (vLLM's rule). Does not take references: ``allocate_slots`` does.
        """
        if not self.reads_prefix_cache(request):
            return [], 0
        assert request.block_size == self.block_size, "request not hashed with this block_size"
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        get = self.block_pool.get_cached_block
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = get(block_hash)
            if block is None:
                break
            blocks.append(block)
        if self.use_eagle and blocks:  # recomputed: the EAGLE head's entry at its end needs the next token
            blocks.pop()
        num_hit_tokens = len(blocks) * self.block_size
        if self.log_stats and record_stats:
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
        return blocks, num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0,
                       ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` after the request's computed (and prefix-hit) tokens.

        Returns the newly allocated blocks (possibly empty), or ``None`` with no state changed if
        the pool cannot supply them: allocation is all or nothing. Prefix-hit blocks (only on the
        first allocation) get a reference here. Full blocks whose tokens are all known are
        published in the prefix cache at once, before their KV is written: the runner writes a
        step's KV before any attention of that step reads it, so a same-step hit is safe.
        ``num_lookahead_tokens`` more slots are allocated (not cached) for a proposer that writes
        the KV of its drafts past the scheduled tokens (a draft model).
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        bs = self.block_size
        if req_blocks is not None and not new_computed_blocks:
            # Decode fast path: the new tokens fit in the blocks the request already has.
            end = request.num_computed_tokens + num_new_tokens
            if min(end + num_lookahead_tokens, self.max_model_len) <= len(req_blocks) * bs:
                # Most decode steps fill no block: check that before calling out.
                if self.enable_caching and end // bs > self.num_cached_block.get(req_id, 0):
                    self._cache_full_blocks(request, req_blocks, end)
                return []
        new_computed_blocks = new_computed_blocks or []
        if req_blocks is None:
            req_blocks = []
        elif new_computed_blocks:
            raise ValueError("prefix-hit blocks can only be added on a request's first allocation")

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_slots = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                        self.max_model_len)
        num_new_blocks = max(
            0, cdiv(num_slots, self.block_size) - len(req_blocks) - len(new_computed_blocks))
        # Free hit blocks leave the free queue when touched, so they are not available for new ones.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None

        if new_computed_blocks:
            # Touch before get_new_blocks so the hits cannot be evicted to serve the new blocks.
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        self.req_to_blocks[req_id] = req_blocks

        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, num_computed_tokens + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock],
                           end: int) -> None:
        """Publish the blocks made full by tokens up to ``end`` (capped at the known tokens)."""
        num_full = min(end, len(request.all_token_ids)) // self.block_size
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(request, req_blocks, num_cached, num_full)
            self.num_cached_block[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so its tail is evicted before its head).

        Blocks published beyond ``request.num_computed_tokens`` (possible only when a request is
        preempted in the same step it was scheduled) are withdrawn from the prefix cache first:
        their KV will never be written.
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, None)
        num_cached = self.num_cached_block.pop(req_id, 0)
        if not blocks:
            return
        num_written_blocks = request.num_computed_tokens // self.block_size
        if num_cached > num_written_blocks:
            self.block_pool.uncache_blocks(
                b for b in blocks[num_written_blocks:num_cached] if b.ref_cnt == 1)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def new_block_ids(self, blocks: list[KVCacheBlock]) -> list[int]:
        """Ids of blocks ``allocate_slots`` returned, as the scheduler ships them."""
        return [b.block_id for b in blocks]


class HybridKVCacheManager(_BlockPoolViews):
    """``KVCacheManager``'s interface over KV cache groups (``HybridKVCacheCoordinator``): one
    block table per group and request, sliding-window groups freeing what falls out of the window.

    Block lists and ids are tuples with one entry per group. The scheduler drives it exactly as
    it drives ``KVCacheManager`` (``allocate_slots`` first frees the blocks the request's
    sliding-window groups no longer read). Invariants: the coordinator's and each group's.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 max_num_batched_tokens: int, enable_caching: bool = True,
                 log_stats: bool = True) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        self.kv_cache_config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.coordinator = HybridKVCacheCoordinator(kv_cache_config, enable_caching)
        self.block_pool = self.coordinator.block_pool
        self.max_num_blocks_per_req = kv_cache_config.max_num_blocks_per_req(
            max_model_len, max_num_batched_tokens)
        self.prefix_cache_stats = PrefixCacheStats()

    def get_computed_blocks(self, request: Request,
                            record_stats: bool = True) -> tuple[GroupBlocks, int]:
        """The longest prefix every group can resume from (``KVCacheManager``'s rules: whole
        blocks, at least the last token computed, no lookup with prompt logprobs)."""
        if not self.reads_prefix_cache(request):
            return self.coordinator.empty_blocks(), 0
        assert request.block_size == self.block_size, "request not hashed with this block_size"
        blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1)
        if self.log_stats and record_stats:
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
        return blocks, num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: GroupBlocks | None = None,
                       num_lookahead_tokens: int = 0,
                       ) -> GroupBlocks | None:
        """As ``KVCacheManager.allocate_slots``, per group; all or nothing over all groups."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        coord = self.coordinator
        req_id = request.request_id
        hits = new_computed_blocks or coord.empty_blocks()
        if any(hits) and any(req_id in m.req_to_blocks for m in coord.single_type_managers):
            raise ValueError("prefix-hit blocks can only be added on a request's first allocation")
        # Freed even if this request cannot be scheduled now: no later token reads them.
        coord.remove_skipped_blocks(req_id, request.num_computed_tokens)
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_slots = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                        self.max_model_len)
        needed = coord.get_num_blocks_to_allocate(req_id, num_slots, hits)
        if needed > self.block_pool.get_num_free_blocks():
            return None
        coord.save_new_computed_blocks(req_id, hits)
        new_blocks = coord.allocate_new_blocks(req_id, num_slots)
        if self.enable_caching:
            coord.cache_blocks(request, min(num_computed_tokens + num_new_tokens,
                                            len(request.all_token_ids)))
        return new_blocks

    def free(self, request: Request) -> None:
        """Every group's blocks, tail first (see ``KVCacheManager.free``)."""
        self.coordinator.free(request.request_id, request.num_computed_tokens)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in blocks]
                     for blocks in self.coordinator.get_blocks(request_id))

    def new_block_ids(self, blocks: GroupBlocks) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in blocks)
