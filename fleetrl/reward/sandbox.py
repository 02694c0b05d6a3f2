"""Sandboxed worker processes, seen from the service: start, call with a timeout, kill, replace.

A `WorkerProcess` is a `python -I` process in its own session (process group). In the jail (the default,
see `jail`) it runs under bubblewrap with nothing of the host but Python, a private tmpfs as its
temp dir and cwd, and new namespaces; in the legacy sandbox (`sandbox_mode = "legacy"`, an explicit
weaker mode) it runs on the host with a minimal environment (PATH, LANG, HOME=TMPDIR=its private
temp dir, named after the service's pid so a later service sweeps it if this one is SIGKILLed).
Inside, it isolates itself (see `worker_main`, `guard`) before loading the spec. Requests go on a Unix
socket and each reply comes on a pipe made for that request (see `protocol`), so user code cannot
answer for an item it is not running. Every item has a wall-clock timeout (CPU limits alone miss
`sleep`); on timeout, death, an oversized or malformed reply, or a cancelled call, every process of
the worker is SIGKILLed (its children by pidfd, its process group, every process of its private
uid), it is reaped, its temp dir removed and a fresh worker started, so the rest of the batch keeps
being scored. Only JSON crosses from worker to service.
User code must not outlive its call: before any user code runs, the service counts the worker's
threads and processes from outside (`procfs.tree`, which user code cannot forge); after a load or a
call it counts again, and a worker with more than before is not clean: a load fails, and a worker
that answered a call is killed and replaced instead of serving the next one (`leftovers`).
`WorkerPool` keeps `size` workers for one spec and hands each item to an idle one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fleetrl.errors import ConfigError, FieldViolation, Unavailable
from fleetrl.reward import jail, procfs, protocol

log = logging.getLogger(__name__)

ROOT = str(Path(__file__).resolve().parents[2])
KILL_WAIT_S = 1.0
LEFTOVER_GRACE_S = 0.05
"""How long a thread or process that user code started may take to end after its call returned."""
TMPDIR_PREFIX = "fleetrl-reward-"


def bootstrap(root: str) -> str:
    """The worker's `python -c` program, importing fleetrl.services.reward from root."""
    return f"import sys; sys.path.insert(0, {root!r}); from fleetrl.reward.worker_main import main; main()"


@dataclass(frozen=True)
class Limits:
    """Resource limits of one worker."""

    memory_mb: int
    cpu_s: int
    file_mb: int
    open_files: int
    processes: int


@dataclass(frozen=True)
class PoolConfig:
    """How a pool starts, limits and recycles its workers."""

    size: int
    limits: Limits
    start_timeout_s: float
    """Limit for a worker to start and isolate itself (trusted code only)."""
    load_timeout_s: float
    """Limit for a started worker to load its spec (a reward file's top-level code runs here)."""
    max_items_per_worker: int
    max_reply_bytes: int
    sandbox_dir: Path | None = None
    namespaces: bool = True
    burst: int = 0
    """Extra workers while items overrun (see `WorkerPool`)."""
    bwrap: str | None = None
    """The bwrap binary when workers run in the jail; None for the legacy sandbox."""
    tmp_mb: int = 64
    """Size of the jail's /sandbox tmpfs."""
    respawn_burst: int = 8
    """Replacement workers the pool may start back to back (see `pool.RespawnBudget`)."""
    respawns_per_s: float = 2.0
    """Replacement workers the pool may start per second once its burst is spent."""


@dataclass
class Outcome:
    """How one item went on a worker: its reply, or why there is none."""

    kind: Literal["reply", "timeout", "killed", "error"]
    reply: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    latency_s: float = 0.0


class WorkerDied(Exception):
    """The worker ended before replying, or its reply is larger than allowed."""


class BadReply(Exception):
    """The worker's reply does not parse (not JSON, not an object, nested too deeply)."""


