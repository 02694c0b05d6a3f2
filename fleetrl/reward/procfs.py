"""A census of processes from /proc, for finding and killing every process of a sandboxed worker.

A worker's processes can leave its process group (setsid) and, without a PID namespace, its
process tree (a parent that exits hands its children to init); what they cannot leave is the
worker's private uid. So the service kills by uid: it SIGKILLs every process any of whose uids
(real, effective, saved, filesystem) is the worker's, until none is left. The service's own
orphaned children among them (it is init, as PID 1 of a container) are reaped here too.
Synchronous and blocking: call it off the event loop.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    uids: tuple[int, ...]
    zombie: bool


def _field(status: str, name: str) -> str:
    """The value of a line "name:\tvalue" of a /proc status file (never its first line, Name)."""
    start = status.index(f"\n{name}:\t") + len(name) + 3
    return status[start:status.index("\n", start)]


def processes() -> Iterator[Proc]:
    """Every process visible in /proc (ones that end while being read are skipped). Only the three
    fields needed are looked up: the service scans /proc on every worker start and kill."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as handle:
                    status = handle.read()
            except OSError:
                continue
            yield Proc(int(name), int(_field(status, "PPid")), tuple(map(int, _field(status, "Uid").split())),
                       _field(status, "State").startswith("Z"))


def uids_in_use() -> set[int]:
    """Every uid some process runs under (zombies too: they count against the uid's process limit)."""
    return {uid for proc in processes() for uid in proc.uids}


def alive(pid: int) -> bool:
    """Whether a process pid exists (a zombie counts)."""
    return os.path.exists(f"/proc/{pid}")


def parent_of(pid: int | Literal["self"]) -> int | None:
    """The parent pid of pid (in /proc's numbering, the service's even inside a PID namespace), or None
    when it has ended."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def pidfds_of_children(parent: int) -> list[int]:
    """Pidfds of parent's live children: a pidfd names one process even if its pid is reused later."""
    pidfds = []
    for proc in processes():
        if proc.ppid == parent and not proc.zombie:
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(proc.pid)
                if parent_of(proc.pid) == parent:  # not a new process that took the pid meanwhile
                    pidfds.append(pidfd)
                else:
                    os.close(pidfd)
    return pidfds


def tree(root: int) -> tuple[int, set[int]]:
    """The threads of root and of every process below it, counted, and those processes' pids, found
    through the kernel's children lists (no scan of /proc); (0, set()) when root has ended. A process
    that left the tree (re-parented to an init outside it) is not in it: the jail's PID namespace,
    whose init is in the tree, keeps every process of a jailed worker below it."""
    threads, pids, todo = 0, set(), [root]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        threads += len(tids)
        pids.add(pid)
        for tid in tids:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as handle:
                todo.extend(int(child) for child in handle.read().split())
    return threads, pids


def pids_of_uid(uid: int) -> set[int]:
    """The live processes any of whose uids is uid."""
    return {proc.pid for proc in processes() if uid in proc.uids and not proc.zombie}


def wait_ended(pidfds: list[int], within_s: float) -> None:
    """Wait until every process of pidfds has ended (a pidfd turns readable then), at most within_s."""
    deadline = time.monotonic() + within_s
    for pidfd in pidfds:
        select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))


def kill_uid(uid: int, within_s: float, reap_except: int = 0) -> list[int]:
    """SIGKILL every process of uid until none is left; the pids still alive after within_s.

    Zombies of uid that are this process's children are reaped, except reap_except (a child whose
    end asyncio's child watcher reports)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for proc in processes():
            if uid not in proc.uids:
                continue
            if not proc.zombie:
                alive.append(proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            elif proc.ppid == os.getpid() and proc.pid != reap_except:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(proc.pid, os.WNOHANG)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)

