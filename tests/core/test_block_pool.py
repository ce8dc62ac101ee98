import pytest

from jaxserve.core import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from tests.core.core_testing import make_request


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_order_and_o1_remove():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert blocks[2] not in q and blocks[3] in q
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append_n([blocks[0]])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 2, 0]
    assert ids(q.popleft_n(2)) == [1, 3] and q.num_free_blocks == 3
    with pytest.raises(ValueError):
        q.remove(blocks[1])
    with pytest.raises(ValueError):
        q.popleft_n(4)
    q.popleft_n(3)
    with pytest.raises(ValueError):
        q.popleft()
    assert q.get_all_free_blocks() == [] and q.num_free_blocks == 0


def test_block_repr_does_not_walk_queue():
    blocks = [KVCacheBlock(i) for i in range(3)]
    FreeKVCacheBlockQueue(blocks)
    assert repr(blocks[1]) == "KVCacheBlock(id=1, ref=0, hash=None)"


def test_null_block_reserved():
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 3 and pool.get_usage() == 0.0
    got = pool.get_new_blocks(3)
    assert 0 not in ids(got) and all(b.ref_cnt == 1 for b in got)
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(ValueError):
        BlockPool(1)


def _cache(pool, req, blocks):
    pool.cache_full_blocks(req, blocks, 0, len(blocks))


def test_lazy_eviction_lru_and_tail_before_head():
    pool = BlockPool(7)
    req = make_request(list(range(12)), block_size=4)
    blocks = pool.get_new_blocks(3)
    _cache(pool, req, blocks)
    assert all(pool.get_cached_block(h) is b for h, b in zip(req.block_hashes, blocks))
    pool.free_blocks(reversed(blocks))  # request's tail first
    # Freed blocks keep their hashes and can still be hit.
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    order = ids(pool.free_block_queue.get_all_free_blocks())
    assert order == [4, 5, 6, 3, 2, 1]
    # Never-used blocks go first, then the freed request's tail block; head survives longest.
    pool.get_new_blocks(4)
    assert pool.get_cached_block(req.block_hashes[2]) is None
    assert blocks[2].block_hash is None
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]


def test_touch_takes_block_off_free_queue():
    pool = BlockPool(4)
    req = make_request(list(range(4)), block_size=4)
    (b,) = pool.get_new_blocks(1)
    _cache(pool, req, [b])
    pool.free_blocks([b])
    assert b in pool.free_block_queue and b.ref_cnt == 0
    pool.touch([b])
    assert b not in pool.free_block_queue and b.ref_cnt == 1
    assert b.block_hash == req.block_hashes[0]  # a hit does not evict
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b not in pool.free_block_queue
    pool.free_blocks([b])
    assert b in pool.free_block_queue
    with pytest.raises(AssertionError):
        pool.free_blocks([b])


def test_duplicate_content_is_not_double_cached():
    pool = BlockPool(4)
    r1 = make_request([1, 2, 3, 4], block_size=4)
    r2 = make_request([1, 2, 3, 4], block_size=4)
    a, b = pool.get_new_blocks(2)
    _cache(pool, r1, [a])
    _cache(pool, r2, [b])
    assert a.block_hash is not None and b.block_hash is None
    assert pool.get_cached_block(r1.block_hashes[0]) is a


def test_reset_prefix_cache_only_when_all_free():
    pool = BlockPool(4)
    req = make_request([1, 2, 3, 4], block_size=4)
    blocks = pool.get_new_blocks(1)
    _cache(pool, req, blocks)
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert not pool.cached_block_hash_to_block and blocks[0].block_hash is None
