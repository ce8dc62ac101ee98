"""The one /metrics reader: label values with spaces and quotes, sums over label sets, metrics
declared before any label set exists."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from jaxserve.bench import prom


def test_reads_sums_and_declarations_from_a_real_exposition():
    registry = CollectorRegistry()
    done = Counter("jaxserve:request_success", "finished", ["finished_reason"], registry=registry)
    Counter("jaxserve:untouched", "never incremented", ["model_name"], registry=registry)
    Gauge("jaxserve:num_requests_running", "running", registry=registry).set(3)
    done.labels(finished_reason='stop "eos" here').inc(2)
    done.labels(finished_reason="length").inc(5)
    text = generate_latest(registry).decode()

    samples = prom.read_samples(text)
    by_reason = {s.labels["finished_reason"]: s.value for s in samples
                 if s.name == "jaxserve:request_success_total"}
    assert by_reason == {'stop "eos" here': 2.0, "length": 5.0}
    values = prom.summed(samples)
    assert values["jaxserve:request_success_total"] == 7.0
    assert values["jaxserve:num_requests_running"] == 3.0
    assert "jaxserve:untouched_total" not in values
    assert prom.declared(text, "jaxserve:untouched_total") and not prom.declared(text, "jaxserve:nothing")
