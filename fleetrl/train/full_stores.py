"""Waiting out a full store inside a run: a write refused for want of space pauses the job, not fails it.

Two stores can fill under a running job while Redis still takes writes: the disk its checkpoints and
metrics.jsonl go to (`files.NoSpace`, naming the file and ENOSPC) and JetStream, at its server's or
account's storage limit or a stream's or bucket's (`bus.JetStreamFull`). `FullStoreWait.call` repeats
such a call every `store_full_retry_s` until it goes through, the job paused meanwhile with the
refusal as its reason: in its record beside state RUNNING (`JobStore.set_pause_reason`), on the status
board (phase "paused") and in `fleetrl_learner_store_full{store}`. The run's job and replay leases are
renewed by their own tasks all along, so nothing it trained is lost and nothing is trained again. Past
`store_full_wait_s` the refusal goes through and the job fails with it. Every call given here is safe
to repeat: a checkpoint's files are written afresh into their temporary directory, a metrics line that
did not fit is cut off again (`MetricsLog.append`), the exported model and adapter are written into a
temporary directory that a failed write deletes, a task publish carries its `Nats-Msg-Id`, and a weight
publish or a chain's repair deletes its half-written object before writing it again, the set-up creates or
updates the streams and consumers to the same config, and a fence finds the pointer stamped already.

A NATS outage is waited out the same way (`bus.NatsUnreachable`: a task publish, weight publish,
dead-letter count, or the run's set-up of the job's streams and consumer or its fence of the weight pointer,
that `bus.retry_outage` gave up on after `OUTAGE_RETRY_BEFORE_PAUSE_S`), the job paused
with the call and the outage as its reason, and `fleetrl_learner_store_full` left alone (the store is
unreachable, not full). A learner cut off from NATS alone keeps its leases in Redis meanwhile. Past
`store_full_wait_s` the NatsUnreachable goes through too, but it does not fail the job: the learner stops
the run as on an unreachable Redis and a claim resumes the job from its checkpoint
(`services/learner/service.py`, `pause_unreachable`). A store that is still full after the wait has
refused the write, and the job fails; a server that does not answer has refused nothing.

SIGTERM during the wait does not wait it out: the call raises `HandedBack` at once, the write not made, and the
service hands the job back (its lease released, the pause reason kept until a claim clears it), so a claim,
this learner's successor's or another's, resumes it from its checkpoint. Before, a learner asked to stop
while paused on a full store stayed until the store took the write or `store_full_wait_s` passed (15
minutes by default), past any orchestrator's grace period, and was SIGKILLed with its leases still held.

A full Redis is not waited out here: the reason could not be written, so the service stops the run
and a claim resumes it (services/learner/service.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fleetrl.errors import FleetError
from fleetrl.jobs.store import JobStore
from fleetrl.tasks.bus import REQUEST_TIMEOUT_S, JetStreamFull, NatsUnreachable
from fleetrl.train.files import NoSpace
from fleetrl.train.observability import STORE_FULL
from fleetrl.train.status import JobStatus

log = logging.getLogger(__name__)
T = TypeVar("T")

STORES: dict[type[Exception], str] = {NoSpace: "disk", JetStreamFull: "nats"}
"""The refusals waited out, and the store each names in `fleetrl_learner_store_full`."""
WAITED_OUT: tuple[type[Exception], ...] = (*STORES, NatsUnreachable)
"""Every error `FullStoreWait.call` waits out: a full store's refusal, and a NATS outage."""
OUTAGE_RETRY_BEFORE_PAUSE_S = REQUEST_TIMEOUT_S
"""How long the learner's NATS calls are retried quietly through an outage (`bus.retry_outage`) before they
raise NatsUnreachable and the job pauses: a call that timed out once has waited this long already, while
a NATS restart's quick refusals (reconnecting, no responders) pass without a pause."""


class HandedBack(FleetError):
    """SIGTERM came while the job was paused on a full or unreachable store: hand it back now, the write not
    made; a claim resumes the job from its checkpoint."""


class FullStoreWait:
    """Waits out full stores for one job run; JobRun wires it and passes each call that may meet one."""

    jobs: JobStore
    board: JobStatus
    job_id: str
    lease_epoch: int
    wait_s: float
    retry_s: float
    check: Callable[[], None]
    """Raises when the run must stop (its job lease lost): called before each try again."""
    stop: asyncio.Event
    """Set by SIGTERM: ends a pause at once with HandedBack."""
    _phase: str
    """The board's phase when the pause began, given back when it ends."""

    def __init__(self, jobs: JobStore, board: JobStatus, job_id: str, lease_epoch: int, *, wait_s: float,
                 retry_s: float, check: Callable[[], None], stop: asyncio.Event) -> None:
        self.jobs, self.board, self.job_id, self.lease_epoch = jobs, board, job_id, lease_epoch
        self.wait_s, self.retry_s, self.check, self.stop = wait_s, retry_s, check, stop
        self._phase = ""

    async def call(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """attempt(), tried again every retry_s while a store refuses it for want of space or NATS does not
        answer it (NatsUnreachable), the job paused;
        the refusal itself once wait_s has passed since the first. However the call ends, the status board
        and the gauge stop saying "paused"; the job's record does when the call goes through (a failed job's
        reason replaces it, and a claim clears it)."""
        give_up_at, store = 0.0, ""
        try:
            while True:
                try:
                    result = await attempt()
                except WAITED_OUT as error:
                    if not store:
                        give_up_at = time.monotonic() + self.wait_s
                        store = next((name for kind, name in STORES.items() if isinstance(error, kind)), "nats")
                        await self.pause(store, str(error), full=not isinstance(error, NatsUnreachable))
                    if time.monotonic() + self.retry_s > give_up_at:
                        raise
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stop.wait(), self.retry_s)
                    if self.stop.is_set():
                        raise HandedBack(f"job {self.job_id}: SIGTERM while paused on the {store} store ({error}); "
                                         "handed back unwritten, a claim resumes it from its checkpoint") from error
                    self.check()
                    continue
                if store:
                    log.info("job %s: the %s store took the write, the pause ends", self.job_id, store)
                    await self.jobs.set_pause_reason(self.job_id, "", lease_epoch=self.lease_epoch)
                return result
        finally:
            if store:
                STORE_FULL.labels(store).set(0)
                self.board.phase, self.board.paused_reason = self._phase, ""

    async def pause(self, store: str, reason: str, *, full: bool = True) -> None:
        """Say the job is paused on store; `full`: for want of space (the gauge), else unreachable."""
        log.warning("job %s paused: %s; trying again every %g s for up to %g s", self.job_id, reason, self.retry_s,
                    self.wait_s)
        self._phase = self.board.phase
        self.board.pause(reason)
        if full:
            STORE_FULL.labels(store).set(1)
        await self.jobs.set_pause_reason(self.job_id, reason, lease_epoch=self.lease_epoch)
