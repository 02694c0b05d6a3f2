"""Prometheus metrics of an actor process (served on `metrics_port` when it is set), and `Activity`.

Counters are the source of truth (`rate()` them in Prometheus); `Activity` also keeps what the
actor is doing now and its busy fraction and token rate over the last WINDOW_S, for the gauges
below and for the heartbeat `fleetrl top` reads.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import Counter, Enum, Gauge, Histogram, Info

STATES = ("idle", "waiting_for_weights", "generating", "scoring", "stepping_env", "inserting")
WINDOW_S = 30.0
PULL_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

ACTOR = Info("fleetrl_actor", "Identity of this actor process")
TASKS = Counter("fleetrl_actor_tasks_total", "Tasks finished, by outcome (inserted, duplicate)", ["job", "outcome"])
REDELIVERIES = Counter("fleetrl_actor_task_redeliveries_total",
                       "Task deliveries received after the first (the task came back)", ["job"])
NAKS = Counter("fleetrl_actor_task_naks_total", "Deliveries released for redelivery after a failure", ["job"])
DEAD_LETTERED = Counter("fleetrl_actor_dead_lettered_total", "Tasks moved to the dead-letter subject", ["job"])
WEIGHT_LOADS = Counter("fleetrl_actor_weight_loads_total", "Weight versions pulled and loaded", ["job"])
WEIGHTS_CORRUPT = Counter("fleetrl_actor_weights_corrupt_total", "Pulled weight objects rejected (sha256/size)",
                          ["job"])
WEIGHT_PULL_SECONDS = Histogram("fleetrl_actor_weight_pull_seconds", "Seconds to pull and verify one weight version",
                                ["job"], buckets=PULL_BUCKETS_S)
WEIGHTS_FULL_FALLBACKS = Counter(
    "fleetrl_actor_weights_full_fallbacks_total",
    "Pulls of a delta version that read the full snapshot instead of deltas only, by reason "
    "(behind: no held version in the chain; delta_missing; delta_corrupt: a delta failed its checks or "
    "the rebuilt weights' sha256 differed from the pointer's)", ["job", "reason"])
WEIGHT_PULL_BYTES = Counter("fleetrl_actor_weight_pull_bytes_total", "Bytes of weights pulled", ["job"])
POLICY_VERSION = Gauge("fleetrl_actor_policy_version", "Policy version held", ["job"])
GENERATED_TOKENS = Counter("fleetrl_actor_generated_tokens_total", "Completion tokens generated", ["job"])
BATCH_GROUPS = Histogram("fleetrl_actor_batch_groups",
                         "Groups generated in one batched backend call (a round's tasks, `ActorSettings.round_tokens`)",
                         ["job"], buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
SERVED_SECONDS = Counter("fleetrl_actor_served_seconds_total",
                         "Wall-clock seconds spent on each job's tasks (what the fair share divides)", ["job"])
EPISODES = Counter("fleetrl_actor_episodes_total",
                   "Episodes played, by how they ended (done, max_turns, truncated, env_error)", ["job", "status"])
EPISODE_TURNS = Histogram("fleetrl_actor_episode_turns", "Assistant turns per episode", ["job"],
                          buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64))
ENV_STEP_SECONDS = Histogram("fleetrl_actor_env_step_seconds",
                             "Seconds of one environment step in the reward service's sandbox")
MEMORY_BUDGET = Gauge("fleetrl_actor_memory_budget_bytes", "Memory the jobs this actor holds may commit")
MEMORY_COMMITTED = Gauge("fleetrl_actor_memory_committed_bytes", "Estimated memory of the jobs this actor holds")
JOBS_DROPPED = Counter("fleetrl_actor_jobs_dropped_total", "Jobs dropped to make room for another (memory budget)",
                       ["job"])
JOBS_DEFERRED = Counter("fleetrl_actor_jobs_deferred_total",
                        "Refreshes at which a running job was not taken: it did not fit the memory budget", ["job"])
AGENT_SEGMENTS = Counter("fleetrl_actor_agent_segments_total",
                         "Segments started after the first in agent episodes (the agent rewrote its history)")
STEP_SECONDS = Histogram("fleetrl_actor_step_seconds", "Seconds per task-loop step", ["step"])
STATE = Enum("fleetrl_actor_state", "What the actor is doing", states=list(STATES))
BUSY_SECONDS = Counter("fleetrl_actor_busy_seconds_total", "Seconds spent holding a task")
BUSY_RATIO = Gauge("fleetrl_actor_busy_ratio", f"Fraction of the last {WINDOW_S:.0f} s spent holding a task")
TOKENS_PER_SECOND = Gauge("fleetrl_actor_tokens_per_second",
                          f"Completion tokens generated per second over the last {WINDOW_S:.0f} s")


class Activity:
    """The actor's current state and job, and its busy time and tokens, windowed."""

    state: str
    job_id: str
    window_s: float

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.state, self.job_id, self.window_s = "idle", "", window_s
        self._clock = clock
        self._tokens = 0
        self._busy_since: float | None = None
        self._ended: dict[str, float] = {}
        """Busy seconds of tasks that ended since the last mark, by job (the next mark's share of them)."""
        self._marks: deque[Mark] = deque([Mark(clock(), 0, {})])

    def begin(self, job_id: str) -> None:
        """A task of job_id was taken."""
        self.job_id, self._busy_since = job_id, self._clock()

    def end(self, shares: Mapping[str, float] | None = None) -> None:
        """The task (or round) was acked, released or dead-lettered. shares: a round's jobs and their weights
        in it (the time is split among them by weight); default: all of it to the job begun."""
        if self._busy_since is not None:
            now = self._clock()
            BUSY_SECONDS.inc(now - self._busy_since)
            busy, shares = now - self._uncounted_since(), shares or {self.job_id: 1.0}
            for job, weight in shares.items():
                self._ended[job] = self._ended.get(job, 0.0) + busy * weight / sum(shares.values())
        self._busy_since = None
        self.set_state("idle")

    def set_state(self, state: str) -> None:
        self.state = state
        STATE.state(state)

    def add_tokens(self, count: int) -> None:
        self._tokens += count

    def rates(self) -> tuple[float, float]:
        """(busy fraction, tokens per second) since the oldest mark inside the window; sets the gauges."""
        now = self._clock()
        busy, self._ended = self._ended, {}
        if self._busy_since is not None:  # the task in hand, up to now
            busy[self.job_id] = busy.get(self.job_id, 0.0) + now - self._uncounted_since()
        self._marks.append(Mark(now, self._tokens, busy))
        while len(self._marks) > 2 and self._marks[1].at <= now - self.window_s:
            self._marks.popleft()
        first = self._marks[0]
        elapsed = max(now - first.at, 1e-9)
        busy_s = sum(sum(mark.busy_by_job.values()) for mark in list(self._marks)[1:])
        fraction, rate = min(1.0, busy_s / elapsed), (self._tokens - first.tokens) / elapsed
        BUSY_RATIO.set(fraction)
        TOKENS_PER_SECOND.set(rate)
        return fraction, rate

    def served_s(self) -> dict[str, float]:
        """Seconds spent on each job's tasks from the oldest mark inside the window to the last `rates` call:
        what `fleetrl top` adds up over actors into each tenant's share of the fleet's time."""
        served: dict[str, float] = {}
        for mark in list(self._marks)[1:]:
            for job, seconds in mark.busy_by_job.items():
                served[job] = served.get(job, 0.0) + seconds
        return {job: round(seconds, 3) for job, seconds in served.items() if seconds > 0}

    def _uncounted_since(self) -> float:
        """Where the task in hand's time not yet in a mark begins: its start, or the last mark after it."""
        assert self._busy_since is not None
        return max(self._busy_since, self._marks[-1].at)


@dataclass(frozen=True)
class Mark:
    """One `Activity.rates` call: the tokens generated so far, and the busy seconds by job since the mark
    before (only the jobs served in between, so a long-lived actor's marks do not grow with every job it
    ever served). The window's figures are the marks after its oldest."""

    at: float
    tokens: int
    busy_by_job: dict[str, float]
