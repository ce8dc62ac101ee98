"""Helpers shared by the core tests: request factory, a fake runner that checks the runner contract
(and simulates KV contents to catch wrong prefix hits), and global pool invariants."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from jaxserve.core import (
    KVCacheManager,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from jaxserve.core.kv_cache_utils import cdiv

_ids = itertools.count()


def make_request(prompt, *, req_id: str | None = None, eos: int | None = None,
                 arrival_time: float | None = None, priority: int = 0, cache_salt=None,
                 lora_name=None, block_size=None, **params) -> Request:
    params.setdefault("max_tokens", 16)
    n = next(_ids)
    return Request(req_id if req_id is not None else f"r{n}", list(prompt),
                   SamplingParams(**params), eos,
                   arrival_time=float(n) if arrival_time is None else arrival_time,
                   priority=priority, cache_salt=cache_salt, lora_name=lora_name,
                   block_size=block_size)


def make_scheduler(*, num_blocks=64, block_size=4, max_model_len=64, enable_caching=True,
                   **cfg) -> Scheduler:
    config = SchedulerConfig(max_model_len=max_model_len, **cfg)
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching)
    return Scheduler(config, kv)


class _ReqState:
    def __init__(self, tokens, block_ids, num_computed):
        self.tokens = tokens
        self.block_ids = block_ids
        self.num_computed = num_computed


class FakeRunner:
    """Plays the model runner: keeps the persistent batch from SchedulerOutputs (asserting the
    contract) and a fake KV cache holding, per slot, the token prefix ending at that position.
    Every read of a computed position checks its slot holds exactly that prefix, so a wrong prefix
    hit, an early eviction or a double-owned block shows up as a mismatch."""

    def __init__(self, block_size: int, sample: Callable[[str], int]):
        self.block_size = block_size
        self.sample = sample
        self.reqs: dict[str, _ReqState] = {}
        self.kv: dict[tuple[int, int], tuple] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for rid in so.finished_req_ids | so.preempted_req_ids:
            assert rid in self.reqs, f"runner told to drop unknown {rid}"
            del self.reqs[rid]
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new twice"
            assert new.num_computed_tokens % bs == 0
            self.reqs[new.req_id] = _ReqState(
                list(new.prompt_token_ids) + list(new.output_token_ids), list(new.block_ids),
                new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for rid, new_ids, nc in zip(cached.req_ids, cached.new_block_ids,
                                    cached.num_computed_tokens):
            st = self.reqs[rid]
            assert st.num_computed == nc, (rid, st.num_computed, nc)
            st.block_ids.extend(new_ids)
        scheduled = [n.req_id for n in so.scheduled_new_reqs] + list(cached.req_ids)
        assert sorted(scheduled) == sorted(so.num_scheduled_tokens)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())

        # Write every scheduled token's KV first (as the real runner does per layer) ...
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            assert n > 0 and st.num_computed + n <= len(st.tokens)
            assert len(st.block_ids) == cdiv(st.num_computed + n, bs)
            assert 0 not in st.block_ids, "null block handed to a request"
            for p in range(st.num_computed, st.num_computed + n):
                self.kv[(st.block_ids[p // bs], p % bs)] = tuple(st.tokens[:p + 1])
        # ... then attend over the whole context.
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            end = st.num_computed + n
            for p in range(end):
                got = self.kv.get((st.block_ids[p // bs], p % bs))
                assert got == tuple(st.tokens[:p + 1]), f"{rid}: wrong KV at position {p}"
            st.num_computed = end
            toks = [self.sample(rid)] if end == len(st.tokens) else []
            st.tokens.extend(toks)
            req_ids.append(rid)
            sampled.append(toks)
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def check_pool_invariants(sched: Scheduler, slack: int = 0) -> None:
    """Ref counts, free queue and cache map agree with the requests' block tables. ``slack``:
    tokens a request may hold slots for past ``num_computed_tokens`` (rejected drafts, lookahead)."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = [b.block_id for b in free]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    assert 0 not in free_ids
    assert pool.null_block.ref_cnt == 0
    live = {r.request_id for r in sched.running}
    assert set(kv.req_to_blocks) == live, (set(kv.req_to_blocks), live)
    holders: dict[int, int] = {}
    for rid, blocks in kv.req_to_blocks.items():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"{rid} holds a block twice"
        for b in ids:
            holders[b] = holders.get(b, 0) + 1
    free_set = set(free_ids)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
        assert (block.ref_cnt == 0) == (block.block_id in free_set), block
    for h, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == h
    hashed = [b for b in pool.blocks if b.block_hash is not None]
    assert len(hashed) == len(pool.cached_block_hash_to_block)
    for r in sched.running:
        held = len(kv.req_to_blocks[r.request_id])
        assert cdiv(r.num_computed_tokens, kv.block_size) <= held <= cdiv(
            min(r.num_computed_tokens + slack, sched.max_model_len), kv.block_size)
        # A published block of a running request is published under that request's hash.
        for i, b in enumerate(kv.req_to_blocks[r.request_id]):
            if b.block_hash is not None:
                assert b.block_hash == r.block_hashes[i]
    for r in sched.waiting:
        assert r.request_id not in kv.req_to_blocks
        assert r.num_computed_tokens == 0


def assert_all_free(sched: Scheduler) -> None:
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not sched.kv_cache_manager.req_to_blocks
    assert sched.kv_cache_manager.usage == 0.0


def run_step(sched: Scheduler, runner: FakeRunner):
    so = sched.schedule()
    mro = runner.execute(so)
    return so, sched.update_from_output(so, mro)
