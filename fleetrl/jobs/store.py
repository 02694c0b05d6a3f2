"""The job store: job records, their files and step metrics, in Redis.

The gateway creates jobs; a learner claims one (a lease key with a TTL, so at
most one learner runs a job and a crashed learner's job is claimable again
once its lease lapses); actors read the spec and the prompt/reward files.
State changes are compare-and-set Lua scripts, so two writers never race a job
out of a terminal state. Keys (all under `fleetrl:`):

- `jobs:index` zset job_id -> created ms;  `jobs:idem` hash tenant/key -> job_id
- `job:<id>` hash (record fields);  `job:<id>:prompts`, `job:<id>:reward_file`,
  `job:<id>:environment_file`, `job:<id>:eval_prompts` bytes
- `job:<id>:lease` learner id with TTL;  `job:<id>:steps` list of step-metric JSON
- `tenant:<tenant>:submit-lock` a random token with TTL (`submission_lock`)

Fencing: every claim increments the record's `lease_epoch`, and the claimant carries that epoch
on every write it makes for the job. `FENCE_LUA` is the one rule, used by the scripts here and by
the ledger's: a write whose epoch is below the record's is refused (`Fenced`), so a learner that
was stopped past its lease cannot write over the learner that took the job over.

Reconnects: a call whose connection is refused or dropped (Redis restarting, or still loading its
AOF) is retried every `REDIS_RETRY_INTERVAL_S` for up to `REDIS_RETRY_S` (`RetryFor`), so a Redis
restart is a pause, not an error, for every service. A timeout (a stopped Redis) is not retried:
the call raises after the socket timeout. Retried writes are safe: the scripts are idempotent or
compare-and-set (`_APPEND_STEP` skips a step it holds).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import enum
import json
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff

from fleetrl.errors import FailedPrecondition, Fenced, NotFound, Unavailable
from fleetrl.runtime import redisutil
from fleetrl.spec.config import JobSpec

PREFIX = "fleetrl:"
SUBMIT_LOCK_TTL_MS = 30_000
"""A submission lock's lifetime: far above a create (a transaction of at most the size caps' bytes)."""
SUBMIT_LOCK_WAIT_S = 10.0
SUBMIT_LOCK_POLL_S = 0.02
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
REDIS_UNREACHABLE: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
"""What redis-py raises when Redis is down, restarting (BusyLoadingError is a ConnectionError) or stopped
past the socket timeout. Neither is a subclass of the builtin ConnectionError or TimeoutError: a retry
path that catches the builtins lets these through (tests/common/test_redis_errors.py)."""


def redis_full(error: BaseException) -> str:
    """Why Redis refused a write for want of space, or "" when error is anything else. Two refusals are
    one condition to their callers: at `maxmemory` under `noeviction`, a write is refused OOM
    (redis-py's OutOfMemoryError); when Valkey cannot write its AOF (its disk is full), every write is
    refused MISCONF. Reads, and under OOM deletes and expiry changes, still work, and writes are
    accepted again once memory or disk is freed: a full Redis is an outage of writes, not an error of
    the job that hit it."""
    if not isinstance(error, redis.exceptions.ResponseError):
        return ""
    text = str(error)
    if isinstance(error, redis.exceptions.OutOfMemoryError) or text.startswith("OOM"):
        return f"{REDIS_FULL[0]} (maxmemory reached, noeviction): {text}"
    if text.startswith("MISCONF"):
        return f"{REDIS_FULL[1]} (MISCONF, is its disk full?): {text}"
    return ""


REDIS_FULL = ("Redis is out of memory", "Redis cannot persist writes")
"""How each `redis_full` reason begins, so a reason that crossed gRPC (replay's RESOURCE_EXHAUSTED carries
it) is known again: `reason.startswith(REDIS_FULL)`."""


REDIS_RETRY_S = 10.0
"""How long a JobStore call keeps reconnecting to a Redis that refuses or drops its connection."""
REDIS_RETRY_INTERVAL_S = 0.25
RENEW_SHARE_OF_LEASE = 1 / 3
"""The most one job-lease renewal may take, as a share of the lease: a renewal gives up after
`lease_s * RENEW_SHARE_OF_LEASE` whatever the client's socket timeout (10 s) and retries (`RetryFor`,
nested: about 2 x `REDIS_RETRY_S`) would allow, so a renewal never outlasts the lease it renews."""


class RetryFor(Retry):
    """redis-py's Retry bounded by time, not by a count: a call retries a refused or dropped connection
    until `deadline_s` after its first attempt, then raises that ConnectionError. redis-py nests the
    connect's retry inside the command's, so one call waits at most about twice `deadline_s`."""

    deadline_s: float

    def __init__(self, deadline_s: float, interval_s: float = REDIS_RETRY_INTERVAL_S) -> None:
        super().__init__(ConstantBackoff(interval_s), -1, supported_errors=(redis.exceptions.ConnectionError,))
        self.deadline_s = deadline_s

    async def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                              with_failure_count: bool = False) -> Any:
        deadline = time.monotonic() + self.deadline_s

        async def failed(error: Exception, *count: int) -> None:
            await fail(error, *count)  # redis-py's cleanup (drop the connection) first
            if time.monotonic() >= deadline:
                raise error

        return await super().call_with_retry(do, failed, is_retryable, with_failure_count)


class JobState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


ACTIVE = (JobState.QUEUED, JobState.RUNNING)


ADAPTER_DIR = "adapter"
"""A LoRA job's exported PEFT adapter directory: this name, beside its exported model (`model_uri`)."""


