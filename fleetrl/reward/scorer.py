"""The reward service's domain core: validate specs, keep worker pools, score batches.

`Scorer.score(job_id, spec, items)` scores every item concurrently on the spec's pool and always
returns one `Result` per item, in order: a hanging or crashing item costs only its own result. A call
with no items is a warm-up: the job's pool starts loading in the background (an actor sends one when it
starts serving a job, so the first group does not wait for the workers' start and imports).
A spec's pool loads in a task of its own (shared by every call for that spec, bounded by the
workers' start and load deadlines); a Score call waits for it at most its items' timeout, so a
reward file with slow top-level code makes that call's items errors naming the load instead of
holding it, and other specs' calls never wait for it. A spec that failed to load (or whose pool
could not start a worker again) is not loaded again for 1 s, doubling per failure in a row up to
60 s: meanwhile its calls' items are errors naming the reason, and no worker is started for them.
Pools are per job: one per (job, spec digest), never shared between jobs even when their specs are
byte-identical, at most `max_pools_per_tenant` for one tenant and `max_pools` in all (the least
recently used idle pool is closed first), and closed after `pool_idle_s` unused. Validate loads the
spec in a pool of its own that is closed when it answers. Worker replies
are re-checked here, since user code could have forged them: a reward must be a finite number,
or a dict of finite numbers whose "reward" entry (else their sum) is the reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from fleetrl.errors import (
    ConfigError,
    FailedPrecondition,
    FieldViolation,
    FleetError,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from fleetrl.reward import guard, jail, verifiers
from fleetrl.reward.metrics import RewardMetrics
from fleetrl.reward.pool import WorkerPool
from fleetrl.reward.protocol import finite_number
from fleetrl.reward.sandbox import Limits, Outcome, PoolConfig, UidPool, sweep_tmpdirs
from fleetrl.reward.settings import RewardSettings
from fleetrl.spec.config import EnvironmentSpec, RewardSpec, validate

log = logging.getLogger(__name__)

MAX_COMPONENTS = 64
LOAD_RETRY_S = 1.0
LOAD_RETRY_MAX_S = 60.0


class Status(enum.StrEnum):
    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    KILLED = "killed"


@dataclass(frozen=True)
class Item:
    """One completion to score, with its prompt and the prompt line's other fields."""

    completion: str
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Result:
    """How one item scored; reward is 0 unless status is OK."""

    reward: float
    components: dict[str, float]
    status: Status
    reason: str = ""
    latency_s: float = 0.0


@dataclass(frozen=True)
class SpecInput:
    """A validated reward or environment spec with its file source and the digest pools are cached by."""

    spec: RewardSpec | EnvironmentSpec
    source: str
    digest: str


def _spec_data(spec_json: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(spec_json)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{what} is not JSON", [FieldViolation("spec.spec_json", str(error))]) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be an object", [FieldViolation("spec.spec_json", "not an object")])
    return data


def _source(file_source: bytes, what: str) -> str:
    try:
        return file_source.decode()
    except UnicodeDecodeError as error:
        raise ConfigError(f"{what} is not UTF-8", [FieldViolation("spec.file_source", str(error))]) from None


def _digest(spec_json: str, file_source: bytes) -> str:
    return hashlib.sha256(spec_json.encode() + b"\0" + file_source).hexdigest()


def parse_spec(spec_json: str, file_source: bytes) -> SpecInput:
    """Validate the job's reward spec (ConfigError naming every bad field)."""
    spec = validate(RewardSpec, _spec_data(spec_json, "reward spec"), "reward spec")
    source = _source(file_source, "reward file")
    if spec.file is not None and not source.strip():
        raise ConfigError("reward file is empty", [FieldViolation("spec.file_source", "no source sent")])
    if spec.builtin is not None:
        check_builtin(spec.builtin, spec.params)
    return SpecInput(spec, source if spec.file is not None else "", _digest(spec_json, file_source))


