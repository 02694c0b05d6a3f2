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
- The observation that ends an episode (done) is not appended: nothing is generated after it.
  Each turn may generate up to `rollout.max_new_tokens`, less what is left of `max_total_tokens`;
  an observation that would leave no room for another token ends the episode as TRUNCATED.
- One episode uses one policy version: weights are applied between tasks only (`job_policy`).
- Turn k of a task is sampled with the seed `task_seed(job seed, "<task id>/turn<k>")`, so a
  redelivery under the same weights and a deterministic environment gives the same group.
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

Verifier = Callable[[list[str]], Awaitable[list[reward_pb2.ScoreResult]]]
"""Scores final actions with the job's built-in verifier, one result per text (Rollout.verifier)."""


@dataclass
class Episode:
    """One episode's sequence as it grows."""

    index: int
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: list[common_pb2.Turn] = field(default_factory=list)
    status: common_pb2.EpisodeStatus = LIVE
    reward_status: common_pb2.RewardStatus = OK
    reason: str = ""
    last_action: str = ""
    components: dict[str, float] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.status == LIVE

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def end(self, status: common_pb2.EpisodeStatus, reward_status: common_pb2.RewardStatus = OK,
            reason: str = "") -> None:
        self.status, self.reward_status, self.reason = status, reward_status, reason

    def add_action(self, completion: Completion) -> None:
        start = len(self.completion_ids)
        self.completion_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.mask += [True] * len(completion.token_ids)
        self.turns.append(common_pb2.Turn(start=start, end=len(self.completion_ids),
                                          finish_reason=completion.finish_reason))
        self.last_action = completion.text

    def verified(self, result: reward_pb2.ScoreResult) -> None:
        """The verifier's score of the last action: added to the last turn's reward, or the episode's
        reward failed with its status and reason."""
        if result.status != OK:
            self.reward_status, self.reason = result.status, result.reason
            return
        steps = sum(t.reward for t in self.turns)
        self.turns[-1].reward += result.reward
        self.components = {**result.components, "environment": steps, "verifier": result.reward}

    def add_observation(self, token_ids: list[int]) -> None:
        self.completion_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.mask += [False] * len(token_ids)

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

    def sample(self, tokenizer: Any, unfinished_reward: float | None = None) -> common_pb2.Sample:
        return common_pb2.Sample(
            prompt_token_ids=self.prompt_ids, completion_token_ids=self.completion_ids,
            behaviour_logprobs=self.logprobs, completion_text=tokenizer.decode(self.completion_ids),
            reward=self.reward(unfinished_reward), reward_status=self.reward_status,
            reward_reason=self.reason, finish_reason=self.turns[-1].finish_reason if self.turns else "",
            loss_mask=self.mask, turns=self.turns, episode_status=self.status, reward_components=self.components)


def messages_of(tokenizer: Any, result: reward_pb2.EpisodeResult) -> list[dict[str, str]]:
    """The environment's observation messages, their contents escaped for the chat template (`chat_escape`)."""
    return escape_messages(tokenizer, [{"role": m.role, "content": m.content} for m in result.observation])


