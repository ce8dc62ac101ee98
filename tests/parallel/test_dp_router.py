"""The data-parallel routing policy: prefix hits first, then load, then KV usage, on plain data."""

from __future__ import annotations

import pytest

from jaxserve.engine.dp.router import ReplicaLoad, choose_replica


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
