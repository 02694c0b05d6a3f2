"""Hostile reward files through a real RewardService: each is stopped or denied within timeout + 1 s,
scored as a non-OK result with a reason, leaves no process behind, and benign requests keep working."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from fleetrl.launcher.embedded import free_port, wait_for_port
from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from fleetrl.reward.pool import describe_isolation
from fleetrl.reward.scorer import Item, Scorer, parse_spec
from fleetrl.reward.settings import RewardSettings
from fleetrl.runtime.grpcutil import channel
from tests.reward.conftest import UID_BASE, descendants, file_spec, items

ROOT = Path(__file__).resolve().parents[2]

OK, ERROR = common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_ERROR
TIMEOUT, KILLED = common_pb2.REWARD_STATUS_TIMEOUT, common_pb2.REWARD_STATUS_KILLED
ESCAPE = f"/tmp/fleetrl-escape-{uuid.uuid4().hex}"
BENIGN = "def reward(completion, prompt, **meta):\n    return float(completion.strip() == meta['answer'])\n"

HOSTILE = {
    "loop": ("def reward(c, p, **m):\n    while True:\n        pass\n", TIMEOUT, "timed out"),
    "sleep": ("import time\ndef reward(c, p, **m):\n    time.sleep(1e9)\n", TIMEOUT, "timed out"),
    "allocate_10gb": ("def reward(c, p, **m):\n    b = bytearray(10 * 1024**3)\n    return 1.0\n",
                      ERROR, "MemoryError"),
    "fork_bomb": ("import os\ndef reward(c, p, **m):\n    while True:\n        os.fork()\n", ERROR, "os.fork"),
    "socket": ("import socket\ndef reward(c, p, **m):\n"
               "    socket.create_connection(('127.0.0.1', m['port']), timeout=0.5)\n    return 1.0\n",
               ERROR, "socket"),
    "write_outside": (f"def reward(c, p, **m):\n    open({ESCAPE!r}, 'w').write('x')\n    return 1.0\n",
                      ERROR, "outside the temp dir"),
    "environ_secret": ("import os\ndef reward(c, p, **m):\n    return os.environ['FLEETRL_TEST_SECRET']\n",
                       ERROR, "KeyError"),
    "raises": ("def reward(c, p, **m):\n    raise ValueError('boom')\n", ERROR, "ValueError: boom"),
    "nan": ("def reward(c, p, **m):\n    return float('nan')\n", ERROR, "not a finite number"),
    "string": ("def reward(c, p, **m):\n    return 'one'\n", ERROR, "expected a float or dict"),
    "subclasses_escape": (
        "def reward(c, p, **m):\n"
        "    for cls in ''.__class__.__bases__[0].__subclasses__():\n"
        "        if cls.__name__ == '_wrap_close':\n"
        f"            cls.__init__.__globals__['system']('touch {ESCAPE}')\n"
        "            return 1.0\n"
        "    raise RuntimeError('no _wrap_close found')\n", ERROR, "os.system"),
    "exits": ("import os\ndef reward(c, p, **m):\n    os._exit(7)\n", KILLED, "exited with code 7"),
}


@pytest.fixture
def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_file_is_contained(case: str, reward_stub: reward_pb2_grpc.RewardServiceStub,
                                         listener: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_TEST_SECRET", "hunter2")  # in os.environ, which workers must not inherit
    source, want_status, want_reason = HOSTILE[case]
    spec = file_spec(source, timeout_s=1.0)
    assert (await reward_stub.Validate(reward_pb2.ValidateRequest(spec=spec), timeout=10)).ok
    port = listener.getsockname()[1]
    start = time.monotonic()
    reply = await reward_stub.Score(reward_pb2.ScoreRequest(
        job_id="j", spec=spec, items=items(("x", {"port": port}), ("y", {"port": port}))), timeout=10)
    assert time.monotonic() - start < 1.0 + 1.0
    for result in reply.results:
        assert result.status == want_status, (case, result)
        assert want_reason in result.reason, (case, result.reason)
        assert result.reward == 0.0
    assert not Path(ESCAPE).exists()
    benign = await reward_stub.Score(reward_pb2.ScoreRequest(
        job_id="j", spec=file_spec(BENIGN), items=items(("57", {"answer": "57"}))), timeout=10)
    assert benign.results[0].status == OK and benign.results[0].reward == 1.0


async def test_hostile_items_do_not_block_the_rest_of_the_batch(
        reward_stub: reward_pb2_grpc.RewardServiceStub) -> None:
    source = ("import time\ndef reward(c, p, **m):\n    if m.get('hang'):\n        time.sleep(1e9)\n"
              "    return 1.0\n")
    rows = [("x", {"hang": i % 4 == 0}) for i in range(12)]
    start = time.monotonic()
    reply = await reward_stub.Score(reward_pb2.ScoreRequest(
        job_id="j", spec=file_spec(source, timeout_s=0.5), items=items(*rows)), timeout=20)
    statuses = [r.status for r in reply.results]
    assert statuses == [TIMEOUT if m["hang"] else OK for _, m in rows]
    assert time.monotonic() - start < 6.0


async def test_import_problems_are_reported_at_validation(reward_stub: reward_pb2_grpc.RewardServiceStub) -> None:
    cases = {
        "import nonexistent_module_xyz\n": "ModuleNotFoundError",
        "x = 1\n": "callable `reward",
        "def reward(:\n": "SyntaxError",
        "import time\ntime.sleep(1e9)\n": "did not load within",
        "import socket\nsocket.socket()\ndef reward(c, p): return 1\n": "socket",
    }
    for source, reason in cases.items():
        reply = await reward_stub.Validate(reward_pb2.ValidateRequest(spec=file_spec(source)), timeout=10)
        assert not reply.ok and reason in reply.reason, (source, reply.reason)


async def test_dict_rewards_params_and_temp_dir_writes(reward_stub: reward_pb2_grpc.RewardServiceStub) -> None:
    source = ("import os\ndef reward(completion, prompt, params, **meta):\n"
              "    open('scratch.txt', 'w').write(completion)\n"
              "    assert os.environ['HOME'] == os.getcwd()\n"
              "    return {'correct': float(completion == meta['answer']), 'bonus': params['bonus']}\n")
    reply = await reward_stub.Score(reward_pb2.ScoreRequest(
        job_id="j", spec=file_spec(source, bonus=0.25), items=items(("57", {"answer": "57"}))), timeout=10)
    result = reply.results[0]
    assert result.status == OK, result.reason
    assert result.reward == 1.25 and dict(result.components) == {"correct": 1.0, "bonus": 0.25}


TYPE_HINTS = {
    # a class made in a function, annotated with the function's local: resolvable only if the annotation was
    # evaluated when the class was made (the file does not inherit the worker's postponed annotations)
    "local": """
