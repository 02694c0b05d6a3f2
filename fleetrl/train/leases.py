"""Bookkeeping of replay leases between training and the checkpoint that makes them durable.

Exactly-once (fifo tables), the argument in full:
1. A step's groups come under one or more replay leases. After the step their leases are
   `pending`: the model contains their effect, the replay table still holds them.
2. A checkpoint records every pending lease with its task ids. Only after the checkpoint is
   complete are the leases committed (consumed in replay).
3. A learner killed before the checkpoint is complete resumes from the previous one, which does
   not contain those steps; their leases expire, the groups return (in their fifo order) and
   are trained again from the same state, as if the first attempt never happened.
4. A learner killed after the checkpoint but before the commits commits the recorded leases on
   resume. A commit answered NOT_FOUND means that lease expired and its groups went back to the
   table although their effect is in the model: their task ids go to `skip`, and the next time
   they are sampled they are committed without being trained.
5. The same holds while running: a sampled group whose task id is in `skip` or in a pending
   lease (its lease expired before the next checkpoint because lease_timeout_s was short) is a
   copy of a group already trained, and is not trained again.
So every inserted group is trained in exactly one step that survives, dropped as stale, or
still in the buffer. Tables with reuse (uniform, prioritized) do not filter copies: there a
group is meant to be trained several times, and a crash may add one use.

A live learner keeps every lease it holds (sampled, not yet committed or released) open with
`keep_alive`, which renews them every lease_timeout_s / 3, so a lease expires only when its
learner is gone (crashed, or lost the job) and points 4-5 stay the exception (a replay outage
longer than the timeout) instead of the rule whenever checkpoint_interval steps take longer
than lease_timeout_s. Held leases are not checkpointed: after a crash nobody renews them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetrl.errors import FleetError
from fleetrl.proto.fleetrl.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseRecord:
    lease_id: str
    task_ids: tuple[str, ...]


@dataclass
class LeaseBook:
    """Leases whose effect is trained but not yet committed, and copies to skip."""

    filter_copies: bool = True
    pending: list[LeaseRecord] = field(default_factory=list)
    skip: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)
    """Lease ids open for this learner (sampled, not yet committed or released): `keep_alive` renews them."""

    def _trained(self) -> set[str]:
        return self.skip.union(*(set(r.task_ids) for r in self.pending))

    def split(self, groups: list[common_pb2.Group], also: set[str] | None = None) -> tuple[list[common_pb2.Group], int]:
        """(groups to train, number of copies of already-trained groups left out)."""
        if not self.filter_copies:
            return groups, 0
        seen = self._trained() | (also or set())
        fresh = [g for g in groups if g.task_id not in seen]
        for group in groups:
            self.skip.discard(group.task_id)  # the new lease now holds the copy
        return fresh, len(groups) - len(fresh)

    def add(self, records: list[LeaseRecord]) -> None:
        self.pending.extend(records)

    def hold(self, lease_id: str) -> None:
        """A lease was just sampled: keep it open until it is committed or released."""
        self.held.add(lease_id)

    def drop(self, lease_id: str) -> None:
        """A lease was released, or found expired: stop renewing it."""
        self.held.discard(lease_id)

    def take_pending(self) -> list[LeaseRecord]:
        """The pending leases, to commit now (they are not renewed any more)."""
        out, self.pending = self.pending, []
        self.held.difference_update(r.lease_id for r in out)
        return out

    def lost(self, record: LeaseRecord) -> None:
        """Its commit found the lease expired: its groups are back in the table, already trained."""
        if self.filter_copies:
            self.skip.update(record.task_ids)

    def to_state(self) -> dict[str, Any]:
        return {"pending": [[r.lease_id, list(r.task_ids)] for r in self.pending], "skip": sorted(self.skip)}

    def restore(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's pending leases and skip set (in place: `keep_alive` holds this book)."""
        self.pending = [LeaseRecord(lease_id, tuple(ids)) for lease_id, ids in state.get("pending", [])]
        self.skip = set(state.get("skip", []))

    @classmethod
    def from_state(cls, state: dict[str, Any], filter_copies: bool = True) -> LeaseBook:
        book = cls(filter_copies)
        book.restore(state)
        return book


class LeaseRenewer(Protocol):
    """The replay client's renewing side (fleetrl.replay.client.ReplayClient)."""

    async def renew(self, job_id: str, lease_ids: Sequence[str]) -> list[str]: ...


async def keep_alive(book: LeaseBook, replay: LeaseRenewer, job_id: str, interval_s: float,
                     stop: asyncio.Event) -> None:
    """Renew the book's held leases every interval_s until stop is set (the job lease was lost)."""
    while not stop.is_set():
        await asyncio.sleep(interval_s)
        held = sorted(book.held)
        if not held or stop.is_set():
            continue
        try:
            missing = await replay.renew(job_id, held)
        except FleetError as error:  # replay or Redis away: the next round retries, within the lease timeout
            log.warning("job %s: renewing %d leases failed: %s", job_id, len(held), error)
            continue
        for lease_id in missing:  # expired anyway (an outage outlasted it): its commit will report it lost
            book.drop(lease_id)
        if missing:
            log.warning("job %s: %d leases expired before they were renewed", job_id, len(missing))
