"""Reading a Prometheus text exposition (``/metrics``), for the benchmarks and the tests.

One reader, the client library's own parser, so a label value holding a space or a quote is read
right. Samples keep their full names (a counter's ``_total``, a histogram's ``_count``).
"""

from __future__ import annotations

import collections
from typing import NamedTuple


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def read_samples(text: str) -> list[Sample]:
    """Every sample of the exposition, in order."""
    from prometheus_client.parser import text_string_to_metric_families

    return [Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def summed(samples: list[Sample]) -> dict[str, float]:
    """Each sample name's value summed over its label sets, but for data parallelism's
    ``engine="total"`` samples, which repeat the replicas' own."""
    out: dict[str, float] = collections.defaultdict(float)
    for s in samples:
        if s.labels.get("engine") != "total":
            out[s.name] += s.value
    return dict(out)


def declared(text: str, name: str) -> bool:
    """Whether the exposition declares the metric ``name`` (sample name or family name), samples
    or not: a labelled metric has none until a label set is first touched."""
    family = name.removesuffix("_total")
    return f"# TYPE {name} " in text or f"# TYPE {family} " in text


def fetch(base_url: str, timeout: float = 30.0) -> str:
    """``/metrics`` of a running server, as text."""
    import httpx

    return httpx.get(f"{base_url}/metrics", timeout=timeout).text