class UidPool:
    """Private uids for workers when running as root (RLIMIT_NPROC then counts one worker).

    A uid is held from `take` until `give`, which the pool calls once every process of the worker
    is gone, and a uid some process still runs under (another service's worker on this host, or
    a zombie) is skipped, so killing "every process of the uid" only ever hits one worker. The walk
    through the range starts at a pid-derived offset. Two services on one host that take the same
    free uid at the same moment would share it: that only tightens the process limit.
    """

    SPAN = 60_000
    enabled: bool
    _counter = itertools.count((os.getpid() * 7919) % SPAN)
    _held: set[int] = set()  # class-level: shared by every pool of this process

    def __init__(self, base: int) -> None:
        self.enabled = base > 0 and os.geteuid() == 0
        self._base = base

    async def take(self) -> int:
        if not self.enabled:
            return 0
        busy = await asyncio.to_thread(procfs.uids_in_use)
        for _ in range(self.SPAN):
            uid = self._base + next(self._counter) % self.SPAN
            if uid not in self._held and uid not in busy:
                self._held.add(uid)
                return uid
        raise Unavailable(f"every sandbox uid in [{self._base}, {self._base + self.SPAN}) is in use")

    def give(self, uid: int) -> None:
        self._held.discard(uid)


def death_reason(returncode: int | None) -> str:
    """Words for how a worker process ended."""
    if returncode is None:
        return "worker closed its pipe"
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = {"SIGKILL": " (CPU or memory limit, or killed)", "SIGXCPU": " (CPU time limit)",
                "SIGXFSZ": " (file size limit)", "SIGSEGV": " (crash)"}.get(name, "")
        return f"worker killed by {name}{hint}"
    return f"worker exited with code {returncode}"