@dataclass(frozen=True)
class JobRecord:
    """A job as stored."""

    job_id: str
    tenant: str
    name: str
    state: JobState
    reason: str
    spec: JobSpec
    created_ms: int
    updated_ms: int
    model_uri: str
    last_step: dict[str, Any] | None
    sandbox: str = ""
    """The reward sandbox the job's reward was checked in at submission (the reward service's summary)."""
    lease_epoch: int = 0
    """How many times the job was claimed: the fencing token of its current learner."""
    weight: float = 1.0
    """Its tenant's share of actor time at submission (the gateway's `TenantQuota.weight`)."""

    @classmethod
    def from_hash(cls, fields: Mapping[bytes | str, bytes | str]) -> JobRecord:
        f = {text(k): text(v) for k, v in fields.items()}
        return cls(
            job_id=f["job_id"], tenant=f["tenant"], name=f["name"], state=JobState(f["state"]),
            reason=f.get("reason", ""), spec=JobSpec.model_validate_json(f["spec_json"]),
            created_ms=int(f["created_ms"]), updated_ms=int(f["updated_ms"]),
            model_uri=f.get("model_uri", ""), last_step=json.loads(f["last_step"]) if f.get("last_step") else None,
            sandbox=f.get("sandbox", ""),
            lease_epoch=int(f.get("lease_epoch", 0)),
            weight=float(f.get("weight", 1.0)),
        )


def text(value: object) -> str:
    """A Redis reply as text (the client returns bytes; its type stubs allow any reply shape)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def now_ms() -> int:
    return int(time.time() * 1000)


def job_dir(run_dir: Path, job_id: str) -> Path:
    """Where a job's files live on the learner's disk: checkpoints, metrics.jsonl, the exported model."""
    return Path(run_dir) / "jobs" / job_id


def key_patterns(job_id: str) -> list[str]:
    """Redis SCAN patterns of every key of one job in the job store."""
    return [_key(job_id), _key(job_id, ":*")]


def _key(job_id: str, suffix: str = "") -> str:
    return f"{PREFIX}job:{job_id}{suffix}"


def job_key(job_id: str) -> str:
    """The job's record hash (its `lease_epoch` field is what FENCE_LUA compares)."""
    return _key(job_id)


FENCE_LUA = """
local function fenced(job_key, epoch)
  return tonumber(redis.call('HGET', job_key, 'lease_epoch') or '0') > tonumber(epoch)
end
"""
"""Lua: `fenced(job_key, epoch)` is true when a newer claim of the job exists."""

# KEYS: job hash, steps list; ARGV: lease epoch, step, payload, now ms. Returns -1 fenced, 0 known, 1 added.
_APPEND_STEP = FENCE_LUA + """
if fenced(KEYS[1], ARGV[1]) then return -1 end
if tonumber(ARGV[2]) <= redis.call('LLEN', KEYS[2]) then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'last_step', ARGV[3], 'updated_ms', ARGV[4])
return 1
"""


# KEYS: job hash; ARGV: lease epoch, reason, now ms. Returns -1 fenced, 0 not running, 1 set.
_SET_PAUSE_REASON = FENCE_LUA + """
if fenced(KEYS[1], ARGV[1]) then return -1 end
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'reason', ARGV[2], 'updated_ms', ARGV[3])
return 1
"""

