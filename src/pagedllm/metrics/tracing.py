"""OpenTelemetry spans per request (--otlp-traces-endpoint), as vLLM emits them.

Each engine request (each choice of each prompt) that finishes gives one span `llm_request` (kind SERVER) from its
arrival to its end, with vLLM's attributes (`SpanAttributes`): the request's id (the response's `id`), its sampling
parameters, its prompt and completion tokens, and its latencies (time to first token, end to end, in queue, in
prefill, in decode). A `traceparent` (and `tracestate`) header on the HTTP request makes the span a child of the
caller's trace. The spans go to a BatchSpanProcessor: `end()` only queues them, a background thread exports them
over OTLP (gRPC by default; `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` for HTTP), and `shutdown()` flushes
what is queued when the server stops.

The OpenTelemetry packages are optional (`pip install 'pagedllm[otel]'`): without them --otlp-traces-endpoint is
refused at start-up (`check_tracing_available`), and nothing here imports them unless a tracer is made.
"""

from __future__ import annotations

import importlib.util
import os
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from pagedllm import envs

TRACE_HEADERS = ("traceparent", "tracestate")


class SpanAttributes:
    """vLLM's span attribute names (vllm/tracing/utils.py)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


@dataclass
class RequestTrace:
    """What the HTTP layer knows of a request for its spans: the trace headers it came with, and (set by the
    serving layer) the id of its response."""

    headers: dict[str, str] = field(default_factory=dict)
    request_id: str | None = None


current_request_trace: ContextVar[RequestTrace | None] = ContextVar("current_request_trace", default=None)
"""Set by the HTTP route while tracing is on; read by the engine frontend when it sends the request."""


_PROTOCOLS = {"grpc": "opentelemetry.exporter.otlp.proto.grpc",
              "http/protobuf": "opentelemetry.exporter.otlp.proto.http"}


def traces_protocol() -> str:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (OpenTelemetry's variable; vLLM's default: grpc)."""
    return envs.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL


def check_tracing_available() -> None:
    """ValueError (for the user, at start-up) when the OpenTelemetry SDK or the exporter of the protocol is missing."""
    protocol = traces_protocol()
    if protocol not in _PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is not supported for "
                         f"--otlp-traces-endpoint; use one of {', '.join(_PROTOCOLS)}.")
    missing = [name for name in ("opentelemetry.sdk.trace", _PROTOCOLS[protocol]) if not _module_exists(name)]
    if missing:
        raise ValueError(f"--otlp-traces-endpoint needs the OpenTelemetry packages, which are not installed "
                         f"(missing: {', '.join(missing)}): pip install 'pagedllm[otel]' (opentelemetry-sdk and "
                         "opentelemetry-exporter-otlp).")


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


class RequestTracer:
    """Makes the `llm_request` spans and exports them off the request path."""

    def __init__(self, endpoint: str, model_name: str):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        check_tracing_available()
        resource = Resource.create({"vllm.instrumenting_module_name": "pagedllm.engine.async_llm",
                                    "vllm.process_id": str(os.getpid())})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
        self.tracer = self.provider.get_tracer("pagedllm.engine.async_llm")
        self.propagator = TraceContextTextMapPropagator()
        self.model_name = model_name
        self._server_kind = SpanKind.SERVER

    def record(self, trace: RequestTrace, params, finished, now: float | None = None) -> None:
        """One finished engine request's span. `params`: its SamplingParams; `finished`: its FinishedRequestStats."""
        attributes = {
            SpanAttributes.GEN_AI_RESPONSE_MODEL: self.model_name,
            SpanAttributes.GEN_AI_LATENCY_E2E: finished.e2e_latency,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: finished.queue_time,
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: finished.num_prompt_tokens,
            SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: finished.num_generation_tokens,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: finished.prefill_time,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: finished.decode_time,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: finished.prefill_time + finished.decode_time,
        }
        if trace.request_id is not None:
            attributes[SpanAttributes.GEN_AI_REQUEST_ID] = trace.request_id
        if finished.time_to_first_token is not None:
            attributes[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = finished.time_to_first_token
        for name, value in ((SpanAttributes.GEN_AI_REQUEST_TOP_P, params.top_p),
                            (SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS, params.max_tokens),
                            (SpanAttributes.GEN_AI_REQUEST_TEMPERATURE, params.temperature),
                            (SpanAttributes.GEN_AI_REQUEST_N, params.n)):
            if value:  # as vLLM: only the parameters that are set and non-zero
                attributes[name] = value
        context = self.propagator.extract(trace.headers) if trace.headers else None
        end = now or time.time()
        span = self.tracer.start_span("llm_request", context=context, kind=self._server_kind,
                                      start_time=int((end - finished.e2e_latency) * 1e9), attributes=attributes)
        span.end(end_time=int(end * 1e9))

    def shutdown(self) -> None:
        """Export what is still queued (the server is stopping), then stop the exporter."""
        self.provider.shutdown()


def _exporter(endpoint: str):
    if traces_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)
