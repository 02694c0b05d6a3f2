"""Observability of every fleetrl gRPC server, in one interceptor; and the /metrics endpoint.

`ObservingInterceptor` wraps each call in a SERVER span whose parent is the caller's context
(W3C `traceparent` in the call metadata, see `telemetry.grpc_metadata`), named like the OpenTelemetry
RPC conventions (`fleetrl.v1.ReplayService/Insert`), and counts it in the de-facto standard
Prometheus families of go-grpc-prometheus (`grpc_server_handled_total` by code,
`grpc_server_handling_seconds`), so stock Grafana dashboards work. Servicers stay thin: none of them
knows it is traced or measured. Health and reflection calls are passed through untouched.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from opentelemetry import trace
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server

from fleetrl.runtime import telemetry

PASS_THROUGH = ("/grpc.health.v1.", "/grpc.reflection.")
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TRACER = telemetry.tracer("fleetrl.grpc")


def serve_metrics(port: int, registry: CollectorRegistry = REGISTRY) -> WSGIServer | None:
    """Serve registry on http://0.0.0.0:port/metrics from a daemon thread (port 0: do nothing); the server,
    for a caller that stops it (`shutdown()`) before its process ends."""
    if not port:
        return None
    server, _ = start_http_server(port, registry=registry)
    return server


class RpcMetrics:
    """The two per-RPC families, in a given registry."""

    handled: Counter
    seconds: Histogram

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.handled = Counter("grpc_server_handled_total", "RPCs completed on the server, by status code",
                               ["grpc_service", "grpc_method", "grpc_code"], registry=registry)
        self.seconds = Histogram("grpc_server_handling_seconds", "Seconds from request to the last response",
                                 ["grpc_service", "grpc_method"], buckets=LATENCY_BUCKETS_S, registry=registry)


class ObservingInterceptor(grpc.aio.ServerInterceptor):
    """A span and the RPC metrics for each unary-unary and unary-stream call."""

    metrics: RpcMetrics

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.metrics = RpcMetrics(registry)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method  # type: ignore[attr-defined]
        if handler is None or method.startswith(PASS_THROUGH):
            return handler
        call = _Call(self.metrics, method, details.invocation_metadata)  # type: ignore[attr-defined]
        return call.wrap(handler)


class _Call:
    """One method's wrapper: opens the span, times the call, records its final code."""

    metrics: RpcMetrics
    name: str
    service: str
    method: str
    metadata: Any

    def __init__(self, metrics: RpcMetrics, method: str, metadata: Any) -> None:
        self.metrics, self.name, self.metadata = metrics, method.lstrip("/"), metadata
        self.service, _, self.method = self.name.partition("/")

    def wrap(self, handler: Any) -> Any:
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(handler.unary_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(handler.unary_stream))
        return handler

    def _unary(self, inner: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with self._span() as span:
                started, code = time.perf_counter(), "OK"
                try:
                    return await inner(request, context)
                except BaseException:
                    code = _code(context)
                    raise
                finally:
                    self._record(span, started, code)

        return unary

    def _stream(self, inner: Callable[[Any, Any], AsyncIterator[Any]]) -> Callable[[Any, Any], AsyncIterator[Any]]:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with self._span() as span:
                started, code = time.perf_counter(), "OK"
                try:
                    async for item in inner(request, context):
                        yield item
                except BaseException:
                    code = _code(context)
                    raise
                finally:
                    self._record(span, started, code)

        return stream

    def _span(self) -> Any:
        return _TRACER.start_as_current_span(
            self.name, context=telemetry.extract(self.metadata), kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": self.service, "rpc.method": self.method},
            record_exception=False, set_status_on_exception=False)

    def _record(self, span: trace.Span, started: float, code: str) -> None:
        self.metrics.seconds.labels(self.service, self.method).observe(time.perf_counter() - started)
        self.metrics.handled.labels(self.service, self.method, code).inc()
        span.set_attribute("rpc.grpc.status_code", code)
        if code != "OK":
            span.set_status(trace.StatusCode.ERROR, code)


def _code(context: grpc.aio.ServicerContext) -> str:
    """The code an aborted call ended with (CANCELLED for a cancelled one, UNKNOWN for a raise)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "CANCELLED" if context.cancelled() else "UNKNOWN"
