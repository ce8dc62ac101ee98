"""Engine metrics with vLLM's names under a ``jaxserve:`` prefix, in a private Prometheus registry.

``/metrics`` renders the registry; ``LLM.get_metrics()`` returns the same samples as plain records.
Gauges are refreshed from the scheduler's stats after each step; counters and histograms are fed
once per step with that step's tokens and latencies (as vLLM's per-iteration stats are), and from
requests as they finish.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from jaxserve.core.stats import SchedulerStats, SpecDecodingStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


@dataclasses.dataclass
class Metric:
    name: str
    kind: str  # gauge | counter | histogram
    value: float  # gauge/counter value; histogram: sum
    count: int | None = None  # histogram sample count
    labels: dict[str, str] | None = None


class BatchedHistogram:
    """A Prometheus histogram fed a whole step's samples at once.

    One numpy pass per step replaces one locked update per token (the inter-token latency has a
    sample per generated token). Bucket ``i`` counts samples ``<= buckets[i]``, as Prometheus'
    ``le`` does; the last bucket is +Inf. Registered as a collector, it renders like any other
    histogram of the registry.
    """

    def __init__(self, name: str, documentation: str, labels: dict[str, str], buckets: Sequence[float],
                 registry: CollectorRegistry):
        self.name, self.documentation, self.labels = name, documentation, dict(labels)
        self.bounds = np.asarray(buckets, np.float64)
        self.counts = np.zeros(len(buckets) + 1, np.int64)
        self.total = 0.0
        self._lock = threading.Lock()  # /metrics reads from the server's thread
        registry.register(self)

    def observe(self, values: Sequence[float]) -> None:
        if len(values) == 0:
            return
        v = np.asarray(values, np.float64)
        counts = np.bincount(np.searchsorted(self.bounds, v, side="left"), minlength=len(self.counts))
        with self._lock:
            self.counts += counts
            self.total += float(v.sum())

    def collect(self):
        with self._lock:
            cumulative, total = np.cumsum(self.counts), self.total
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        family.add_metric(list(self.labels.values()), list(zip(les, cumulative.tolist())), total)
        yield family


class ExpertLoadCollector:
    """A MoE model's routed (token, expert) pairs per expert, summed over the layers, as one counter
    labelled by expert: read from the runner's totals when scraped, so a step pays nothing for it."""

    def __init__(self, labels: dict[str, str], registry: CollectorRegistry):
        self.labels = dict(labels)
        self.totals: list[int] | None = None  # the runner's running totals (CompileStats.expert_routed)
        registry.register(self)

    def collect(self):
        totals = self.totals
        if totals is None:
            return
        family = CounterMetricFamily("jaxserve:moe_expert_routed_tokens", "Routed (token, expert) pairs per expert "
                                     "(MoE layers summed, padding excluded)", labels=[*self.labels, "expert"])
        for expert, count in enumerate(list(totals)):
            family.add_metric([*self.labels.values(), str(expert)], count)
        yield family


