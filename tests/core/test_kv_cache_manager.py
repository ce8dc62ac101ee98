import pytest

from jaxserve.core import KVCacheManager
from tests.core.core_testing import make_request


def new(mgr, prompt, **kw):
    return make_request(prompt, block_size=mgr.block_size, **kw)


def admit(mgr, req):
    """What the scheduler does for a waiting request: lookup, allocate, book the hit."""
    blocks, n = mgr.get_computed_blocks(req)
    got = mgr.allocate_slots(req, req.num_tokens - n, n, blocks)
    assert got is not None
    req.num_computed_tokens = req.num_tokens
    return blocks, n


def test_hit_capped_before_last_token():
    mgr = KVCacheManager(16, 4, 64)
    a = new(mgr, list(range(8)))
    admit(mgr, a)
    # Same 8 tokens: both blocks cached, but the last token must be computed -> 1 block.
    b = new(mgr, list(range(8)))
    blocks, n = mgr.get_computed_blocks(b)
    assert n == 4 and blocks == mgr.req_to_blocks[a.request_id][:1]
    # A longer prompt can use both.
    c = new(mgr, list(range(9)))
    blocks, n = mgr.get_computed_blocks(c)
    assert n == 8 and blocks == mgr.req_to_blocks[a.request_id]
    # Divergence in block 2 stops the run; a hit after a miss is not used.
    d = new(mgr, [0, 1, 2, 3, 9, 9, 9, 9, 8, 8])
    assert mgr.get_computed_blocks(d)[1] == 4
    st = mgr.prefix_cache_stats
    assert (st.requests, st.queries, st.hits) == (4, 8 + 8 + 9 + 10, 0 + 4 + 8 + 4)


def test_eagle_hits_end_one_block_short():
    """With use_eagle the hit's last block is recomputed (the head's entry there reads the token
    after the hit); a one-block hit is no hit."""
    mgr = KVCacheManager(16, 4, 64, use_eagle=True)
    a = new(mgr, list(range(12)))
    admit(mgr, a)
    blocks, n = mgr.get_computed_blocks(new(mgr, list(range(13))))
    assert n == 8 and blocks == mgr.req_to_blocks[a.request_id][:2]
    assert mgr.get_computed_blocks(new(mgr, [0, 1, 2, 3, 9, 9]))[1] == 0


def test_prompt_logprobs_and_caching_off_skip_lookup():
    mgr = KVCacheManager(16, 4, 64)
    admit(mgr, new(mgr, list(range(8))))
    assert mgr.get_computed_blocks(new(mgr, list(range(9)), prompt_logprobs=1)) == ([], 0)
    off = KVCacheManager(16, 4, 64, enable_caching=False)
    a = make_request(list(range(8)))
    admit(off, a)
    assert off.get_computed_blocks(make_request(list(range(9)))) == ([], 0)
    assert not off.block_pool.cached_block_hash_to_block


def test_hit_shares_blocks_and_ref_counts():
    mgr = KVCacheManager(8, 4, 32)
    a = new(mgr, list(range(9)))
    admit(mgr, a)
    b = new(mgr, list(range(9)) + [5])
    blocks, n = admit(mgr, b)
    assert n == 8
    shared = mgr.req_to_blocks[a.request_id][:2]
    assert mgr.req_to_blocks[b.request_id][:2] == shared
    assert all(blk.ref_cnt == 2 for blk in shared)
    mgr.free(a)
    assert all(blk.ref_cnt == 1 for blk in shared)
    mgr.free(b)
    assert mgr.num_free_blocks == 7 and mgr.usage == 0.0
    # Freed hits from the free queue are revived by touch.
    c = new(mgr, list(range(9)))
    blocks, n = admit(mgr, c)
    assert n == 8 and blocks == shared and all(blk.ref_cnt == 1 for blk in shared)


def test_allocate_none_leaves_state_unchanged():
    mgr = KVCacheManager(5, 4, 16)  # 4 usable blocks
    a = new(mgr, list(range(8)))
    admit(mgr, a)
    b = new(mgr, list(range(8)) + [7, 7, 7, 7, 7, 7])  # hits 2 blocks, needs 2 more
    mgr.free(a)  # hits now sit in the free queue: they cannot also serve as new blocks
    c = new(mgr, [9, 9, 9, 9, 9])
    admit(mgr, c)  # 2 blocks used, 2 free (both are b's hits)
    blocks, n = mgr.get_computed_blocks(b)
    assert n == 8
    before = (mgr.num_free_blocks, dict(mgr.req_to_blocks), [x.ref_cnt for x in blocks],
              dict(mgr.block_pool.cached_block_hash_to_block))
    assert mgr.allocate_slots(b, 6, n, blocks) is None
    after = (mgr.num_free_blocks, dict(mgr.req_to_blocks), [x.ref_cnt for x in blocks],
             dict(mgr.block_pool.cached_block_hash_to_block))
    assert before == after and b.request_id not in mgr.req_to_blocks


def test_allocate_returns_only_new_blocks_and_caches_known_full_blocks():
    mgr = KVCacheManager(16, 4, 64)
    r = new(mgr, list(range(10)))
    got = mgr.allocate_slots(r, 6)  # chunk of 6: block 0 full, block 1 half
    assert len(got) == 2 and mgr.get_block_ids(r.request_id) == [b.block_id for b in got]
    assert got[0].block_hash == r.block_hashes[0] and got[1].block_hash is None
    r.num_computed_tokens = 6
    got2 = mgr.allocate_slots(r, 4)  # rest of prompt: blocks 1 full, block 2 partial
    assert len(got2) == 1 and mgr.req_to_blocks[r.request_id][1].block_hash == r.block_hashes[1]
    r.num_computed_tokens = 10
    r.append_output_token_ids(5)
    assert mgr.allocate_slots(r, 1) == []  # slot 10 fits in block 2
    with pytest.raises(ValueError):
        mgr.allocate_slots(r, 0)


def test_free_is_reverse_order_and_forgets():
    mgr = KVCacheManager(8, 4, 32)
    r = new(mgr, list(range(12)) + [1])
    admit(mgr, r)
    blocks = list(mgr.req_to_blocks[r.request_id])
    mgr.free(r)
    assert r.request_id not in mgr.req_to_blocks and mgr.get_block_ids(r.request_id) == []
    tail = mgr.block_pool.free_block_queue.get_all_free_blocks()[-4:]
    assert tail == blocks[::-1]


def test_free_withdraws_blocks_whose_kv_was_never_written():
    mgr = KVCacheManager(8, 4, 32)
    r = new(mgr, list(range(8)) + [1])
    mgr.allocate_slots(r, 9)  # scheduled, not yet computed (e.g. preempted in the same step)
    assert len(mgr.block_pool.cached_block_hash_to_block) == 2
    mgr.free(r)  # num_computed_tokens is still 0
    assert not mgr.block_pool.cached_block_hash_to_block


def test_reset_prefix_cache():
    mgr = KVCacheManager(16, 4, 64)
    a = new(mgr, list(range(9)))
    b = new(mgr, list(range(8)) + [3, 3])
    admit(mgr, a)
    admit(mgr, b)
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    mgr.free(b)
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(new(mgr, list(range(9))))[1] == 0
