"""The end-to-end task ledger: every task the feeder publishes, and what became of it.

Design choice: each stage records what it alone knows, at the moment it acts, and the accounting
joins those records with what NATS holds now; no service's counters are trusted to balance.
Keys of a job (prefix L = `fleetrl:ledger:<job>:`):
  L..pub    set    every task id the feeder published (written before the publish, one SADD per top-up)
  L..fate   hash   task id -> what replay did with its group, written by replay's own Lua scripts in
                   the same atomic step: `r` stored, `c` consumed (removed after its last commit),
                   `s` dropped as stale, `e` evicted for capacity
  L..steps  hash   step -> the task ids trained in it, space-separated (written by the learner before
                   the checkpoint of that step; a resumed learner forgets the steps after its checkpoint)
Dead letters are read from the job's dead-letter subject and tasks in flight from the task stream
(`bus.job_tasks_in_stream`), at accounting time only.

A task's fate, the first that holds: trained (in a surviving step), stale, evicted, pending (stored
in replay), dead-lettered, in flight (in the task stream: queued or held by an actor), else lost.
Reads go upstream first (published, stream, dead letters, replay, steps), so a task that moves on
while the accounting runs is still seen in one place: a lost task is one seen nowhere. Duplicated
counts tasks trained in more steps than the table's reuse allows (fifo: one).
Cost per task: one set member and one hash field in Redis (`bench.ledger` measures it).
The learner's writes (published, trained, forgotten steps) carry its job-lease epoch and are refused
(`Fenced`) when the job was claimed again since (`jobs.store.FENCE_LUA`): a stale learner can neither publish
tasks (the record comes first) nor record a step.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from nats.js import JetStreamContext

from fleetrl.jobs import store as jobs
from fleetrl.replay.samplers import SAMPLERS
from fleetrl.spec import seeding
from fleetrl.spec.config import JobSpec
from fleetrl.tasks import bus

PREFIX = "fleetrl:ledger:"
STORED, CONSUMED, STALE, EVICTED = "r", "c", "s", "e"
"""Codes replay writes to a task's `fate` field."""


def key(job_id: str, name: str) -> str:
    """One of a job's ledger keys: `pub`, `fate` or `steps`."""
    return f"{PREFIX}{bus.check_job_id(job_id)}:{name}"


def max_trainings(spec: JobSpec) -> int:
    """Steps one task's group may be trained in: once without reuse (fifo), up to max_reuse otherwise."""
    return SAMPLERS[spec.replay.sampler].trainings_per_group(spec.replay.max_reuse)


class Fate(enum.StrEnum):
    TRAINED = "trained"
    STALE = "stale"
    EVICTED = "evicted"
    PENDING = "pending"
    DEAD_LETTERED = "dead_lettered"
    IN_FLIGHT = "in_flight"
    LOST = "lost"


@dataclass(frozen=True)
class TaskAccount:
    """What became of one published task."""

    task_id: str
    epoch: int
    prompt_index: int
    fate: Fate
    steps: tuple[int, ...] = ()
    """Steps that trained it, in order (more than allowed: duplicated)."""
    reason: str = ""
    """Why it was dead-lettered, or why it counts as lost."""


@dataclass(frozen=True)
class Accounting:
    """A job's ledger joined with NATS: one TaskAccount per published task, and the counts."""

    job_id: str
    tasks: list[TaskAccount]
    duplicated: int
    unpublished: int
    """Task ids trained, stored or dead-lettered that the ledger never saw published."""
    counts: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        tally = Counter(t.fate for t in self.tasks)
        counts = {"published": len(self.tasks), **{f.value: tally.get(f, 0) for f in Fate},
                  "duplicated": self.duplicated, "unpublished": self.unpublished}
        object.__setattr__(self, "counts", counts)

    @property
    def balanced(self) -> bool:
        """Nothing lost, nothing trained twice, nothing downstream that was never published."""
        return self.counts[Fate.LOST] == 0 and self.duplicated == 0 and self.unpublished == 0


