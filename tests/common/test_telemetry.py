"""Tracing: file exporter writes linked spans; context crosses a header carrier."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from fleetrl.runtime import telemetry


def test_jsonl_exporter_links_parent_across_a_carrier(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    provider = TracerProvider(resource=Resource.create({"service.name": "t"}))
    provider.add_span_processor(SimpleSpanProcessor(telemetry.JsonlSpanExporter(path)))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("publish"):
        headers = telemetry.inject_headers()
        trace_id = telemetry.current_trace_id()
    with tracer.start_as_current_span("consume", context=telemetry.extract(headers)):
        pass
    provider.shutdown()
    spans = {s["name"]: s for s in map(json.loads, path.read_text().splitlines())}
    assert "traceparent" in headers
    assert spans["consume"]["trace_id"] == spans["publish"]["trace_id"] == trace_id
    assert spans["consume"]["parent_id"] == spans["publish"]["span_id"]


def test_tracing_is_off_by_default(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FLEETRL_TRACING", raising=False)
    assert not telemetry.setup_tracing("t", tmp_path)
    assert telemetry.current_trace_id() == ""
    assert not (tmp_path / "traces").exists()
