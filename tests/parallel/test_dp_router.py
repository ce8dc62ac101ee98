"""The data-parallel routing policy: prefix hits first, then load, then KV usage, on plain data."""

from __future__ import annotations

import pytest

from jaxserve.core.kv_cache_utils import hash_block_tokens
from jaxserve.engine.dp_router import ReplicaLoad, choose_replica, count_cached_blocks


def test_least_loaded_replica_wins():
    loads = [ReplicaLoad(num_waiting=2, num_running=3), ReplicaLoad(num_waiting=0, num_running=4),
             ReplicaLoad(num_waiting=1, num_running=5)]
    assert choose_replica(loads) == 1


def test_waiting_and_running_count_alike():
    assert choose_replica([ReplicaLoad(num_waiting=3), ReplicaLoad(num_running=2)]) == 1
    assert choose_replica([ReplicaLoad(num_running=3), ReplicaLoad(num_waiting=2)]) == 1


def test_kv_usage_breaks_a_load_tie():
    loads = [ReplicaLoad(num_running=2, kv_cache_usage=0.7), ReplicaLoad(num_running=2, kv_cache_usage=0.2)]
    assert choose_replica(loads) == 1


def test_a_cached_prefix_beats_a_lighter_load():
    loads = [ReplicaLoad(num_running=1), ReplicaLoad(num_running=9, kv_cache_usage=0.9, cached_blocks=2)]
    assert choose_replica(loads) == 1


def test_more_cached_blocks_win_then_load():
    loads = [ReplicaLoad(num_running=0, cached_blocks=1), ReplicaLoad(num_running=5, cached_blocks=3),
             ReplicaLoad(num_running=2, cached_blocks=3)]
    assert choose_replica(loads) == 2


def test_full_tie_goes_to_the_lowest_index():
    assert choose_replica([ReplicaLoad(), ReplicaLoad()]) == 0
    assert choose_replica([ReplicaLoad(num_running=1), ReplicaLoad(), ReplicaLoad()]) == 1


def test_a_burst_spreads_when_each_pick_is_counted():
    counts = [0, 0, 0]
    for _ in range(9):
        i = choose_replica([ReplicaLoad(num_waiting=c) for c in counts])
        counts[i] += 1
    assert counts == [3, 3, 3]


def test_no_replica_is_an_error():
    with pytest.raises(ValueError):
        choose_replica([])


def _chain(tokens: list[int], block_size: int) -> list[bytes]:
    hashes, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes


def test_cached_blocks_counts_the_leading_run_only():
    tokens = list(range(16))
    hashes = _chain(tokens, 4)
    cached = {hashes[0]: "b0", hashes[1]: "b1", hashes[3]: "b3"}  # block 2 was evicted
    assert count_cached_blocks(hashes, len(tokens) + 1, 4, cached.get) == 2
    assert count_cached_blocks(hashes, len(tokens) + 1, 4, {}.get) == 0


def test_cached_blocks_stop_one_token_short_of_the_prompt():
    tokens = list(range(8))
    hashes = _chain(tokens, 4)
    cached = {h: "b" for h in hashes}
    # An 8-token prompt must compute its last token: only its first block can be a hit.
    assert count_cached_blocks(hashes, 8, 4, cached.get) == 1
    assert count_cached_blocks(hashes, 9, 4, cached.get) == 2
