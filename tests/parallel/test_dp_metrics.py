"""Two replicas' metrics in one exposition: every sample labelled with its engine, each family
once, and totals under ``engine="total"`` that combine the replicas as each family means."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.core.stats import SchedulerStats
from jaxserve.engine.dp.metrics import merge_stats, merged_snapshot, render_merged
from jaxserve.engine.metrics import EngineMetrics


def two_replicas() -> list[EngineMetrics]:
    replicas = [EngineMetrics("m", "cpu", engine_index=i) for i in range(2)]
    for i, (metrics, running, usage) in enumerate(zip(replicas, (3, 1), (0.5, 0.25))):
        metrics.record_step(SchedulerStats(num_running_reqs=running, num_waiting_reqs=i, kv_cache_usage=usage,
                                           prefix_cache_hits=16 * (i + 1)))
        metrics.record_iteration(10 * (i + 1), [0.01] * (i + 1), [0.1], num_prompt_tokens=7)
        metrics.record_finished("stop", 1.0)
    replicas[1].record_finished("length", 2.0)
    return replicas


def samples_by_engine(text: str) -> dict[str, dict[tuple, float]]:
    """sample name -> {(engine, other labels...): value}"""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.labels.get("engine"),) + tuple(sorted((k, v) for k, v in s.labels.items() if k != "engine"))
            out.setdefault(s.name, {})[key] = s.value
    return out


def test_one_engine_is_labelled_engine_0():
    text = EngineMetrics("m", "cpu").render().decode()
    assert 'jaxserve:engine_dead{engine="0",model_name="m"} 0.0' in text


def test_each_family_is_listed_once_with_every_replica_and_a_total():
    text = render_merged([m.registry for m in two_replicas()]).decode()
    assert text.count("# TYPE jaxserve:num_requests_running gauge") == 1
    s = samples_by_engine(text)
    running = s["jaxserve:num_requests_running"]
    m = (("model_name", "m"),)
    assert running[("0",) + m] == 3 and running[("1",) + m] == 1 and running[("total",) + m] == 4
    assert s["jaxserve:generation_tokens_total"][("total",) + m] == 30
    assert s["jaxserve:prefix_cache_hits_total"][("total",) + m] == 48
    success = s["jaxserve:request_success_total"]
    assert success[("total", ("finished_reason", "stop"), ("model_name", "m"))] == 2
    assert success[("total", ("finished_reason", "length"), ("model_name", "m"))] == 1


def test_usage_is_averaged_and_per_engine_facts_have_no_total():
    s = samples_by_engine(render_merged([m.registry for m in two_replicas()]).decode())
    assert s["jaxserve:kv_cache_usage_perc"][("total", ("model_name", "m"))] == pytest.approx(0.375)
    assert {k[0] for k in s["jaxserve:attention_backend_info"]} == {"0", "1"}
    assert ("total", ("model_name", "m")) in s["jaxserve:engine_dead"]


def test_histogram_totals_add_bucket_by_bucket():
    s = samples_by_engine(render_merged([m.registry for m in two_replicas()]).decode())
    count = s["jaxserve:inter_token_latency_seconds_count"]
    assert count[("total", ("model_name", "m"))] == 3
    buckets = s["jaxserve:e2e_request_latency_seconds_bucket"]
    assert buckets[("total", ("le", "1.0"), ("model_name", "m"))] == 2
    assert buckets[("total", ("le", "2.5"), ("model_name", "m"))] == 3


def test_offline_snapshot_has_the_same_totals():
    snapshot = merged_snapshot([m.snapshot() for m in two_replicas()])
    totals = {(x.name, tuple(sorted(x.labels.items()))): x for x in snapshot if x.labels["engine"] == "total"}
    assert totals[("jaxserve:num_requests_running", (("engine", "total"), ("model_name", "m")))].value == 4
    e2e = totals[("jaxserve:e2e_request_latency_seconds", (("engine", "total"), ("model_name", "m")))]
    assert (e2e.value, e2e.count) == (4.0, 3)
    assert not any(x.name == "jaxserve:attention_backend_info" for x in totals.values())


def test_merged_stats_sum_counts_and_keep_each_replica():
    per_engine = [{"num_requests_running": 2, "num_requests_waiting": 1, "num_free_blocks": 10,
                   "prefix_cache_queries": 5, "prefix_cache_hits": 1, "num_preemptions": 0, "kv_cache_usage_perc": 0.2},
                  {"num_requests_running": 1, "num_requests_waiting": 0, "num_free_blocks": 30,
                   "prefix_cache_queries": 7, "prefix_cache_hits": 3, "num_preemptions": 2, "kv_cache_usage_perc": 0.4}]
    merged = merge_stats(per_engine)
    assert merged["num_requests_running"] == 3 and merged["num_free_blocks"] == 40 and merged["num_preemptions"] == 2
    assert merged["kv_cache_usage_perc"] == pytest.approx(0.3)
    assert merged["data_parallel_size"] == 2 and merged["engines"] == per_engine
