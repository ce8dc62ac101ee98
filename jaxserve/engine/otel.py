"""OpenTelemetry spans per request (``--otlp-traces-endpoint``), exported over OTLP/HTTP.

When a request ends (finished, aborted, failed) its timeline becomes one span tree: a root
``llm_request`` span from its receipt (or arrival) to its finish, with vLLM's ``gen_ai.*``
attributes, and one child span per stage (template, tokenize, to engine, queue, prefill, decode),
consecutive inside it. A request that came with a W3C ``traceparent`` (and ``tracestate``) header
gets its root span in that trace, as a child of the caller's span, as vLLM does. The SDK's batch
processor sends them from its own thread; the engine thread only builds spans. Needs the ``otel``
extra (``pip install jaxserve[otel]``).
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Mapping

from jaxserve.engine.timeline import RequestTimeline, request_span, stage_spans
from jaxserve.exceptions import ConfigError

ROOT_SPAN = "llm_request"
EXPORT_DELAY_MS = 1000  # how long finished spans may wait before a batch goes out


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: a bare collector address gets the standard ``/v1/traces`` path."""
    parsed = urllib.parse.urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"otlp_traces_endpoint: expected an http(s) URL, got {endpoint!r}")
    return endpoint if parsed.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def _attributes(t: RequestTimeline, model_name: str) -> dict:
    """vLLM's span attributes (latencies in seconds), plus the stage-table answers jaxserve adds."""
    m, p = t.metrics, t.sampling_params
    attrs = {
        "gen_ai.request.id": t.request_id,
        "gen_ai.response.model": model_name,
        "gen_ai.request.n": p.n,
        "gen_ai.request.temperature": p.temperature,
        "gen_ai.request.top_p": p.top_p,
        "gen_ai.request.max_tokens": t.max_tokens if t.max_tokens is not None else -1,
        "gen_ai.usage.prompt_tokens": t.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": sum(s.num_output_tokens for s in t.samples),
        "gen_ai.response.finish_reasons": [s.finish_reason or "" for s in t.samples],
        "jaxserve.finish_causes": [s.finish_cause or "" for s in t.samples],
        "jaxserve.num_cached_tokens": t.num_cached_tokens,
        "jaxserve.num_preemptions": m.num_preemptions,
    }
    if t.lora_name is not None:
        attrs["jaxserve.lora_name"] = t.lora_name
    latencies = {"gen_ai.latency.time_in_queue": m.time_in_queue,
                 "gen_ai.latency.time_to_first_token": m.time_to_first_token, "gen_ai.latency.e2e": m.e2e_latency}
    attrs.update({k: v for k, v in latencies.items() if v is not None})
    return attrs


class RequestTracer:
    """Turns ended requests' timelines into span trees sent to an OTLP/HTTP collector."""

    def __init__(self, endpoint: str, model_name: str, service_name: str = "jaxserve"):
        url = traces_url(endpoint)
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise ConfigError("otlp_traces_endpoint needs the OpenTelemetry SDK and OTLP exporter: "
                              "pip install 'jaxserve[otel]'") from exc
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self.model_name = model_name
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=EXPORT_DELAY_MS))
        self.tracer = self.provider.get_tracer("jaxserve")
        # Timelines use the monotonic clock; spans carry wall-clock nanoseconds.
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def export(self, t: RequestTimeline, now: float | None = None,
               trace_headers: Mapping[str, str] | None = None) -> None:
        """``trace_headers``: the request's ``traceparent``/``tracestate``; without them (or with
        a malformed one) the span starts a trace of its own."""
        now = time.monotonic() if now is None else now
        start, end = request_span(t.metrics, now)
        parent = self._propagator.extract(carrier=dict(trace_headers)) if trace_headers else None
        root = self.tracer.start_span(ROOT_SPAN, context=parent, kind=self._trace.SpanKind.SERVER,
                                      start_time=self._ns(start), attributes=_attributes(t, self.model_name))
        context = self._trace.set_span_in_context(root)
        for name, stage_start, stage_end in stage_spans(t.metrics, now):
            self.tracer.start_span(name, context=context, start_time=self._ns(stage_start)).end(self._ns(stage_end))
        root.end(self._ns(end))

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self.provider.shutdown()
