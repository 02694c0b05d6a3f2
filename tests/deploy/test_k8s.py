"""deploy/k8s agrees with Kubernetes, KEDA and the code.

No cluster runs here. Each overlay (and an overlay of every component together) is rendered by the
real kustomize in kubectl, every object is checked against its schema (k8s_objects), and, as
tests/fleet/test_compose.py does for compose: every fleetrl container runs a real `fleetrl`
subcommand, every FLEETRL_<SERVICE>_<FIELD> names a real setting and the values validate, each
gRPC service is probed through the gRPC health service on the port it listens on, names that
objects use (Service selectors and ports, volumes, claims) exist, and the KEDA trigger reads the
gateway's backlog gauge where the gateway serves it.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from k8s_objects import K8S, NEEDS_KUBECTL, find, problems, render

from fleetrl.launcher import credentials
from fleetrl.launcher.configdoc import SERVICES
from fleetrl.launcher.main import ROUTES
from fleetrl.services.gateway.server import TASK_BACKLOG
from fleetrl.spec.config import load_settings

pytestmark = NEEDS_KUBECTL

OVERLAYS = ["cpu", "gpu", "ha"]
COMPONENTS = sorted(p.name for p in (K8S / "components").iterdir())
SETTINGS = {name: (cls, prefix) for name, cls, prefix in SERVICES}
GRPC_SERVICES = {"gateway", "replay", "reward", "learner"}
HTTP_SERVICES = {"tinker": "/api/v1/healthz"}
"""Services that serve HTTP, with the unauthenticated path their probes read."""


def overlay_of(tmp_path: Path, components: list[str], patches: list[dict[str, Any]] | None = None) -> Path:
    """A kustomization in tmp_path: the base plus components (paths must be relative for kustomize)."""
    rel = Path(os.path.relpath(K8S, tmp_path))
    kustomization = {"resources": [str(rel / "base")], "components": [str(rel / "components" / c) for c in components],
                     "patches": patches or []}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return tmp_path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    every = overlay_of(tmp_path_factory.mktemp("all"), COMPONENTS)
    return {**{name: render(K8S / "overlays" / name) for name in OVERLAYS}, "all-components": render(every)}


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(o, o["spec"]["template"]["spec"]) for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def fleetrl_containers(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(service, container) of every container running the fleetrl image."""
    return [(service, container) for service, container, _ in fleetrl_pods(objects)]


def fleetrl_pods(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(service, container, pod spec) of every container running the fleetrl image."""
    out = []
    for _, spec in pod_specs(objects):
        for container in spec["containers"]:
            if container["image"].split(":")[0].endswith("fleetrl"):
                args = container.get("args", [])
                service = args[args.index("fleetrl") + 1] if "command" in container else args[0]
                out.append((service, container, spec))
    return out


def secret_file(container: dict[str, Any], spec: dict[str, Any], path: str) -> str:
    """The key of the Secret fleetrl-infra that a container reads at path (a mounted item of it)."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret", {})
        if secret.get("secretName") == "fleetrl-infra" and path.startswith(mount["mountPath"] + "/"):
            items = {item["path"]: item["key"] for item in secret["items"]}
            return items[path[len(mount["mountPath"]) + 1:]]
    raise AssertionError(f"{path} is no item of a mounted fleetrl-infra secret")


