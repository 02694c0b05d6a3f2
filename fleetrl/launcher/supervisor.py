"""A small process supervisor: the fleet's services as child processes.

Each child runs in its own session (process group), so stopping it stops
everything it spawned (the reward service's sandbox workers included) and
Ctrl-C on `fleetrl up` leaves no orphans. A child that exits unexpectedly is
restarted with exponential backoff (capped), and its restarts are counted;
one that keeps crashing right after start is still retried, never spun on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
HEALTHY_AFTER_S = 30.0  # a child that lived this long resets its backoff
GROUP_GONE_S = 5.0  # SIGKILL is asynchronous: how long stop waits for a group's last members to die


@dataclass
class ChildSpec:
    """How to run one child: name (also its log file), argv and extra environment."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = True


@dataclass
class Child:
    spec: ChildSpec
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start_at: float = 0.0
    backoff_s: float = BACKOFF_START_S
    stopping: bool = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Start, watch, restart and stop named child processes."""

    children: dict[str, Child]

    def __init__(self, log_dir: Path, base_env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.children = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def add(self, spec: ChildSpec) -> Child:
        if spec.name in self.children:
            raise ValueError(f"child {spec.name!r} exists already")
        child = Child(spec, self.log_dir / f"{spec.name}.log")
        self.children[spec.name] = child
        self._start(child)
        return child

    def remove(self, names: list[str], grace_s: float = 10.0) -> None:
        """Stop children for good, all at once: SIGTERM, then SIGKILL what is left after grace_s."""
        _stop([self.children.pop(name) for name in names], grace_s)

    def poll(self) -> list[str]:
        """Restart children that died (after their backoff); return the names (re)started now."""
        now = time.monotonic()
        started = []
        for child in self.children.values():
            if child.alive() or child.stopping or not child.spec.restart:
                continue
            if child.proc is not None:  # it just died: reap what it spawned, schedule the restart
                _signal_group(child, signal.SIGKILL)
                code = child.proc.returncode
                lived = now - child.started_at
                healthy = lived > HEALTHY_AFTER_S
                child.backoff_s = BACKOFF_START_S if healthy else min(BACKOFF_MAX_S, child.backoff_s * 2)
                child.next_start_at = now + child.backoff_s
                child.proc = None
                log.warning("%s exited with %s after %.1fs; restart in %.1fs%s", child.spec.name, code, lived,
                            child.backoff_s, f": {last_line(child.log_path)}" if code else "")
            if now >= child.next_start_at:
                child.restarts += 1
                self._start(child)
                started.append(child.spec.name)
        return started

    def stop_all(self, grace_s: float = 15.0) -> None:
        """SIGTERM every child's process group, wait up to grace_s, SIGKILL what is left."""
        _stop(list(self.children.values()), grace_s)

    def _start(self, child: Child) -> None:
        env = {**self.base_env, **child.spec.env}
        with open(child.log_path, "ab") as out:
            out.write(f"\n==== start {time.strftime('%H:%M:%S')}: {' '.join(child.spec.argv)}\n".encode())
            out.flush()
            child.proc = subprocess.Popen(
                child.spec.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )
        child.started_at = time.monotonic()


def last_line(log_path: Path, tail_bytes: int = 4096) -> str:
    """The last non-empty line of a child's log: a service that exits non-zero prints its reason last."""
    try:
        with open(log_path, "rb") as log_file:
            log_file.seek(max(0, log_file.seek(0, os.SEEK_END) - tail_bytes))
            lines = log_file.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def _signal_group(child: Child, sig: int) -> None:
    if child.proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, sig)


def _stop(children: list[Child], grace_s: float) -> None:
    """SIGTERM each child's process group, wait for all of them up to grace_s together, then
    SIGKILL the groups (which also reaps grandchildren left in them) and wait until they are gone."""
    for child in children:
        child.stopping = True
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        if child.proc is not None:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", child.spec.name, grace_s)
        _signal_group(child, signal.SIGKILL)
        if child.proc is not None:
            child.proc.wait()
            _wait_group_gone(child.proc.pid, GROUP_GONE_S)


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until no live (non-zombie) process is left in process group pgid; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while _live_group_members(pgid):
        if time.monotonic() >= deadline:
            log.warning("process group %d still has members after SIGKILL", pgid)
            return False
        time.sleep(0.02)
    return True


def _live_group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, _ppid, group = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:  # the process exited while we looked
            continue
        if int(group) == pgid and state != "Z":
            members.append(int(entry.name))
    return members
