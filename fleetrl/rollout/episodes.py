"""The multi-turn rollout: one task's group as n episodes against the reward service's environment.

`EpisodeRunner.play(job, task)` runs the group's n episodes together and returns their samples:
open the session (`OpenEpisodes`: `Env(task, **params)` and `reset()` in the reward service's
sandbox) -> render each first observation through the chat template (with the environment's tool
schemas, which a template with a tool format renders) -> per turn, generate the next
assistant turn of every live episode in one batch (`Backend.generate_batch`), send the actions
(`StepEpisodes`) and append each observation's tokens -> until the environment says done, or
`max_turns`, or `max_total_tokens` -> close the session. No environment code runs here.

- A sample is the whole sequence: `prompt_token_ids` (the first observation), then
  `completion_token_ids` with every action and observation, `loss_mask` true on the policy's tokens
  and false on the environment's (observations and the chat template's tokens around them),
  behaviour log-probs (0 on environment tokens), `turns` (where each action is, its reward) and
  `episode_status`. Its reward is the sum of its turns' rewards (`environment.unfinished_reward`, when
  set, replaces it for an episode truncated or out of turns); an environment failure (raised, bad
  value, timeout, worker died) ends the episode as ENV_ERROR with reward 0, like a failed reward.
  A total that is not finite (the turns' sum overflowed a double) fails the episode's reward too:
  REWARD_STATUS_ERROR with a reason naming the total, reward 0, no components.
- The environment's text (observation contents, tool schemas) is escaped before the chat template
  (`chat_escape`), so it can never become a special token; the job's prompt is not.
- A job with a built-in verifier beside its environment (`[reward] builtin`) has the verifier score
  each episode's last action against the task (one Score call for the group, as a single-turn group
  is scored): its value is added to the last turn's reward, and the sample's components are the
  verifier's, plus `environment` (the steps' sum) and `verifier` (its value). A verifier failure
  fails the episode's reward like a failed single-turn score (reward 0, the status and reason kept).
- Agent episodes (`environment.kind = "agent"`, `fleetrl.env.agent`): each chat completion the agent
  asks for is a turn. A call that extends the previous one (its messages, then the reply it was given,
  then new messages) comes as an ordinary observation, so the sequence holds exactly the tokens the
  policy generated and saw, never re-rendered. Any other call opens a new segment (`segment`): its
  whole conversation through the chat template, with the call's tools. An episode becomes one sample
  per segment that holds a turn, all with the episode's reward and status; every sample but an
  episode's last has `continues` set, and the learner's group baseline counts the episode once. A
  call's `max_tokens` caps its turn. `run` may return an answer (a str) for the job's verifier, which
  then scores it in place of the last action, or named components, which the sample reports.
- An async agent's concurrent calls (`asyncio.gather`, up to `environment.max_parallel_calls`) come
  together, one result per call, and are generated in the same batch as the other episodes' turns:
  one turn of `max_turns`. Each call names the earlier call whose sequence it extends (`extends`), so
  parallel branches grow as segments of their own; its action names the call it answers.
- The observation that ends an episode (done) is not appended: nothing is generated after it.
  Each turn may generate up to `rollout.max_new_tokens`, less what is left of `max_total_tokens`;
  an observation that would leave no room for another token ends the episode as TRUNCATED.
- One episode uses one policy version: weights are applied between tasks only (`job_policy`), unless
  the job sets `environment.inflight_updates`: then the actor loads the newest weights before each
  turn after the first. Each turn records the version that generated it (`Turn.policy_version`),
  and its behaviour log-probs are that version's, which is what the learner's off-policy
  correction reads; the group's `policy_version` is the first turn's (the oldest).
- Each call is sampled from its own seed, `task_seed(job seed, "<task id>/e<episode>/turn<k>/call<c>")`
  (call 0 for an environment's turn), so a redelivery under the same weights and a deterministic
  environment gives the same group, and one episode's tokens do not depend on which other episodes or
  calls share its batch (up to the padded forward's rounding).
- The session id is fresh per delivery. If the reward service restarts, its next step is NOT_FOUND
  and the error propagates: the queue releases the task for redelivery. The session is closed in
  any case (best effort; the service reaps sessions left idle).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetrl.policy.backends import Backend, Completion, conversation_tokens, observation_tokens, prompt_tokens
from fleetrl.policy.chat_escape import escape_json, escape_messages
from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2
from fleetrl.rollout import metrics
from fleetrl.rollout.settings import ActorSettings
from fleetrl.spec.config import EnvironmentSpec, RolloutConfig
from fleetrl.spec.seeding import task_seed

log = logging.getLogger(__name__)

OK = common_pb2.REWARD_STATUS_OK
LIVE = common_pb2.EPISODE_STATUS_UNSPECIFIED


class EpisodeHost(Protocol):
    """Where episodes run (fleetrl.reward.client.RewardClient)."""

    async def open_episodes(self, job_id: str, session_id: str, spec: reward_pb2.EnvironmentSpec,
                            task: Any, count: int, timeout_s: float,
                            tenant: str = "") -> list[reward_pb2.EpisodeResult]: ...

    async def step_episodes(self, job_id: str, session_id: str, actions: Sequence[reward_pb2.Action],
                            timeout_s: float) -> list[reward_pb2.EpisodeResult]: ...

    async def close_episodes(self, job_id: str, session_id: str) -> None: ...


Stage = Callable[[str, str], AbstractContextManager[None]]
"""A named step of a task: its span, its step_seconds sample and the actor's state (Rollout._stage)."""

