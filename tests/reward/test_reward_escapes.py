"""Reward files that start processes the service did not ask for: each one, and everything it
started, is gone within 1 s of the call that left them running (user code must not outlive its call:
the worker is replaced), or within timeout + 1 s of an item that hangs, while the same service keeps
serving.

The processes escape the worker's process group (setsid, setpgid) or are created through
`_posixsubprocess.fork_exec`, which raises no audit event, so the audit hook cannot stop them; the
kernel layers and the kill must. In the jail the seccomp filter refuses the fork (and the worker
leads its session already); in the legacy sandbox the processes start and the kill must find them.
The census counts processes by the worker's private uid, which exists only when the service runs as root.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from tests.reward.conftest import file_spec, items, reward_service, uid_processes

OK, TIMEOUT = common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_TIMEOUT
BENIGN = "def reward(completion, prompt, **meta):\n    return float(completion.strip() == meta['answer'])\n"
MAX_PROCESSES = 8
TIMEOUT_S = 1.0

# A fork bomb bounded to 4 + 4 * 2**4 processes should every limit fail, so a broken sandbox cannot
# take the test machine down. Each exec'd child runs without the audit hook, forks freely and puts
# every new process in a session of its own.
BOMB_CHILD = """
import os, time
for _ in range(4):
    try:
        if os.fork() == 0:
            os.setsid()
    except OSError:
        break
time.sleep(1e9)
"""
FORK_EXEC = """
def escape():
    import _posixsubprocess
    started = 0
    for _ in range(4):
        errpipe_read, errpipe_write = os.pipe()
        try:
            _posixsubprocess.fork_exec(
                [sys.executable, "-I", "-c", BOMB_CHILD], [os.fsencode(sys.executable)], True, (), None,
                [b"PATH=/usr/bin:/bin"], -1, -1, -1, -1, -1, -1, errpipe_read, errpipe_write, True, True,
                -1, None, None, None, -1, None, False)  # CPython 3.11's argument list
            started += 1
        except OSError:
            break
        finally:
            os.close(errpipe_read)
            os.close(errpipe_write)
    return started
"""
ESCAPES = {  # in the jail the worker leads its session already: setsid and setpgid refuse
    "setsid": "def escape():\n    try:\n        os.setsid()\n    except OSError:\n        pass\n    return 0\n",
    "setpgid": "def escape():\n    try:\n        os.setpgid(0, 0)\n    except OSError:\n        pass\n    return 0\n",
    "fork_exec_bomb": FORK_EXEC,
}
TEMPLATE = """
import os, sys, time
BOMB_CHILD = {bomb_child!r}
{escape}
def reward(completion, prompt, **meta):
    if meta.get("probe"):
        return {{"uid": os.getuid(), "started": escape()}}
    time.sleep(1e9)
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the census counts processes by a worker's private uid")


def escape_source(case: str) -> str:
    return TEMPLATE.format(bomb_child=BOMB_CHILD, escape=ESCAPES[case])


async def score_one(stub: reward_pb2_grpc.RewardServiceStub, spec: reward_pb2.RewardSpec,
                    meta: dict[str, object]) -> reward_pb2.ScoreResult:
    reply = await stub.Score(reward_pb2.ScoreRequest(job_id="j", spec=spec, items=items(("x", meta))), timeout=20)
    return reply.results[0]


async def gone(uid: int, within_s: float) -> list[int]:
    """The uid's processes still alive after within_s (polled without blocking the service's loop)."""
    deadline = time.monotonic() + within_s
    while (left := uid_processes(lambda u: u == uid)) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return left


@pytest.mark.parametrize(("case", "mode", "namespaces"), [
    ("setsid", "jail", True), ("fork_exec_bomb", "jail", True),
    ("setsid", "legacy", True), ("setpgid", "legacy", True),  # without a PID namespace the worker leads its session
    ("fork_exec_bomb", "legacy", True), ("fork_exec_bomb", "legacy", False)])
async def test_escaped_processes_die_with_their_worker(case: str, mode: str, namespaces: bool, tmp_path: Path) -> None:
    async with reward_service(tmp_path, workers_per_pool=1, worker_max_processes=MAX_PROCESSES,
                              sandbox_mode=mode, worker_namespaces=namespaces) as stub:
        spec = file_spec(escape_source(case), timeout_s=TIMEOUT_S)
        probe = await score_one(stub, spec, {"probe": True})
        assert probe.status == OK, probe.reason
        uid, started = int(probe.components["uid"]), int(probe.components["started"])
        if case == "fork_exec_bomb" and mode == "jail":
            assert started == 0, "the seccomp filter let fork_exec start a process"
        elif case == "fork_exec_bomb":
            assert started >= 1, "fork_exec started no process"
            left = await gone(uid, within_s=1.0)  # they outlived the call: the worker went, and they with it
            assert left == [], f"processes left by the call (uid {uid}) still run: {left}"
        census = uid_processes(lambda u: u == uid)
        assert len(census) == (0 if case == "fork_exec_bomb" and mode == "legacy" else 1), census

        start = time.monotonic()
        hang = await score_one(stub, spec, {})  # the escape happened above; this item hangs
        assert hang.status == TIMEOUT, hang.reason
        left = await gone(uid, within_s=start + TIMEOUT_S + 1.0 - time.monotonic())
        assert left == [], f"processes of the killed worker (uid {uid}) still run: {left}"

        benign = await score_one(stub, file_spec(BENIGN), {"answer": "x"})
        assert benign.status == OK and benign.reward == 1.0, benign.reason