class EpisodeRunner:
    """Plays the episodes of one task at a time."""

    settings: ActorSettings

    def __init__(self, settings: ActorSettings, host: EpisodeHost, stage: Stage) -> None:
        self.settings = settings
        self._host = host
        self._stage = stage

    async def play(self, job_id: str, spec_seed: int, rollout: RolloutConfig, env: EnvironmentSpec,
                   env_proto: reward_pb2.EnvironmentSpec, backend: Backend, task: common_pb2.Task,
                   verifier: Verifier | None = None, tenant: str = "") -> list[common_pb2.Sample]:
        """The group's samples, one per episode, in episode order (verifier: the job's built-in
        verifier, which scores each episode's last action; tenant: the job's, for the reward service's
        per-tenant share of episode slots)."""
        session = f"{self.settings.actor_id}/{task.task_id}/{uuid.uuid4().hex[:12]}"[-128:]
        timeout_s = env.step_timeout_s + self.settings.reward_timeout_s
        with self._stage("env_open", "stepping_env"):
            opened = await self._host.open_episodes(job_id, session, env_proto, task, rollout.samples_per_prompt,
                                                    timeout_s, tenant=tenant)
        try:
            episodes = [self._first(backend.tokenizer, result, rollout, env, task) for result in opened]
            for turn in range(env.max_turns):
                live = [e for e in episodes if e.live]
                if not live:
                    break
                await self._turn(job_id, task_seed(spec_seed, f"{task.task_id}/turn{turn}"), rollout, env,
                                 backend, session, live, turn, timeout_s)
            for episode in episodes:
                if episode.live:
                    episode.end(common_pb2.EPISODE_STATUS_MAX_TURNS)
        finally:
            with contextlib.suppress(Exception):  # the service reaps a session left open
                await asyncio.wait_for(self._host.close_episodes(job_id, session), self.settings.reward_timeout_s)
        if verifier is not None:
            await self._verify(verifier, episodes)
        for episode in episodes:
            episode.check_total()
        return [e.sample(backend.tokenizer, env.unfinished_reward) for e in episodes]

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

    @staticmethod
    def _first(tokenizer: Any, result: reward_pb2.EpisodeResult, rollout: RolloutConfig, env: EnvironmentSpec,
               task: common_pb2.Task) -> Episode:
        if result.status != OK:
            episode = Episode(result.episode, prompt_tokens(tokenizer, task.prompt, rollout))
            episode.end(common_pb2.EPISODE_STATUS_ENV_ERROR, result.status, result.reason)
            return episode
        tools = escape_json(tokenizer, json.loads(result.tools_json)) if result.tools_json else None
        first = conversation_tokens(tokenizer, messages_of(tokenizer, result), rollout, tools)
        episode = Episode(result.episode, first)
        if result.done:
            episode.end(common_pb2.EPISODE_STATUS_DONE)
        elif len(episode.prompt_ids) >= env.max_total_tokens:
            episode.end(common_pb2.EPISODE_STATUS_TRUNCATED)
        return episode

    async def _turn(self, job_id: str, seed: int, rollout: RolloutConfig, env: EnvironmentSpec, backend: Backend,
                    session: str, live: list[Episode], turn: int, timeout_s: float) -> None:
        """One assistant turn of every live episode, then the environment's answers."""
        budgets = [min(rollout.max_new_tokens, env.max_total_tokens - len(e.tokens)) for e in live]
        with self._stage("generate", "generating"):
            completions = await asyncio.to_thread(
                backend.generate_batch, [e.tokens for e in live], max_new_tokens=budgets,
                temperature=rollout.temperature, top_p=rollout.top_p, seed=seed)
        metrics.GENERATED_TOKENS.labels(job_id).inc(sum(len(c.token_ids) for c in completions))
        for episode, completion in zip(live, completions, strict=True):
            episode.add_action(completion)
        actions = [reward_pb2.Action(episode=e.index, turn=turn, text=c.text)
                   for e, c in zip(live, completions, strict=True)]
        with self._stage("env_step", "stepping_env"):
            results = await self._host.step_episodes(job_id, session, actions, timeout_s)
        if len(results) != len(actions):
            raise RuntimeError(f"reward service returned {len(results)} results for {len(actions)} actions")
        for episode, completion, result in zip(live, completions, results, strict=True):
            self._answer(backend.tokenizer, rollout, env, episode, completion, result)

    @staticmethod
    def _answer(tokenizer: Any, rollout: RolloutConfig, env: EnvironmentSpec, episode: Episode,
                completion: Completion, result: reward_pb2.EpisodeResult) -> None:
        last = episode.turns[-1]
        last.reward, last.env_latency_s = result.reward, result.latency_s
        metrics.ENV_STEP_SECONDS.observe(result.latency_s)
        if result.status != OK:
            episode.end(common_pb2.EPISODE_STATUS_ENV_ERROR, result.status, result.reason)
        elif result.done:
            episode.end(common_pb2.EPISODE_STATUS_DONE)
        else:
            observed = observation_tokens(tokenizer, messages_of(tokenizer, result), rollout,
                                          after_eos=completion.finish_reason == "eos")
            if len(episode.tokens) + len(observed) >= env.max_total_tokens:
                episode.end(common_pb2.EPISODE_STATUS_TRUNCATED)
            else:
                episode.add_observation(observed)