# Each: KEYS job hash, ledger key; ARGV[1] lease epoch. Returns -1 when fenced.
_PUBLISHED = jobs.FENCE_LUA + """
if fenced(KEYS[1], ARGV[1]) then return -1 end
for i = 2, #ARGV do redis.call('SADD', KEYS[2], ARGV[i]) end
return 1
"""
_TRAINED = jobs.FENCE_LUA + """
if fenced(KEYS[1], ARGV[1]) then return -1 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return 1
"""
_FORGET = jobs.FENCE_LUA + """
if fenced(KEYS[1], ARGV[1]) then return -1 end
for _, s in ipairs(redis.call('HKEYS', KEYS[2])) do
  if tonumber(s) > tonumber(ARGV[2]) then redis.call('HDEL', KEYS[2], s) end
end
return 1
"""


class Ledger:
    """Writes of the feeder and the learner, and the accounting (replay writes `fate` in its scripts)."""

    redis: aioredis.Redis

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self._published = client.register_script(_PUBLISHED)
        self._trained = client.register_script(_TRAINED)
        self._forget = client.register_script(_FORGET)

    async def published(self, job_id: str, task_ids: list[str], *, lease_epoch: int) -> None:
        """Record tasks about to be published (before the publish: a crash in between shows as lost,
        never as a task that went out unrecorded)."""
        if task_ids:
            await self._fenced(self._published, job_id, "pub", [lease_epoch, *task_ids], "task publishes")

    async def trained(self, job_id: str, step: int, task_ids: list[str], *, lease_epoch: int) -> None:
        """Record the task ids trained in step (a re-trained step after a resume overwrites its record)."""
        await self._fenced(self._trained, job_id, "steps", [lease_epoch, step, " ".join(task_ids)],
                           f"step {step}'s training record")

    async def forget_steps_after(self, job_id: str, step: int, *, lease_epoch: int) -> None:
        """A learner resumed from the checkpoint of `step`: later steps will be trained again."""
        await self._fenced(self._forget, job_id, "steps", [lease_epoch, step], "forgetting later steps")

    async def _fenced(self, script: Any, job_id: str, name: str, args: list[Any], what: str) -> None:
        if int(await script(keys=[jobs.job_key(job_id), key(job_id, name)], args=args)) == -1:
            raise jobs.fenced(job_id, int(args[0]), what)

    async def account(self, js: JetStreamContext, job_id: str, max_trainings: int = 1) -> Accounting:
        """Every published task's fate now; `max_trainings`: steps a task may be trained in (table reuse)."""
        published = {_text(t) for t in await self.redis.smembers(key(job_id, "pub"))}
        in_stream = set(await bus.job_tasks_in_stream(js, job_id))
        dead = {d.task_id: d.reason for d in await bus.dead_letters(js, job_id)}
        fates = {_text(t): _text(f) for t, f in (await self.redis.hgetall(key(job_id, "fate"))).items()}
        steps = {int(s): _text(ids).split() for s, ids in (await self.redis.hgetall(key(job_id, "steps"))).items()}
        trained: dict[str, list[int]] = {}
        for step in sorted(steps):
            for task_id in steps[step]:
                trained.setdefault(task_id, []).append(step)
        tasks = [_account_one(t, tuple(trained.get(t, ())), fates.get(t), dead.get(t), t in in_stream)
                 for t in sorted(published, key=_order)]
        duplicated = sum(len(s) > max_trainings for s in trained.values())
        unpublished = len((set(trained) | set(fates) | set(dead)) - published)
        return Accounting(job_id, tasks, duplicated, unpublished)


def _account_one(task_id: str, steps: tuple[int, ...], fate: str | None, dead: str | None,
                 in_stream: bool) -> TaskAccount:
    epoch, index = _order(task_id)

    def of(kind: Fate, reason: str = "") -> TaskAccount:
        return TaskAccount(task_id, epoch, index, kind, steps, reason)

    if steps:
        return of(Fate.TRAINED)
    if fate == STALE:
        return of(Fate.STALE)
    if fate == EVICTED:
        return of(Fate.EVICTED)
    if fate == STORED:
        return of(Fate.PENDING)
    if dead is not None:
        return of(Fate.DEAD_LETTERED, dead)
    if in_stream:
        return of(Fate.IN_FLIGHT)
    if fate == CONSUMED:
        return of(Fate.LOST, "replay consumed its group, but no surviving step trained it")
    return of(Fate.LOST, "published, but neither in the task stream, dead-lettered nor stored in replay")


def _order(task_id: str) -> tuple[int, int]:
    epoch, index = seeding.parse_task_id(task_id)
    return epoch, index


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
