"""The replay domain core: per-job tables of opaque groups in Redis, built from strategies.

Like Reverb's `Table(sampler, remover, rate_limiter, max_size)`, a table is a
`TableConfig`: a `Sampler` (fifo, uniform, prioritized: which groups a Sample
leases and whether stale ones are dropped), a remover (a group leaves after
`max_reuse` commits; fifo: one), a staleness limit (`min_policy_version` per
Sample) and a capacity (oldest unleased group evicted first). Named factories
(`TableConfig.queue`, `.uniform`, `.prioritized`) give the common setups.

Unlike Reverb, every byte of state lives in Redis and each operation is one Lua
script (see `scripts`), so a killed replay process loses nothing, any number of
replicas can serve the same tables, inserts are deduplicated forever on (job,
task id), samples are leased, and lineage stays queryable after consumption.
Groups are opaque bytes (the serialised Group) plus a small `GroupRecord`, so
nothing is re-encoded here. This module imports no grpc.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from fleetrl.errors import (
    FailedPrecondition,
    Fenced,
    FieldViolation,
    FleetError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from fleetrl.jobs.store import REDIS_FULL, REDIS_UNREACHABLE, redis_full
from fleetrl.replay import scripts
from fleetrl.replay.samplers import SAMPLERS, Sampler
from fleetrl.spec.config import DEFAULT_LEASE_TIMEOUT_S, MAX_CAPACITY_GROUPS, MAX_LEASE_TIMEOUT_S, MAX_REUSE
from fleetrl.tasks import ledger

log = logging.getLogger(__name__)

JOBS_KEY = "fleetrl:replay:jobs"
SAFE_POLICIES = frozenset({"noeviction"})
COUNTERS = ("inserted", "duplicates", "sampled", "committed", "expired_leases", "evicted", "stale_dropped")


def prefix(job_id: str) -> str:
    """Key prefix of a job's table."""
    return f"fleetrl:replay:{job_id}:"


def _out_of_bounds(field: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"{field} {why}", [FieldViolation(field, why)])


@dataclass(frozen=True)
class TableConfig:
    """Settings of one job's table, within the bounds of a job's `ReplayConfig` (stated there once)."""

    capacity_groups: int
    sampler: Sampler
    max_reuse: int = 1
    lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 1 <= self.capacity_groups <= MAX_CAPACITY_GROUPS:
            raise _out_of_bounds("capacity_groups", f"must be in [1, {MAX_CAPACITY_GROUPS}]")
        if not 1 <= self.max_reuse <= MAX_REUSE:
            raise _out_of_bounds("max_reuse", f"must be in [1, {MAX_REUSE}]")
        if not self.sampler.reuses and self.max_reuse != 1:
            raise _out_of_bounds("max_reuse", f"must be 1 with the {self.sampler.name} sampler (it never reuses)")
        if not 0 < self.lease_timeout_s <= MAX_LEASE_TIMEOUT_S:
            raise _out_of_bounds("lease_timeout_s", f"must be in (0, {MAX_LEASE_TIMEOUT_S}]")

    @classmethod
    def of(cls, capacity_groups: int, sampler: Sampler, max_reuse: int = 0,
           lease_timeout_s: float = 0.0) -> TableConfig:
        """A table as ConfigureTable asks for it: 0 means the default (max_reuse 1, lease 300 s);
        a sampler without reuse trains each group once whatever max_reuse says."""
        max_reuse = max(1, max_reuse) if sampler.reuses else 1
        return cls(capacity_groups, sampler, max_reuse, lease_timeout_s or DEFAULT_LEASE_TIMEOUT_S)

    @classmethod
    def queue(cls, capacity_groups: int, lease_timeout_s: float = 300.0) -> TableConfig:
        """On-policy: oldest first, each group trained once, stale groups dropped."""
        return cls(capacity_groups, SAMPLERS["fifo"], 1, lease_timeout_s)

    @classmethod
    def uniform(cls, capacity_groups: int, max_reuse: int, lease_timeout_s: float = 300.0) -> TableConfig:
        """Off-policy: uniformly at random, each group trained up to max_reuse times."""
        return cls(capacity_groups, SAMPLERS["uniform"], max_reuse, lease_timeout_s)

    @classmethod
    def prioritized(cls, capacity_groups: int, max_reuse: int, lease_timeout_s: float = 300.0) -> TableConfig:
        """Off-policy: proportional to priority, each group trained up to max_reuse times."""
        return cls(capacity_groups, SAMPLERS["prioritized"], max_reuse, lease_timeout_s)


