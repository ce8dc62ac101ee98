"""The hybrid KV cache: specs and groups, the sliding-window manager's hits and frees, and the
scheduler driving KV cache groups under random workloads (a fake runner that reads, per group,
only the positions that group's attention reads)."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.core import (
    FullAttentionSpec,
    HybridKVCacheManager,
    KVCacheConfig,
    KVCacheManager,
    ModelRunnerOutput,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SlidingWindowSpec,
    get_kv_cache_config,
    get_kv_cache_groups,
)
from jaxserve.core.kv_cache_utils import cdiv, make_block_hash_with_group_id
from tests.core.core_testing import make_request


def full(bs=4):
    return FullAttentionSpec(bs, 2, 8, "float32")


def swa(w, bs=4):
    return SlidingWindowSpec(bs, 2, 8, "float32", w)


def gemma3_like(num_layers=26, window=512, bs=16):
    """Five local layers per global one (Gemma 3's pattern)."""
    return [full(bs) if (i + 1) % 6 == 0 else swa(window, bs) for i in range(num_layers)]


# ---------------------------------------------------------------- specs and groups

def test_groups_single_full_type_is_one_slot_per_layer():
    groups = get_kv_cache_groups([full()] * 5)
    cfg = KVCacheConfig(10, groups)
    assert len(groups) == 1 and cfg.group_size == 5
    assert [cfg.layer_slot(layer) for layer in range(5)] == [(0, layer) for layer in range(5)]
    assert cfg.bytes_per_block == 5 * full().page_size_bytes == 5 * 2 * 4 * 2 * 8 * 4


def test_groups_gemma3_pattern():
    specs = gemma3_like()
    groups = get_kv_cache_groups(specs)
    full_layers = [i for i, s in enumerate(specs) if isinstance(s, FullAttentionSpec)]
    assert full_layers == [5, 11, 17, 23]
    # Group size 4 (the global layers); 22 local layers -> 6 groups of at most 4, strided.
    assert [len(g.layer_names) for g in groups] == [4, 4, 4, 4, 3, 3, 4]
    assert groups[-1].layer_names == tuple(full_layers)
    assert sorted(layer for g in groups for layer in g.layer_names) == list(range(26))
    for g in groups:
        assert all(specs[layer] == g.kv_cache_spec for layer in g.layer_names)
    cfg = get_kv_cache_config(specs, 4 * specs[0].page_size_bytes * 100 + 7)
    assert cfg.num_blocks == 100 and cfg.group_size == 4


def test_groups_close_counts_pad_rather_than_split():
    # 9 vs 8 layers (under 1.25x): one padded slot rather than two groups for the 9 (vLLM's rule).
    groups = get_kv_cache_groups([swa(8), full()] * 8 + [swa(8)])
    assert [len(g.layer_names) for g in groups] == [9, 8]
    # 5 vs 4 is not under 1.25x: the 5 split into groups of 3 and 2.
    groups = get_kv_cache_groups([swa(8), full()] * 4 + [swa(8)])
    assert [len(g.layer_names) for g in groups] == [3, 2, 4]


def test_config_refuses_mixed_block_sizes_and_bad_window():
    with pytest.raises(ValueError, match="block and page size"):
        KVCacheConfig(4, get_kv_cache_groups([full(4), swa(8, bs=8)]))
    with pytest.raises(ValueError, match="sliding_window"):
        swa(0)


def test_sliding_max_blocks_bound():
    s = swa(10, bs=4)
    assert s.max_num_blocks(max_model_len=1000, max_num_batched_tokens=8) == cdiv(9 + 8, 4) + 1
    assert s.max_num_blocks(max_model_len=12, max_num_batched_tokens=8) == 3
    assert full().max_num_blocks(1000, 8) == 250


def test_group_keys_apart():
    h = b"x" * 32
    assert make_block_hash_with_group_id(h, 0) == h
    keys = {make_block_hash_with_group_id(h, g) for g in range(4)}
    assert len(keys) == 4


# ---------------------------------------------------------------- the manager, by hand

def manager(specs, num_blocks=64, max_model_len=64, budget=64, caching=True):
    cfg = KVCacheConfig(num_blocks, get_kv_cache_groups(specs))
    return HybridKVCacheManager(cfg, max_model_len, budget, caching)


def admit(mgr, req, chunk=None):
    hit, n = mgr.get_computed_blocks(req)
    num_new = req.num_tokens - n if chunk is None else chunk
    assert mgr.allocate_slots(req, num_new, n, hit) is not None
    req.num_computed_tokens = n + num_new
    return n


def test_sliding_group_frees_blocks_out_of_window():
    mgr = manager([swa(6), full()], num_blocks=64)
    req = make_request(list(range(40)), block_size=4)
    for _ in range(10):  # 10 chunks of 4 tokens
        mgr.allocate_slots(req, 4)
        req.num_computed_tokens += 4
    mgr.allocate_slots(req, 1)  # the decode step after: frees what position 40 no longer reads
    sliding_ids, full_ids = mgr.get_block_ids(req.request_id)
    assert len(sliding_ids) == len(full_ids) == 11
    # Position 40 reads [35, 40]: blocks 8..10 live, 0..7 the null block.
    assert sliding_ids[:8] == [0] * 8 and 0 not in sliding_ids[8:]
    assert 0 not in full_ids
    assert mgr.block_pool.get_num_free_blocks() == 63 - 11 - 3
    # The freed blocks keep their hashes: still hits for the sliding group.
    assert mgr.block_pool.num_cached_free_blocks == 8
    mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == 63


def test_sliding_hit_needs_only_the_window():
    mgr = manager([swa(6), full()])
    a = make_request(list(range(33)), block_size=4)
    admit(mgr, a)
    mgr.allocate_slots(a, 1)  # frees a's sliding blocks 0..6 (position 33 reads [28, 33])
    pool = mgr.block_pool
    # Evict the early blocks of the sliding group only (its freed ones, reused by another request).
    filler = make_request([99] * 28, block_size=4)
    admit(mgr, filler)
    b = make_request(list(range(33)) + [7], block_size=4)
    hit, n = mgr.get_computed_blocks(b)
    sliding_hit, full_hit = hit
    # Full attention still has all 8 blocks; the sliding group only the last cdiv(5, 4) = 2 of
    # the hit: the hit is 32 tokens with nulls before the window.
    assert n == 32 and len(full_hit) == len(sliding_hit) == 8
    assert [blk.is_null for blk in sliding_hit] == [True] * 6 + [False] * 2
    assert all(not blk.is_null for blk in full_hit)
    assert admit(mgr, b) == 32
    assert pool.null_block.ref_cnt == 0


def test_hybrid_hit_is_what_all_groups_agree_on():
    mgr = manager([swa(6), full()])
    a = make_request(list(range(20)), block_size=4)
    admit(mgr, a)
    mgr.free(a)  # everything cached and free
    # Evict the full group's block 3 only (the pool keys groups apart: drop that one key).
    full_block = mgr.coordinator.single_type_managers[1]
    pool = mgr.block_pool
    key = make_block_hash_with_group_id(a.block_hashes[3], full_block.kv_cache_group_id)
    victim = pool.cached_block_hash_to_block[key]
    pool.uncache_blocks([victim])
    b = make_request(list(range(20)) + [1], block_size=4)
    hit, n = mgr.get_computed_blocks(b)
    assert n == 12 and [len(h) for h in hit] == [3, 3]
    # The sliding group resumes at 12 (its window: blocks 1, 2) though it could at 20 alone.
    assert [blk.is_null for blk in hit[0]] == [True, False, False]


def test_sliding_hit_after_a_gap_needs_a_whole_window():
    mgr = manager([swa(9)])  # window 9 -> the last cdiv(8, 4) = 2 blocks
    a = make_request(list(range(24)), block_size=4)
    admit(mgr, a)
    mgr.free(a)
    pool = mgr.block_pool
    pool.uncache_blocks([pool.get_cached_block(a.block_hashes[3])])  # a hole at block 3
    b = make_request(list(range(24)) + [5], block_size=4)
    # Blocks 4, 5 make a window: resume at 24 though block 3 is gone.
    assert mgr.get_computed_blocks(b)[1] == 24
    pool.uncache_blocks([pool.get_cached_block(a.block_hashes[5])])
    # Now no two cached blocks in a row end a prefix except 1..2 -> resume at 12.
    assert mgr.get_computed_blocks(b)[1] == 12
    pool.uncache_blocks([pool.get_cached_block(a.block_hashes[1])])
    # Block 0 alone: a prefix shorter than the window, cached whole.
    assert mgr.get_computed_blocks(b)[1] == 4


def test_window_of_one_needs_nothing_cached():
    mgr = manager([swa(1)])
    b = make_request(list(range(9)), block_size=4)
    hit, n = mgr.get_computed_blocks(b)
    assert n == 8 and all(blk.is_null for blk in hit[0])


def test_single_full_group_matches_kv_cache_manager():
    """One full-attention group is the old manager: the same blocks, hits and stats."""
    rng = random.Random(3)
    old = KVCacheManager(24, 4, 40)
    new = manager([full()] * 3, num_blocks=24, max_model_len=40)
    live = []
    for step in range(200):
        if live and (rng.random() < 0.4 or len(live) > 4):
            r_old, r_new = live.pop(rng.randrange(len(live)))
            old.free(r_old)
            new.free(r_new)
            continue
        prompt = [rng.randrange(2) for _ in range(rng.randint(1, 30))]
        r_old, r_new = (make_request(prompt, req_id=f"s{step}", block_size=4) for _ in range(2))
        (b_old, n_old), (b_new, n_new) = old.get_computed_blocks(r_old), new.get_computed_blocks(r_new)
        assert n_old == n_new and [b.block_id for b in b_old] == [b.block_id for b in b_new[0]]
        got_old = old.allocate_slots(r_old, r_old.num_tokens - n_old, n_old, b_old)
        got_new = new.allocate_slots(r_new, r_new.num_tokens - n_new, n_new, b_new)
        assert (got_old is None) == (got_new is None)
        if got_old is None:
            continue
        assert old.new_block_ids(got_old) == new.new_block_ids(got_new)[0]
        r_old.num_computed_tokens = r_new.num_computed_tokens = r_old.num_tokens
        assert (old.get_block_ids(r_old.request_id),) == new.get_block_ids(r_new.request_id)
        live.append((r_old, r_new))
    assert old.prefix_cache_stats == new.prefix_cache_stats
    assert old.num_free_blocks == new.num_free_blocks


# ---------------------------------------------------------------- the scheduler on KV groups

class GroupFakeRunner:
    """The runner contract per KV group, with a fake KV per group: each position a request's
    attention reads (every earlier one for full attention, the last W for a window of W) must hold
    exactly that request's token prefix. Stale ids where a window freed a block are never read."""

    def __init__(self, cfg: KVCacheConfig, rng: random.Random, eos: int):
        self.cfg, self.rng, self.eos = cfg, rng, eos
        self.windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in cfg.kv_cache_groups]
        self.reqs: dict[str, list] = {}
        self.kv: list[dict] = [{} for _ in self.windows]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.cfg.block_size
        for rid in so.finished_req_ids | so.preempted_req_ids:
            del self.reqs[rid]
        for new in so.scheduled_new_reqs:
            assert len(new.block_ids) == len(self.windows)
            self.reqs[new.req_id] = [list(new.prompt_token_ids) + list(new.output_token_ids),
                                     [list(ids) for ids in new.block_ids], new.num_computed_tokens]
        cached = so.scheduled_cached_reqs
        for rid, new_ids, nc in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            st_ = self.reqs[rid]
            assert st_[2] == nc
            for table, ids in zip(st_[1], new_ids):
                table.extend(ids)
        for rid, n in so.num_scheduled_tokens.items():
            tokens, tables, nc = self.reqs[rid]
            for g, table in enumerate(tables):
                assert len(table) == cdiv(nc + n, bs), (rid, g)
                for p in range(nc, nc + n):
                    assert table[p // bs] != 0, f"{rid}: null block at a position written"
                    self.kv[g][(table[p // bs], p % bs)] = tuple(tokens[:p + 1])
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            tokens, tables, nc = st_ = self.reqs[rid]
            end = nc + n
            for g, (table, w) in enumerate(zip(tables, self.windows)):
                first = 0 if w is None else max(0, nc - w + 1)
                for p in range(first, end):
                    got = self.kv[g].get((table[p // bs], p % bs))
                    assert got == tuple(tokens[:p + 1]), f"{rid}: wrong KV at {p} in group {g}"
            st_[2] = end
            toks = [self.eos if self.rng.random() < 0.1 else self.rng.randrange(1, 3)] if end == len(tokens) else []
            tokens.extend(toks)
            req_ids.append(rid)
            sampled.append(toks)
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def check_group_invariants(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    pool = kv.block_pool
    free_ids = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    holders: dict[int, int] = {}
    live = {r.request_id for r in sched.running}
    for mgr in kv.coordinator.single_type_managers:
        assert set(mgr.req_to_blocks) == live
        spec = mgr.kv_cache_spec
        for rid, blocks in mgr.req_to_blocks.items():
            req = sched.requests[rid]
            assert len(blocks) == cdiv(req.num_computed_tokens, kv.block_size)
            held = [b for b in blocks if not b.is_null]
            # A window holds no more than its bound (vLLM's max_memory_usage_bytes).
            assert len(held) <= spec.max_num_blocks(kv.max_model_len, sched.max_num_batched_tokens)
            if isinstance(spec, FullAttentionSpec):
                assert len(held) == len(blocks)
            for i, b in enumerate(blocks):
                if b.is_null:
                    continue
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
                if b.block_hash is not None:
                    assert b.block_hash == make_block_hash_with_group_id(
                        req.block_hashes[i], mgr.kv_cache_group_id)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
        assert (block.ref_cnt == 0) == (block.block_id in free_ids)
    assert pool.null_block.ref_cnt == 0 and 0 not in free_ids
    for key, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == key
    assert pool.num_cached_free_blocks == sum(
        1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None and not b.is_null)


LAYOUTS = {
    "gemma3": lambda bs: [swa(5, bs)] * 5 + [full(bs)],
    "mistral": lambda bs: [swa(6, bs)] * 2,
    "two_windows": lambda bs: [swa(3, bs), swa(9, bs), full(bs)],
    "full": lambda bs: [full(bs)] * 2,
}


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(sorted(LAYOUTS)), block_size=st.sampled_from([2, 3, 4]),
       max_model_len=st.sampled_from(range(10, 25)), extra=st.sampled_from([0, 1, 3, 8]),
       budget=st.sampled_from([3, 5, 8, 16]), policy=st.sampled_from(["fcfs", "priority"]),
       async_scheduling=st.booleans(), caching=st.sampled_from([True, True, False]),
       seed=st.integers(0, 2**16))
def test_scheduler_on_kv_groups(layout, block_size, max_model_len, extra, budget, policy,
                                async_scheduling, caching, seed):
    """Random prompts sharing prefixes, aborts now and then, a pool small enough to preempt:
    every read position holds the right KV, the pool's counts agree with the tables after every
    step, and every request finishes (a pool of ``max_num_blocks_per_req`` is enough)."""
    rng = random.Random(seed)
    specs = LAYOUTS[layout](block_size)
    groups = get_kv_cache_groups(specs)
    probe = HybridKVCacheManager(KVCacheConfig(2, groups), max_model_len, budget)
    cfg = KVCacheConfig(probe.max_num_blocks_per_req + 1 + extra, groups)
    kv = HybridKVCacheManager(cfg, max_model_len, budget, caching)
    sched = Scheduler(SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=budget,
                                      max_num_seqs=3, policy=policy,
                                      async_scheduling=async_scheduling), kv)
    runner = GroupFakeRunner(cfg, rng, eos=0)
    heads = ([1, 2] * 12, [2, 2, 1, 1] * 6)
    pending = []  # async scheduling: a step's output arrives after the next is scheduled
    for i in range(12):
        n = rng.randint(1, max_model_len - 1)
        prompt = (list(rng.choice(heads)[:rng.randint(0, n)]) + [rng.randrange(3) for _ in range(n)])[:n]
        sched.add_request(make_request(prompt, req_id=f"h{i}", eos=0, priority=rng.randrange(2),
                                       max_tokens=rng.choice([None, 2, 6]), block_size=block_size))
    for _ in range(1000):
        if not sched.has_requests() and not pending:
            break
        so = sched.schedule()
        mro = runner.execute(so)
        pending.append((so, mro))
        while pending and (not async_scheduling or len(pending) > 1 or not so.num_scheduled_tokens):
            sched.update_from_output(*pending.pop(0))
        if rng.random() < 0.05 and sched.requests:
            sched.finish_requests(rng.choice(sorted(sched.requests)), RequestStatus.FINISHED_ABORTED)
        check_group_invariants(sched)
    assert not sched.has_requests() and not pending
    sched.schedule()  # ships the last finished ids
    assert kv.num_free_blocks == kv.num_blocks - 1
    assert all(not m.req_to_blocks for m in kv.coordinator.single_type_managers)
