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
- An agent's episode may have several calls pending at once (an async `run`'s concurrent chat
  completions, at most the spec's `max_parallel_calls`): the open or step answers with one result per
  call, and the next step must answer each of them, by call id, in one turn.
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
    call: int = 0
    """Agent episodes: the id of the call this result carries (0: an environment's observation, or the end)."""
    extends: int = 0
    """Agent episodes: the call whose sequence this call's observation continues (0: a segment, or none)."""


@dataclass(frozen=True)
class Action:
    """One episode's next action (an agent's: the reply to one of its pending calls), as the actor sent it."""

    episode: int
    turn: int
    text: str
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    call: int = 0

    def fields(self) -> dict[str, Any]:
        """The action as the worker gets it."""
        return {"action": self.text, "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "call": self.call}


def step_request(kind: str, actions: list[Action]) -> dict[str, Any]:
    """The worker's step request for an episode's actions: an environment's one action, or an agent's
    actions, one per pending call."""
    if kind == "agent":
        return {"op": "step", "actions": [action.fields() for action in actions]}
    (action,) = actions
    return {"op": "step", **action.fields()}


MAX_TOOLS_JSON = 16 << 10
"""Most bytes of an environment's tool schemas (they go into every episode's first prompt)."""
MAX_ANSWER_CHARS = 1 << 20
"""Most characters of an agent's final answer."""


@dataclass
class Episode:
    """One episode of a session: the worker it holds (None once ended), its last answer and its pending calls."""

    index: int
    worker: WorkerProcess | None
    turn: int = 0
    """The turn of the next actions."""
    last: list[EpisodeResult] | None = None
    pending: list[int] = field(default_factory=list)
    """The ids of the calls the next actions answer (an environment's episode: [0])."""
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
    """The open's results: one per episode, or one per pending call of an agent's."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def check_reply(index: int, outcome: Outcome, max_calls: int = 0) -> list[EpisodeResult]:
    """An outcome of a reset or step as results: an environment's one (max_calls 0), or an agent's end or
    its pending calls, one result each (at most max_calls); anything malformed is an environment error."""
    if outcome.kind != "reply":
        status = {"timeout": Status.TIMEOUT, "error": Status.ERROR}.get(outcome.kind, Status.KILLED)
        return [EpisodeResult(index, [], 0.0, True, status, outcome.reason, outcome.latency_s)]
    reply = outcome.reply
    if "error" in reply:
        return [EpisodeResult(index, [], 0.0, True, Status.ERROR, str(reply["error"])[:4000], outcome.latency_s)]
    try:
        if max_calls and reply.get("done") is not True:
            return _checked_calls(index, reply, outcome.latency_s, max_calls)
        return [_checked(index, reply, outcome.latency_s)]
    except EnvError as error:
        return [EpisodeResult(index, [], 0.0, True, Status.ERROR, str(error), outcome.latency_s)]


def _checked_calls(index: int, reply: dict[str, Any], latency_s: float, max_calls: int) -> list[EpisodeResult]:
    """An agent's pending calls: 1 to max_calls of them, with distinct ids >= 1, each extending an earlier
    call (`extends` >= 1) or opening a segment, never both."""
    calls = reply.get("calls")
    if reply.get("done") is not False or not isinstance(calls, list) or not 0 < len(calls) <= max_calls:
        raise EnvError(f"an agent's reply must hold 1 to {max_calls} pending calls (max_parallel_calls)")
    results = []
    for position, call in enumerate(calls):
        if not isinstance(call, dict):
            raise EnvError("a pending call is not an object")
        reward = reply.get("reward") if position == 0 else 0.0  # the step's reward goes with its first call
        result = _checked(index, {**call, "reward": reward, "done": False}, latency_s)
        if not (_is_id(result.call, 1) and _is_id(result.extends, 0)) or result.segment == (result.extends > 0):
            raise EnvError("a pending call needs an id >= 1, and extends an earlier call or opens a segment")
        results.append(result)
    if len({r.call for r in results}) != len(results):
        raise EnvError("an agent's pending calls need distinct ids")
    return results


def _is_id(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value < 1 << 32


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
    call, extends = reply.get("call", 0), reply.get("extends", 0)
    if not (_is_id(call, 0) and _is_id(extends, 0)):
        raise EnvError("a call's id and the call it extends must be ints in [0, 2**32)")
    return EpisodeResult(index, observation, reward, done, Status.OK, "", latency_s, tools_json, segment, cap, answer,
                         {k: v for k, v in numbers.items() if v is not None}, call, extends)


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
        request = {"op": "reset", "task": task, "params": session.spec.params,
                   "max_parallel_calls": session.spec.max_parallel_calls}
        opened = await asyncio.gather(*(self._call(session, e, request, "reset") for e in session.episodes))
        session.first = [result for results in opened for result in results]
        session.touched = time.monotonic()

    async def step(self, job_id: str, session_id: str, actions: list[Action]) -> list[EpisodeResult]:
        """The results of the episodes stepped, in the order of their first action: one per episode, or one
        per pending call of an agent's that made several at once."""
        session = self._sessions.get((job_id, session_id))
        if session is None:
            raise NotFound(f"no episode session {session_id!r} of job {job_id!r} (closed, reaped after idle, or the "
                           "reward service restarted)")
        by_episode: dict[int, list[Action]] = {}
        for position, action in enumerate(actions):
            if not 0 <= action.episode < len(session.episodes):
                raise InvalidArgument("no such episode", [FieldViolation(
                    f"actions[{position}].episode", f"{action.episode} is not in [0, {len(session.episodes)})")])
            by_episode.setdefault(action.episode, []).append(action)
        async with session.lock:
            session.touched = time.monotonic()
            todo = [(session.episodes[index], group) for index, group in by_episode.items()]
            fresh = [(episode, group) for episode, group in todo if not self._repeated(episode, group)]
            await asyncio.gather(*(self._step(session, episode, group) for episode, group in fresh))
            session.touched = time.monotonic()
            return [result for episode, _ in todo for result in episode.last or ()]

    @staticmethod
    def _repeated(episode: Episode, actions: list[Action]) -> bool:
        """Whether an episode's actions repeat its last step (answered from memory); FailedPrecondition or
        InvalidArgument when they do not fit the episode's turn or its pending calls."""
        turns = {action.turn for action in actions}
        if len(turns) != 1:
            reason = f"episode {episode.index} has actions of turns {sorted(turns)}"
            raise InvalidArgument(f"an episode's actions are one turn's: {reason}", [FieldViolation("actions", reason)])
        (turn,) = turns
        if turn + 1 == episode.turn and episode.last is not None:
            return True
        if turn != episode.turn:
            raise FailedPrecondition(f"episode {episode.index} expects turn {episode.turn}, not {turn}")
        if episode.worker is None:
            raise FailedPrecondition(f"episode {episode.index} has ended")
        calls = sorted(action.call for action in actions)
        if calls != sorted(episode.pending):
            reason = f"episode {episode.index} has calls {sorted(episode.pending)} pending, the actions answer {calls}"
            raise InvalidArgument(f"one action per pending call: {reason}", [FieldViolation("actions", reason)])
        return False

    async def _step(self, session: Session, episode: Episode, actions: list[Action]) -> None:
        results = await self._call(session, episode, step_request(session.spec.kind, actions), "step")
        episode.turn += 1
        episode.last = results

    def _add_reward(self, session: Session, episode: Episode, results: list[EpisodeResult]) -> list[EpisodeResult]:
        """results, or an environment error ending the episode when its turns' rewards no longer sum to a
        finite number."""
        total = episode.total_reward + sum(result.reward for result in results)
        if math.isfinite(total):
            episode.total_reward = total
            return results
        self._end(session, episode, "error")
        return [EpisodeResult(episode.index, [], 0.0, True, Status.ERROR,
                              "the episode's turn rewards sum to a non-finite total", results[0].latency_s)]

    async def _call(self, session: Session, episode: Episode, request: dict[str, Any],
                    op: str) -> list[EpisodeResult]:
        """A reset or step of one episode under its deadlines: its result, or one per pending call of an agent's;
        an episode that ends frees its worker."""
        results = await self._outcome(session, episode, request, op)
        episode.pending = [] if results[0].done else [result.call for result in results]
        if results[0].done and episode.worker is not None:
            status = results[0].status
            self._end(session, episode, "done" if status == Status.OK else status.value)
        return results

    async def _outcome(self, session: Session, episode: Episode, request: dict[str, Any],
                       op: str) -> list[EpisodeResult]:
        worker = episode.worker
        if worker is None or not session.pool.holds(worker):
            self._end(session, episode, "killed")
            return [EpisodeResult(episode.index, [], 0.0, True, Status.KILLED, "the episode's worker is gone")]
        left = session.opened + session.spec.episode_timeout_s - time.monotonic()
        if left <= 0:
            self._end(session, episode, "episode_timeout")
            return [EpisodeResult(episode.index, [], 0.0, True, Status.TIMEOUT,
                                  f"episode ran past episode_timeout_s {session.spec.episode_timeout_s:g}")]
        outcome = await session.pool.call(worker, request, min(session.spec.step_timeout_s, left))
        self.metrics.env_latency.labels(op=op).observe(outcome.latency_s)
        if worker.dirty and outcome.kind == "reply":
            self._end(session, episode, "dirty")
            return [EpisodeResult(episode.index, [], 0.0, True, Status.ERROR,
                                  f"the environment's {op} {worker.dirty}", outcome.latency_s)]
        max_calls = session.spec.max_parallel_calls if session.spec.kind == "agent" else 0
        return self._add_reward(session, episode, check_reply(episode.index, outcome, max_calls))

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