@dataclass(frozen=True)
class GroupRecord:
    """One group as the table sees it: the serialised Group plus what sampling and lineage need."""

    job_id: str
    task_id: str
    policy_version: int
    mean_reward: float
    priority: float
    payload: bytes
    lineage: dict[str, Any] = field(default_factory=dict)
    """actor_id, trace_id, delivery_attempt, ...: kept for Query after the group is consumed."""


@dataclass(frozen=True)
class SampleResult:
    lease_id: str
    payloads: list[bytes]
    stale_dropped: int
    expires_unix_ms: int


@dataclass(frozen=True)
class TableStats:
    job_id: str
    size_groups: int
    leased_groups: int
    inserted: int = 0
    duplicates: int = 0
    sampled: int = 0
    committed: int = 0
    expired_leases: int = 0
    evicted: int = 0
    stale_dropped: int = 0


@dataclass(frozen=True)
class LineageRow:
    task_id: str
    policy_version: int
    mean_reward: float
    times_committed: int
    lineage: dict[str, Any]


class ReplayTables:
    """All jobs' tables in one Redis. Every method is one atomic script (or a read)."""

    redis: aioredis.Redis
    max_lineage_records: int
    poll_interval_s: float
    fsync_timeout_s: float
    waits_for_fsync: bool

    def __init__(self, client: aioredis.Redis, *, max_lineage_records: int = 1_000_000,
                 poll_interval_s: float = 0.02, fsync_timeout_s: float = 0.0) -> None:
        self.redis = client
        self.max_lineage_records = max_lineage_records
        self.poll_interval_s = poll_interval_s
        self.fsync_timeout_s = fsync_timeout_s
        self.waits_for_fsync = False  # set by check_fsync
        self._insert = client.register_script(scripts.INSERT)
        self._sample = client.register_script(scripts.SAMPLE)
        self._commit = client.register_script(scripts.COMMIT)
        self._release = client.register_script(scripts.RELEASE)
        self._renew = client.register_script(scripts.RENEW)
        self._status = client.register_script(scripts.STATUS)
        self._raise_fence = client.register_script(scripts.RAISE_FENCE)

    async def check_redis(self) -> None:
        """Refuse a Redis that may evict keys silently; warn when CONFIG is disabled."""
        try:
            policy = (await self.redis.config_get("maxmemory-policy")).get("maxmemory-policy")
        except ResponseError as error:
            log.warning("cannot read maxmemory-policy (%s); make sure it is noeviction", error)
            return
        if policy not in SAFE_POLICIES:
            raise FailedPrecondition(
                f"Redis maxmemory-policy is {policy!r}: it may evict replay groups silently; "
                "set `maxmemory-policy noeviction`")

    async def check_fsync(self) -> None:
        """Set `waits_for_fsync` when fsync_timeout_s > 0 and Redis can confirm an insert's fsync to its AOF
        (`WAITAOF`: needs `appendonly yes` and Redis >= 7.2 or Valkey), so `insert` answers only then; warns
        when it cannot, and inserts are then answered once Redis applied them."""
        if self.fsync_timeout_s <= 0:
            return
        try:
            await _run(self.redis.execute_command("WAITAOF", 1, 0, 100))
        except ResponseError as error:
            log.warning("inserts are answered before they are on disk: WAITAOF failed (%s); a Redis crash may "
                        "lose acknowledged groups (docs/guarantees.md)", error)
            return
        self.waits_for_fsync = True

    async def configure(self, job_id: str, cfg: TableConfig, lease_epoch: int = 0) -> int:
        """Create or update a job's table; returns the groups it holds. Raises the table's fence to
        lease_epoch first (Fenced below it)."""
        p = prefix(job_id)
        if int(await _run(self._raise_fence(args=[p, lease_epoch]))) == -1:
            raise Fenced(f"job {job_id}: ConfigureTable under lease epoch {lease_epoch} refused: a newer "
                         "learner configured the table")
        mapping: dict[str | bytes, str | int] = {
            "capacity": cfg.capacity_groups, "sampler": cfg.sampler.name, "selection": cfg.sampler.selection,
            "drops_stale": int(cfg.sampler.drops_stale), "max_reuse": cfg.max_reuse,
            "lease_timeout_ms": int(cfg.lease_timeout_s * 1000)}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(p + "cfg", mapping=mapping)  # type: ignore[arg-type]
            pipe.sadd(JOBS_KEY, job_id)
            pipe.zcard(p + "stored")
            result = await _run(pipe.execute())
        return int(result[-1])

    async def config(self, job_id: str) -> TableConfig:
        raw = await _run(self.redis.hgetall(prefix(job_id) + "cfg"))
        if not raw:
            raise _no_table(job_id)
        return TableConfig(int(raw[b"capacity"]), SAMPLERS[raw[b"sampler"].decode()],
                           int(raw[b"max_reuse"]), int(raw[b"lease_timeout_ms"]) / 1000)

    async def insert(self, records: list[GroupRecord]) -> tuple[list[bool], int]:
        """Store groups: one script call per job holding all of its groups (a request rarely mixes jobs), all
        in one pipeline; with `waits_for_fsync`, the pipeline ends with WAITAOF on the same connection, and
        the groups are answered only once Redis has them on disk. Returns (inserted? per group, evicted).
        Raises Unavailable when the fsync is not confirmed within fsync_timeout_s, and ResourceExhausted
        when the AOF write failed (a full disk): the groups may be stored, and a retry is answered
        duplicate once they are on disk (every insert script writes, so its WAITAOF covers any earlier
        write of the same groups: the AOF is one ordered log)."""
        by_job: dict[str, list[int]] = {}
        for i, r in enumerate(records):
            by_job.setdefault(r.job_id, []).append(i)
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id, indices in by_job.items():
                args: list[str | bytes | int] = [prefix(job_id), self.max_lineage_records]
                for i in indices:
                    r = records[i]
                    lineage = {**r.lineage, "policy_version": r.policy_version, "mean_reward": r.mean_reward}
                    args += [r.task_id, r.payload, r.policy_version, repr(r.priority),
                             json.dumps(lineage, separators=(",", ":"))]
                await self._insert(keys=[ledger.key(job_id, "fate")], args=args, client=pipe)
            if self.waits_for_fsync:
                pipe.execute_command("WAITAOF", 1, 0, max(1, round(self.fsync_timeout_s * 1000)))
            results = await _run(pipe.execute())
        outcomes, evicted = [False] * len(records), 0
        for (job_id, indices), result in zip(by_job.items(), results[:len(by_job)], strict=True):
            if result[0] == -1:
                raise _no_table(job_id)
            for i, outcome in zip(indices, result[:-1], strict=True):
                outcomes[i] = outcome == 1
            evicted += int(result[-1])
        if self.waits_for_fsync and int(results[-1][0]) < 1:
            raise await self._not_on_disk()
        return outcomes, evicted

    async def _not_on_disk(self) -> FleetError:
        """Why Redis did not confirm an insert's fsync in time: its AOF write failed (the MISCONF condition:
        every write is refused until its disk has space), or the fsync is slow."""
        info = await _run(self.redis.info("persistence"))
        if info.get("aof_last_write_status") == "err":
            return ResourceExhausted(f"{REDIS_FULL[1]} (MISCONF, is its disk full?): the AOF write of this insert "
                                     "failed (retry later)")
        return Unavailable(f"Redis did not confirm the insert on disk within {self.fsync_timeout_s:g} s (a slow "
                           "AOF fsync; retry: the retry is answered duplicate once the groups are on disk)")

    async def sample(self, job_id: str, max_groups: int, min_policy_version: int = 0,
                     wait_s: float = 0.0, seed: int = 0) -> SampleResult:
        """Lease up to max_groups eligible groups, waiting up to wait_s for that many."""
        if max_groups < 1:
            raise InvalidArgument("max_groups must be at least 1")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if (await self._state(job_id, min_policy_version))[2] >= max_groups:
                break
            await asyncio.sleep(self.poll_interval_s)
        lease_id = uuid.uuid4().hex
        seed = seed or random.getrandbits(31)
        args: list[str | int] = [prefix(job_id), max_groups, min_policy_version, seed, lease_id]
        out = await _run(self._sample(keys=[ledger.key(job_id, "fate")], args=args))
        if out[0] == -1:
            raise _no_table(job_id)
        payloads = list(out[2:])
        return SampleResult(lease_id if payloads else "", payloads, int(out[0]), int(out[1]))

    async def commit(self, job_id: str, lease_id: str, lease_epoch: int = 0) -> int:
        """Consume a lease's groups; 0 if it was committed before. Fenced when a newer job-lease epoch
        configured the table."""
        n = int(await _run(self._commit(keys=[ledger.key(job_id, "fate")],
                                        args=[prefix(job_id), lease_id, lease_epoch])))
        if n == -2:
            raise _no_table(job_id)
        if n == -3:
            raise Fenced(f"job {job_id}: commit of lease {lease_id} under lease epoch {lease_epoch} refused: a "
                         "newer learner configured the table")
        if n == -1:
            raise NotFound(f"lease {lease_id!r} of job {job_id!r} is unknown or expired "
                           "(its groups went back to the table)")
        return n

    async def release(self, job_id: str, lease_id: str) -> int:
        """Return a lease's groups to the table now."""
        n = int(await _run(self._release(args=[prefix(job_id), lease_id])))
        if n == -2:
            raise _no_table(job_id)
        if n == -1:
            raise NotFound(f"lease {lease_id!r} of job {job_id!r} is unknown or expired")
        return max(n, 0)

    async def renew(self, job_id: str, lease_ids: list[str]) -> tuple[list[str], int]:
        """Extend open leases to lease_timeout_s from now: (ids not open any more, new expiry unix ms)."""
        out = await _run(self._renew(args=[prefix(job_id), *lease_ids]))
        if out[0] == -1:
            raise _no_table(job_id)
        return [lease.decode() for lease in out[1:]], int(out[0])

    async def stats(self, job_id: str) -> TableStats:
        """Counters of a job's table (expired leases are reclaimed first)."""
        stored, avail, _, _ = await self._state(job_id, 0)
        raw = await _run(self.redis.hmget(prefix(job_id) + "ctr", list(COUNTERS)))
        counts = {name: int(v or 0) for name, v in zip(COUNTERS, raw, strict=True)}
        return TableStats(job_id, stored, stored - avail, **counts)

    async def query(self, job_id: str, min_pv: int, max_pv: int | None, reward_range: tuple[float, float] | None,
                    limit: int) -> list[LineageRow]:
        """Lineage of groups (stored or consumed) by policy-version range and mean-reward range."""
        await self._state(job_id, 0)
        p = prefix(job_id)
        hi: int | str = "+inf" if max_pv is None else max_pv
        rows: list[LineageRow] = []
        offset, page = 0, 1000
        while len(rows) < limit:
            ids = await _run(self.redis.zrangebyscore(p + "linpv", min_pv, hi, start=offset, num=page))
            if not ids:
                break
            offset += len(ids)
            rows.extend(await self._rows(p, ids, reward_range))
        return rows[:limit]

    async def jobs(self) -> list[str]:
        """Every job that has a table."""
        return sorted(job.decode() for job in await _run(self.redis.smembers(JOBS_KEY)))

    async def reclaim_all(self) -> int:
        """Return the groups of every job's expired leases; the number of leases reclaimed."""
        total = 0
        for job in await self.jobs():
            total += (await self._state(job, 0))[3]
        return total

    async def _rows(self, p: str, ids: list[bytes], reward_range: tuple[float, float] | None) -> list[LineageRow]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(p + "lin", ids)
            pipe.hmget(p + "reuse", ids)
            lins, reuses = await _run(pipe.execute())
        rows = []
        for task, lin, reuse in zip(ids, lins, reuses, strict=True):
            if lin is None:
                continue
            data = json.loads(lin)
            reward = float(data.pop("mean_reward"))
            if reward_range is not None and not reward_range[0] <= reward <= reward_range[1]:
                continue
            rows.append(LineageRow(task.decode(), int(data.pop("policy_version", 0)), reward,
                                   int(reuse or 0), data))
        return rows

    async def _state(self, job_id: str, min_pv: int) -> list[int]:
        out = await _run(self._status(args=[prefix(job_id), min_pv]))
        if out[0] == -1:
            raise _no_table(job_id)
        return [int(x) for x in out]


def stats_dict(stats: TableStats) -> dict[str, Any]:
    return asdict(stats)


def _no_table(job_id: str) -> NotFound:
    return NotFound(f"job {job_id!r} has no replay table: the learner must call ConfigureTable "
                    "for it first (retry shortly if the learner is starting)")


def _mapped(error: BaseException) -> BaseException:
    if full := redis_full(error):
        return ResourceExhausted(f"{full} (retry later)")
    if isinstance(error, REDIS_UNREACHABLE):
        return Unavailable(f"Redis unreachable: {error}")
    return error


_MAPPED: tuple[type[Exception], ...] = (ResponseError, *REDIS_UNREACHABLE)


async def _run(awaitable: Any) -> Any:
    """Await a Redis call, turning a full Redis (`redis_full`) into ResourceExhausted and lost connections into
    Unavailable."""
    try:
        return await awaitable
    except _MAPPED as error:
        raise _mapped(error) from error