def worker_env(tmpdir: str) -> dict[str, str]:
    """The whole environment a worker gets: nothing of the service's (no credentials)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmpdir, "TMPDIR": tmpdir,
            **jail.SINGLE_THREADED_ENV}


def sweep_tmpdirs(sandbox_dir: Path | None) -> list[str]:
    """Remove legacy workers' temp dirs whose service (the pid in the name) is gone; the paths removed."""
    removed = []
    for path in Path(sandbox_dir or tempfile.gettempdir()).glob(f"{TMPDIR_PREFIX}*-*"):
        owner = path.name[len(TMPDIR_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not procfs.alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


class WorkerProcess:
    """One sandboxed worker process serving one spec, one item at a time."""

    proc: asyncio.subprocess.Process
    sock: socket.socket
    tmpdir: str | None
    uid: int
    isolation: dict[str, Any]
    items: int
    cpu_s: float
    baseline_threads: int
    """Threads of the worker's process tree before any user code ran."""
    dirty: str
    """What of user code outlived its last call ("" while the worker is clean)."""
    warnings: list[str]
    """Deprecation warnings the spec's load raised (e.g. an environment file importing `env_tools`)."""

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket, tmpdir: str | None, uid: int,
                 jailed: bool = False) -> None:
        self.proc, self.sock, self.tmpdir, self.uid, self._jailed = proc, sock, tmpdir, uid, jailed
        self.isolation, self.items, self.cpu_s = {}, 0, 0.0
        self.baseline_threads, self.dirty, self.warnings = 0, "", []

    @classmethod
    async def start(cls, boot: dict[str, Any], uid: int, cfg: PoolConfig) -> WorkerProcess:
        """Start a worker and load the spec; ConfigError naming why when it cannot load."""
        worker = await cls._spawn(uid, cfg)
        message = {**boot, "limits": cfg.limits.__dict__, "uid": uid, "parent_pid": os.getpid(),
                   "namespaces": cfg.namespaces, "jail": cfg.bwrap is not None,
                   "tmpdir": worker.tmpdir or jail.WORKDIR, "root": jail.INSIDE_ROOT if cfg.bwrap else ROOT}
        step = f"did not start within {cfg.start_timeout_s:g}s (worker_start_timeout_s)"
        try:
            ready = await worker._exchange(message, cfg.start_timeout_s, cfg.max_reply_bytes)
            if ready.get("ok"):
                worker.isolation = dict(ready.get("isolation") or {})  # reported before any user code ran
                worker.baseline_threads = procfs.tree(worker.proc.pid)[0]
                step = f"did not load within {cfg.load_timeout_s:g}s (worker_load_timeout_s)"
                ready = await worker._exchange({"load": True}, cfg.load_timeout_s, cfg.max_reply_bytes)
                worker.warnings = [str(w)[:500] for w in ready.get("warnings") or []][:10]
                if ready.get("ok") and await worker.leftovers():
                    ready = {"ok": False, "reason": f"its top-level code {worker.dirty}"}
        except (TimeoutError, WorkerDied, BadReply) as error:
            await worker.kill()
            what = step if isinstance(error, TimeoutError) else str(error)
            raise ConfigError(f"{_what(boot)} cannot load", [FieldViolation(_spec_field(boot), what)]) from None
        except BaseException:
            await worker.kill()  # cancelled while loading: leave no process behind
            raise
        if not ready.get("ok"):
            await worker.kill()
            reason = str(ready.get("reason", "unknown"))
            raise ConfigError(f"{_what(boot)} cannot load", [FieldViolation(_spec_field(boot), reason)])
        return worker

    @classmethod
    async def _spawn(cls, uid: int, cfg: PoolConfig) -> WorkerProcess:
        ours, theirs = socket.socketpair()
        tmpdir = None
        if cfg.bwrap:
            argv = jail.command(cfg.bwrap, [sys.executable, "-I", "-c", bootstrap(jail.INSIDE_ROOT)], cfg.tmp_mb)
            options: dict[str, Any] = {"cwd": "/", "env": worker_env(jail.WORKDIR)}
        else:
            tmpdir = tempfile.mkdtemp(prefix=f"{TMPDIR_PREFIX}{os.getpid()}-", dir=cfg.sandbox_dir)
            if uid:
                os.chown(tmpdir, uid, uid)
            argv = [sys.executable, "-I", "-c", bootstrap(ROOT)]
            options = {"cwd": tmpdir, "env": worker_env(tmpdir)}
        try:  # asyncio kills the process itself when this is cancelled
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=theirs.fileno(), stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL, start_new_session=True, **options)
        except BaseException:
            ours.close()
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(proc, ours, tmpdir, uid, jailed=cfg.bwrap is not None)

    async def _exchange(self, message: dict[str, Any], timeout_s: float, max_bytes: int) -> dict[str, Any]:
        """Send message with a fresh reply pipe and read the first frame on that pipe."""
        read_fd, write_fd = os.pipe()
        try:
            os.set_blocking(read_fd, False)
            async with asyncio.timeout(timeout_s):
                await self._send(message, write_fd)
                os.close(write_fd)
                write_fd = -1
                return await self._read(read_fd, max_bytes)
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)

    async def _send(self, message: dict[str, Any], reply_fd: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    protocol.send_request(self.sock, reply_fd)
                    break
                except BlockingIOError:
                    await _ready(loop.add_writer, loop.remove_writer, self.sock.fileno())
            await loop.sock_sendall(self.sock, protocol.encode(message))
        except (BrokenPipeError, ConnectionResetError):
            raise WorkerDied(await self._reason()) from None

    async def _read(self, fd: int, max_bytes: int) -> dict[str, Any]:
        """The one frame on a reply pipe, which must then close (a second frame is not a reply)."""
        try:
            (size,) = protocol.HEADER.unpack(await _read_exact(fd, protocol.HEADER.size))
            if size > max_bytes:
                raise WorkerDied(f"reply of {size} bytes exceeds {max_bytes}")
            reply = protocol.decode(await _read_exact(fd, size))
            if await _read_exact(fd, 1, eof_ok=True):
                raise BadReply("more than one frame on the reply pipe (the reward code wrote on it)")
            return reply
        except EOFError:
            raise WorkerDied(await self._reason()) from None
        except protocol.ProtocolError as error:
            raise BadReply(f"malformed reply: {error}") from None

    async def _reason(self) -> str:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 1.0)
        return death_reason(self.proc.returncode)

    async def call(self, request: dict[str, Any], timeout_s: float, max_bytes: int) -> dict[str, Any]:
        """The worker's reply to one item; TimeoutError, WorkerDied or BadReply otherwise. A worker that
        user code left threads or processes in is marked `dirty` (see `leftovers`)."""
        reply = await self._exchange(request, timeout_s, max_bytes)
        self.items += 1
        cpu = reply.get("cpu_s")
        self.cpu_s = float(cpu) if isinstance(cpu, int | float) else self.cpu_s
        await self.leftovers()
        return reply

    async def leftovers(self) -> int:
        """Threads and processes user code left running beyond the worker's own, counted from outside and
        given LEFTOVER_GRACE_S to end; when there are any, `dirty` names them. Outside the jail's PID
        namespace a process that left the worker's tree is found by the worker's private uid."""
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while True:
            threads, pids = procfs.tree(self.proc.pid)
            strays = procfs.pids_of_uid(self.uid) - pids if self.uid and not self._jailed else set()
            extra = max(0, threads - self.baseline_threads) + len(strays)
            if not extra or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.005)
        if extra:
            self.dirty = (f"left {extra} thread(s) or process(es) running after it returned (user code must not "
                          "outlive its call: join the threads and wait for the processes it starts)")
        return extra

    async def kill(self) -> None:
        """SIGKILL every process of the worker, reap it and remove its temp dir.

        First its children by pidfd: with a PID namespace, the item loop is the worker's child and
        PID 1 of the namespace, whose death takes every process of the namespace with it, even ones
        that left the process group. Then the process group, then (with a private uid) every process
        of that uid, wherever it went. Only then is the worker awaited: asyncio also waits until its
        pipes close, which a surviving process would hold open, so that wait is bounded.
        """
        children = await asyncio.to_thread(procfs.pidfds_of_children, self.proc.pid)
        for pidfd in children:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        left = await asyncio.to_thread(self._sweep, children)
        if left:
            log.warning("processes of sandbox uid %d survived SIGKILL for %gs: %s", self.uid, KILL_WAIT_S, left)
        try:
            await asyncio.wait_for(self.proc.wait(), KILL_WAIT_S)
        except TimeoutError:
            log.warning("reward worker %d did not end within %gs of SIGKILL", self.proc.pid, KILL_WAIT_S)
        self.sock.close()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def _sweep(self, children: list[int]) -> list[int]:
        procfs.wait_ended(children, KILL_WAIT_S)
        for pidfd in children:
            os.close(pidfd)
        return procfs.kill_uid(self.uid, KILL_WAIT_S, reap_except=self.proc.pid) if self.uid else []


async def _ready(add: Any, remove: Any, fd: int) -> None:
    """Wait until fd is ready through the loop's add_reader/add_writer."""
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add(fd, wake)
    try:
        await ready
    finally:
        remove(fd)


async def _read_exact(fd: int, size: int, eof_ok: bool = False) -> bytes:
    """size bytes from a non-blocking fd; at EOF before that, what came if eof_ok, else EOFError."""
    loop = asyncio.get_running_loop()
    data = bytearray()
    while len(data) < size:
        try:
            chunk = os.read(fd, size - len(data))
        except BlockingIOError:
            await _ready(loop.add_reader, loop.remove_reader, fd)
            continue
        if not chunk and eof_ok:
            break
        if not chunk:
            raise EOFError("the worker closed the reply pipe")
        data += chunk
    return bytes(data)


def _spec_field(boot: dict[str, Any]) -> str:
    return {"file": "reward.file", "env": "environment.file", "agent": "agent.file"}.get(boot.get("mode", ""),
                                                                                       "reward.params")


def _what(boot: dict[str, Any]) -> str:
    return {"env": "environment", "agent": "agent"}.get(boot.get("mode", ""), "reward spec")
