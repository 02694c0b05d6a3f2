"""The operator's view of every tenant's sessions: per-tenant gauges on the Tinker service's metrics port,
exact against what each tenant holds, down again when a session is closed or reaped; the tenant-facing
API still shows each tenant its own sessions only, and has no route to the gauges."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from fleetrl.launcher.embedded import free_port
from fleetrl.services.tinker.client import TinkerClient
from fleetrl.services.tinker.metrics import TenantGauges, registry
from fleetrl.tinker.requests import RequestLog
from fleetrl.tinker.service import Limits, TinkerService
from fleetrl.tinker.types import LoraRequest
from tests.observability.obs_fleet import scrape
from tests.tinker.conftest import KEYS, MODEL, TinkerServer

FIGURES = ("sessions", "training_runs", "sampling_sessions", "requests_queued", "requests_running")


def figures(port: int, tenant: str) -> tuple[float, ...]:
    samples = scrape(port)
    return tuple(samples[(f"fleetrl_tinker_{name}", (("tenant", tenant),))] for name in FIGURES)


def test_the_metrics_port_shows_each_tenants_sessions_and_runs_against_the_quotas(tmp_path: Path) -> None:
    port = free_port()
    server = TinkerServer(tmp_path, metrics_port=port, max_sessions_per_tenant=3,
                          max_training_runs_per_tenant=2).start()
    try:
        alice_1, alice_2, bob = server.client("alice"), server.client("alice"), server.client("bob")
        alice_1.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
        alice_1.create_sampling_client(base_model=MODEL)
        alice_2.create_sampling_client(base_model=MODEL)
        bob.create_sampling_client(base_model=MODEL)  # the SDK opens a client's session at its first call
        samples = scrape(port)
        assert figures(port, "alice") == (2, 1, 2, 0, 0)
        assert figures(port, "bob") == (1, 0, 1, 0, 0)
        assert (samples[("fleetrl_tinker_max_sessions_per_tenant", ())],
                samples[("fleetrl_tinker_max_training_runs_per_tenant", ())]) == (3, 2)
        assert samples[("fleetrl_tinker_adapter_bytes", (("tenant", "alice"),))] > 0
        assert samples[("fleetrl_tinker_adapter_bytes", (("tenant", "bob"),))] == 0
        assert 0 <= samples[("fleetrl_tinker_last_request_age_seconds", (("tenant", "alice"),))] < 60

        # each tenant's own listing: its sessions only; the API port has no operator route
        assert {s.tenant for s in TinkerClient(server.url, KEYS["alice"]).sessions()} == {"alice"}
        assert [(s.tenant, s.training_runs) for s in TinkerClient(server.url, KEYS["bob"]).sessions()] == [("bob", 0)]
        request = urllib.request.Request(f"{server.url}/metrics", headers={"X-API-Key": KEYS["alice"]})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 404

        alice_1.close("success").result()  # its run and its sampling session go with it
        assert figures(port, "alice") == (1, 0, 1, 0, 0)
        bob.close("success").result()
        assert figures(port, "bob") == (0, 0, 0, 0, 0)  # listed while the token table names bob
        assert ("fleetrl_tinker_last_request_age_seconds", (("tenant", "bob"),)) not in scrape(port)
        alice_2.close("success").result()
    finally:
        server.stop()
    with pytest.raises(OSError):  # the metrics port went with the server
        scrape(port)


class Held(concurrent.futures.Executor):
    """An executor that never runs its work: a request stays queued."""

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        return concurrent.futures.Future()


def gauges(service: TinkerService) -> CollectorRegistry:
    return registry(TenantGauges(service, ("alice", "bob")))


def value(served: CollectorRegistry, name: str, tenant: str) -> float | None:
    return served.get_sample_value(f"fleetrl_tinker_{name}", {"tenant": tenant})


def test_a_reaped_session_leaves_the_operators_figures(tmp_path: Path) -> None:
    service = TinkerService(Limits((MODEL,), (), tmp_path, 64, 64, 4, 8, 8), RequestLog(Held()))
    served = gauges(service)
    silent, live = service.create_session("alice"), service.create_session("bob")
    service.create_model("alice", silent, 0, MODEL, LoraRequest(rank=4, seed=0))  # queued, never run
    service.create_sampling_session("alice", silent, MODEL, None)
    assert [value(served, n, "alice") for n in FIGURES] == [1, 1, 1, 1, 0]
    assert [value(served, n, "bob") for n in FIGURES] == [1, 0, 0, 0, 0]
    later = time.monotonic() + 301
    service.heartbeat("bob", live).last_seen = later - 10
    assert service.reap(300, now=later) == [silent]
    # the queued creation stays counted as a request until its work ends; its quota place went with the session
    assert [value(served, n, "alice") for n in FIGURES] == [0, 1, 0, 1, 0]
    assert [value(served, n, "bob") for n in FIGURES] == [1, 0, 0, 0, 0]
    assert service.sessions("bob")[0].session_id == live and service.sessions("alice") == []


def test_a_running_request_and_a_trained_runs_bytes_are_counted(tmp_path: Path) -> None:
    service = TinkerService(Limits((MODEL,), (), tmp_path, 64, 64, 4, 8, 8),
                            RequestLog(concurrent.futures.ThreadPoolExecutor(1)))
    session = service.create_session("alice")
    created = service.create_model("alice", session, 0, MODEL, LoraRequest(rank=4, seed=0))
    created.future.result()
    run = service.run("alice", created.extra["model_id"])
    adapter = sum(p.numel() * p.element_size() for p in run.model.parameters() if p.requires_grad)
    served = gauges(service)
    assert value(served, "adapter_bytes", "alice") == adapter  # no gradient nor moments before a step
    release = threading.Event()
    blocking = service.log.submit("bob", ("held", 0), "Test", release.wait)
    service.log.submit("alice", ("held", 1), "Test", lambda: None)  # queued behind bob's
    deadline = time.monotonic() + 10
    while not blocking.future.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (value(served, "requests_running", "bob"), value(served, "requests_queued", "alice")) == (1, 1)
    release.set()
    blocking.future.result(10)
    service.log.submit("alice", ("held", 2), "Test", lambda: None).future.result(10)
    assert [value(served, n, t) for n in ("requests_queued", "requests_running") for t in ("alice", "bob")] == [0] * 4