# KEYS[1]=job hash; ARGV: new state, reason, now ms, allowed-from states...
_SET_STATE = """
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {-1, ''} end
for i = 4, #ARGV do
  if ARGV[i] == cur then
    redis.call('HSET', KEYS[1], 'state', ARGV[1], 'reason', ARGV[2], 'updated_ms', ARGV[3])
    return {1, cur}
  end
end
return {0, cur}
"""

# KEYS[1]=index zset; ARGV: learner id, lease ms, now ms, prefix, base. Claims the oldest active job
# without a live lease; a RUNNING job without a lease is one whose learner died: it is resumed (and a
# pause reason its previous learner left is cleared). A base other than '' claims only a LoRA job on that
# base model (a learner adding a job to the LoRA jobs it trains: `JobStore.claim`). A write script (the
# shebang, without allow-oom): a Redis that refuses writes refuses every claim, also one that finds nothing
# to take, so a learner paused on a full Redis keeps saying so until Redis takes writes again.
_CLAIM = """#!lua
local function on_base(h, base)
  if base == '' then return true end
  local ok, spec = pcall(cjson.decode, redis.call('HGET', h, 'spec_json') or '')
  if not ok or type(spec) ~= 'table' or type(spec['train']) ~= 'table' then return false end
  return spec['model'] == base and type(spec['train']['lora']) == 'table'
end
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, id in ipairs(ids) do
  local h = ARGV[4] .. 'job:' .. id
  local st = redis.call('HGET', h, 'state')
  if (st == 'queued' or st == 'running') and redis.call('EXISTS', h .. ':lease') == 0 and on_base(h, ARGV[5]) then
    if redis.call('SET', h .. ':lease', ARGV[1], 'NX', 'PX', ARGV[2]) then
      redis.call('HINCRBY', h, 'lease_epoch', 1)
      redis.call('HSET', h, 'state', 'running', 'updated_ms', ARGV[3], 'learner_id', ARGV[1], 'reason', '')
      return id
    end
  end
end
return false
"""

