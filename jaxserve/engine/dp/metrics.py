"""One Prometheus exposition for M data-parallel replicas: each replica's samples, plus totals.

Each replica keeps its own ``EngineMetrics`` (samples labelled ``engine="0"``, ``engine="1"`` ...).
The merged view lists every family once, with the samples of all replicas, then the totals under
``engine="total"``: counters and histograms summed, the request gauges summed, the usage ratios
averaged (the replicas' pools are equal), ``engine_dead`` the worst. Families that describe one
engine (backend, start-up, compiled variants) have no total. A query summing over ``engine``
itself filters ``engine!="total"`` out.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric as PromMetric

from jaxserve.engine.metrics import Metric

TOTAL = "total"

# How the replicas' values of a family combine into its total; a family missing here has none.
_MEAN = ("jaxserve:kv_cache_usage_perc", "jaxserve:step_padding_ratio")
_MAX = ("jaxserve:engine_dead",)
_NO_TOTAL = ("jaxserve:attention_backend_info", "jaxserve:startup_seconds",
             "jaxserve:startup_step_variant_seconds", "jaxserve:num_compiled_step_variants")


def total_of(family: str) -> Callable[[list[float]], float] | None:
    """The function that combines the replicas' values of ``family``'s samples, or None."""
    if family in _NO_TOTAL:
        return None
    if family in _MEAN:
        return statistics.fmean
    if family in _MAX:
        return max
    return sum


def _merge_family(families: list[PromMetric]) -> PromMetric:
    first = families[0]
    merged = PromMetric(first.name, first.documentation, first.type)
    for family in families:
        merged.samples.extend(family.samples)
    combine = total_of(first.name)
    if combine is None or len(families) < 2:
        return merged
    groups: dict[tuple, list[float]] = collections.defaultdict(list)
    for family in families:
        for s in family.samples:
            if s.name.endswith("_created"):  # creation times do not add up
                continue
            rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "engine"))
            groups[(s.name, rest)].append(s.value)
    for (name, rest), values in groups.items():
        merged.add_sample(name, {**dict(rest), "engine": TOTAL}, combine(values))
    return merged


class MergedCollector:
    """A Prometheus collector over the replicas' registries (read at each scrape)."""

    def __init__(self, registries: Sequence[CollectorRegistry]):
        self.registries = list(registries)

    def collect(self) -> Iterable[PromMetric]:
        by_name: dict[str, list[PromMetric]] = {}
        for registry in self.registries:
            for family in registry.collect():
                by_name.setdefault(family.name, []).append(family)
        for families in by_name.values():
            yield _merge_family(families)


def render_merged(registries: Sequence[CollectorRegistry]) -> bytes:
    """The replicas' metrics and their totals, in the text exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MergedCollector(registries))
    return generate_latest(registry)


def merged_snapshot(snapshots: Sequence[list[Metric]]) -> list[Metric]:
    """``LLM.get_metrics()`` over replicas: every replica's records (each labelled with its
    ``engine``), then the totals as ``EngineMetrics.snapshot`` records labelled ``engine="total"``."""
    out = [m for snap in snapshots for m in snap]
    if len(snapshots) < 2:
        return out
    groups: dict[tuple, list[Metric]] = collections.defaultdict(list)
    for m in out:
        rest = tuple(sorted((k, v) for k, v in (m.labels or {}).items() if k != "engine"))
        groups[(m.name, m.kind, rest)].append(m)
    for (name, kind, rest), ms in groups.items():
        family = name.removesuffix("_total") if kind == "counter" else name
        combine = total_of(family)
        if combine is None:
            continue
        count = sum(m.count or 0 for m in ms) if kind == "histogram" else None
        out.append(Metric(name, kind, combine([m.value for m in ms]), count, {**dict(rest), "engine": TOTAL}))
    return out


# Counters and counts of ``EngineCore.stats()`` that add up over replicas.
_SUMMED_STATS = ("num_requests_running", "num_requests_waiting", "num_free_blocks", "prefix_cache_queries",
                 "prefix_cache_hits", "num_preemptions")


def merge_stats(per_engine: Sequence[dict]) -> dict:
    """``stats()`` over replicas: the summable counts summed, KV usage averaged, and every
    replica's own dict under ``engines`` (index = replica)."""
    merged: dict = {k: sum(s[k] for s in per_engine) for k in _SUMMED_STATS if all(k in s for s in per_engine)}
    merged["kv_cache_usage_perc"] = statistics.fmean(s["kv_cache_usage_perc"] for s in per_engine)
    merged["data_parallel_size"] = len(per_engine)
    merged["engines"] = list(per_engine)
    return merged