def parse_environment(spec_json: str, file_source: bytes) -> SpecInput:
    """Validate the job's environment spec (ConfigError naming every bad field)."""
    spec = validate(EnvironmentSpec, _spec_data(spec_json, "environment spec"), "environment spec")
    source = _source(file_source, "environment file")
    if not source.strip():
        raise ConfigError("environment file is empty", [FieldViolation("spec.file_source", "no source sent")])
    return SpecInput(spec, source, _digest(spec_json, file_source))


def check_builtin(name: str, params: dict[str, Any]) -> None:
    """ConfigError unless name is a built-in and params fit its model."""
    try:
        verifiers.resolve(name, params)
    except KeyError as error:
        raise ConfigError("unknown reward built-in", [FieldViolation("reward.builtin", str(error.args[0]))]) from None
    except ValidationError as error:
        violations = [FieldViolation(".".join(["reward.params", *map(str, e["loc"])]), e["msg"])
                      for e in error.errors()]
        raise ConfigError(f"bad params for built-in {name!r}", violations) from None


def boot_message(spec: SpecInput) -> dict[str, Any]:
    """What a worker needs to load the spec."""
    if isinstance(spec.spec, EnvironmentSpec):
        return {"mode": spec.spec.kind, "spec": {"params": spec.spec.params}, "source": spec.source}
    if spec.spec.builtin is not None:
        return {"mode": "builtin", "spec": {"builtin": spec.spec.builtin, "params": spec.spec.params}}
    return {"mode": "file", "spec": {"params": spec.spec.params}, "source": spec.source}


def _kind(spec: SpecInput) -> str:
    if isinstance(spec.spec, EnvironmentSpec):
        return "agent file" if spec.spec.kind == "agent" else "environment file"
    return "reward file" if spec.spec.file is not None else "reward spec"


def _what(spec: SpecInput) -> str:
    """The spec as load errors name it (as `sandbox.WorkerProcess.start` does)."""
    return "environment" if isinstance(spec.spec, EnvironmentSpec) else "reward spec"


def _field(spec: SpecInput) -> str:
    if isinstance(spec.spec, EnvironmentSpec):
        return "environment.file"
    return "reward.file" if spec.spec.file is not None else "reward.params"


def owner(job_id: str, tenant: str) -> str:
    """Whose share a job's pools and episodes count against: its tenant, or the job alone when the caller
    names none."""
    return tenant or f"job:{job_id}"


@dataclass(frozen=True)
class PoolKey:
    """What a pool serves: one job's one spec. Two jobs never share a pool (nor its workers, their temp
    dirs or anything user code left in them), even with byte-identical specs."""

    job_id: str
    tenant: str
    digest: str


@dataclass(frozen=True)
class LoadFailure:
    """A spec that failed to load count times in a row: its reason, and when a load is tried again."""

    count: int
    retry_at: float
    violations: list[FieldViolation]


def to_result(outcome: Outcome) -> Result:
    """Check a worker's reply and turn any outcome into a Result."""
    if outcome.kind != "reply":
        status = {"timeout": Status.TIMEOUT, "error": Status.ERROR}.get(outcome.kind, Status.KILLED)
        return Result(0.0, {}, status, outcome.reason, outcome.latency_s)
    reply = outcome.reply
    if "error" in reply:
        return Result(0.0, {}, Status.ERROR, str(reply["error"])[:4000], outcome.latency_s)
    if "value" in reply:
        value = finite_number(reply["value"])
        if value is None:
            return Result(0.0, {}, Status.ERROR, f"reward is not a finite number: {str(reply['value'])[:80]!r}",
                          outcome.latency_s)
        return Result(value, {}, Status.OK, "", outcome.latency_s)
    return _components_result(reply.get("components"), outcome.latency_s)


