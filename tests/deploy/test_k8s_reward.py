"""The reward pods' securityContext is enough for the sandbox: a real service with exactly those capabilities.

`fleetrl reward` runs as root under `setpriv --bounding-set`, holding only the capabilities the
rendered reward container adds, with the container's FLEETRL_REWARD_* settings (listen address,
metrics port, uid range and temp dir made local). A reward file then reports from inside its
worker: its uid (a private one from the range), its pid (at most 2 in its own PID namespace: as root,
bwrap's init is PID 1) and its network interfaces (only `lo`: its own network namespace). Needs root
and setpriv, as the pod does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from k8s_objects import K8S, NEEDS_KUBECTL, find, render

from fleetrl.launcher.embedded import free_port, wait_for_port
from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from fleetrl.reward.client import spec_to_proto
from fleetrl.runtime.grpcutil import channel
from fleetrl.spec.config import RewardSpec
from tests import sandbox_uids

pytestmark = [NEEDS_KUBECTL, pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                                reason="needs root and setpriv, like the reward pod")]

UID_BASE = sandbox_uids.claim()  # sandbox uids of this module, apart from every other's
REPORTER = """
import os
def reward(completion, prompt, **meta):
    with open("/proc/net/dev") as f:
        interfaces = [line.split(":")[0].strip() for line in f.read().splitlines()[2:]]
    return {"uid": float(os.getuid()), "pid": float(os.getpid()), "interfaces": float(len(interfaces)),
            "only_lo": float(interfaces == ["lo"])}
"""


async def test_workers_get_every_isolation_layer_with_the_pods_capabilities(tmp_path: Path) -> None:
    reward = find(render(K8S / "overlays" / "cpu"), "Deployment", "reward")
    (container,) = reward["spec"]["template"]["spec"]["containers"]
    context = container["securityContext"]
    assert context["runAsUser"] == 0 and context["capabilities"]["drop"] == ["ALL"]
    bounding = ",".join(["-all", *(f"+{cap.lower()}" for cap in context["capabilities"]["add"])])
    port = free_port()
    env = {v["name"]: v["value"] for v in container["env"]}
    env |= {"FLEETRL_REWARD_LISTEN": f"127.0.0.1:{port}", "FLEETRL_REWARD_METRICS_PORT": "0",
            "FLEETRL_REWARD_SANDBOX_UID_BASE": str(UID_BASE), "FLEETRL_REWARD_SANDBOX_DIR": str(tmp_path)}
    env |= {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "HOME") if k in os.environ}
    command = ["setpriv", f"--bounding-set={bounding}", sys.executable, "-m", "fleetrl.launcher.main",
               *container["args"]]
    log = tmp_path / "reward.log"
    with log.open("wb") as out:
        service = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, 60, service)
        spec = spec_to_proto(RewardSpec(file="reward.py", timeout_per_item_s=10), REPORTER.encode())
        async with channel(f"127.0.0.1:{port}") as chan:
            reply = await reward_pb2_grpc.RewardServiceStub(chan).Score(reward_pb2.ScoreRequest(
                job_id="j", spec=spec, items=[reward_pb2.ScoreItem(completion="c", prompt="p", metadata_json="{}")]),
                timeout=60)
    finally:
        service.terminate()
        service.wait(30)
    (result,) = reply.results
    assert result.status == common_pb2.REWARD_STATUS_OK, result.reason
    seen = dict(result.components)
    assert UID_BASE <= seen["uid"] < UID_BASE + 60_000, seen
    assert seen["pid"] <= 2 and seen["only_lo"] == 1, seen  # as root, bwrap's init is PID 1 and the worker 2
    isolation = next(line for line in log.read_text().splitlines() if "isolation" in line)
    active = isolation.split("isolation ", 1)[1].split(";")[0].split()
    assert {"netns", "pidns", "dropped_uid", "audit_hook"} <= set(active), isolation