@pytest.mark.parametrize("overlay", [*OVERLAYS, "all-components"])
def test_every_object_validates(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = rendered[overlay]
    found = {f"{o['kind']}/{o['metadata']['name']}: {p}" for o in objects for p in problems(o)}
    assert not found, "\n".join(sorted(found))
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"fleetrl"}
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("StatefulSet", "nats"), ("StatefulSet", "redis"), ("StatefulSet", "learner"), ("Deployment", "actor"),
            ("Deployment", "gateway"), ("Deployment", "replay"), ("Deployment", "reward")} <= kinds
    autoscalers = [o for o in objects if o["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]
    assert len(autoscalers) == 1, "exactly one autoscaler owns the actors"


def test_schema_check_refuses_what_the_api_server_would(rendered: dict[str, list[dict[str, Any]]]) -> None:
    gateway = find(rendered["cpu"], "Deployment", "gateway")
    assert problems(gateway) == []
    container = lambda obj: obj["spec"]["template"]["spec"]["containers"][0]  # noqa: E731
    breakages = [
        lambda o: container(o).__setitem__("readinesProbe", container(o).pop("readinessProbe")),
        lambda o: container(o)["ports"][0].__setitem__("containerport", container(o)["ports"][0].pop("containerPort")),
        lambda o: container(o)["livenessProbe"]["grpc"].__setitem__("port", "50051"),
        lambda o: o["spec"].__setitem__("replicas", "2"),
        lambda o: container(o).pop("name"),
    ]
    for breakage in breakages:
        broken = copy.deepcopy(gateway)
        breakage(broken)
        assert problems(broken), "a broken Deployment passed"

    scaled = find(rendered["cpu"], "ScaledObject", "actor")
    assert problems(scaled) == []
    for breakage in [
        lambda o: o["spec"].__setitem__("minReplicas", o["spec"].pop("minReplicaCount")),
        lambda o: o["spec"]["triggers"][-1]["metadata"].__setitem__("value", 70),
        lambda o: o["spec"]["triggers"][0]["metadata"].__setitem__("targetValue", "two"),
        lambda o: o["spec"]["triggers"][0]["metadata"].__setitem__("format", "openmetrics"),
        lambda o: o["spec"].__setitem__("fallback", {"failureThreshold": 3, "replicas": 2}),
        lambda o: o["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"].__setitem__(
            "stabilisationWindowSeconds", 300),
        lambda o: o["spec"].__setitem__("triggers", []),
    ]:
        broken = copy.deepcopy(scaled)
        breakage(broken)
        assert problems(broken), "a broken ScaledObject passed"


@pytest.mark.parametrize("overlay", [*OVERLAYS, "all-components"])
def test_containers_run_real_entry_points_with_real_settings(rendered: dict[str, list[dict[str, Any]]],
                                                             overlay: str, tmp_path: Path) -> None:
    """... and every service that talks to NATS or Redis logs in with the Secret fleetrl-infra's files (as
    `fleetrl secrets --kubernetes` makes them); the reward service, which runs user code, mounts none."""
    containers = fleetrl_pods(rendered[overlay])
    assert {service for service, _, _ in containers} == set(SETTINGS)
    made = json.loads(credentials.kubernetes_secret("fleetrl-infra"))["stringData"]
    for service, container, spec in containers:
        if "command" in container:  # torchrun running the same entry point: `torchrun --no-python fleetrl learner`
            assert container["command"] == ["torchrun"] and container["args"][0] == "--no-python", container
        module, keeps_name, _ = ROUTES[service]
        assert module == f"fleetrl.services.{service}.__main__" and not keeps_name
        cls, prefix = SETTINGS[service]
        values = {}
        for variable in container.get("env", []):
            name = variable["name"]
            if name.startswith("PET_"):  # torchrun's own options, read from PET_<OPTION>
                assert container.get("command") == ["torchrun"], name
                assert name[4:].lower() in torchrun_options(), f"{name} is not a torchrun option"
                continue
            assert name.startswith(prefix), f"{service}: {name} is not {prefix}*"
            field = name[len(prefix):].lower().split("__")[0]
            assert field in cls.model_fields, f"{name} is not a setting of {service}"
            values[name] = variable["value"]
            if field.endswith("_credentials_file"):  # the Secret's item, as the pod mounts it, here
                key = secret_file(container, spec, variable["value"])
                assert key == field.removesuffix("_credentials_file"), name
                values[name] = str(tmp_path / key)
                (tmp_path / key).write_text(made[key])
        for server in ("nats", "redis"):
            if f"{prefix}{server.upper()}_URL" in values:
                assert f"{prefix}{server.upper()}_CREDENTIALS_FILE" in values, f"{service} does not log in to {server}"
        infra = [v["secret"] for v in spec.get("volumes", [])
                 if v.get("secret", {}).get("secretName") == "fleetrl-infra"]
        if service == "reward":  # it runs user code: no credentials at all
            assert not infra
        if service == "tinker":  # its samples go to the actors through NATS: NATS's credentials, not Redis's
            assert [item["key"] for secret in infra for item in secret["items"]] == ["nats"]
        settings = load_settings(cls, env_prefix=prefix, environ=values)  # the values validate too
        if service in GRPC_SERVICES:
            assert settings.listen.startswith("0.0.0.0:"), f"{service} must listen on every interface"


def torchrun_options() -> set[str]:
    from torch.distributed.run import get_args_parser

    return {action.dest for action in get_args_parser()._actions}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_servers_are_probed_through_their_health_endpoints(rendered: dict[str, list[dict[str, Any]]],
                                                           overlay: str) -> None:
    for service, container in fleetrl_containers(rendered[overlay]):
        prefix = SETTINGS[service][1]
        env = {v["name"]: v.get("value") for v in container.get("env", [])}
        if service not in GRPC_SERVICES and service not in HTTP_SERVICES:
            assert f"{prefix}LISTEN" not in env and not any(k in container for k in ("livenessProbe", "readinessProbe"))
            continue
        port = int(env[f"{prefix}LISTEN"].rsplit(":", 1)[1])
        ports = {p["containerPort"]: p.get("name") for p in container["ports"]}
        assert port in ports
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if service in HTTP_SERVICES:
                assert container[probe]["httpGet"] == {"path": HTTP_SERVICES[service], "port": ports[port]}, probe
            else:
                assert container[probe]["grpc"] == {"port": port}, f"{service} {probe}"


@pytest.mark.parametrize("overlay", [*OVERLAYS, "all-components"])
def test_references_resolve(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = rendered[overlay]
    pods = [(o["spec"]["template"]["metadata"]["labels"], spec) for o, spec in pod_specs(objects)]
    claims = {o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolumeClaim"}
    config_maps = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
    for service in (o for o in objects if o["kind"] == "Service"):
        selected = [spec for labels, spec in pods if service["spec"]["selector"].items() <= labels.items()]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        named = {p.get("name") for spec in selected for c in spec["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in named, f"{service['metadata']['name']}: no container port {port['targetPort']}"
    for owner, spec in pod_specs(objects):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        templates = {t["metadata"]["name"] for t in owner["spec"].get("volumeClaimTemplates", [])}
        for container in spec["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, mount
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps


def test_reward_pods_get_what_the_sandbox_needs_and_no_more(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["cpu"]
    spec = find(objects, "Deployment", "reward")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    context = container["securityContext"]
    assert context["runAsUser"] == 0  # private uids are used only by a root service (sandbox.UidPool)
    assert context["capabilities"]["drop"] == ["ALL"]
    assert set(context["capabilities"]["add"]) == {"SYS_ADMIN", "NET_ADMIN", "SETUID", "SETGID", "CHOWN",
                                                   "DAC_OVERRIDE", "KILL"}
    # the jail mounts, so the service runs unconfined by the runtime; its workers load their own filter
    assert context["seccompProfile"] == context["appArmorProfile"] == {"type": "Unconfined"}
    assert not context.get("privileged")
    assert spec["automountServiceAccountToken"] is False and not spec.get("shareProcessNamespace")
    policy = find(objects, "NetworkPolicy", "reward-no-egress")["spec"]
    assert policy["policyTypes"] == ["Egress"] and policy["egress"] == []
    labels = find(objects, "Deployment", "reward")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    for service, other in fleetrl_containers(objects):
        if service != "reward":
            assert other["securityContext"]["capabilities"] == {"drop": ["ALL"]}, service
            assert other["securityContext"]["allowPrivilegeEscalation"] is False, service


def test_one_backlog_trigger_scales_the_actors_on_every_jobs_tasks(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """KEDA reads the gateway's fleet-wide backlog gauge from the gateway Service's metrics port: the
    URL's host, port and family name match what the gateway serves (tests/deploy/test_k8s_infra.py reads
    that URL from a real gateway)."""
    for overlay in OVERLAYS:
        objects = rendered[overlay]
        scaled = find(objects, "ScaledObject", "actor")
        [backlog] = [t for t in scaled["spec"]["triggers"] if t["type"] == "metrics-api"]
        url = urlsplit(backlog["metadata"]["url"])
        gateway = find(objects, "Service", "gateway")
        assert url.hostname == f"gateway.{gateway['metadata']['namespace']}.svc.cluster.local"
        [metrics] = [p for p in gateway["spec"]["ports"] if p["name"] == "metrics"]
        assert url.port == metrics["port"]
        container = find(objects, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert int(env["FLEETRL_GATEWAY_METRICS_PORT"]) in {p["containerPort"] for p in container["ports"]
                                                          if p["name"] == metrics["targetPort"]}
        assert backlog["metadata"]["format"] == "prometheus"
        assert backlog["metadata"]["valueLocation"] == TASK_BACKLOG._name
        assert parse_qs(url.query)["name[]"] == [TASK_BACKLOG._name]
        assert [t["type"] for t in scaled["spec"]["triggers"]] == ["metrics-api", "cpu"]
        # the cpu trigger of KEDA's HPA needs a CPU request on the target's containers
        actor = find(objects, "Deployment", "actor")["spec"]["template"]["spec"]["containers"][0]
        assert "cpu" in actor["resources"]["requests"]
        assert "replicas" not in find(objects, "Deployment", "actor")["spec"], "the autoscaler owns the count"


def test_redis_cannot_evict_and_nats_keeps_jetstream_on_volumes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay in OVERLAYS:
        objects = rendered[overlay]
        redis = find(objects, "StatefulSet", "redis")
        args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
        assert args[args.index("--appendonly") + 1] == "yes"
        nats = find(objects, "StatefulSet", "nats")
        for workload in (redis, nats):
            assert workload["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    ha = find(rendered["ha"], "StatefulSet", "nats")
    args = ha["spec"]["template"]["spec"]["containers"][0]["args"]
    routes = next(a for a in args if a.startswith("--routes=")).removeprefix("--routes=").split(",")
    assert ha["spec"]["replicas"] == 3 and len(routes) == 3
    assert routes == [f"nats://nats-{i}.{ha['spec']['serviceName']}:6222" for i in range(3)]