def _components_result(components: Any, latency_s: float) -> Result:
    if not isinstance(components, dict) or len(components) > MAX_COMPONENTS:
        return Result(0.0, {}, Status.ERROR, "malformed reply from the reward worker", latency_s)
    numbers = {k: finite_number(v) for k, v in components.items()}
    if not all(isinstance(k, str) and v is not None for k, v in numbers.items()):
        return Result(0.0, {}, Status.ERROR, "reward dict values must be finite numbers", latency_s)
    parts = {k: float(v or 0.0) for k, v in numbers.items() if k != "reward"}
    reward = numbers["reward"] if "reward" in numbers else sum(parts.values())
    if reward is None or not math.isfinite(reward):
        return Result(0.0, {}, Status.ERROR, "the reward dict's components sum to a non-finite total", latency_s)
    return Result(reward, parts, Status.OK, "", latency_s)


@dataclass(frozen=True)
class SandboxState:
    """The sandbox this service runs reward code in, as found at start-up."""

    mode: str
    layers: dict[str, bool]
    problem: str = ""
    """Why reward code is refused ("" when it runs)."""
    bwrap: str | None = None
    note: str = ""
    """Why this mode was chosen, when it was not the operator's setting."""

    def describe(self) -> str:
        held = [name for name, ok in self.layers.items() if ok]
        missing = [name for name, ok in self.layers.items() if not ok]
        line = f"mode {self.mode}: {' '.join(held) or 'none'} hold; missing: {' '.join(missing) or 'none'}"
        return line + (f" ({self.note})" if self.note else "")

    def for_trusted_builtins(self) -> SandboxState:
        """The legacy sandbox, for built-ins that run no submitted code when the jail is unavailable."""
        return SandboxState("legacy", self.layers, "", None,
                            note=f"the jail is unavailable ({self.problem}); built-ins that run no submitted code "
                                 "are scored in the legacy sandbox")


def find_sandbox(settings: RewardSettings) -> SandboxState:
    """Probe the jail (jail mode) and sweep temp dirs of dead services; which layers hold."""
    for path in sweep_tmpdirs(settings.sandbox_dir):
        log.info("removed a reward worker temp dir left by a killed service: %s", path)
    if settings.sandbox_mode == "legacy":
        return SandboxState("legacy", {"bwrap": False, "mountns": False, "seccomp": False})
    bwrap = jail.bwrap_binary()
    layers, problem = jail.probe(bwrap)
    return SandboxState("jail", layers, problem, bwrap)


