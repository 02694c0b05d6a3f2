"""The supervisor restarts crashed children with backoff and leaves no orphans on stop."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from fleetrl.launcher.supervisor import ChildSpec, Supervisor

# A child that spawns a grandchild and then sleeps: stopping must take both.
SCRIPT = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); " \
         "print('up', flush=True); time.sleep(600)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def test_crashed_child_is_restarted_and_stop_leaves_no_orphans(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    child = sup.add(ChildSpec("worker", [sys.executable, "-c", SCRIPT]))
    first_pid = child.pid
    assert first_pid is not None
    time.sleep(0.5)
    os.kill(first_pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (child.alive() and child.pid != first_pid):
        sup.poll()
        time.sleep(0.05)
    assert child.restarts == 1 and child.alive()
    second_pid = child.pid
    assert second_pid is not None
    time.sleep(0.5)
    assert len(_group_members(second_pid)) == 2  # child + grandchild
    sup.stop_all(grace_s=2)
    assert _group_members(second_pid) == []
    assert "up" in (tmp_path / "logs" / "worker.log").read_text()


def test_backoff_grows_for_a_child_that_keeps_crashing(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    child = sup.add(ChildSpec("crasher", [sys.executable, "-c", "raise SystemExit(3)"]))
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        sup.poll()
        time.sleep(0.02)
    # 0.5 + 1 + 2 s of backoff fit in 4 s: three restarts, not hundreds
    assert 2 <= child.restarts <= 3
    sup.stop_all(grace_s=1)


def test_a_child_that_fails_is_logged_with_its_last_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sup = Supervisor(tmp_path / "logs")
    script = "import sys; print('starting'); print('service: listen: 127.0.0.1:1: cannot listen there', " \
             "file=sys.stderr); sys.exit(2)"
    child = sup.add(ChildSpec("failing", [sys.executable, "-c", script]))
    assert child.proc is not None
    child.proc.wait(10)
    with caplog.at_level("WARNING"):
        sup.poll()
    sup.stop_all(grace_s=1)
    assert "failing exited with 2" in caplog.text
    assert caplog.text.rstrip().endswith("service: listen: 127.0.0.1:1: cannot listen there")
