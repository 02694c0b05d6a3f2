"""Everything a job leaves in each store, and its deletion: Redis, NATS JetStream and the run directory.

One place knows every store a job writes to, so `fleetrl delete` and the gateway's retention delete all
of it and a test can list what is left:
- Redis: the job store's keys (`store.key_patterns`: record, files, steps, lease), the ledger's
  (`ledger.key`), the replay table's (`table.prefix`), and the job's entries in the shared index, the
  idempotency hash and replay's job set;
- NATS: its task and dead-letter consumers, and its messages on the task, dead-letter, event and
  advisory subjects of the shared streams;
- disk: `<run_dir>/jobs/<job>/` (checkpoints, metrics, exported model and adapter);
- the weights, wherever their transport keeps them (`Transport.usage` and `Transport.purge`: NATS's weight
  bucket and pointer entries, or the job's directory under `weights_dir`), counted with that store.
A deletion is idempotent: what is already gone is skipped, so an interrupted one is finished by the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from fleetrl.jobs import store
from fleetrl.replay import table
from fleetrl.tasks import bus, ledger
from fleetrl.weights.transport import Transport

SCAN_COUNT = 500


@dataclass(frozen=True)
class Footprint:
    """What one job holds in each store: bytes (Redis: MEMORY USAGE; NATS: stream bytes of its bucket,
    messages on shared streams) and counts."""

    redis_keys: int = 0
    redis_bytes: int = 0
    nats_messages: int = 0
    nats_bytes: int = 0
    nats_consumers: int = 0
    disk_files: int = 0
    disk_bytes: int = 0
    shared_entries: list[str] = field(default_factory=list)
    """The job's entries in shared Redis structures (index, idempotency hash, replay's job set)."""

    @property
    def empty(self) -> bool:
        return not (self.redis_keys or self.nats_messages or self.nats_consumers or self.disk_files
                    or self.shared_entries)


def _patterns(job_id: str) -> list[str]:
    return [*store.key_patterns(job_id), ledger.key(job_id, "*"), table.prefix(job_id) + "*"]


def _subjects(job_id: str) -> list[tuple[str, str]]:
    """(stream, subject) of the job's messages in the streams every job shares."""
    return [(bus.TASKS_STREAM, bus.task_subject(job_id)), (bus.DLQ_STREAM, bus.dlq_subject(job_id)),
            (bus.EVENTS_STREAM, bus.events_subject(job_id)),
            (bus.ADVISORIES_STREAM, bus.max_deliveries_subject(job_id))]


def _consumers(job_id: str) -> list[tuple[str, str]]:
    return [(bus.TASKS_STREAM, bus.task_consumer(job_id)), (bus.ADVISORIES_STREAM, bus.advisory_consumer(job_id))]


async def _keys(redis: aioredis.Redis, job_id: str) -> list[bytes]:
    found: list[bytes] = []
    for pattern in _patterns(job_id):
        found += [k async for k in redis.scan_iter(match=pattern, count=SCAN_COUNT)]
    return sorted(set(found))


async def _shared_entries(redis: aioredis.Redis, job_id: str) -> list[str]:
    entries = []
    if await redis.zscore(f"{store.PREFIX}jobs:index", job_id) is not None:
        entries.append("jobs:index")
    idem = await redis.hgetall(f"{store.PREFIX}jobs:idem")
    entries += [f"jobs:idem {store.text(k)}" for k, v in idem.items() if store.text(v) == job_id]
    if await redis.sismember(table.JOBS_KEY, job_id):
        entries.append(table.JOBS_KEY)
    return entries


async def footprint(redis: aioredis.Redis, js: JetStreamContext, run_dir: Path, weights: Transport,
                    job_id: str) -> Footprint:
    """What the job holds in every store now; `weights` is the transport its weights went through."""
    bus.check_job_id(job_id)
    keys = await _keys(redis, job_id)
    redis_bytes = sum([int(await redis.memory_usage(k) or 0) for k in keys])
    messages, nats_bytes, consumers = 0, 0, 0
    for stream, subject in _subjects(job_id):
        try:
            info = await js.stream_info(stream, subjects_filter=subject)
        except NotFoundError:
            continue
        messages += sum((info.state.subjects or {}).values())
    for stream, name in _consumers(job_id):
        try:
            await js.consumer_info(stream, name)
            consumers += 1
        except NotFoundError:
            continue
    files, disk_bytes = await asyncio.to_thread(_disk, store.job_dir(run_dir, job_id))
    held = await weights.usage(job_id)
    if held.store == "nats":
        messages, nats_bytes = messages + held.items, nats_bytes + held.size_bytes
    else:
        files, disk_bytes = files + held.items, disk_bytes + held.size_bytes
    return Footprint(len(keys), redis_bytes, messages, nats_bytes, consumers, files, disk_bytes,
                     await _shared_entries(redis, job_id))


def _disk(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
    return len(files), sum(p.stat().st_size for p in files)


async def delete(redis: aioredis.Redis, js: JetStreamContext, run_dir: Path, weights: Transport,
                 job_id: str) -> Footprint:
    """Delete everything of the job in every store; what it held before. Call it for a job that has
    ended: a learner or actor still serving it would write again."""
    before = await footprint(redis, js, run_dir, weights, job_id)
    for stream, name in _consumers(job_id):
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(stream, name)
    for stream, subject in _subjects(job_id):
        with contextlib.suppress(NotFoundError):
            await js.purge_stream(stream, subject=subject)
    await weights.purge(job_id)
    keys = await _keys(redis, job_id)
    async with redis.pipeline(transaction=True) as pipe:
        if keys:
            pipe.unlink(*keys)
        pipe.zrem(f"{store.PREFIX}jobs:index", job_id)
        for entry in before.shared_entries:
            if entry.startswith("jobs:idem "):
                pipe.hdel(f"{store.PREFIX}jobs:idem", entry.removeprefix("jobs:idem "))
        pipe.srem(table.JOBS_KEY, job_id)
        await pipe.execute()
    await asyncio.to_thread(shutil.rmtree, store.job_dir(run_dir, job_id), True)
    return before