class Scorer:
    """Scores batches on cached worker pools; one instance per service."""

    settings: RewardSettings
    metrics: RewardMetrics
    sandbox: SandboxState

    def __init__(self, settings: RewardSettings, metrics: RewardMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or RewardMetrics()
        self._pools: dict[PoolKey, asyncio.Task[WorkerPool]] = {}
        self._load_failures: dict[PoolKey, LoadFailure] = {}
        self._uids = UidPool(settings.sandbox_uid_base)
        if not self._uids.enabled:
            guard.hide_from_same_uid()  # workers run under our uid: keep them out of our /proc environ
        self.sandbox = find_sandbox(settings)
        self.metrics.sandbox_layers(self.sandbox.layers)
        if self.sandbox.problem:
            log.error("reward sandbox %s; refusing to run reward code: %s (sandbox_mode=legacy runs it in the "
                      "weaker legacy sandbox)", self.sandbox.describe(), self.sandbox.problem)
        else:
            log.log(logging.INFO if self.sandbox.mode == "jail" else logging.WARNING, "reward sandbox %s",
                    self.sandbox.describe())

    def sandbox_for(self, spec: RewardSpec | EnvironmentSpec) -> SandboxState:
        """Where this spec's code runs: the service's sandbox; when the jail is unavailable, the legacy
        sandbox for a built-in that runs no submitted code (trusted code parsing untrusted text, still
        under rlimits, timeouts and a private uid), while reward files, environments and `code_tests`
        stay refused."""
        if self.sandbox.problem and isinstance(spec, RewardSpec) and spec.builtin is not None and \
                not verifiers.runs_submitted_code(spec.builtin, spec.params):
            return self.sandbox.for_trusted_builtins()
        return self.sandbox

    def _pool_config(self, spec: RewardSpec | EnvironmentSpec, sandbox: SandboxState) -> PoolConfig:
        s = self.settings
        limits = Limits(spec.memory_limit_mb, s.worker_cpu_limit_s, s.worker_max_file_mb,
                        s.worker_max_open_files, s.worker_max_processes)
        return PoolConfig(s.workers_per_pool, limits, s.worker_start_timeout_s, s.worker_load_timeout_s,
                          s.max_items_per_worker, s.max_reply_bytes, s.sandbox_dir, s.worker_namespaces,
                          s.burst_workers_per_pool, sandbox.bwrap, s.worker_tmp_mb, s.worker_respawn_burst,
                          s.worker_respawns_per_s)

    def check_caps(self, spec: RewardSpec | EnvironmentSpec) -> None:
        """ConfigError naming each field of spec above the operator's cap."""
        s = self.settings
        if isinstance(spec, EnvironmentSpec):
            asked = (("environment.memory_limit_mb", spec.memory_limit_mb, "max_memory_limit_mb"),
                     ("environment.step_timeout_s", spec.step_timeout_s, "max_timeout_per_item_s"))
        else:
            asked = (("reward.memory_limit_mb", spec.memory_limit_mb, "max_memory_limit_mb"),
                     ("reward.timeout_per_item_s", spec.timeout_per_item_s, "max_timeout_per_item_s"))
        violations = [FieldViolation(name, f"{value:g} exceeds this reward service's cap {getattr(s, cap):g} "
                                     f"({cap})") for name, value, cap in asked if value > getattr(s, cap)]
        if violations:
            raise ConfigError("reward spec asks for more than the reward service allows", violations)

    async def _new_pool(self, spec: SpecInput) -> WorkerPool:
        sandbox = self.sandbox_for(spec.spec)
        if sandbox.problem:
            raise FailedPrecondition(
                f"the reward sandbox is not available: {self.sandbox.problem}; reward files, environments and "
                "code_tests need it (built-ins that run no submitted code do not); an operator may accept the "
                "weaker legacy sandbox with the reward setting sandbox_mode=legacy "
                "(FLEETRL_REWARD_SANDBOX_MODE=legacy)")
        if sandbox is not self.sandbox:
            log.warning("reward sandbox for a built-in: %s", sandbox.describe())
        pool = WorkerPool(boot_message(spec), self._pool_config(spec.spec, sandbox), self._uids,
                          self.metrics.worker_replaced)
        try:
            await pool.start()
        except BaseException:
            await pool.close()
            raise
        return pool

    def _loading(self, key: PoolKey, spec: SpecInput) -> asyncio.Task[WorkerPool]:
        """The task starting a job's pool for spec, started on first use. A failed one is forgotten when it
        ends; after a pool failed to load, the next load waits LOAD_RETRY_S, doubling with each failure in a
        row up to LOAD_RETRY_MAX_S (ConfigError naming the reason meanwhile), so a file that fails to load
        (or whose pool broke) cannot make the service start a worker on every call."""
        task = self._pools.get(key)
        if task is None:
            failed = self._load_failures.get(key)
            if failed is not None and time.monotonic() < failed.retry_at:
                raise ConfigError(f"{_what(spec)} cannot load (failed {failed.count} time(s) in a row; not tried "
                                  f"again for {failed.retry_at - time.monotonic():.1f}s)", failed.violations)
            task = asyncio.get_running_loop().create_task(self._new_pool(spec))
            self._pools[key] = task
            task.add_done_callback(lambda done: self._loaded(key, done))
        return task

    def _loaded(self, key: PoolKey, task: asyncio.Task[WorkerPool]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._load_failures.pop(key, None)
            return
        if self._pools.get(key) is task:
            del self._pools[key]
        error = None if task.cancelled() else task.exception()
        if isinstance(error, ConfigError):
            self._failed_to_load(key, error.violations)

    def _failed_to_load(self, key: PoolKey, violations: list[FieldViolation]) -> None:
        count = self._load_failures[key].count + 1 if key in self._load_failures else 1
        delay = min(LOAD_RETRY_MAX_S, LOAD_RETRY_S * 2 ** (count - 1))
        self._load_failures[key] = LoadFailure(count, time.monotonic() + delay, violations)

    async def pool(self, job_id: str, spec: SpecInput, wait_s: float | None = None, tenant: str = "") -> WorkerPool:
        """The job's pool for spec, started on first use; ConfigError when the spec cannot load or asks too
        much, ResourceExhausted when the tenant holds its share of pools, TimeoutError when it has not loaded
        within wait_s (the load goes on for the next call)."""
        self.check_caps(spec.spec)
        key = PoolKey(job_id, owner(job_id, tenant), spec.digest)
        pool = await asyncio.wait_for(asyncio.shield(await self._start(key, spec)), wait_s)
        if pool.broken:
            raise await self._drop_broken(key, spec, pool)
        pool.last_used = time.monotonic()
        return pool

    async def _drop_broken(self, key: PoolKey, spec: SpecInput, pool: WorkerPool) -> ConfigError:
        """A pool none of whose workers could be started again: dropped (once, by whichever caller met it
        first) with the load back-off started; the error naming why, for the caller to raise or report."""
        violations = [FieldViolation(_field(spec), pool.broken or "broken")]
        task = self._pools.get(key)
        if task is not None and task.done() and not task.cancelled() and task.exception() is None \
                and task.result() is pool:
            del self._pools[key]
            self._failed_to_load(key, violations)
            await pool.close()
        return ConfigError(f"{_what(spec)} cannot load", violations)

    async def _start(self, key: PoolKey, spec: SpecInput) -> asyncio.Task[WorkerPool]:
        """The task loading the pool of key, started (after making room for it) unless it is up or loading."""
        if key not in self._pools:
            await self._make_room(key)
        return self._loading(key, spec)

    def _idle_pools(self) -> dict[PoolKey, WorkerPool]:
        """Pools that are up and hold no episode's worker (those may be closed)."""
        return {k: t.result() for k, t in self._pools.items()
                if t.done() and not t.cancelled() and not t.exception() and not t.result().held_workers}

    async def _make_room(self, key: PoolKey) -> None:
        """Before a new pool starts: close the tenant's least recently used idle pool while the tenant holds
        `max_pools_per_tenant` (ResourceExhausted when none of them is idle), then anyone's while the service
        holds `max_pools`."""
        idle = self._idle_pools()
        for limit, mine in ((self.settings.max_pools_per_tenant, lambda k: k.tenant == key.tenant),
                            (self.settings.max_pools, lambda k: True)):
            while sum(1 for k in self._pools if mine(k)) >= limit:
                candidates = [k for k in idle if mine(k)]
                if not candidates:
                    if limit == self.settings.max_pools:
                        break  # every pool holds episodes: the episode caps bound those
                    raise ResourceExhausted(
                        f"tenant {key.tenant} holds {limit} reward worker pools, each busy with episodes "
                        f"(max_pools_per_tenant {limit})")
                oldest = min(candidates, key=lambda k: idle[k].last_used)
                del self._pools[oldest]
                await idle.pop(oldest).close()
        self.metrics.pools.set(len(self._pools))

    async def validate(self, spec: SpecInput) -> None:
        """Load the spec in a sandboxed worker of its own; ConfigError with the reason when it cannot. The
        worker is closed afterwards: a job's items run only on its own pool."""
        self.check_caps(spec.spec)
        key = PoolKey("", "validate", spec.digest)
        task = self._loading(key, spec)
        try:
            pool = await asyncio.shield(task)
        finally:
            if self._pools.get(key) is task:
                del self._pools[key]
        await pool.close()
        if pool.broken:
            raise ConfigError(f"{_what(spec)} cannot load", [FieldViolation(_field(spec), pool.broken)])

    async def score(self, job_id: str, spec: SpecInput, items: list[Item], tenant: str = "") -> list[Result]:
        """One Result per item, in order, scored concurrently on the spec's pool."""
        if len(items) > self.settings.max_items_per_request:
            raise InvalidArgument("too many items", [FieldViolation(
                "items", f"{len(items)} > max_items_per_request {self.settings.max_items_per_request}")])
        if not items:  # a warm-up: the job's pool loads in the background for its first items
            await self._warm(job_id, spec, tenant)
            return []
        if not isinstance(spec.spec, RewardSpec):
            raise InvalidArgument("not a reward spec", [FieldViolation("spec", "an environment cannot score items")])
        timeout_s = spec.spec.timeout_per_item_s
        start = time.monotonic()
        try:
            pool = await self.pool(job_id, spec, wait_s=timeout_s, tenant=tenant)
        except TimeoutError:
            return self._unscored(job_id, items, start, (
                f"{_kind(spec)} not loaded within the item timeout {timeout_s:g}s (reward.timeout_per_item_s): its "
                f"top-level code is still running (a load may take up to worker_load_timeout_s, "
                f"{self.settings.worker_load_timeout_s:g}s)"))
        except ConfigError as error:  # caps were checked above: the spec does not load
            return self._unscored(job_id, items, start, str(error))
        key = PoolKey(job_id, owner(job_id, tenant), spec.digest)
        return list(await asyncio.gather(*(self._score_one(key, spec, pool, item, timeout_s) for item in items)))

    async def _warm(self, job_id: str, spec: SpecInput, tenant: str) -> None:
        """Start loading the job's pool unless it is up or loading, within the pool shares as any start
        (the load's errors reach its first items)."""
        try:
            self.check_caps(spec.spec)
            await self._start(PoolKey(job_id, owner(job_id, tenant), spec.digest), spec)
        except FleetError as error:  # a spec that does not load, or is backing off: its items will say why
            log.info("warming the reward pool of job %s: %s", job_id, error)

    def _unscored(self, job_id: str, items: list[Item], start: float, reason: str) -> list[Result]:
        """Every item an error naming reason (the spec has no pool to score on)."""
        latency_s = time.monotonic() - start
        for _ in items:
            self.metrics.observe(job_id, Status.ERROR.value, latency_s)
        return [Result(0.0, {}, Status.ERROR, reason, latency_s) for _ in items]

    async def _score_one(self, key: PoolKey, spec: SpecInput, pool: WorkerPool, item: Item,
                         timeout_s: float) -> Result:
        """The item's result; when the pool broke while the item waited for a worker (no replacement could be
        started), an error naming why, and the pool dropped as `pool` drops it: a verdict on the spec, as for
        the items sent after, not a failed call."""
        request = {"completion": item.completion, "prompt": item.prompt, "metadata": item.metadata}
        start = time.monotonic()
        try:
            result = to_result(await pool.run(request, timeout_s))
        except Unavailable:
            if not pool.broken:  # the pool closed (the service stops): the caller tries again elsewhere
                raise
            error = await self._drop_broken(key, spec, pool)
            result = Result(0.0, {}, Status.ERROR, str(error), time.monotonic() - start)
        self.metrics.observe(key.job_id, result.status.value, result.latency_s)
        return result

    async def reap_idle(self) -> int:
        """Close pools unused for pool_idle_s; returns how many were closed."""
        now = time.monotonic()
        idle = [key for key, pool in self._idle_pools().items() if now - pool.last_used > self.settings.pool_idle_s]
        for key in idle:
            await self._pools.pop(key).result().close()
        self.metrics.pools.set(len(self._pools))
        return len(idle)

    async def close(self) -> None:
        """Close every pool (kills all workers); a pool still loading is cancelled (which kills its worker)."""
        tasks = list(self._pools.values())
        self._pools.clear()
        for task in tasks:
            task.cancel()  # a no-op for a pool that is up
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                with contextlib.suppress(Exception):
                    await task.result().close()