class Weights(Protocol):
    """The job's weights as the actor holds them (fleetrl.rollout.job_policy.JobPolicy)."""

    version: int

    async def refresh(self) -> bool: ...


Verifier = Callable[[list[str]], Awaitable[list[reward_pb2.ScoreResult]]]
"""Scores final actions with the job's built-in verifier, one result per text (Rollout.verifier)."""


@dataclass
class Segment:
    """One stretch of an episode's sequence that grows by appending: a prompt, then turns and
    observations. An agent that rewrites its history starts a new one (`EpisodeResult.segment`)."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: list[common_pb2.Turn] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add_observation(self, token_ids: list[int]) -> None:
        """The environment's tokens: no log-probs, outside the loss."""
        self.completion_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.mask += [False] * len(token_ids)


@dataclass
class Pending:
    """A turn an episode waits for: the call it answers (an agent's id; 0 for an environment), the segment it
    continues, and the call's cap on new tokens (0: none)."""

    call: int
    segment: Segment
    cap: int = 0


@dataclass
class Episode:
    """One episode's sequence as it grows: its segments (one, unless an agent rewrote its history or made
    calls that do not extend one another) and the turns it waits for."""

    index: int
    segments: list[Segment]
    status: common_pb2.EpisodeStatus = LIVE
    reward_status: common_pb2.RewardStatus = OK
    reason: str = ""
    last_action: str = ""
    """What the verifier scores: the last action, or the answer an agent's run returned."""
    components: dict[str, float] = field(default_factory=dict)
    answered: bool = False
    """An agent's run returned a final answer (for the verifier) rather than a reward."""
    pending: list[Pending] = field(default_factory=list)
    """The next turn's calls: one for an environment, up to `max_parallel_calls` for an agent."""
    heads: dict[int, tuple[Segment, bool]] = field(default_factory=dict)
    """Calls answered and not extended yet, by id: the segment that ends with their action, and whether it
    ended at EOS (the chat template's next tokens depend on it)."""
    last_turn: common_pb2.Turn | None = None
    """The latest action's turn, which the environment's next reward goes to."""

    @property
    def live(self) -> bool:
        return self.status == LIVE

    @property
    def turns(self) -> list[common_pb2.Turn]:
        """Every turn of every segment, in order."""
        return [turn for segment in self.segments for turn in segment.turns]

    def end(self, status: common_pb2.EpisodeStatus, reward_status: common_pb2.RewardStatus = OK,
            reason: str = "") -> None:
        self.status, self.reward_status, self.reason = status, reward_status, reason

    def add_action(self, pending: Pending, completion: Completion, version: int = 0) -> None:
        segment = pending.segment
        start = len(segment.completion_ids)
        segment.completion_ids += completion.token_ids
        segment.logprobs += completion.logprobs
        segment.mask += [True] * len(completion.token_ids)
        self.last_turn = common_pb2.Turn(start=start, end=len(segment.completion_ids),
                                         finish_reason=completion.finish_reason, policy_version=version)
        segment.turns.append(self.last_turn)
        self.heads[pending.call] = (segment, completion.finish_reason == "eos")
        self.last_action = completion.text

    def verified(self, result: reward_pb2.ScoreResult) -> None:
        """The verifier's score of the last action: added to the last turn's reward, or the episode's
        reward failed with its status and reason."""
        if result.status != OK:
            self.reward_status, self.reason = result.status, result.reason
            return
        turns = self.turns
        steps = sum(t.reward for t in turns)
        turns[-1].reward += result.reward
        self.components = {**result.components, "environment": steps, "verifier": result.reward}

    def check_total(self) -> None:
        """Fails the episode's reward (REWARD_STATUS_ERROR) when the sum of its turns' rewards is not finite."""
        total = sum(t.reward for t in self.turns)
        if self.reward_status == OK and not math.isfinite(total):
            self.reward_status = common_pb2.REWARD_STATUS_ERROR
            self.reason = f"the episode's total reward (the sum of its turns' rewards) is {total}, not finite"
            self.components = {}

    def reward(self, unfinished_reward: float | None) -> float:
        """The sum of the turns' rewards; 0 after an environment failure; unfinished_reward (unless None)
        for an episode truncated or out of turns."""
        if self.reward_status != OK:
            return 0.0
        unfinished = self.status in (common_pb2.EPISODE_STATUS_TRUNCATED, common_pb2.EPISODE_STATUS_MAX_TURNS)
        if unfinished and unfinished_reward is not None:
            return unfinished_reward
        return sum(t.reward for t in self.turns)

    def samples(self, tokenizer: Any, unfinished_reward: float | None = None) -> list[common_pb2.Sample]:
        """One sample per segment that holds a turn (the first segment when none does), each with the
        episode's reward and status; all but the last have `continues` set."""
        segments = [s for s in self.segments if s.turns] or self.segments[:1]
        reward, turns = self.reward(unfinished_reward), self.turns
        finish = turns[-1].finish_reason if turns else ""
        return [common_pb2.Sample(
            prompt_token_ids=s.prompt_ids, completion_token_ids=s.completion_ids, behaviour_logprobs=s.logprobs,
            completion_text=tokenizer.decode(s.completion_ids), reward=reward, reward_status=self.reward_status,
            reward_reason=self.reason, finish_reason=finish, loss_mask=s.mask, turns=s.turns,
            episode_status=self.status, reward_components=self.components, continues=i < len(segments) - 1)
            for i, s in enumerate(segments)]


