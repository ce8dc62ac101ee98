"""The batched histogram renders exactly what a Prometheus histogram fed the same samples one by one
would (the engine-level counts are in test_engine_features)."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from jaxserve.engine.metrics import BatchedHistogram


def _bucket_lines(registry: CollectorRegistry, name: str) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line.startswith(name) and not line.startswith(name + "_created")]


def test_batched_histogram_matches_prometheus_sample_by_sample():
    buckets = (0.001, 0.01, 0.1, 1.0, 10.0)
    rng = np.random.default_rng(0)
    samples = np.concatenate([rng.exponential(0.05, 500), buckets, [0.0, 100.0]])  # boundaries land in "le"
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batched = BatchedHistogram("x_seconds", "x", {"model_name": "m"}, buckets, ours)
    reference = Histogram("x_seconds", "x", ["model_name"], buckets=buckets, registry=theirs).labels(model_name="m")
    for chunk in np.array_split(samples, 7):
        batched.observe(chunk.tolist())
        for v in chunk:
            reference.observe(float(v))
    batched.observe([])
    mine, ref = _bucket_lines(ours, "x_seconds"), _bucket_lines(theirs, "x_seconds")
    assert [line.split(" ")[0] for line in mine] == [line.split(" ")[0] for line in ref]
    for a, b in zip(mine, ref):  # the _sum may differ in its last bits: summed in another order
        assert np.isclose(float(a.split(" ")[1]), float(b.split(" ")[1]), rtol=1e-12), (a, b)
    assert int(float(mine[-2].split(" ")[1])) == len(samples)  # _count
