"""Episode sessions: the multi-turn environments of actors' rollouts, in sandboxed workers.

`EpisodeSessions.open(session_id, job_id, spec, task, count)` holds `count` workers of the
environment's pool (`Scorer.pool`, the same sandbox, limits and caching as reward files), builds
`Env(task, **params)` and calls `reset()` in each, and returns the first observations; `step` gives
live episodes their actions; `close` gives the workers back. Design choices:

- One worker per episode for its whole life, so a step that hangs or crashes costs only its own
  episode: the worker is killed (its reason counted by the pool), the episode ends as an environment
  error, and the rest of the group goes on. An episode that ends cleanly frees its worker at once.
- A session lives in this process only. A restarted service knows none: steps answer NOT_FOUND and
  the actor releases the task for redelivery.
- Steps are idempotent per (episode, turn): the last answer is kept, so a retried call gets it again
  instead of stepping twice. A session's calls run one at a time (its lock).
- Deadlines: every reset and step has the spec's step_timeout_s, cut to what is left of the
  episode's episode_timeout_s (counted from the open). A session not called for
  `episode_idle_timeout_s` (its actor died) is reaped by `reap_idle`: its workers are killed,
  counted as "abandoned".
- Worker replies are checked again here: user code could have forged them. A turn's reward must be a
  finite number, and so must the sum of an episode's turn rewards: otherwise the episode ends as an
  environment error.
- Sessions are per job: found by (job, session id), so a job's calls never reach another job's
  session, and their workers come from the job's own pool (`Scorer.pool`). Episode slots are shared
  out: at most `max_episodes` in all, `max_episodes_per_job` for one job and `max_episodes_per_tenant`
  for one tenant's jobs; an open past any of them is RESOURCE_EXHAUSTED naming the setting.
- User code must not outlive its call: a reset or step after which the environment left a thread or
  process running (`WorkerProcess.leftovers`) ends its episode as an error, and the worker is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetrl.env.host import EnvError, observation_messages, observation_roles
from fleetrl.errors import FailedPrecondition, FieldViolation, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from fleetrl.reward.metrics import RewardMetrics
from fleetrl.reward.pool import ReplaceReason, WorkerPool
from fleetrl.reward.protocol import finite_number
from fleetrl.reward.sandbox import Outcome, WorkerProcess
from fleetrl.reward.scorer import MAX_COMPONENTS, Scorer, SpecInput, Status, owner
from fleetrl.reward.settings import RewardSettings
from fleetrl.spec.config import EnvironmentSpec

log = logging.getLogger(__name__)

MAX_SESSION_ID = 128
KILL_REASONS: dict[str, ReplaceReason] = {"episode_timeout": "episode_timeout", "abandoned": "abandoned",
                                          "cancelled": "cancelled", "dirty": "dirty"}
"""Episode ends that kill the worker (the pool counts the reason); other ends give it back. A step that
timed out or crashed has had its worker killed by the pool already."""


@dataclass(frozen=True)
class EpisodeResult:
    """The environment's answer for one episode: its observation messages, reward and whether it ended."""

    episode: int
    observation: list[dict[str, str]]
    reward: float
    done: bool
    status: Status = Status.OK
    reason: str = ""
    latency_s: float = 0.0
    tools_json: str = ""
    """On an open (and an agent's segment): the tools as a JSON list of function schemas ("" without tools)."""
    segment: bool = False
    """Agent episodes: the observation is a whole new conversation (`fleetrl.env.agent`)."""
    max_new_tokens: int = 0
    """Agent episodes: the call's cap on new tokens (0: none)."""
    answer: str = ""
    """Agent episodes that ended: the final answer for the job's verifier."""
    components: dict[str, float] = field(default_factory=dict)
    """Agent episodes that ended: the reward components `run` returned."""


@dataclass(frozen=True)
class Action:
    """One episode's next action, as the actor sent it."""

    episode: int
    turn: int
    text: str
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def request(self) -> dict[str, Any]:
        """The worker's step request."""
        return {"op": "step", "action": self.text, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}


MAX_TOOLS_JSON = 16 << 10
"""Most bytes of an environment's tool schemas (they go into every episode's first prompt)."""
MAX_ANSWER_CHARS = 1 << 20
"""Most characters of an agent's final answer."""


@dataclass
class Episode:
    """One episode of a session: the worker it holds (None once ended) and its last answer."""

    index: int
    worker: WorkerProcess | None
    turn: int = 0
    """The turn of the next action."""
    last: EpisodeResult | None = None
    total_reward: float = 0.0
    """The sum of the rewards of its turns so far (which must stay finite)."""


