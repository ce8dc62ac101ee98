"""``otlp_traces_endpoint``: one span tree per request, received by a real OTLP/HTTP endpoint that
decodes the protobuf export requests (the message classes of ``opentelemetry-proto``)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jaxserve import LLM, ConfigError, SamplingParams
from jaxserve.engine.outputs import RequestOutputKind
from jaxserve.engine.timeline import STAGES, EntryTimes
from tests.shapes import ENGINE_TESTS_SHAPE

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACE_HEADERS = {"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01"}


class OTLPReceiver:
    """An OTLP/HTTP traces endpoint on a free port, keeping every span it is sent."""

    def __init__(self):
        self.spans: list = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.headers["Content-Type"] == "application/x-protobuf"
                request = ExportTraceServiceRequest.FromString(body)
                receiver.paths.append(self.path)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(scope_spans.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = [getattr(x, x.WhichOneof("value")) for x in v.array_value.values] if kind == "array_value" \
            else getattr(v, kind)
    return out


def test_one_span_tree_per_request(demo_model):
    receiver = OTLPReceiver()
    try:
        llm = LLM(demo_model, show_progress=False, otlp_traces_endpoint=receiver.url, **ENGINE_TESTS_SHAPE)
        outs = llm.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13]],
                            [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                             SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                             SamplingParams(temperature=1.0, max_tokens=3, n=2, seed=1, ignore_eos=True)],
                            use_tqdm=False)
        engine = llm.llm_engine
        engine.add_request("aborted", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True),
                           output_kind=RequestOutputKind.DELTA)
        engine.step()
        engine.abort_request(["aborted"])
        # A caller's W3C trace context (what the server reads from the request's headers).
        traced = engine.process_request("traced", [4, 5], SamplingParams(max_tokens=2, ignore_eos=True),
                                        entry_times=EntryTimes(time.monotonic(), trace_headers=TRACE_HEADERS))
        engine.add_processed_request(traced)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.tracer.flush()
        engine.shutdown()
    finally:
        receiver.close()

    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    by_trace = defaultdict(list)
    for span in receiver.spans:
        by_trace[span.trace_id].append(span)
    assert len(by_trace) == len(outs) + 2  # one tree per request, n=2 included
    stage_order = [name for name, _ in STAGES]
    seen = {}
    for spans in by_trace.values():
        roots = [s for s in spans if s.name == "llm_request"]
        assert len(roots) == 1  # without a caller's trace context, a root (see "traced" below)
        root = roots[0]
        attrs = attributes(root)
        seen[attrs["gen_ai.request.id"]] = attrs
        children = sorted((s for s in spans if s is not root), key=lambda s: s.start_time_unix_nano)
        assert children and all(s.parent_span_id == root.span_id for s in children)
        names = [s.name for s in children]
        assert names == [n for n in stage_order if n in names]
        assert root.start_time_unix_nano <= children[0].start_time_unix_nano
        assert children[-1].end_time_unix_nano <= root.end_time_unix_nano
        for a, b in zip(children, children[1:]):
            assert a.end_time_unix_nano <= b.start_time_unix_nano  # consecutive, not overlapping
    for out in outs:
        attrs = seen[out.request_id]
        assert attrs["gen_ai.usage.prompt_tokens"] == len(out.prompt_token_ids)
        assert attrs["gen_ai.usage.completion_tokens"] == sum(len(o.token_ids) for o in out.outputs)
        assert attrs["gen_ai.response.finish_reasons"] == ["length"] * len(out.outputs)
        assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(out.metrics.time_to_first_token)
        assert attrs["gen_ai.latency.e2e"] == pytest.approx(out.metrics.e2e_latency)
    assert seen["aborted"]["jaxserve.finish_causes"] == ["abort"]
    # the traced request's root continues the caller's trace, as a child of the caller's span
    (traced_root,) = [s for s in receiver.spans if s.name == "llm_request"
                      and attributes(s)["gen_ai.request.id"] == "traced"]
    assert traced_root.trace_id == bytes.fromhex(TRACE_ID) and traced_root.parent_span_id == bytes.fromhex(SPAN_ID)
    others = [s for s in receiver.spans if s.name == "llm_request" and s is not traced_root]
    assert all(s.trace_id != traced_root.trace_id and not s.parent_span_id for s in others)


def test_the_server_passes_the_trace_context_headers_on():
    from jaxserve_server.entry_times import start

    times = start({"traceparent": TRACE_HEADERS["traceparent"], "tracestate": "k=v", "user-agent": "x"})
    assert times.trace_headers == {"traceparent": TRACE_HEADERS["traceparent"], "tracestate": "k=v"}
    assert start({"user-agent": "x"}).trace_headers is None


def test_bad_endpoint_is_a_config_error(demo_model):
    with pytest.raises(ConfigError, match="otlp_traces_endpoint"):
        LLM(demo_model, show_progress=False, otlp_traces_endpoint="localhost:4318", **ENGINE_TESTS_SHAPE)
