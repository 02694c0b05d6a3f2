"""A pool of sandboxed workers for one reward spec.

The first worker is started before the pool is used, so a spec that cannot load fails the call that
brought it (and Validate) with the reason; the other workers start in the background. Each item
takes an idle worker, runs with the spec's wall-clock timeout and gives the worker back, or, when
the item timed out, crashed the worker, or the call was cancelled, kills it and starts a replacement
(so does a worker that has served max_items_per_worker items or used half its CPU limit, or that
user code left a thread or process in); `on_replace` hears each replacement's reason. An episode
holds one worker for its whole life (`hold`, `call`, `give_back`, `discard`); held workers do not
count against the pool's size, so the pool starts others for the items and episodes behind them. A
hostile item therefore holds one worker for at most its timeout. An item still running after a
quarter of its timeout is overrunning: for each one the pool may start an extra worker (at most
`cfg.burst`), so items that hang take the capacity they hold, not the capacity of the items queued
behind them. Extra workers are retired when they are given back and the pool holds more than it
needs. Every replacement of a killed worker (timeout, crash, cancellation, age) takes a token of the
pool's `RespawnBudget`: `respawn_burst` back to back, then `respawns_per_s`; starts for demand (the
pool's size, the workers episodes hold, bursts) take none, as max_episodes and the burst bound them.
A replacement waits for its token, and while nothing can serve (no worker free or busy, every start
waiting) the pool is backing off: callers waiting and arriving fail at once with `BackingOff` naming
why (an item scores as an error), so a reward file that kills its worker on every item costs a
bounded number of starts. Idle workers go to waiting callers in arrival order. The pool logs which
isolation layers its first worker reports.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

from fleetrl.errors import Unavailable
from fleetrl.reward.sandbox import BadReply, Outcome, PoolConfig, UidPool, WorkerDied, WorkerProcess

log = logging.getLogger(__name__)

SPAWN_ATTEMPTS = 3
OVERRUN_FRACTION = 0.25
"""An item running longer than this share of its timeout is overrunning (it earns a burst worker)."""
LAYERS = ("netns", "pidns", "userns", "mountns", "seccomp", "dropped_uid", "audit_hook")

ReplaceReason = Literal["timeout", "crash", "cancelled", "recycled", "abandoned", "episode_timeout", "dirty"]


class BackingOff(Unavailable):
    """The pool's workers keep dying and every replacement waits for its start budget: nothing can serve now."""