@dataclass
class Session:
    """The episodes of one task, opened together by one actor."""

    session_id: str
    job_id: str
    tenant: str
    spec: EnvironmentSpec
    pool: WorkerPool
    opened: float
    touched: float
    episodes: list[Episode] = field(default_factory=list)
    first: list[EpisodeResult] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def check_reply(index: int, outcome: Outcome) -> EpisodeResult:
    """An outcome of a reset or step as a result; anything malformed is an environment error."""
    if outcome.kind != "reply":
        status = {"timeout": Status.TIMEOUT, "error": Status.ERROR}.get(outcome.kind, Status.KILLED)
        return EpisodeResult(index, [], 0.0, True, status, outcome.reason, outcome.latency_s)
    reply = outcome.reply
    if "error" in reply:
        return EpisodeResult(index, [], 0.0, True, Status.ERROR, str(reply["error"])[:4000], outcome.latency_s)
    try:
        return _checked(index, reply, outcome.latency_s)
    except EnvError as error:
        return EpisodeResult(index, [], 0.0, True, Status.ERROR, str(error), outcome.latency_s)


def _checked(index: int, reply: dict[str, Any], latency_s: float) -> EpisodeResult:
    reward, done = finite_number(reply.get("reward")), reply.get("done")
    segment = reply.get("segment", False) is True
    observation = observation_messages(reply.get("observation"), observation_roles(reply))
    if reward is None or not isinstance(done, bool):
        raise EnvError("malformed reply from the environment worker")
    tools = reply.get("tools", [])
    tools_json = json.dumps(tools, separators=(",", ":")) if tools else ""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools) or len(tools_json) > MAX_TOOLS_JSON:
        raise EnvError(f"the tools are not a list of function schemas of at most {MAX_TOOLS_JSON} bytes")
    cap, answer, components = reply.get("max_new_tokens", 0), reply.get("answer", ""), reply.get("components", {})
    if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap < 1 << 32:
        raise EnvError("the call's max_tokens is not an int in [0, 2**32)")
    if not isinstance(answer, str) or len(answer) > MAX_ANSWER_CHARS:
        raise EnvError(f"the agent's answer is not a str of at most {MAX_ANSWER_CHARS} characters")
    numbers = {str(k): finite_number(v) for k, v in components.items()} if isinstance(components, dict) else {}
    if not isinstance(components, dict) or len(numbers) > MAX_COMPONENTS or None in numbers.values():
        raise EnvError(f"the reward components are not at most {MAX_COMPONENTS} finite numbers")
    return EpisodeResult(index, observation, reward, done, Status.OK, "", latency_s, tools_json, segment, cap, answer,
                         {k: v for k, v in numbers.items() if v is not None})


