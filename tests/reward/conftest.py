"""Fixtures of the reward-service tests: a real RewardService on a free port and a process census."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from services.common.config import RewardSpec
from services.common.grpcutil import channel
from services.proto.fleetrl.v1 import reward_pb2, reward_pb2_grpc
from services.reward.config import RewardSettings
from services.reward.convert import spec_to_proto
from services.reward.server import running

UID_BASE = 300_000  # clear of the default range [200_000, 260_000) that other tests' reward services use


def descendants(root: int | None = None) -> list[int]:
    """Pids of every live descendant of root (default: this test process), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [root or os.getpid()]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found += children
        frontier += children
    return found


def sandbox_uid_processes() -> list[int]:
    """Pids running under any sandbox uid of these tests (escapees of a process group would show here)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                uid = int(entry.stat().st_uid)
                zombie = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                continue
            if UID_BASE <= uid < UID_BASE + 60_000 and not zombie:
                out.append(int(entry.name))
    return out


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


@pytest.fixture
async def reward_stub(tmp_path: Path) -> AsyncIterator[reward_pb2_grpc.RewardServiceStub]:
    """A RewardService (2 workers per pool) and a stub; asserts every worker process is gone after."""
    settings = RewardSettings(listen="127.0.0.1:0", workers_per_pool=2, worker_start_timeout_s=3.0,
                              sandbox_uid_base=UID_BASE, sandbox_dir=tmp_path, grace_s=0.5)
    before = set(descendants())  # servers that other tests' session fixtures keep running
    async with running(settings) as service, channel(f"127.0.0.1:{service.port}") as chan:
        yield reward_pb2_grpc.RewardServiceStub(chan)
    assert set(descendants()) - before == set(), "worker processes left behind"
    assert wait_gone(sandbox_uid_processes) == [], "processes of sandbox uids left behind"
    assert list(tmp_path.iterdir()) == [], "worker temp dirs left behind"