import typing
from typing import Annotated

def state_class():
    Items = Annotated[list, "merge"]
    class State(typing.TypedDict):
        items: Items
    return State

def reward(completion, prompt, **meta):
    return float(typing.get_type_hints(state_class(), include_extras=True) == {"items": Annotated[list, "merge"]})
""",
    # the file's own postponed annotations: strings, resolved in its module's namespace (it is in sys.modules)
    "future": """
from __future__ import annotations
import typing
from typing import Annotated

class State(typing.TypedDict):
    items: Annotated[list, "merge"]

def reward(completion, prompt, **meta):
    return float(typing.get_type_hints(State, include_extras=True) == {"items": Annotated[list, "merge"]})
""",
}


@pytest.mark.parametrize("case", sorted(TYPE_HINTS))
async def test_a_user_files_annotations_resolve_as_in_an_imported_module(
        case: str, reward_stub: reward_pb2_grpc.RewardServiceStub) -> None:
    """`typing.get_type_hints` on a class of the user's file (what LangGraph does to a graph's state class, and
    pydantic to a model) sees what it would see in an imported module."""
    reply = await reward_stub.Score(reward_pb2.ScoreRequest(
        job_id="j", spec=file_spec(TYPE_HINTS[case]), items=items(("x", {}))), timeout=10)
    assert reply.results[0].status == OK and reply.results[0].reward == 1.0, reply.results[0].reason


async def test_workers_are_isolated_and_the_pool_logs_how(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = set(descendants())
    scorer = Scorer(RewardSettings(workers_per_pool=1, sandbox_uid_base=UID_BASE, sandbox_dir=tmp_path))
    spec = file_spec(BENIGN)
    with caplog.at_level(logging.INFO, logger="fleetrl.reward.pool"):
        pool = await scorer.pool("j", parse_spec(spec.spec_json, spec.file_source))
    isolation = pool.isolation
    await scorer.close()
    assert [r.getMessage() for r in caplog.records if "isolation" in r.getMessage()] == [
        f"reward pool (file, 1 workers): isolation {describe_isolation(isolation)}"]
    assert isolation["audit_hook"]
    if os.geteuid() == 0:
        assert isolation["netns"] and isolation["pidns"] and isolation["dropped_uid"]
        assert UID_BASE <= isolation["uid"] < UID_BASE + 60_000
        assert describe_isolation(isolation).startswith(
            f"rlimits netns pidns mountns seccomp dropped_uid audit_hook (uid {isolation['uid']})")
    assert set(descendants()) - before == set()


async def test_every_worker_replacement_is_counted_by_reason(tmp_path: Path) -> None:
    source = ("import os, time\ndef reward(c, p, **m):\n    if c == 'hang':\n        time.sleep(1e9)\n"
              "    if c == 'exit':\n        os._exit(1)\n    return 1.0\n")
    scorer = Scorer(RewardSettings(workers_per_pool=1, max_items_per_worker=2, sandbox_uid_base=UID_BASE,
                                   sandbox_dir=tmp_path))
    spec = file_spec(source, timeout_s=0.5)
    parsed = parse_spec(spec.spec_json, spec.file_source)
    try:
        for completion in ("hang", "exit", "ok", "ok"):  # the second "ok" is the worker's 2nd item: recycled
            await scorer.score("j", parsed, [Item(completion, "p")])
    finally:
        await scorer.close()
    counts = {reason: scorer.metrics.registry.get_sample_value("fleetrl_reward_worker_restarts_total",
                                                               {"reason": reason})
              for reason in ("timeout", "crash", "recycled", "cancelled")}
    assert counts == {"timeout": 1.0, "crash": 1.0, "recycled": 1.0, "cancelled": None}


async def test_an_item_that_hangs_does_not_take_the_capacity_of_the_next(tmp_path: Path) -> None:
    """One worker, one burst: once the hanging item has run a quarter of its timeout the pool starts
    a second worker, which scores the next item while the first still hangs (without the burst the
    next item could only start after the hang's timeout). Afterwards the pool shrinks back to one."""
    source = "import time\ndef reward(c, p, **m):\n    if c == 'hang':\n        time.sleep(1e9)\n    return 1.0\n"
    scorer = Scorer(RewardSettings(workers_per_pool=1, burst_workers_per_pool=1, sandbox_uid_base=UID_BASE,
                                   sandbox_dir=tmp_path))
    spec = file_spec(source, timeout_s=20)
    parsed = parse_spec(spec.spec_json, spec.file_source)
    try:
        pool = await scorer.pool("j", parsed)
        hang = asyncio.create_task(scorer.score("j", parsed, [Item("hang", "p")]))
        await asyncio.sleep(0.2)
        benign = asyncio.create_task(scorer.score("j", parsed, [Item("ok", "p")]))
        done, _ = await asyncio.wait({hang, benign}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        assert done == {benign}, "the benign item waited for the hanging one"
        assert [r.status for r in benign.result()] == ["ok"]
        assert pool.live_workers == 2
        hang.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hang
        await asyncio.sleep(0.5)
        assert pool.live_workers == 1
    finally:
        await scorer.close()


SECRET_SCAN = """
import glob, os
def reward(completion, prompt, secret, **meta):
    found = 0
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(path, "rb") as handle:
                found += secret.encode() in handle.read()
        except OSError:
            pass
    return {"found": found, "in_os_environ": float(secret in str(os.environ))}
"""


async def test_the_services_environment_does_not_reach_user_code(tmp_path: Path) -> None:
    """A service process started with a secret in its real environment: the /proc scan that finds
    the secret in a plain process from this test finds nothing from a reward file, nor does
    os.environ. (The control is a separate process because an unprivileged service makes itself
    non-dumpable, which hides its environ from this test too.)"""
    secret = f"hunter2-{uuid.uuid4().hex}"
    port = free_port()
    env = {**os.environ, "FLEETRL_TEST_SECRET": secret}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetrl.services.reward", "--listen", f"127.0.0.1:{port}",
         "--set", f"sandbox_uid_base={UID_BASE}", "--set", f"sandbox_dir={tmp_path}"], env=env, cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.to_thread(wait_for_port, "127.0.0.1", port, 60.0, proc)
        scan: dict[str, Any] = {}
        exec(SECRET_SCAN, scan)
        control = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
        try:
            assert scan["reward"]("x", "p", secret=secret)["found"] >= 1, "the scan cannot find the secret even here"
        finally:
            control.kill()
            control.wait()
        async with channel(f"127.0.0.1:{port}") as chan:
            reply = await reward_pb2_grpc.RewardServiceStub(chan).Score(reward_pb2.ScoreRequest(
                job_id="j", spec=file_spec(SECRET_SCAN), items=items(("x", {"secret": secret}))), timeout=30)
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)
    result = reply.results[0]
    assert result.status == OK, result.reason
    assert dict(result.components) == {"found": 0.0, "in_os_environ": 0.0}
    assert proc.returncode == 0 and list(tmp_path.iterdir()) == []