def messages_of(tokenizer: Any, result: reward_pb2.EpisodeResult) -> list[dict[str, str]]:
    """The environment's observation messages, their contents escaped for the chat template (`chat_escape`)."""
    return escape_messages(tokenizer, [{"role": m.role, "content": m.content} for m in result.observation])


def conversation_of(tokenizer: Any, result: reward_pb2.EpisodeResult, rollout: RolloutConfig) -> list[int]:
    """The tokens of a whole conversation the environment (or an agent's call) opens a segment with:
    its messages and tools through the chat template, ready for the assistant's turn."""
    tools = escape_json(tokenizer, json.loads(result.tools_json)) if result.tools_json else None
    return conversation_tokens(tokenizer, messages_of(tokenizer, result), rollout, tools)


class EpisodeRunner:
    """Plays the episodes of one task at a time."""

    settings: ActorSettings

    def __init__(self, settings: ActorSettings, host: EpisodeHost, stage: Stage) -> None:
        self.settings = settings
        self._host = host
        self._stage = stage

    async def play(self, job_id: str, spec_seed: int, rollout: RolloutConfig, env: EnvironmentSpec,
                   env_proto: reward_pb2.EnvironmentSpec, backend: Backend, task: common_pb2.Task,
                   verifier: Verifier | None = None, tenant: str = "",
                   weights: Weights | None = None) -> list[common_pb2.Sample]:
        """The group's samples, one per episode, in episode order (verifier: the job's built-in
        verifier, which scores each episode's last action; tenant: the job's, for the reward service's
        per-tenant share of episode slots; weights: the job's weights the backend holds, whose version
        each turn records and which, with `env.inflight_updates`, are refreshed before each turn after
        the first)."""
        session = f"{self.settings.actor_id}/{task.task_id}/{uuid.uuid4().hex[:12]}"[-128:]
        timeout_s = env.step_timeout_s + self.settings.reward_timeout_s
        with self._stage("env_open", "stepping_env"):
            opened = await self._host.open_episodes(job_id, session, env_proto, task, rollout.samples_per_prompt,
                                                    timeout_s, tenant=tenant)
        try:
            episodes = [self._first(backend.tokenizer, results, rollout, env, task)
                        for results in _by_episode(opened, range(rollout.samples_per_prompt))]
            for turn in range(env.max_turns):
                live = [e for e in episodes if e.live]
                if not live:
                    break
                if turn and env.inflight_updates and weights is not None:
                    with self._stage("ensure_weights", "waiting_for_weights"):
                        await weights.refresh()
                version = weights.version if weights is not None else 0
                await self._turn(job_id, spec_seed, task, rollout, env, backend, session, live, turn, timeout_s,
                                 version)
            for episode in episodes:
                if episode.live:
                    episode.end(common_pb2.EPISODE_STATUS_MAX_TURNS)
        finally:
            with contextlib.suppress(Exception):  # the service reaps a session left open
                await asyncio.wait_for(self._host.close_episodes(job_id, session), self.settings.reward_timeout_s)
        if verifier is not None:
            await self._verify(verifier, episodes)
        for episode in episodes:
            if verifier is None and episode.answered and episode.reward_status == OK:
                episode.reward_status = common_pb2.REWARD_STATUS_ERROR
                episode.reason = "the agent's run returned an answer (a str), but the job has no verifier to score " \
                                 "it: set reward.builtin, or return the reward (a number)"
        for episode in episodes:
            episode.check_total()
        return [sample for e in episodes for sample in e.samples(backend.tokenizer, env.unfinished_reward)]

    @staticmethod
    async def _verify(verifier: Verifier, episodes: list[Episode]) -> None:
        """The verifier's score of every episode that acted and did not fail."""
        scored = [e for e in episodes if e.reward_status == OK and e.turns]
        if not scored:
            return
        results = await verifier([e.last_action for e in scored])
        if len(results) != len(scored):
            raise RuntimeError(f"reward service returned {len(results)} results for {len(scored)} final actions")
        for episode, result in zip(scored, results, strict=True):
            episode.verified(result)

    def _first(self, tokenizer: Any, results: list[reward_pb2.EpisodeResult], rollout: RolloutConfig,
               env: EnvironmentSpec, task: common_pb2.Task) -> Episode:
        first = results[0]
        if first.status != OK:
            episode = Episode(first.episode, [Segment(prompt_tokens(tokenizer, task.prompt, rollout))])
            episode.end(common_pb2.EPISODE_STATUS_ENV_ERROR, first.status, first.reason)
            return episode
        episode = Episode(first.episode, [])
        if first.done:  # its sample still needs a prompt
            episode.segments.append(Segment(conversation_of(tokenizer, first, rollout)))
        self._receive(tokenizer, rollout, env, episode, results)
        return episode

    async def _turn(self, job_id: str, spec_seed: int, task: common_pb2.Task, rollout: RolloutConfig,
                    env: EnvironmentSpec, backend: Backend, session: str, live: list[Episode], turn: int,
                    timeout_s: float, version: int) -> None:
        """One assistant turn of every live episode (each of an agent's pending calls, all in one batch, each
        from its own seed), then the environment's answers."""
        calls = [(episode, pending) for episode in live for pending in episode.pending]
        budgets = [min(rollout.max_new_tokens, env.max_total_tokens - len(p.segment.tokens),
                       p.cap or rollout.max_new_tokens) for _, p in calls]
        seeds = [task_seed(spec_seed, f"{task.task_id}/e{e.index}/turn{turn}/call{p.call}") for e, p in calls]
        with self._stage("generate", "generating"):
            completions = await asyncio.to_thread(
                backend.generate_batch, [p.segment.tokens for _, p in calls], max_new_tokens=budgets,
                temperature=rollout.temperature, top_p=rollout.top_p, seeds=seeds)
        metrics.GENERATED_TOKENS.labels(job_id).inc(sum(len(c.token_ids) for c in completions))
        actions = [reward_pb2.Action(episode=e.index, turn=turn, call=p.call, text=c.text,
                                     finish_reason=c.finish_reason, prompt_tokens=len(p.segment.tokens),
                                     completion_tokens=len(c.token_ids))
                   for (e, p), c in zip(calls, completions, strict=True)]
        for (episode, pending), completion in zip(calls, completions, strict=True):
            episode.add_action(pending, completion, version)
        for episode in live:
            episode.pending = []
        with self._stage("env_step", "stepping_env"):
            results = await self._host.step_episodes(job_id, session, actions, timeout_s)
        for episode, answers in zip(live, _by_episode(results, [e.index for e in live]), strict=True):
            self._receive(backend.tokenizer, rollout, env, episode, answers)

    @staticmethod
    def _receive(tokenizer: Any, rollout: RolloutConfig, env: EnvironmentSpec, episode: Episode,
                 results: list[reward_pb2.EpisodeResult]) -> None:
        """An episode's answers from the open or a step: its end, or the calls (the observation) its next turn
        answers, each appended to the sequence it extends or opening a segment."""
        first = results[0]
        if episode.last_turn is not None:
            episode.last_turn.reward += sum(result.reward for result in results)
            episode.last_turn.env_latency_s = first.latency_s
            metrics.ENV_STEP_SECONDS.observe(first.latency_s)
        if first.status != OK:
            episode.end(common_pb2.EPISODE_STATUS_ENV_ERROR, first.status, first.reason)
        elif first.done:
            episode.end(common_pb2.EPISODE_STATUS_DONE)
            if first.answer:
                episode.last_action, episode.answered = first.answer, True
            if first.components:
                episode.components = dict(first.components)
        else:
            for result in results:
                if not _continue(tokenizer, rollout, env, episode, result):
                    return


