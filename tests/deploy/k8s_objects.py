"""Render deploy/k8s with kustomize and check each object against its schema.

Rendering uses the real kustomize built into `kubectl` (`kubectl kustomize DIR`, offline). Built-in
kinds are checked against the `kubernetes` package's typed models: from version 37 they are
pydantic models generated from the Kubernetes OpenAPI document with `extra="forbid"` and strict
types, so `model_validate` refuses an unknown (misspelled) field, a wrong type and a missing required
field at any depth. (Its `from_dict`/`ApiClient.deserialize` would drop unknown keys silently.)
KEDA's ScaledObject is a CRD the package does not know: `scaled_object_problems` checks it against
KEDA's documented spec (keda.sh/v1alpha1) and the rules KEDA's admission webhook enforces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes.client
import pydantic
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
NEEDS_KUBECTL = pytest.mark.skipif(KUBECTL is None and os.environ.get("CI") != "true",
                                   reason="kubectl (kustomize) not installed; CI requires it")
JOB = "j-0123456789ab"
"""A job id as the gateway makes them, for the job trigger."""


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` prints (kustomize built into kubectl; no cluster)."""
    assert KUBECTL, "kubectl (with its built-in kustomize) is not installed"
    out = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of that kind and name."""
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def model_class(obj: dict[str, Any]) -> type[pydantic.BaseModel]:
    """The typed model of a built-in kind: apps/v1 Deployment -> V1Deployment."""
    version = obj["apiVersion"].rsplit("/", 1)[-1]
    cls = getattr(kubernetes.client, version.capitalize() + obj["kind"], None)
    assert isinstance(cls, type) and issubclass(cls, pydantic.BaseModel), f"no model of {obj['kind']}"
    return cls


def problems(obj: dict[str, Any]) -> list[str]:
    """Every schema problem of one rendered object, as 'path: message' lines (none: valid)."""
    if obj.get("apiVersion") == "keda.sh/v1alpha1" and obj.get("kind") == "ScaledObject":
        return scaled_object_problems(obj)
    try:
        model_class(obj).model_validate(obj)
    except pydantic.ValidationError as error:
        return [f"{'.'.join(str(p) for p in item['loc'])}: {item['msg']}" for item in error.errors()]
    return []


# ----------------------------------------------------------------------------- KEDA ScaledObject

_SPEC = {"scaleTargetRef": dict, "pollingInterval": int, "cooldownPeriod": int, "initialCooldownPeriod": int,
         "idleReplicaCount": int, "minReplicaCount": int, "maxReplicaCount": int, "fallback": dict,
         "advanced": dict, "triggers": list}
_TARGET = {"name": str, "apiVersion": str, "kind": str, "envSourceContainerName": str}
_TRIGGER = {"type": str, "name": str, "metadata": dict, "authenticationRef": dict, "metricType": str,
            "useCachedMetrics": bool}
_FALLBACK = {"failureThreshold": int, "replicas": int, "behavior": str}
_ADVANCED = {"restoreToOriginalReplicaCount": bool, "horizontalPodAutoscalerConfig": dict, "scalingModifiers": dict}
_HPA_CONFIG = {"name": str, "behavior": dict}
METRIC_TYPES = {"AverageValue", "Value", "Utilization"}
# Trigger metadata KEDA reads, by trigger type: (required keys, optional keys). Every value is a string.
TRIGGER_METADATA = {
    "nats-jetstream": ({"natsServerMonitoringEndpoint", "account", "stream", "consumer"},
                       {"lagThreshold", "activationLagThreshold", "useHttps"}),
    "cpu": ({"value"}, {"containerName"}),
    "metrics-api": ({"url", "valueLocation", "targetValue"},
                    {"format", "activationTargetValue", "unsafeSsl", "authMode"}),
}
METRICS_API_FORMATS = {"json", "xml", "yaml", "prometheus"}


def _fields(value: Any, schema: dict[str, type], path: str, required: tuple[str, ...] = ()) -> list[str]:
    if not isinstance(value, dict):
        return [f"{path}: expected an object"]
    out = [f"{path}.{key}: required" for key in required if key not in value]
    for key, item in value.items():
        if key not in schema:
            out.append(f"{path}.{key}: unknown field")
        elif not isinstance(item, schema[key]) or (schema[key] is int and isinstance(item, bool)):
            out.append(f"{path}.{key}: expected {schema[key].__name__}")
    return out


def _trigger_problems(trigger: Any, path: str) -> list[str]:
    out = _fields(trigger, _TRIGGER, path, ("type", "metadata"))
    if out:
        return out
    if trigger.get("metricType", "AverageValue") not in METRIC_TYPES:
        out.append(f"{path}.metricType: one of {sorted(METRIC_TYPES)}")
    metadata = trigger["metadata"]
    out += [f"{path}.metadata.{k}: values are strings" for k, v in metadata.items() if not isinstance(v, str)]
    if trigger["type"] not in TRIGGER_METADATA:
        return [*out, f"{path}.type: {trigger['type']!r} is not a trigger type checked here"]
    needed, optional = TRIGGER_METADATA[trigger["type"]]
    out += [f"{path}.metadata.{k}: required" for k in sorted(needed - set(metadata))]
    out += [f"{path}.metadata.{k}: unknown key" for k in sorted(set(metadata) - needed - optional)]
    if trigger["type"] == "cpu" and trigger.get("metricType") not in ("Utilization", "AverageValue"):
        out.append(f"{path}.metricType: a cpu trigger needs Utilization or AverageValue")
    for key in ("lagThreshold", "activationLagThreshold", "value"):
        if key in metadata and not str(metadata[key]).isdigit():
            out.append(f"{path}.metadata.{key}: not a whole number")
    for key in ("targetValue", "activationTargetValue"):
        if key in metadata and not _is_number(str(metadata[key])):
            out.append(f"{path}.metadata.{key}: not a number")
    if metadata.get("format", "json") not in METRICS_API_FORMATS:
        out.append(f"{path}.metadata.format: one of {sorted(METRICS_API_FORMATS)}")
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def scaled_object_problems(obj: dict[str, Any]) -> list[str]:
    """KEDA's ScaledObject spec, plus the webhook's rules: min <= max, no fallback with a cpu trigger."""
    out = _fields({k: v for k, v in obj.items() if k not in ("apiVersion", "kind")},
                  {"metadata": dict, "spec": dict}, "", ("metadata", "spec"))
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return out
    out += _fields(spec, _SPEC, "spec", ("scaleTargetRef", "triggers"))
    out += _fields(spec.get("scaleTargetRef", {}), _TARGET, "spec.scaleTargetRef", ("name",))
    triggers = spec.get("triggers")
    if not isinstance(triggers, list) or not triggers:
        out.append("spec.triggers: at least one trigger")
        triggers = []
    for i, trigger in enumerate(triggers):
        out += _trigger_problems(trigger, f"spec.triggers[{i}]")
    if "fallback" in spec:
        out += _fields(spec["fallback"], _FALLBACK, "spec.fallback", ("failureThreshold", "replicas"))
        if any(isinstance(t, dict) and t.get("type") in ("cpu", "memory") for t in triggers):
            out.append("spec.fallback: KEDA refuses a fallback on a ScaledObject with a cpu or memory trigger")
    advanced = spec.get("advanced", {})
    out += _fields(advanced, _ADVANCED, "spec.advanced")
    hpa = advanced.get("horizontalPodAutoscalerConfig", {}) if isinstance(advanced, dict) else {}
    out += _fields(hpa, _HPA_CONFIG, "spec.advanced.horizontalPodAutoscalerConfig")
    if isinstance(hpa, dict) and "behavior" in hpa:
        try:
            kubernetes.client.V2HorizontalPodAutoscalerBehavior.model_validate(hpa["behavior"])
        except pydantic.ValidationError as error:
            out += [f"spec.advanced.horizontalPodAutoscalerConfig.behavior: {error.errors()[0]['msg']}"]
    low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if isinstance(low, int) and isinstance(high, int) and low > high:
        out.append("spec: minReplicaCount must not exceed maxReplicaCount")
    return out