class RespawnBudget:
    """A token bucket of worker starts: `burst` back to back, then `per_s` a second. `take` reserves the
    next start and returns how long it must wait for it (reservations queue up, 1/per_s apart)."""

    burst: int
    per_s: float

    def __init__(self, burst: int, per_s: float) -> None:
        self.burst, self.per_s = burst, per_s
        self._tokens, self._at = float(burst), time.monotonic()

    def take(self) -> float:
        now = time.monotonic()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.per_s) - 1.0
        self._at = now
        return max(0.0, -self._tokens / self.per_s)


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
        self._idle: collections.deque[WorkerProcess] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[WorkerProcess]] = collections.deque()
        self._respawns = RespawnBudget(cfg.respawn_burst, cfg.respawns_per_s)
        self._delayed = 0
        self._replaced = 0
        self._last_reason = ""
        self._live: set[WorkerProcess] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._spawns: set[asyncio.Task[None]] = set()
        self._starting = 0
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
    def broken(self) -> str | None:
        """Why the pool cannot serve (no worker could be started again), or None."""
        return self._broken

    @property
    def isolation(self) -> dict[str, Any]:
        return next(iter(self._live)).isolation if self._live else {}

    async def start(self) -> None:
        """Start the first worker (raising ConfigError if the spec cannot load), then the rest."""
        first = await self._start_worker()
        level = logging.INFO if first.isolation.get("netns") else logging.WARNING
        log.log(level, "reward pool (%s, %d workers): isolation %s", self.boot["mode"], self.cfg.size,
                describe_isolation(first.isolation))
        for warning in first.warnings:
            log.warning("reward pool (%s): %s", self.boot["mode"], warning)
        self._add(first)
        for _ in range(self.cfg.size - 1):
            self._spawn(budgeted=False)

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

    def _top_up(self, replacing: bool = False) -> None:
        """Start the workers the target lacks; a replacement of a killed worker waits for the start budget,
        a start for demand (an episode's hold, an overrunning item's burst) does not: those are bounded by
        max_episodes and the burst."""
        while not self._closed and len(self._live) + self._starting < self._target():
            self._spawn(budgeted=replacing)

    def _add(self, worker: WorkerProcess) -> None:
        if self._closed or len(self._live) >= self._target():  # closed, or a burst no longer needed
            self._background(self._retire(worker))
            return
        self._live.add(worker)
        self._hand_out(worker)

    def _hand_out(self, worker: WorkerProcess) -> None:
        """Give an idle worker to the longest-waiting caller, else keep it idle."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(worker)
                return
        self._idle.append(worker)

    def _background(self, coro: Any, tasks: set[asyncio.Task[None]] | None = None) -> None:
        group = self._tasks if tasks is None else tasks
        task = asyncio.get_running_loop().create_task(coro)
        group.add(task)
        task.add_done_callback(group.discard)

    def _spawn(self, *, budgeted: bool) -> None:
        self._starting += 1
        self._background(self._spawn_with_retries(budgeted), self._spawns)

    async def _spawn_with_retries(self, budgeted: bool) -> None:
        """Start a worker and add it to the pool; `_starting` counts it until then (not until its task ends,
        which is later than the caller it is handed to resumes)."""
        try:
            worker = await self._start_with_retries(budgeted)
        finally:
            self._starting -= 1
        if worker is not None:
            self._add(worker)
        elif not self._live:
            self._broken = f"no reward worker could be started ({SPAWN_ATTEMPTS} attempts)"
            self._fail_waiters(Unavailable(self._broken))

    async def _start_with_retries(self, budgeted: bool) -> WorkerProcess | None:
        """A started worker, or None after SPAWN_ATTEMPTS failures; each attempt of a budgeted start (a
        replacement of a killed worker) waits for the start budget."""
        for attempt in range(1, SPAWN_ATTEMPTS + 1):
            if budgeted:
                await self._wait_for_budget()
            try:
                return await self._start_worker()
            except Exception as error:  # deliberate: a failed replacement is retried, then reported
                log.warning("reward worker start failed (%d/%d): %s", attempt, SPAWN_ATTEMPTS, error)
                await asyncio.sleep(0.2 * attempt)
        return None

    async def _wait_for_budget(self) -> None:
        delay = self._respawns.take()
        if delay <= 0:
            return
        self._delayed += 1
        try:
            if self._stalled():
                log.warning("%s (%s)", self._backoff_reason(), self.boot["mode"])
                self._fail_waiters(BackingOff(self._backoff_reason()))
            await asyncio.sleep(delay)
        finally:
            self._delayed -= 1

    def _stalled(self) -> bool:
        """No worker can serve a waiting caller until the start budget allows one: none is free or busy
        outside an episode, and every start is waiting for its budget."""
        return 0 < self._delayed == self._starting and not self._live - self._held

    def _backoff_reason(self) -> str:
        return (f"reward pool backing off: {self._replaced} workers replaced (the last for: {self._last_reason}), "
                f"and it starts at most {self.cfg.respawn_burst} back to back, then "
                f"{self.cfg.respawns_per_s:g} a second (worker_respawn_burst, worker_respawns_per_s)")

    def _fail_waiters(self, error: Exception) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    async def _retire(self, worker: WorkerProcess) -> None:
        self._live.discard(worker)
        await worker.kill()
        self._uids.give(worker.uid)

    def _replace(self, worker: WorkerProcess, reason: ReplaceReason) -> None:
        self._live.discard(worker)
        self._held.discard(worker)
        self._replaced += 1
        self._last_reason = reason
        self._on_replace(reason)
        self._background(self._retire(worker))
        self._top_up(replacing=True)

    async def _acquire(self) -> WorkerProcess:
        """An idle worker, once one is free; Unavailable when the pool is broken or closed, BackingOff when
        nothing can serve until the start budget allows a new worker."""
        if self._broken or self._closed:
            raise Unavailable(self._broken or "reward pool closed")
        if self._idle:
            return self._idle.popleft()
        if self._stalled():
            raise BackingOff(self._backoff_reason())
        waiter: asyncio.Future[WorkerProcess] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._hand_out(waiter.result())  # handed over as this caller was cancelled: pass it on
            raise

    async def run(self, request: dict[str, Any], timeout_s: float) -> Outcome:
        """Score one item on an idle worker; every failure mode becomes an Outcome."""
        self.last_used = time.monotonic()
        try:
            worker = await self._acquire()
        except BackingOff as error:
            return Outcome("error", reason=str(error))
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
        if worker.dirty:  # user code left a thread or process behind: it must not see the next item
            self._replace(worker, "dirty")
        elif worn:
            self._replace(worker, "recycled")
        elif len(self._live) > self._target():  # a burst worker whose overrunning item has ended
            self._live.discard(worker)
            self._background(self._retire(worker))
        else:
            self._hand_out(worker)

    async def close(self) -> None:
        """Kill every worker and stop starting new ones."""
        self._closed = True
        self._fail_waiters(Unavailable("reward pool closed"))
        for task in list(self._spawns):
            task.cancel()
        while self._spawns or self._tasks:  # a spawn that finished meanwhile retires its worker in a new task
            await asyncio.gather(*self._spawns, *self._tasks, return_exceptions=True)
        await asyncio.gather(*(self._retire(w) for w in list(self._live)), return_exceptions=True)
