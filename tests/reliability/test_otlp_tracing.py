"""--otlp-traces-endpoint: a real server exports one `llm_request` span per engine request, with vLLM's attributes,
to an OTLP collector run by the test (gRPC, the default; and HTTP/protobuf through the tracer itself), a
`traceparent` header making the span a child of the caller's trace; and the flag without the packages is refused
with a message that says what to install."""

from __future__ import annotations

import http.server
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("opentelemetry.sdk.trace")
grpc = pytest.importorskip("grpc")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402
from reliability_utils import MODEL_NAME, wait_for  # noqa: E402

from pagedllm.metrics import tracing  # noqa: E402
from pagedllm.metrics.loggers import FinishedRequestStats  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the gRPC service's name)
        with self.lock:
            self.spans += [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def _attributes(span) -> dict:
    values = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        values[kv.key] = getattr(kv.value, kind)
    return values


@pytest.fixture
def grpc_collector():
    collector = _Collector()
    server = grpc.server(ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, f"http://127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.slow
def test_spans_reach_the_collector_with_vllm_attributes_and_the_callers_trace(server_factory, grpc_collector):
    collector, endpoint = grpc_collector
    server = server_factory("--otlp-traces-endpoint", endpoint, "--api-server-count", "2", name="otlp")  # each exports
    client = server.client()
    plain = client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=5, n=2, temperature=0.5,
                                      top_p=0.9, seed=1, extra_body={"ignore_eos": True})
    traced = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0.0,
        extra_body={"ignore_eos": True}, extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"})
    server.close()  # the spans still queued are flushed at shutdown
    assert server.proc.returncode == 0
    assert wait_for(lambda: len(collector.spans) >= 3, 10.0), collector.spans
    spans = {}
    for span in collector.spans:
        attributes = _attributes(span)
        spans.setdefault(attributes["gen_ai.request.id"], []).append((span, attributes))
    assert set(spans) == {plain.id, traced.id}, list(spans)
    assert len(spans[plain.id]) == 2  # one per choice
    for span, a in spans[plain.id]:
        assert span.name == "llm_request" and span.kind == span.SPAN_KIND_SERVER
        assert a["gen_ai.usage.prompt_tokens"] == plain.usage.prompt_tokens
        assert a["gen_ai.usage.completion_tokens"] == 5
        assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.n"] == 2
        assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert a["gen_ai.response.model"] == MODEL_NAME
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        for name in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode", "time_in_model_inference"):
            assert 0 <= a[f"gen_ai.latency.{name}"] <= a["gen_ai.latency.e2e"], name
        assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(
            a["gen_ai.latency.e2e"] * 1e9, abs=2e6)
        assert not span.parent_span_id  # no traceparent: a root span
    [(span, a)] = spans[traced.id]
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    assert a["gen_ai.usage.completion_tokens"] == 3 == traced.usage.completion_tokens
    assert a["gen_ai.usage.prompt_tokens"] == traced.usage.prompt_tokens
    assert "gen_ai.request.temperature" not in a  # as vLLM: zero parameters are left out


def test_http_protobuf_exporter_and_the_flush_at_shutdown(monkeypatch):
    received: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            received.extend((self.path, span) for rs in request.resource_spans for ss in rs.scope_spans
                            for span in ss.spans)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # the batch waits for shutdown: no timing race below
    tracer = tracing.RequestTracer(f"http://127.0.0.1:{collector.server_port}/v1/traces", "m")
    finished = FinishedRequestStats("length", e2e_latency=0.5, num_prompt_tokens=7, num_generation_tokens=4,
                                    queue_time=0.1, prefill_time=0.2, decode_time=0.2, time_to_first_token=0.3)
    tracer.record(tracing.RequestTrace({}, "cmpl-1"), SamplingParams(max_tokens=4), finished)
    assert not received  # queued, not exported on the request's path
    tracer.shutdown()
    collector.shutdown()
    [(path, span)] = received
    assert path == "/v1/traces" and span.name == "llm_request"
    assert _attributes(span)["gen_ai.usage.prompt_tokens"] == 7


def test_the_flag_without_the_packages_names_what_to_install(monkeypatch):
    monkeypatch.setattr(tracing, "_module_exists", lambda name: not name.startswith("opentelemetry.exporter"))
    with pytest.raises(ValueError, match=r"--otlp-traces-endpoint needs the OpenTelemetry packages.*pagedllm\[otel\]"):
        tracing.check_tracing_available()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='thrift'"):
        tracing.check_tracing_available()
