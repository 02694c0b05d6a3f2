"""A pool of sandboxed workers for one reward spec.

The first worker is started before the pool is used, so a spec that cannot load fails the call
that brought it (and Validate) with the reason; the other workers start in the background. Each
item takes an idle worker, runs with the spec's wall-clock timeout and gives the worker back, or,
when the item timed out, crashed the worker, or the call was cancelled, kills it and starts a
replacement (so does a worker that has served max_items_per_worker items or used half its CPU
limit); `on_replace` hears each replacement's reason. An episode holds one worker for its whole
life (`hold`, `call`, `give_back`, `discard`); held workers do not count against the pool's size,
so the pool starts others for the items and episodes behind them. A hostile item therefore holds one worker for
at most its timeout. An item still running after a quarter of its timeout is overrunning: for each
one the pool may start an extra worker (at most `cfg.burst`), so items that hang take the capacity
they hold, not the capacity of the items queued behind them. Extra workers are retired when they
are given back and the pool holds more than it needs. The pool logs which isolation layers its
first worker reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

from services.common.errors import Unavailable
from services.reward.sandbox import BadReply, Outcome, PoolConfig, UidPool, WorkerDied, WorkerProcess

log = logging.getLogger(__name__)

SPAWN_ATTEMPTS = 3
OVERRUN_FRACTION = 0.25
"""An item running longer than this share of its timeout is overrunning (it earns a burst worker)."""
LAYERS = ("netns", "pidns", "userns", "mountns", "seccomp", "dropped_uid", "audit_hook")

ReplaceReason = Literal["timeout", "crash", "cancelled", "recycled", "abandoned", "episode_timeout"]


def describe_isolation(isolation: dict[str, Any]) -> str:
    """The active and missing isolation layers, e.g. "rlimits netns pidns dropped_uid (uid 200001); missing: userns"."""
    active = ["rlimits", *(layer for layer in LAYERS if isolation.get(layer))]
    missing = [layer for layer in LAYERS if not isolation.get(layer)]
    uid = f" (uid {isolation['uid']})" if isolation.get("dropped_uid") else ""
    return f"{' '.join(active)}{uid}; missing: {' '.join(missing) or 'none'}"


class WorkerPool:
    """`cfg.size` workers serving one spec (boot message) concurrently."""

    boot: dict[str, Any]
    cfg: PoolConfig
    last_used: float

    def __init__(self, boot: dict[str, Any], cfg: PoolConfig, uids: UidPool,
                 on_replace: Callable[[ReplaceReason], None] = lambda reason: None) -> None:
        self.boot, self.cfg, self._uids, self._on_replace = boot, cfg, uids, on_replace
        self._idle: asyncio.Queue[WorkerProcess] = asyncio.Queue()
        self._live: set[WorkerProcess] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._spawns: set[asyncio.Task[None]] = set()
        self._overrunning: set[object] = set()
        self._held: set[WorkerProcess] = set()
        self._broken: str | None = None
        self._closed = False
        self.last_used = time.monotonic()

    @property
    def live_workers(self) -> int:
        return len(self._live)

    @property
    def held_workers(self) -> int:
        return len(self._held)

    @property
    def isolation(self) -> dict[str, Any]:
        return next(iter(self._live)).isolation if self._live else {}

    async def start(self) -> None:
        """Start the first worker (raising ConfigError if the spec cannot load), then the rest."""
        first = await self._start_worker()
        level = logging.INFO if first.isolation.get("netns") else logging.WARNING
        log.log(level, "reward pool (%s, %d workers): isolation %s", self.boot["mode"], self.cfg.size,
                describe_isolation(first.isolation))
        self._add(first)
        for _ in range(self.cfg.size - 1):
            self._spawn()

    async def _start_worker(self) -> WorkerProcess:
        uid = await self._uids.take()
        try:
            return await WorkerProcess.start(self.boot, uid, self.cfg)
        except BaseException:
            self._uids.give(uid)
            raise

    def _target(self) -> int:
        """Workers the pool should have now: its size, plus one per overrunning item up to the burst, plus
        the workers episodes hold."""
        return self.cfg.size + min(len(self._overrunning), self.cfg.burst) + len(self._held)

    def _top_up(self) -> None:
        while not self._closed and len(self._live) + len(self._spawns) < self._target():
            self._spawn()

    def _add(self, worker: WorkerProcess) -> None:
        if self._closed or len(self._live) >= self._target():  # closed, or a burst no longer needed
            self._background(self._retire(worker))
            return
        self._live.add(worker)
        self._idle.put_nowait(worker)

    def _background(self, coro: Any, tasks: set[asyncio.Task[None]] | None = None) -> None:
        group = self._tasks if tasks is None else tasks
        task = asyncio.get_running_loop().create_task(coro)
        group.add(task)
        task.add_done_callback(group.discard)

    def _spawn(self) -> None:
        self._background(self._spawn_with_retries(), self._spawns)

    async def _spawn_with_retries(self) -> None:
        for attempt in range(1, SPAWN_ATTEMPTS + 1):
            try:
                self._add(await self._start_worker())
                return
            except Exception as error:  # deliberate: a failed replacement is retried, then reported
                log.warning("reward worker start failed (%d/%d): %s", attempt, SPAWN_ATTEMPTS, error)
                await asyncio.sleep(0.2 * attempt)
        if not self._live:
            self._broken = f"no reward worker could be started ({SPAWN_ATTEMPTS} attempts)"

    async def _retire(self, worker: WorkerProcess) -> None:
        self._live.discard(worker)
        await worker.kill()
        self._uids.give(worker.uid)

    def _replace(self, worker: WorkerProcess, reason: ReplaceReason) -> None:
        self._live.discard(worker)
        self._held.discard(worker)
        self._on_replace(reason)
        self._background(self._retire(worker))
        self._top_up()

    async def _acquire(self) -> WorkerProcess:
        while True:
            if self._broken or self._closed:
                raise Unavailable(self._broken or "reward pool closed")
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(self._idle.get(), 0.5)

    async def run(self, request: dict[str, Any], timeout_s: float) -> Outcome:
        """Score one item on an idle worker; every failure mode becomes an Outcome."""
        self.last_used = time.monotonic()
        worker = await self._acquire()
        with self._overrun_watch(timeout_s):
            outcome = await self.call(worker, request, timeout_s)
        if outcome.kind == "reply":
            self._release(worker)
        return outcome

    async def call(self, worker: WorkerProcess, request: dict[str, Any], timeout_s: float) -> Outcome:
        """One request on a worker this caller holds; a failure kills and replaces the worker (the
        caller then holds nothing), and every failure mode becomes an Outcome."""
        start = time.monotonic()
        try:
            reply = await worker.call(request, timeout_s, self.cfg.max_reply_bytes)
        except TimeoutError:
            self._replace(worker, "timeout")
            return Outcome("timeout", reason=f"timed out after {timeout_s:g}s", latency_s=time.monotonic() - start)
        except WorkerDied as died:
            self._replace(worker, "crash")
            return Outcome("killed", reason=str(died), latency_s=time.monotonic() - start)
        except BadReply as bad:
            self._replace(worker, "crash")
            return Outcome("error", reason=str(bad), latency_s=time.monotonic() - start)
        except BaseException:
            self._replace(worker, "cancelled")  # cancelled mid-request: its late reply must not reach the next one
            raise
        return Outcome("reply", reply=reply, latency_s=time.monotonic() - start)

    async def hold(self) -> WorkerProcess:
        """An idle worker for one episode, held until `give_back` or `discard`."""
        self.last_used = time.monotonic()
        worker = await self._acquire()
        self._held.add(worker)
        self._top_up()
        return worker

    def holds(self, worker: WorkerProcess) -> bool:
        """Whether worker is still held (not killed since `hold`)."""
        return worker in self._held

    def give_back(self, worker: WorkerProcess) -> None:
        """A held worker whose episode ended cleanly serves the pool again."""
        if worker in self._held:
            self._held.discard(worker)
            self._release(worker)

    def discard(self, worker: WorkerProcess, reason: ReplaceReason) -> None:
        """Kill a held worker (its episode timed out or was abandoned) and start a replacement."""
        if worker in self._live:
            self._replace(worker, reason)

    @contextlib.contextmanager
    def _overrun_watch(self, timeout_s: float) -> Iterator[None]:
        """Count the block as overrunning once it has run OVERRUN_FRACTION of timeout_s, until it ends."""
        token = object()

        def overrun() -> None:
            self._overrunning.add(token)
            self._top_up()

        handle = asyncio.get_running_loop().call_later(timeout_s * OVERRUN_FRACTION, overrun)
        try:
            yield
        finally:
            handle.cancel()
            self._overrunning.discard(token)

    def _release(self, worker: WorkerProcess) -> None:
        worn = worker.items >= self.cfg.max_items_per_worker or worker.cpu_s > self.cfg.limits.cpu_s / 2
        if worn:
            self._replace(worker, "recycled")
        elif len(self._live) > self._target():  # a burst worker whose overrunning item has ended
            self._live.discard(worker)
            self._background(self._retire(worker))
        else:
            self._idle.put_nowait(worker)

    async def close(self) -> None:
        """Kill every worker and stop starting new ones."""
        self._closed = True
        for task in list(self._spawns):
            task.cancel()
        while self._spawns or self._tasks:  # a spawn that finished meanwhile retires its worker in a new task
            await asyncio.gather(*self._spawns, *self._tasks, return_exceptions=True)
        await asyncio.gather(*(self._retire(w) for w in list(self._live)), return_exceptions=True)
