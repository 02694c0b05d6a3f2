"""docs/OBSERVABILITY.md, docs/prometheus.yml, docs/grafana/ and the compose files agree with the code."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric

import fleetrl.rollout.metrics
import fleetrl.services.gateway.server
import fleetrl.services.tinker.server
import fleetrl.tinker.requests
import fleetrl.train.observability
import fleetrl.weights.store
from fleetrl.reward.metrics import RewardMetrics
from fleetrl.runtime.observe import RpcMetrics
from fleetrl.services.replay.server import Metrics as ReplayMetrics
from fleetrl.services.tinker import metrics as tinker_metrics

ROOT = Path(__file__).resolve().parents[2]
FLEETRL = ("gateway", "replay", "reward", "learner", "actor", "tinker")


CATALOGUE_ROW = re.compile(r"^\| `(?P<name>[a-z_0-9]+)` \| (?P<type>[a-z ]+) \|(?P<labels>[^|]*)\|", re.MULTILINE)
METRIC_NAME = re.compile(r"\b(?:fleetrl|grpc_server)_[a-z_0-9]+")
HISTOGRAM_SAMPLES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Family:
    name: str  # as exposed: counters with _total, info with _info
    type: str  # as the catalogue writes it
    labels: tuple[str, ...]


def _exposed_name(family: Metric) -> str:
    suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
    return family.name + suffix


def _families() -> dict[str, Family]:
    """Every family a fleetrl process can expose (the actor's and learner's modules registered theirs in
    the default registry when imported above), with its label names (a state set's: its own name)."""
    rpc = CollectorRegistry()
    RpcMetrics(rpc)
    out = {}
    for registry in (REGISTRY, ReplayMetrics().registry, RewardMetrics().registry, rpc):
        for collector in list(registry._collector_to_names):  # the metric objects, which know their labels
            for family in collector.collect():
                if family.name.startswith(("fleetrl_", "grpc_")):
                    labels = (family.name,) if family.type == "stateset" else tuple(collector._labelnames)
                    kind = family.type.replace("stateset", "state set")
                    out[_exposed_name(family)] = Family(_exposed_name(family), kind, labels)
    for family in tinker_metrics.families([], None):  # read from the service at each scrape: no metric objects
        out[family.name] = Family(family.name, family.type, family._labelnames)
    return out


def _catalogue() -> dict[str, Family]:
    text = (ROOT / "docs" / "OBSERVABILITY.md").read_text()
    rows = [Family(m["name"], m["type"], tuple(label.strip() for label in m["labels"].split(",") if label.strip()))
            for m in CATALOGUE_ROW.finditer(text)]
    assert len(rows) == len({row.name for row in rows}), "a metric is catalogued twice"
    return {row.name: row for row in rows}


def test_the_catalogue_lists_every_metric_and_only_those() -> None:
    assert fleetrl.rollout.metrics.TASKS and fleetrl.train.observability.STEPS
    assert fleetrl.tinker.requests.WORK_SECONDS and fleetrl.services.tinker.server.HTTP_SECONDS
    code, docs = _families(), _catalogue()
    assert sorted(set(code) - set(docs)) == [], "not in docs/OBSERVABILITY.md's catalogue"
    assert sorted(set(docs) - set(code)) == [], "catalogued in docs/OBSERVABILITY.md, but no code exposes it"
    for name, family in code.items():
        if family.type == "info":  # an info's labels are the values it is given, not declared names
            assert docs[name].type == "info", name
        else:
            assert docs[name] == family, name


def _unknown_metrics(text: str) -> list[str]:
    """Metric names in text that no code exposes (a histogram's _bucket/_sum/_count count as it)."""
    families = _families()
    histograms = {name for name, family in families.items() if family.type == "histogram"}
    return [name for name in sorted(set(METRIC_NAME.findall(text))) if name not in families
            and not any(name.endswith(s) and name.removesuffix(s) in histograms for s in HISTOGRAM_SAMPLES)]


def test_every_metric_name_in_the_docs_exists() -> None:
    """Queries and prose too, not only the catalogue."""
    for path in ("docs/OBSERVABILITY.md", "README.md"):
        assert not _unknown_metrics((ROOT / path).read_text()), f"{path} names metrics no code exposes"


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
    for name in ("prometheus", "grafana", "jaeger"):
        assert services[name]["profiles"] == ["observability"], name


def test_every_published_port_is_on_loopback_only() -> None:
    """Nothing in the compose fleet asks for a password (the gateway and the Tinker API run in open mode)."""
    services = _compose("docker-compose.yml")
    assert services["gateway"]["environment"]["FLEETRL_GATEWAY_OPEN_MODE"] == "true"
    assert services["tinker"]["environment"]["FLEETRL_TINKER_OPEN_MODE"] == "true"
    published = {name: svc["ports"] for name, svc in services.items() if "ports" in svc}
    assert set(published) == {"gateway", "tinker", "prometheus", "grafana", "jaeger"}
    for name, ports in published.items():
        assert all(port.startswith("127.0.0.1:") for port in ports), f"{name} publishes {ports} beyond this host"


def test_grafana_is_provisioned_with_prometheus_and_the_fleet_dashboard() -> None:
    services = _compose("docker-compose.yml")
    grafana = services["grafana"]
    mounts = {target: ROOT / source for source, target, _ in (volume.split(":") for volume in grafana["volumes"])}
    provisioning = mounts["/etc/grafana/provisioning"]
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    [prometheus_port] = [port.rsplit(":", 1)[1] for port in services["prometheus"]["ports"]]
    assert (source["type"], source["url"], source["isDefault"]) == (
        "prometheus", f"http://prometheus:{prometheus_port}", True)
    assert "prometheus" in grafana["depends_on"]

    [provider] = yaml.safe_load((provisioning / "dashboards" / "fleetrl.yml").read_text())["providers"]
    dashboards = mounts[provider["options"]["path"]]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    dashboard = json.loads((dashboards / home.rsplit("/", 1)[1]).read_text())
    targets = [target for panel in dashboard["panels"] for target in panel["targets"]]
    assert {panel["datasource"]["uid"] for panel in dashboard["panels"]} == {source["uid"]}
    assert {target["datasource"]["uid"] for target in targets} == {source["uid"]}
    queries = "\n".join(target["expr"] for target in targets)
    assert not _unknown_metrics(queries), "the dashboard queries metrics no code exposes"
    for key in ("fleetrl_actor_generated_tokens_total", "fleetrl_learner_policy_version", "fleetrl_task_queue_pending",
                "fleetrl_learner_reward_mean", "fleetrl_learner_staleness_versions_bucket",
                "fleetrl_learner_phase_seconds_sum", "fleetrl_tinker_http_seconds_bucket",
                "fleetrl_tinker_work_seconds_sum", "fleetrl_tinker_training_runs",
                "fleetrl_actor_tinker_samples_total"):
        assert key in queries, f"the dashboard does not show {key}"


def test_tracing_override_points_every_service_at_jaeger() -> None:
    base, tracing = _compose("docker-compose.yml"), _compose("docker-compose.tracing.yml")
    assert set(tracing) == set(FLEETRL)
    assert "127.0.0.1:4317:4317" in base["jaeger"]["ports"]
    for name, service in tracing.items():
        assert service["environment"]["FLEETRL_TRACING"] == "1", name
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name
        assert "otlp" in service["build"]["args"]["INSTALL_EXTRAS"], name