class EngineMetrics:
    """One engine's metrics. Every sample carries ``model_name`` and ``engine`` (the replica's index
    under data parallelism, "0" otherwise), as vLLM labels them."""

    def __init__(self, model_name: str, attention_backend: str = "unknown", engine_index: int = 0):
        self.registry = r = CollectorRegistry()
        lbl = ["model_name", "engine"]
        self._labels = {"model_name": model_name, "engine": str(engine_index)}
        self._children: dict = {}
        self.running = Gauge("jaxserve:num_requests_running", "Requests in the running set", lbl, registry=r)
        self.waiting = Gauge("jaxserve:num_requests_waiting", "Requests waiting", lbl, registry=r)
        self.kv_usage = Gauge("jaxserve:kv_cache_usage_perc", "KV cache usage (1 = 100%)", lbl, registry=r)
        self.prefix_queries = Counter("jaxserve:prefix_cache_queries", "Prefix cache queries, in tokens", lbl,
                                      registry=r)
        self.prefix_hits = Counter("jaxserve:prefix_cache_hits", "Prefix cache hits, in tokens", lbl, registry=r)
        self.preemptions = Counter("jaxserve:num_preemptions", "Preemptions", lbl, registry=r)
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prefill tokens processed", lbl, registry=r)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "Generated tokens", lbl, registry=r)
        self.request_success = Counter("jaxserve:request_success", "Finished requests", [*lbl, "finished_reason"],
                                       registry=r)
        self.ttft = BatchedHistogram("jaxserve:time_to_first_token_seconds", "Time to first token",
                                     self._labels, _LATENCY_BUCKETS, r)
        self.itl = BatchedHistogram("jaxserve:inter_token_latency_seconds", "Inter-token latency",
                                    self._labels, _LATENCY_BUCKETS, r)
        self.e2e = BatchedHistogram("jaxserve:e2e_request_latency_seconds", "End-to-end request latency",
                                    self._labels, _LATENCY_BUCKETS, r)
        self.compiles = Gauge("jaxserve:num_compiled_step_variants", "Compiled step variants", lbl, registry=r)
        self.padding = Gauge("jaxserve:step_padding_ratio", "Share of padded token slots so far", lbl, registry=r)
        self.backend = Gauge("jaxserve:attention_backend_info", "Attention backend in use (value 1)",
                             lbl + ["backend"], registry=r)
        self.startup = Gauge("jaxserve:startup_seconds", "Seconds of the engine's start-up, by phase",
                             lbl + ["phase"], registry=r)
        self.variant_compile = Gauge("jaxserve:startup_step_variant_seconds",
                                     "Seconds to compile (or read from the persistent cache) each step variant",
                                     lbl + ["variant", "cached"], registry=r)
        self.memory = Gauge("jaxserve:memory_bytes", "Bytes held by the weights and the KV cache, by kind "
                            "and storage format (--quantization, --kv-cache-dtype)", lbl + ["kind", "format"],
                            registry=r)
        self.dead = Gauge("jaxserve:engine_dead", "1 once the engine loop has failed (restart the server)", lbl,
                          registry=r)
        # vLLM's lora_requests_info: the adapters in use as labels, the value the time of the update.
        self.lora_info = Gauge("jaxserve:lora_requests_info", "LoRA adapters of the running and waiting requests "
                               "(labels; value: unix time of the update)",
                               lbl + ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r)
        self.expert_load = ExpertLoadCollector(self._labels, r)
        # vLLM's spec_decode_* counters (drafts verified, their tokens, the accepted ones, by position).
        self.spec_drafts = Counter("jaxserve:spec_decode_num_drafts", "Speculative drafts verified (one per "
                                   "request and step)", lbl, registry=r)
        self.spec_draft_tokens = Counter("jaxserve:spec_decode_num_draft_tokens", "Draft tokens verified", lbl,
                                         registry=r)
        self.spec_accepted = Counter("jaxserve:spec_decode_num_accepted_tokens", "Draft tokens accepted", lbl,
                                     registry=r)
        self.spec_accepted_per_pos = Counter("jaxserve:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each position", lbl + ["position"], registry=r)
        self._lora_labels: tuple | None = None
        self._lora_child: Any = None
        self._last: SchedulerStats | None = None
        self._l(self.backend, backend=attention_backend).set(1)
        self._l(self.dead).set(0)

    def record_startup(self, phases: dict[str, float], compile_stats=None) -> None:
        """Start-up seconds by phase and, from the runner's ``CompileStats``, by step variant."""
        for phase, seconds in phases.items():
            self._l(self.startup, phase=phase).set(seconds)
        if compile_stats is not None:
            cached = set(compile_stats.cached_variants)
            for variant, seconds in compile_stats.compile_seconds_per_bucket.items():
                self._l(self.variant_compile, variant=variant, cached=str(variant in cached).lower()).set(seconds)

    def record_memory(self, memory: dict) -> None:
        """``ModelRunner.memory()``: weight and KV cache bytes and their formats."""
        self._l(self.memory, kind="weights", format=memory["quantization"]).set(memory["weight_bytes"])
        self._l(self.memory, kind="kv_cache", format=memory["kv_cache_dtype"]).set(memory["kv_cache_bytes"])

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
        if stats.max_loras:
            self._record_loras(stats)
        if stats.spec_decoding is not None:
            self._record_spec(stats.spec_decoding, last.spec_decoding)
        if runner_stats is not None:
            self._l(self.compiles).set(runner_stats.num_compiles)
            self._l(self.padding).set(runner_stats.padding_ratio)
            self.expert_load.totals = getattr(runner_stats, "expert_routed", None)
        self._last = stats

    def _record_spec(self, now: SpecDecodingStats, before: SpecDecodingStats | None) -> None:
        before = before or SpecDecodingStats()
        self._l(self.spec_drafts).inc(now.num_drafts - before.num_drafts)
        self._l(self.spec_draft_tokens).inc(now.num_draft_tokens - before.num_draft_tokens)
        self._l(self.spec_accepted).inc(now.num_accepted_tokens - before.num_accepted_tokens)
        old = before.num_accepted_tokens_per_pos
        for pos in range(now.num_spec_tokens):  # every position exported, from 0 on
            n = now.num_accepted_tokens_per_pos[pos] if pos < len(now.num_accepted_tokens_per_pos) else 0
            self._l(self.spec_accepted_per_pos, position=str(pos)).inc(n - (old[pos] if pos < len(old) else 0))

    def _record_loras(self, stats: SchedulerStats) -> None:
        labels = (",".join(sorted(stats.running_lora_adapters)), ",".join(sorted(stats.waiting_lora_adapters)),
                  str(stats.max_loras))
        if labels != self._lora_labels:  # one sample, the current adapters (no stale label sets pile up)
            self.lora_info.clear()
            self._lora_labels = labels
            self._lora_child = self.lora_info.labels(**self._labels, running_lora_adapters=labels[0],
                                                     waiting_lora_adapters=labels[1], max_lora=labels[2])
        self._lora_child.set(time.time())

    def record_dead(self) -> None:
        """The loop failed: every request was answered with an error and none runs any more; the
        cache's state is unknown (NaN), not the last value seen."""
        self._l(self.dead).set(1)
        self._l(self.running).set(0)
        self._l(self.waiting).set(0)
        self._l(self.kv_usage).set(float("nan"))

    def record_iteration(self, num_generation_tokens: int, itls: Sequence[float], ttfts: Sequence[float],
                         num_prompt_tokens: int) -> None:
        """One step's new tokens: their count, the inter-token latencies of requests past their
        first token, and the time to first token of those that got it (with their prompt sizes)."""
        if num_generation_tokens:
            self._l(self.generation_tokens).inc(num_generation_tokens)
        if num_prompt_tokens:
            self._l(self.prompt_tokens).inc(num_prompt_tokens)
        self.itl.observe(itls)
        self.ttft.observe(ttfts)

    def record_finished(self, finish_reason: str, e2e: float | None) -> None:
        self._l(self.request_success, finished_reason=finish_reason).inc()
        if e2e is not None:
            self.e2e.observe([e2e])

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
