"""Fixtures of the reward-service tests: a real RewardService on a free port and a process census."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetrl.proto.fleetrl.v1 import reward_pb2, reward_pb2_grpc
from fleetrl.reward.client import spec_to_proto
from fleetrl.reward.settings import RewardSettings
from fleetrl.runtime.grpcutil import channel
from fleetrl.services.reward.server import Running, running
from fleetrl.spec.config import RewardSpec
from tests import sandbox_uids

UID_BASE = sandbox_uids.claim()  # this process's own range: teardowns count its processes
ROOT = Path(__file__).resolve().parents[2]
USER = "fleettest"
"""The ordinary user a service runs as in the tests' "user" mode (`launcher`)."""
PR_SET_CHILD_SUBREAPER = 36


def _parents(zombies: bool = False) -> dict[int, int]:
    """Each live process's parent pid, from /proc (zombies only, when asked)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if (fields[0] == "Z") == zombies:
                parents[int(entry.name)] = int(fields[1])
    return parents


def descendants(root: int | None = None) -> list[int]:
    """Pids of every live descendant of root (default: this test process), from /proc."""
    parents = _parents()
    found, frontier = [], [root or os.getpid()]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found += children
        frontier += children
    return found


@contextlib.contextmanager
def subreaper() -> Iterator[None]:
    """Inside, this process adopts the orphans of its descendants (PR_SET_CHILD_SUBREAPER): a process that
    a child leaves behind when it exits stays in `descendants()` instead of passing to init. On the way
    out, the adopted ones that have died are reaped."""
    own = {pid for pid, parent in _parents(zombies=True).items() if parent == os.getpid()}
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for pid, parent in _parents(zombies=True).items():
            if parent == os.getpid() and pid not in own:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)


def uid_processes(wanted: Callable[[int], bool]) -> list[int]:
    """Pids of live (not zombie) processes any of whose uids (real, effective, saved, fs) is wanted."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            uids = [int(u) for u in fields["Uid"].split()]
            if not fields["State"].strip().startswith("Z") and any(wanted(u) for u in uids):
                out.append(int(entry.name))
    return out


def sandbox_uid_processes() -> list[int]:
    """Pids running under any sandbox uid of these tests (escapees of a process group would show here)."""
    return uid_processes(lambda uid: UID_BASE <= uid < UID_BASE + 60_000)


def wait_gone(census: Callable[[], list[int]], within_s: float = 2.0) -> list[int]:
    """census() once it is empty, or what is left after within_s (SIGKILLed processes die asynchronously)."""
    deadline = time.monotonic() + within_s
    while (left := census()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def file_spec(source: str, timeout_s: float = 1.0, memory_mb: int = 256, **params: object) -> reward_pb2.RewardSpec:
    spec = RewardSpec(file="reward.py", timeout_per_item_s=timeout_s, memory_limit_mb=memory_mb, params=params)
    return spec_to_proto(spec, source.encode())


def builtin_spec(name: str, params: dict[str, object] | None = None, timeout_s: float = 5.0) -> reward_pb2.RewardSpec:
    return spec_to_proto(RewardSpec(builtin=name, params=params or {}, timeout_per_item_s=timeout_s))


def items(*rows: tuple[str, dict[str, object]]) -> list[reward_pb2.ScoreItem]:
    return [reward_pb2.ScoreItem(completion=c, prompt="p", metadata_json=json.dumps(m)) for c, m in rows]


@contextlib.asynccontextmanager
async def reward_service(sandbox_dir: Path, **settings: Any) -> AsyncIterator[reward_pb2_grpc.RewardServiceStub]:
    """A RewardService and a stub; asserts every worker process and temp dir is gone after."""
    async with reward_server(sandbox_dir, **settings) as (stub, _):
        yield stub


@contextlib.asynccontextmanager
async def reward_server(sandbox_dir: Path,
                        **settings: Any) -> AsyncIterator[tuple[reward_pb2_grpc.RewardServiceStub, Running]]:
    """A RewardService, a stub and the running service (its scorer, sessions and metrics); asserts every
    worker process and temp dir is gone after."""
    settings = {"workers_per_pool": 2, "worker_start_timeout_s": 3.0, "worker_load_timeout_s": 3.0, **settings}
    config = RewardSettings(listen="127.0.0.1:0", sandbox_uid_base=UID_BASE, sandbox_dir=sandbox_dir, grace_s=0.5,
                            **settings)
    before = set(descendants())  # servers that other tests' session fixtures keep running
    async with running(config) as service, channel(f"127.0.0.1:{service.port}") as chan:
        yield reward_pb2_grpc.RewardServiceStub(chan), service
    assert set(descendants()) - before == set(), "worker processes left behind"
    assert wait_gone(sandbox_uid_processes) == [], "processes of sandbox uids left behind"
    assert list(sandbox_dir.iterdir()) == [], "worker temp dirs left behind"


@pytest.fixture
async def reward_stub(tmp_path: Path) -> AsyncIterator[reward_pb2_grpc.RewardServiceStub]:
    """A RewardService with 2 workers per pool."""
    async with reward_service(tmp_path) as stub:
        yield stub


def service_user() -> tuple[int, int] | None:
    """(uid, gid) of the test's ordinary user, created when missing; None when that is not possible."""
    with contextlib.suppress(KeyError):
        entry = pwd.getpwnam(USER)
        return entry.pw_uid, entry.pw_gid
    if shutil.which("useradd") is None:
        return None
    subprocess.run(["useradd", "--create-home", USER], check=True, capture_output=True)
    entry = pwd.getpwnam(USER)
    return entry.pw_uid, entry.pw_gid


LAUNCH = """
import os, sys
sys.path.insert(0, {root!r})
from fleetrl.reward import guard
uid, gid = int(sys.argv[1]), int(sys.argv[2])
guard.expose_paths([sys.prefix, sys.base_prefix, sys.executable, {root!r}])
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
os.execv(sys.argv[3], sys.argv[3:])
"""


def launcher(mode: str) -> tuple[list[str], int, int]:
    """The command prefix that runs a process in mode, and its uid and gid."""
    if mode == "root":
        if os.geteuid() != 0:
            pytest.skip("the root parametrisation needs the tests to run as root")
        return [], 0, 0
    if os.geteuid() != 0:
        return [], os.getuid(), os.getgid()  # an ordinary user already
    user = service_user()
    if user is None:
        pytest.skip("running as root without useradd: cannot create an ordinary user for the service")
    uid, gid = user
    return [sys.executable, "-I", "-c", LAUNCH.format(root=str(ROOT)), str(uid), str(gid)], uid, gid