# KEYS[1]=lease key; ARGV: learner id, lease ms. Renew only our own lease. A write script (the shebang,
# without allow-oom): a Redis that refuses writes refuses the renewal, OOM included, where a bare PEXPIRE
# would go through, so a learner that writes nothing else meanwhile (waiting for groups) still meets it.
_RENEW = """#!lua
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2]); return 1
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class JobStore:
    """Async access to job records. One instance per process; cheap to share."""

    redis: aioredis.Redis

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self._set_state = client.register_script(_SET_STATE)
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._append_step = client.register_script(_APPEND_STEP)
        self._set_pause_reason = client.register_script(_SET_PAUSE_REASON)
        self._fence = client.register_script(FENCE_LUA + "return fenced(KEYS[1], ARGV[1]) and 1 or 0")
        self._unlock = client.register_script(_UNLOCK)

    @classmethod
    def from_url(cls, url: str, retry_s: float = REDIS_RETRY_S, tls_ca_file: Path | None = None) -> JobStore:
        return cls(redisutil.client(url, tls_ca_file=tls_ca_file, socket_timeout=10, socket_connect_timeout=5,
                                    retry=RetryFor(retry_s)))

    async def close(self) -> None:
        await self.redis.aclose()

    async def create(
        self, tenant: str, spec: JobSpec, prompts: bytes, reward_file: bytes | None, idempotency_key: str = "",
        *, eval_prompts: bytes | None = None, sandbox: str = "", environment_file: bytes | None = None,
        weight: float = 1.0,
    ) -> JobRecord:
        """Store a new queued job with its files, all in one transaction; same key, same job."""
        existing = await self.find_idempotent(tenant, idempotency_key)
        if existing is not None:
            return existing
        job_id = "j-" + secrets.token_hex(6)
        ms = now_ms()
        record: dict[Any, Any] = {
            "job_id": job_id, "tenant": tenant, "name": spec.name, "state": JobState.QUEUED.value, "reason": "",
            "spec_json": spec.model_dump_json(), "created_ms": ms, "updated_ms": ms, "model_uri": "",
            "sandbox": sandbox, "weight": repr(float(weight)),
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(_key(job_id), mapping=record)
            pipe.set(_key(job_id, ":prompts"), prompts)
            if reward_file is not None:
                pipe.set(_key(job_id, ":reward_file"), reward_file)
            if eval_prompts is not None:
                pipe.set(_key(job_id, ":eval_prompts"), eval_prompts)
            if environment_file is not None:
                pipe.set(_key(job_id, ":environment_file"), environment_file)
            pipe.zadd(f"{PREFIX}jobs:index", {job_id: ms})
            if idempotency_key:
                pipe.hset(f"{PREFIX}jobs:idem", f"{tenant}/{idempotency_key}", job_id)
            await pipe.execute()
        return await self.get(job_id)

    @contextlib.asynccontextmanager
    async def submission_lock(self, tenant: str, wait_s: float = SUBMIT_LOCK_WAIT_S) -> AsyncIterator[None]:
        """Hold the tenant's submission lock: one submission of a tenant at a time across every gateway
        replica, so its quota count and idempotency check and its create see no other submission of the
        tenant between them (checked, then created, two concurrent submissions would both pass the
        quota, or both create a job for one idempotency key). Unavailable after wait_s of waiting. A
        lock its holder left (a gateway killed) lapses after SUBMIT_LOCK_TTL_MS; only the holder's
        token releases it."""
        key, token = f"{PREFIX}tenant:{tenant}:submit-lock", secrets.token_hex(8)
        deadline = time.monotonic() + wait_s
        while not await self.redis.set(key, token, nx=True, px=SUBMIT_LOCK_TTL_MS):
            if time.monotonic() > deadline:
                raise Unavailable(f"another submission of tenant {tenant!r} held its submission lock for {wait_s:g}s")
            await asyncio.sleep(SUBMIT_LOCK_POLL_S)
        try:
            yield
        finally:
            await self._unlock(keys=[key], args=[token])

    async def find_idempotent(self, tenant: str, idempotency_key: str) -> JobRecord | None:
        """The job the tenant submitted with this idempotency key, or None (always None without a key)."""
        if not idempotency_key:
            return None
        existing = await self.redis.hget(f"{PREFIX}jobs:idem", f"{tenant}/{idempotency_key}")
        return await self.get(text(existing)) if existing else None

    async def get(self, job_id: str) -> JobRecord:
        fields = await self.redis.hgetall(_key(job_id))
        if not fields:
            raise NotFound(f"job {job_id!r} does not exist")
        return JobRecord.from_hash(fields)

    async def list(self, tenant: str | None = None, limit: int = 50) -> builtins.list[JobRecord]:
        """Newest first; tenant None lists every tenant's jobs."""
        ids = await self.redis.zrevrange(f"{PREFIX}jobs:index", 0, -1)
        out: builtins.list[JobRecord] = []
        for raw in ids:
            try:
                record = await self.get(text(raw))
            except NotFound:  # deleted (retention, DeleteJob) since the index was read
                continue
            if tenant is None or record.tenant == tenant:
                out.append(record)
                if len(out) >= limit:
                    break
        return out

    async def files(self, job_id: str) -> tuple[bytes, bytes | None]:
        """The job's prompt JSONL and reward file (None when the reward is a built-in)."""
        prompts, reward_file = await self.redis.mget(_key(job_id, ":prompts"), _key(job_id, ":reward_file"))
        if prompts is None:
            raise NotFound(f"job {job_id!r} has no prompts stored")
        return cast(bytes, prompts), cast(bytes | None, reward_file)

    async def eval_prompts(self, job_id: str) -> bytes | None:
        """The job's eval prompt JSONL, None when its spec names none."""
        return cast(bytes | None, await self.redis.get(_key(job_id, ":eval_prompts")))
    async def environment_file(self, job_id: str) -> bytes | None:
        """The job's environment file (None when the job has no environment)."""
        return cast(bytes | None, await self.redis.get(_key(job_id, ":environment_file")))

    async def set_state(
        self, job_id: str, state: JobState, reason: str = "", *, allowed_from: tuple[JobState, ...] = ACTIVE
    ) -> JobRecord:
        """Move the job to state if it is in one of allowed_from; FailedPrecondition otherwise."""
        changed, previous = await self._set_state(
            keys=[_key(job_id)], args=[state.value, reason, now_ms(), *(s.value for s in allowed_from)]
        )
        if changed == -1:
            raise NotFound(f"job {job_id!r} does not exist")
        if changed == 0:
            raise FailedPrecondition(f"job {job_id} is {text(previous)}, cannot become {state.value}")
        await self.redis.publish(f"{PREFIX}job-events", job_id)
        return await self.get(job_id)

    async def claim(self, learner_id: str, lease_s: float, *, lora_base: str = "") -> JobRecord | None:
        """Take the oldest queued (or orphaned running) job; None if there is none. With `lora_base`, only a
        job that trains LoRA adapters on that base model (`train.lora` set, `model` equal): one a learner
        already holding that base can add to the jobs it trains (`LearnerSettings.max_jobs`)."""
        job_id = await self._claim(
            keys=[f"{PREFIX}jobs:index"], args=[learner_id, int(lease_s * 1000), now_ms(), PREFIX, lora_base]
        )
        return await self.get(text(job_id)) if job_id else None

    async def renew(self, job_id: str, learner_id: str, lease_s: float, *, timeout_s: float | None = None) -> bool:
        """Extend our lease; False means we lost the job (another learner may own it now). A Redis that refuses
        writes (`redis_full`) refuses the renewal too, OOM included. Gives up after
        timeout_s (default `lease_s * RENEW_SHARE_OF_LEASE`), raising redis-py's TimeoutError (one of
        REDIS_UNREACHABLE) instead of waiting out the client's socket timeout and nested retries."""
        bound_s = lease_s * RENEW_SHARE_OF_LEASE if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(bound_s):
                return bool(await self._renew(keys=[_key(job_id, ":lease")],
                                              args=[learner_id, int(lease_s * 1000)]))
        except TimeoutError as error:  # the builtin, from asyncio.timeout: no redis-py timeout is one
            raise redis.exceptions.TimeoutError(
                f"job {job_id}: lease renewal gave up after {bound_s:.2f} s (Redis unreachable)") from error

    async def release(self, job_id: str, learner_id: str) -> None:
        await self._release(keys=[_key(job_id, ":lease")], args=[learner_id])

    async def lease_holder(self, job_id: str) -> str | None:
        holder = await self.redis.get(_key(job_id, ":lease"))
        return text(holder) if holder else None

    async def append_step(self, job_id: str, metrics: dict[str, Any], *, lease_epoch: int) -> None:
        """Record one step's metrics (must contain "step"); idempotent per step number (a resumed
        learner re-reporting a step adds nothing). Fenced when a newer claim than lease_epoch exists."""
        done = await self._append_step(keys=[_key(job_id), _key(job_id, ":steps")],
                                       args=[lease_epoch, int(metrics["step"]), json.dumps(metrics), now_ms()])
        if int(done) == -1:
            raise fenced(job_id, lease_epoch, f"step {metrics['step']}'s metrics")

    async def set_pause_reason(self, job_id: str, reason: str, *, lease_epoch: int) -> None:
        """Say why the running job is paused (a store its learner writes to is full), or "" once it goes
        on: GetJob shows the reason beside state RUNNING. A job no longer running keeps its own reason.
        Fenced when a newer claim than lease_epoch exists."""
        if int(await self._set_pause_reason(keys=[_key(job_id)], args=[lease_epoch, reason, now_ms()])) == -1:
            raise fenced(job_id, lease_epoch, "the job's pause reason")

    async def check_fence(self, job_id: str, lease_epoch: int, what: str) -> None:
        """Fenced when the job was claimed again after the claim of lease_epoch (before writing `what`)."""
        if int(await self._fence(keys=[_key(job_id)], args=[lease_epoch])):
            raise fenced(job_id, lease_epoch, what)

    async def steps(self, job_id: str, from_step: int = 0) -> builtins.list[dict[str, Any]]:
        """Step metrics from from_step on (steps are 1-based)."""
        raw = await self.redis.lrange(_key(job_id, ":steps"), max(0, from_step - 1), -1)
        return [json.loads(item) for item in raw]

    async def set_model_uri(self, job_id: str, uri: str) -> None:
        await self.redis.hset(_key(job_id), mapping={"model_uri": uri, "updated_ms": now_ms()})

    async def active_jobs(self) -> builtins.list[JobRecord]:
        """Jobs queued or running, oldest first (what actors serve)."""
        ids = await self.redis.zrange(f"{PREFIX}jobs:index", 0, -1)
        records = []
        for raw in ids:
            with contextlib.suppress(NotFound):  # deleted (retention, DeleteJob) since the index was read
                records.append(await self.get(text(raw)))
        return [r for r in records if r.state in ACTIVE]


def fenced(job_id: str, lease_epoch: int, what: str) -> Fenced:
    return Fenced(f"job {job_id}: {what} refused: written under lease epoch {lease_epoch}, "
                  "and another learner has claimed the job since")


def require_state(record: JobRecord, *states: JobState) -> None:
    if record.state not in states:
        raise FailedPrecondition(f"job {record.job_id} is {record.state.value}")
