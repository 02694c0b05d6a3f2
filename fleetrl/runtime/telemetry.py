"""OpenTelemetry tracing for fleetrl: one trace per trajectory, across processes.

Tracing is on when `FLEETRL_TRACING` says so (`1`/`0`, also `true`/`false`, `on`/`off`), or, when
that is unset, when an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`): whoever points a process at a collector wants its spans.
Off, the global tracer is OpenTelemetry's no-op and spans cost a function call. On, spans go to
OTLP/gRPC when an endpoint is set (needs the `otlp` extra; without it start-up fails with a
ConfigError naming the extra), else to a JSONL file per process under `<run_dir>/traces/`, so a
local run can be inspected offline. Context crosses NATS messages as message headers and gRPC
calls as metadata, both in W3C `traceparent` form.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from fleetrl.errors import ConfigError, FieldViolation

_configured = False
OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class JsonlSpanExporter(SpanExporter):
    """Append finished spans as one JSON object per line (ids in hex, times in ns)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in shutdown()
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_record(span)) for span in spans]
        with self._lock:
            self._file.write("".join(line + "\n" for line in lines))
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def span_record(span: ReadableSpan) -> dict[str, object]:
    """One finished span as a JSON-able dict: ids in hex, times in ns since the epoch."""
    ctx = span.get_span_context()
    assert ctx is not None
    return {
        "name": span.name,
        "trace_id": _trace_hex(ctx.trace_id),
        "span_id": _span_hex(ctx.span_id),
        "parent_id": _span_hex(span.parent.span_id) if span.parent else None,
        "kind": span.kind.name,
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "service": span.resource.attributes.get("service.name"),
        "scope": span.instrumentation_scope.name if span.instrumentation_scope else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "links": [{"trace_id": _trace_hex(link.context.trace_id), "span_id": _span_hex(link.context.span_id),
                   "attributes": dict(link.attributes or {})} for link in span.links],
        "events": [{"name": event.name, "time_ns": event.timestamp, "attributes": dict(event.attributes or {})}
                   for event in span.events],
    }


def _trace_hex(trace_id: int) -> str:
    return format(trace_id, "032x")


def _span_hex(span_id: int) -> str:
    return format(span_id, "016x")


def tracing_enabled() -> bool:
    """FLEETRL_TRACING when set, else whether an OTLP endpoint is configured."""
    value = os.environ.get("FLEETRL_TRACING", "").strip().lower()
    if not value:
        return otlp_endpoint_variable() is not None
    if value not in _TRUE + _FALSE:
        raise ConfigError("bad environment variable", [
            FieldViolation("FLEETRL_TRACING", f"{value!r} is not one of {', '.join(_TRUE + _FALSE)}")])
    return value in _TRUE


def otlp_endpoint_variable() -> str | None:
    """The name of the OTLP endpoint variable that is set (the traces-specific one first), or None."""
    return next((name for name in OTLP_ENDPOINT_VARIABLES if os.environ.get(name)), None)


def setup_tracing(service_name: str, run_dir: Path, *, enabled: bool | None = None) -> bool:
    """Install the tracer provider for this process; returns whether tracing is on (enabled=None:
    `tracing_enabled()`). Raises ConfigError when spans should go to OTLP but its exporter is missing."""
    global _configured
    if _configured:
        return True
    if not (tracing_enabled() if enabled is None else enabled):
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(_exporter(service_name, run_dir), schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    _configured = True
    return True


def _exporter(service_name: str, run_dir: Path) -> SpanExporter:
    variable = otlp_endpoint_variable()
    if variable is None:
        return JsonlSpanExporter(Path(run_dir) / "traces" / f"{service_name}-{os.getpid()}.jsonl")
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigError("tracing to an OTLP collector needs the otlp extra", [FieldViolation(
            variable, "set, but opentelemetry-exporter-otlp is not installed: pip install 'fleetrl[otlp]' "
                      "(or unset it: with FLEETRL_TRACING=1 spans then go to <run_dir>/traces/)")]) from None
    return OTLPSpanExporter()


def shutdown_tracing() -> None:
    """Flush and close exporters (call at process exit)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """The current context as W3C headers (for NATS message headers)."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def grpc_metadata() -> list[tuple[str, str]]:
    """The current context as gRPC call metadata."""
    return list(inject_headers().items())


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """A context from NATS headers or gRPC invocation metadata (missing: the empty context)."""
    if carrier is None:
        return otel_context.Context()
    pairs = carrier.items() if isinstance(carrier, Mapping) else carrier
    flat = {str(k).lower(): v.decode() if isinstance(v, bytes) else str(v) for k, v in pairs}
    return propagate.extract(flat)


def current_trace_id() -> str:
    """Hex trace id of the active span, or "" when tracing is off."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def current_span_id() -> str:
    """Hex span id of the active span, or "" when tracing is off."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.span_id, "016x") if ctx.is_valid else ""


def remote_parent(trace_id: str, span_id: str) -> otel_context.Context:
    """A context whose parent is the span (trace_id, span_id) of another process, as stored in a
    group's lineage; the empty context when either id is missing (tracing was off there)."""
    if not trace_id or not span_id:
        return otel_context.Context()
    parent = trace.SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True,
                               trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    return trace.set_span_in_context(trace.NonRecordingSpan(parent), otel_context.Context())