class EpisodeSessions:
    """Every open session of this service."""

    settings: RewardSettings
    metrics: RewardMetrics

    def __init__(self, scorer: Scorer) -> None:
        self._scorer = scorer
        self.settings = scorer.settings
        self.metrics = scorer.metrics
        self._sessions: dict[tuple[str, str], Session] = {}
        self._opening: dict[tuple[str, str], asyncio.Task[Session]] = {}
        self._reserved: dict[tuple[str, str], int] = {}
        """Episodes being opened, by (job, tenant)."""

    @property
    def open_episodes(self) -> int:
        """Episodes holding a worker, plus those being opened."""
        return self._holding(lambda job, tenant: True)

    def _holding(self, counts: Callable[[str, str], bool]) -> int:
        """Open and opening episodes of the (job, tenant) pairs counts accepts."""
        live = sum(1 for s in self._sessions.values() if counts(s.job_id, s.tenant)
                   for e in s.episodes if e.worker is not None)
        return live + sum(n for (job, tenant), n in self._reserved.items() if counts(job, tenant))

    def _check_shares(self, job_id: str, tenant: str, count: int) -> None:
        """ResourceExhausted naming the setting when count more episodes would pass the service's, the
        job's or the tenant's share of episode slots."""
        s = self.settings
        for held, limit, name in (
                (self.open_episodes, s.max_episodes, "max_episodes"),
                (self._holding(lambda job, _: job == job_id), s.max_episodes_per_job, "max_episodes_per_job"),
                (self._holding(lambda _, owner: owner == tenant), s.max_episodes_per_tenant,
                 "max_episodes_per_tenant")):
            if held + count > limit:
                raise ResourceExhausted(f"{held} episodes are open; {count} more would exceed {name} {limit}")

    async def open(self, session_id: str, job_id: str, spec: SpecInput, task: dict[str, Any],
                   count: int, tenant: str = "") -> list[EpisodeResult]:
        """The first observation of each of count new episodes (those of the session, if it is open already).

        The opening runs shielded from the caller: if the caller gives up, the session still opens and
        is reaped once idle (or found by a retried open)."""
        if not isinstance(spec.spec, EnvironmentSpec):
            raise InvalidArgument("not an environment spec", [FieldViolation("spec", "expected an environment")])
        _check_open(session_id, count)
        key, tenant = (job_id, session_id), owner(job_id, tenant)
        opening = self._opening.get(key)
        if opening is None:
            if key in self._sessions:
                return self._sessions[key].first
            self._check_shares(job_id, tenant, count)
            opening = asyncio.get_running_loop().create_task(self._open(key, tenant, spec.spec, spec, task, count))
            self._opening[key] = opening
            opening.add_done_callback(lambda _: self._opening.pop(key, None))
        return (await asyncio.shield(opening)).first

    async def _open(self, key: tuple[str, str], tenant: str, env: EnvironmentSpec, spec: SpecInput,
                    task: dict[str, Any], count: int) -> Session:
        job_id, session_id = key
        self._reserved[job_id, tenant] = self._reserved.get((job_id, tenant), 0) + count
        try:
            pool = await self._scorer.pool(job_id, spec, tenant=tenant)
            now = time.monotonic()
            session = Session(session_id, job_id, tenant, env, pool, now, now)
            async with session.lock:
                self._sessions[key] = session
                try:
                    await self._reset(session, task, count)
                except BaseException:
                    self._sessions.pop(key, None)
                    self._end_all(session, "cancelled")
                    raise
            return session
        finally:
            self._reserved[job_id, tenant] -= count
            if not self._reserved[job_id, tenant]:
                del self._reserved[job_id, tenant]
            self.metrics.open_episodes.set(self.open_episodes)

    async def _reset(self, session: Session, task: dict[str, Any], count: int) -> None:
        wait_s = 2 * (self.settings.worker_start_timeout_s + self.settings.worker_load_timeout_s)
        for index in range(count):
            try:
                worker = await asyncio.wait_for(session.pool.hold(), wait_s)
            except TimeoutError:
                raise Unavailable(f"no sandboxed worker became free within {wait_s:g}s") from None
            session.episodes.append(Episode(index, worker))
        request = {"op": "reset", "task": task, "params": session.spec.params}
        session.first = list(await asyncio.gather(*(self._call(session, e, request, "reset")
                                                    for e in session.episodes)))
        session.touched = time.monotonic()

    async def step(self, job_id: str, session_id: str, actions: list[Action]) -> list[EpisodeResult]:
        """One result per action, in order."""
        session = self._sessions.get((job_id, session_id))
        if session is None:
            raise NotFound(f"no episode session {session_id!r} of job {job_id!r} (closed, reaped after idle, or the "
                           "reward service restarted)")
        episodes = [action.episode for action in actions]
        if len(set(episodes)) != len(episodes):
            raise InvalidArgument("one action per episode", [FieldViolation("actions", "an episode appears twice")])
        async with session.lock:
            session.touched = time.monotonic()
            todo = [self._check_action(session, i, a) for i, a in enumerate(actions)]
            fresh = [(episode, action) for episode, action in todo if episode is not None]
            results = await asyncio.gather(*(self._step(session, e, action) for e, action in fresh))
            answers = iter(results)
            session.touched = time.monotonic()
            out = []
            for (episode, _), action in zip(todo, actions, strict=True):
                out.append(next(answers) if episode is not None else self._last(session, action.episode))
            return out

    def _check_action(self, session: Session, position: int, action: Action) -> tuple[Episode | None, Action]:
        """The episode to step for an action, or None when the action is a repeat of the last one."""
        index, turn = action.episode, action.turn
        if not 0 <= index < len(session.episodes):
            raise InvalidArgument("no such episode", [FieldViolation(
                f"actions[{position}].episode", f"{index} is not in [0, {len(session.episodes)})")])
        episode = session.episodes[index]
        if turn + 1 == episode.turn and episode.last is not None:
            return None, action
        if turn != episode.turn:
            raise FailedPrecondition(f"episode {index} expects turn {episode.turn}, not {turn}")
        if episode.worker is None:
            raise FailedPrecondition(f"episode {index} has ended")
        return episode, action

    @staticmethod
    def _last(session: Session, index: int) -> EpisodeResult:
        last = session.episodes[index].last
        assert last is not None
        return last

    async def _step(self, session: Session, episode: Episode, action: Action) -> EpisodeResult:
        result = await self._call(session, episode, action.request(), "step")
        episode.turn += 1
        episode.last = result
        return result

    def _add_reward(self, session: Session, episode: Episode, result: EpisodeResult) -> EpisodeResult:
        """result, or an environment error ending the episode when its turns' rewards no longer sum to a
        finite number."""
        total = episode.total_reward + result.reward
        if math.isfinite(total):
            episode.total_reward = total
            return result
        self._end(session, episode, "error")
        return EpisodeResult(episode.index, [], 0.0, True, Status.ERROR,
                             "the episode's turn rewards sum to a non-finite total", result.latency_s)

    async def _call(self, session: Session, episode: Episode, request: dict[str, Any], op: str) -> EpisodeResult:
        """A reset or step of one episode under its deadlines; an episode that ends frees its worker."""
        worker = episode.worker
        if worker is None or not session.pool.holds(worker):
            self._end(session, episode, "killed")
            return EpisodeResult(episode.index, [], 0.0, True, Status.KILLED, "the episode's worker is gone")
        left = session.opened + session.spec.episode_timeout_s - time.monotonic()
        if left <= 0:
            self._end(session, episode, "episode_timeout")
            return EpisodeResult(episode.index, [], 0.0, True, Status.TIMEOUT,
                                 f"episode ran past episode_timeout_s {session.spec.episode_timeout_s:g}")
        outcome = await session.pool.call(worker, request, min(session.spec.step_timeout_s, left))
        self.metrics.env_latency.labels(op=op).observe(outcome.latency_s)
        if worker.dirty and outcome.kind == "reply":
            self._end(session, episode, "dirty")
            return EpisodeResult(episode.index, [], 0.0, True, Status.ERROR,
                                 f"the environment's {op} {worker.dirty}", outcome.latency_s)
        result = self._add_reward(session, episode, check_reply(episode.index, outcome))
        if result.done and episode.worker is not None:
            self._end(session, episode, "done" if result.status == Status.OK else result.status.value)
        return result

    def _end(self, session: Session, episode: Episode, status: str) -> None:
        """Free an episode's worker: given back after a clean end, killed otherwise."""
        worker, episode.worker = episode.worker, None
        if worker is None:
            return
        kill = KILL_REASONS.get(status)
        if status == "closed" and session.spec.kind == "agent":
            kill = "cancelled"  # its run is still waiting inside a call: the worker cannot serve another episode
        if kill is None:
            session.pool.give_back(worker)  # a no-op when the pool killed it already (step timeout, crash)
        else:
            session.pool.discard(worker, kill)
        self.metrics.episodes.labels(job=session.job_id, status=status).inc()
        self.metrics.open_episodes.set(self.open_episodes)

    def _end_all(self, session: Session, status: str) -> None:
        for episode in session.episodes:
            self._end(session, episode, status)

    async def close(self, job_id: str, session_id: str) -> None:
        """Give back the workers of a session's live episodes; unknown sessions are ignored."""
        key = (job_id, session_id)
        opening = self._opening.get(key)
        if opening is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(opening)
        session = self._sessions.pop(key, None)
        if session is None:
            return
        async with session.lock:
            self._end_all(session, "closed")

    def reap_idle(self) -> int:
        """Kill the workers of sessions not called for episode_idle_timeout_s; how many sessions were reaped."""
        limit = time.monotonic() - self.settings.episode_idle_timeout_s
        idle = [s for s in self._sessions.values() if s.touched < limit and not s.lock.locked()]
        for session in idle:
            del self._sessions[session.job_id, session.session_id]
            self._end_all(session, "abandoned")
            log.warning("reaped abandoned episode session %s of job %s (%d episodes)", session.session_id,
                        session.job_id, len(session.episodes))
        return len(idle)

    def close_all(self) -> None:
        for session in list(self._sessions.values()):
            self._end_all(session, "closed")
        self._sessions.clear()


def _check_open(session_id: str, count: int) -> None:
    violations = []
    if not 0 < len(session_id) <= MAX_SESSION_ID:
        violations.append(FieldViolation("session_id", f"must have 1 to {MAX_SESSION_ID} characters"))
    if count < 1:
        violations.append(FieldViolation("count", "must be at least 1"))
    if violations:
        raise InvalidArgument("bad OpenEpisodes request", violations)
