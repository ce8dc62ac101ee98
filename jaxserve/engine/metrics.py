"""Engine metrics with vLLM's names under a ``jaxserve:`` prefix, in a private Prometheus registry.

``/metrics`` renders the registry; ``LLM.get_metrics()`` returns the same samples as plain records.
Gauges are refreshed from the scheduler's stats after each step; counters and histograms are fed
from step stats and from requests as they finish.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxserve.core.stats import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


@dataclasses.dataclass
class Metric:
    name: str
    kind: str  # gauge | counter | histogram
    value: float  # gauge/counter value; histogram: sum
    count: Optional[int] = None  # histogram sample count
    labels: Optional[dict[str, str]] = None


class EngineMetrics:
    def __init__(self, model_name: str, attention_backend: str = "unknown"):
        self.registry = r = CollectorRegistry()
        lbl = ["model_name"]
        self._labels = {"model_name": model_name}
        self._children: dict = {}
        self.running = Gauge("jaxserve:num_requests_running", "Requests in the running set", lbl, registry=r)
        self.waiting = Gauge("jaxserve:num_requests_waiting", "Requests waiting", lbl, registry=r)
        self.kv_usage = Gauge("jaxserve:kv_cache_usage_perc", "KV cache usage (1 = 100%)", lbl, registry=r)
        self.prefix_queries = Counter("jaxserve:prefix_cache_queries", "Prefix cache queries, in tokens", lbl, registry=r)
        self.prefix_hits = Counter("jaxserve:prefix_cache_hits", "Prefix cache hits, in tokens", lbl, registry=r)
        self.preemptions = Counter("jaxserve:num_preemptions", "Preemptions", lbl, registry=r)
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prefill tokens processed", lbl, registry=r)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "Generated tokens", lbl, registry=r)
        self.request_success = Counter("jaxserve:request_success", "Finished requests", lbl + ["finished_reason"], registry=r)
        self.ttft = Histogram("jaxserve:time_to_first_token_seconds", "Time to first token", lbl,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jaxserve:inter_token_latency_seconds", "Inter-token latency", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve:e2e_request_latency_seconds", "End-to-end request latency", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.compiles = Gauge("jaxserve:num_compiled_step_variants", "Compiled step variants", lbl, registry=r)
        self.padding = Gauge("jaxserve:step_padding_ratio", "Share of padded token slots so far", lbl, registry=r)
        self.backend = Gauge("jaxserve:attention_backend_info", "Attention backend in use (value 1)",
                             lbl + ["backend"], registry=r)
        self._last: Optional[SchedulerStats] = None
        self._l(self.backend, backend=attention_backend).set(1)

    def _l(self, metric, **extra):
        # Labelled children are looked up once: labels() costs more than the update itself.
        key = (id(metric), tuple(sorted(extra.items())))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self._labels, **extra)
        return child

    def record_step(self, stats: SchedulerStats, runner_stats=None) -> None:
        last = self._last or SchedulerStats()
        self._l(self.running).set(stats.num_running_reqs)
        self._l(self.waiting).set(stats.num_waiting_reqs)
        self._l(self.kv_usage).set(stats.kv_cache_usage)
        self._l(self.prefix_queries).inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
        self._l(self.prefix_hits).inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self._l(self.preemptions).inc(max(0, stats.num_preemptions - last.num_preemptions))
        if runner_stats is not None:
            self._l(self.compiles).set(runner_stats.num_compiles)
            self._l(self.padding).set(runner_stats.padding_ratio)
        self._last = stats

    def record_tokens(self, num_tokens: int, itl: Optional[float]) -> None:
        self._l(self.generation_tokens).inc(num_tokens)
        if itl is not None:
            self._l(self.itl).observe(itl)

    def record_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self._l(self.ttft).observe(ttft)
        self._l(self.prompt_tokens).inc(num_prompt_tokens)

    def record_finished(self, finish_reason: str, e2e: Optional[float]) -> None:
        self._l(self.request_success, finished_reason=finish_reason).inc()
        if e2e is not None:
            self._l(self.e2e).observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> list[Metric]:
        out = []
        for family in self.registry.collect():
            if family.type == "histogram":
                total = {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name.endswith("_sum")}
                for s in family.samples:
                    if s.name.endswith("_count"):
                        key = tuple(sorted(s.labels.items()))
                        out.append(Metric(family.name, "histogram", total.get(key, 0.0), int(s.value), dict(s.labels)))
            else:
                for s in family.samples:
                    if s.name.endswith("_created"):
                        continue
                    out.append(Metric(s.name, family.type, s.value, None, dict(s.labels)))
        return out
