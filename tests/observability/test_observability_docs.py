"""docs/OBSERVABILITY.md, docs/prometheus.yml and the compose files agree with the code."""

from __future__ import annotations

from pathlib import Path

import yaml
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric

import services.actor.metrics
import services.learner.observe
from services.common.observe import RpcMetrics
from services.replay.server import Metrics as ReplayMetrics
from services.reward.metrics import RewardMetrics

ROOT = Path(__file__).resolve().parents[2]
FLEETRL = ("gateway", "replay", "reward", "learner", "actor")


def _exposed_name(family: Metric) -> str:
    suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
    return family.name + suffix


def _families() -> list[str]:
    """Every family a fleetrl process can expose (the actor's and learner's modules registered theirs in
    the default registry when imported above)."""
    rpc = CollectorRegistry()
    RpcMetrics(rpc)
    registries = [REGISTRY, ReplayMetrics().registry, RewardMetrics().registry, rpc]
    names = [_exposed_name(f) for r in registries for f in r.collect()]
    return [n for n in names if n.startswith(("fleetrl_", "grpc_"))]


def test_every_metric_is_in_the_catalogue() -> None:
    assert services.actor.metrics.TASKS and services.learner.observe.STEPS
    text = (ROOT / "docs" / "OBSERVABILITY.md").read_text()
    missing = [name for name in _families() if f"`{name}`" not in text]
    assert not missing, f"not documented in docs/OBSERVABILITY.md: {missing}"


def _compose(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())["services"]


def test_prometheus_scrapes_the_ports_compose_configures() -> None:
    services = _compose("docker-compose.yml")
    ports = {name: int(services[name]["environment"][f"FLEETRL_{name.upper()}_METRICS_PORT"]) for name in FLEETRL}
    jobs = {job["job_name"]: job for job in yaml.safe_load((ROOT / "docs" / "prometheus.yml").read_text())
            ["scrape_configs"]}
    assert set(jobs) == set(FLEETRL)
    for name in FLEETRL:
        if name == "actor":  # scaled replicas, found by DNS
            assert jobs[name]["dns_sd_configs"] == [{"names": ["actor"], "type": "A", "port": ports[name]}]
        else:
            assert jobs[name]["static_configs"] == [{"targets": [f"{name}:{ports[name]}"]}]
    assert "./docs/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    assert services["prometheus"]["profiles"] == services["jaeger"]["profiles"] == ["observability"]


def test_tracing_override_points_every_service_at_jaeger() -> None:
    base, tracing = _compose("docker-compose.yml"), _compose("docker-compose.tracing.yml")
    assert set(tracing) == set(FLEETRL)
    assert "4317:4317" in base["jaeger"]["ports"]
    for name, service in tracing.items():
        assert service["environment"]["FLEETRL_TRACING"] == "1", name
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name
        assert "otlp" in service["build"]["args"]["INSTALL_EXTRAS"], name