def _continue(tokenizer: Any, rollout: RolloutConfig, env: EnvironmentSpec, episode: Episode,
              result: reward_pb2.EpisodeResult) -> bool:
    """Queue the turn answering one call (or an environment's observation): a new segment from its whole
    conversation, or its messages appended to the sequence it extends. False when the episode ended instead
    (truncated at max_total_tokens, or a call that extends nothing answered)."""
    if result.segment or not episode.segments:
        segment = Segment(conversation_of(tokenizer, result, rollout))
        if episode.segments:
            metrics.AGENT_SEGMENTS.inc()
        episode.segments.append(segment)
        if len(segment.tokens) >= env.max_total_tokens:
            episode.end(common_pb2.EPISODE_STATUS_TRUNCATED)
            return False
    else:
        head = episode.heads.pop(result.extends, None)
        if head is None:
            episode.end(common_pb2.EPISODE_STATUS_ENV_ERROR, common_pb2.REWARD_STATUS_ERROR,
                        f"call {result.call} extends call {result.extends}, which has no answered turn to extend")
            return False
        segment, after_eos = head
        observed = observation_tokens(tokenizer, messages_of(tokenizer, result), rollout, after_eos=after_eos)
        if len(segment.tokens) + len(observed) >= env.max_total_tokens:
            episode.end(common_pb2.EPISODE_STATUS_TRUNCATED)
            return False
        segment.add_observation(observed)
    episode.pending.append(Pending(result.call, segment, result.max_new_tokens))
    return True


def _by_episode(results: Sequence[reward_pb2.EpisodeResult],
                indices: Sequence[int]) -> list[list[reward_pb2.EpisodeResult]]:
    """The reward service's results grouped by episode, one non-empty group per index in indices (an agent's
    episode has one result per pending call); RuntimeError when an episode has none or one was not asked for."""
    groups: dict[int, list[reward_pb2.EpisodeResult]] = {index: [] for index in indices}
    for result in results:
        if result.episode not in groups:
            raise RuntimeError(f"reward service returned a result for episode {result.episode}, not one of "
                               f"{list(indices)}")
        groups[result.episode].append(result)
    missing = [index for index, group in groups.items() if not group]
    if missing:
        raise RuntimeError(f"reward service returned no result for episodes {missing}")
    return list(groups.values())
