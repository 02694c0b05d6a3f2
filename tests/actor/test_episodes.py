"""Multi-turn episodes through real services: an actor process, the reward service's sandboxed
environment sessions, replay, and a tiny model.

A scripted environment with known observations and rewards: the group replay returns holds, for
every episode, exactly the tokens the policy generated (an in-process `EpisodeRunner` against the
same reward service, with the same weights and seeds, generates the same), each observation's tokens
exactly as the chat template renders the environment's text, loss mask true on policy tokens only,
behaviour log-probs that match a full forward pass, turn boundaries, per-turn and final rewards,
and the episode's status. A hostile environment that hangs in step is contained within its timeout.
A reward service SIGKILLed mid-episode: the actor's next step fails cleanly (NOT_FOUND once the
service is back), the task is redelivered and its group stored once. An actor SIGKILLed mid-episode:
the task is redelivered and stored once, and the dead actor's session is reaped within the idle timeout.
Both faults are tried on an environment and on an agent file (`fleetrl.env.agent`) playing the same
episodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from actor_fleet import MODEL, Fleet, start_service, wait_until
from prometheus_client.parser import text_string_to_metric_families

from fleetrl.jobs.store import JobState
from fleetrl.launcher.embedded import free_port
from fleetrl.policy import models
from fleetrl.policy.backends import LOGPROB_TOL, HFBackend, observation_tokens
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.reward import verifiers
from fleetrl.reward.client import RewardClient, environment_to_proto
from fleetrl.rollout.episodes import OK, Episode, EpisodeRunner, Segment
from fleetrl.rollout.settings import ActorSettings
from fleetrl.spec.config import JobSpec, RewardSpec

SCRIPTED_ENV = b'''
class Env:
    def __init__(self, task, turns=3, hang_on=""):
        self.prompt, self.turns, self.hang_on, self.turn = task["prompt"], turns, hang_on, 0

    def reset(self):
        return "Say anything about: " + self.prompt

    def step(self, action):
        if self.hang_on and self.hang_on in self.prompt:
            while True:
                pass
        self.turn += 1
        reward = 0.25 * self.turn + len(action) % 2
        if self.turn >= self.turns:
            return None, reward, True
        return f"turn {self.turn}: you wrote {len(action)} characters", reward, False
'''


def expected_turn(turn: int, action: str, turns: int) -> tuple[str | None, float, bool]:
    """What SCRIPTED_ENV answers to `action` at 0-based `turn`."""
    reward = 0.25 * (turn + 1) + len(action) % 2
    if turn + 1 >= turns:
        return None, reward, True
    return f"turn {turn + 1}: you wrote {len(action)} characters", reward, False


def env_job(**environment: Any) -> JobSpec:
    return JobSpec.model_validate({
        "model": MODEL, "prompts": "prompts.jsonl", "seed": 11,
        "environment": {"file": "env.py", "max_turns": 3, "max_total_tokens": 400, "step_timeout_s": 3.0,
                        "memory_limit_mb": 256, **environment},
        "rollout": {"samples_per_prompt": 3, "max_new_tokens": 8, "prompts_per_step": 4, "temperature": 1.0},
        "train": {"task_ack_wait_s": 10.0, "max_retries_per_episode": 3, "max_staleness": 0},
    })


async def stored_group(fleet: Fleet, job: str, timeout_s: float = 120) -> common_pb2.Group:
    await wait_until(lambda: _inserted(fleet, job), timeout_s, f"job {job}'s group")
    _, groups, _ = await fleet.replay.sample(job, 1)
    assert len(groups) == 1
    return groups[0]


async def _inserted(fleet: Fleet, job: str) -> bool:
    return (await fleet.replay.stats(job)).inserted >= 1


def check_episode(sample: common_pb2.Sample, tokenizer: Any, spec: JobSpec) -> None:
    """Turns, mask, observations and rewards of one stored episode against the script."""
    assert spec.environment is not None
    ids, mask = list(sample.completion_token_ids), list(sample.loss_mask)
    assert len(mask) == len(ids) == len(sample.behaviour_logprobs)
    policy = [False] * len(ids)
    total = 0.0
    for k, turn in enumerate(sample.turns):
        policy[turn.start:turn.end] = [True] * (turn.end - turn.start)
        action = tokenizer.decode(ids[turn.start:turn.end], skip_special_tokens=True)
        observation, reward, done = expected_turn(k, action, spec.environment.params.get("turns", 3))
        assert turn.reward == reward
        total += reward
        following = ids[turn.end:sample.turns[k + 1].start] if k + 1 < len(sample.turns) else ids[turn.end:]
        if done:
            assert following == [] and k == len(sample.turns) - 1
        elif k == len(sample.turns) - 1 and sample.episode_status != common_pb2.EPISODE_STATUS_DONE:
            assert following == []  # truncated or out of turns: the last observation is not appended
        else:
            assert observation is not None
            rendered = observation_tokens(tokenizer, [{"role": "user", "content": observation}], spec.rollout,
                                          after_eos=turn.finish_reason == "eos")
            assert following == rendered
    assert mask == policy  # the policy's tokens and nothing else
    assert all(lp == 0.0 for lp, m in zip(sample.behaviour_logprobs, mask, strict=True) if not m)
    assert sample.reward == total and sample.reward_status == common_pb2.REWARD_STATUS_OK


def full_forward_gap(model: torch.nn.Module, sample: common_pb2.Sample) -> float:
    """max |behaviour log-prob - full-forward log-prob| over the sample's policy tokens."""
    tokens = [*sample.prompt_token_ids, *sample.completion_token_ids]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
    start = len(sample.prompt_token_ids)
    gaps = [abs(logp[start + i - 1, token].item() - sample.behaviour_logprobs[i])
            for i, token in enumerate(sample.completion_token_ids) if sample.loss_mask[i]]
    return max(gaps)


@contextlib.contextmanager
def serving(fleet: Fleet, name: str) -> Iterator[None]:
    fleet.start_actor(name)
    try:
        yield
    finally:
        fleet.kill(name)


async def test_scripted_environment_groups_are_stored_exactly(fleet: Fleet) -> None:
    """One actor serves three jobs: episodes that end done; episodes truncated at max_total_tokens next to
    episodes whose environment hangs in step (each ended by its 1 s step timeout); and episodes whose
    last action a built-in verifier scores."""
    spec = env_job(params={"turns": 3})
    job = await fleet.create_job(spec, [], environment_file=SCRIPTED_ENV)
    await fleet.publish_weights(job, 0, dtype="float32")  # the actor then holds exactly models.load(MODEL)'s weights
    task = await fleet.publish_task(job, 0, "the sea", "")
    limited = env_job(params={"turns": 50, "hang_on": "HANG"}, max_turns=50, max_total_tokens=90, step_timeout_s=1.0)
    other = await fleet.create_job(limited, [], environment_file=SCRIPTED_ENV)
    await fleet.publish_weights(other, 0, dtype="float32")
    await fleet.publish_task(other, 0, "a short story", "")
    await fleet.publish_task(other, 1, "please HANG", "")
    verified_spec = env_job(params={"turns": 2}).model_copy(update={"reward": VERIFIER})
    verified = await fleet.create_job(verified_spec, [], environment_file=SCRIPTED_ENV)
    await fleet.publish_weights(verified, 0, dtype="float32")
    await fleet.publish_task(verified, 0, "the moon", "")
    with serving(fleet, "ep0"):
        group = await stored_group(fleet, job)
        await wait_until(lambda: _count(fleet, other, 2), 120, "both groups of the second job")
        verified_group = await stored_group(fleet, verified)
    assert group.policy_version == 0 and len(group.samples) == 3
    model, tokenizer = models.load(MODEL)
    for sample in group.samples:
        check_episode(sample, tokenizer, spec)
        assert sample.episode_status == common_pb2.EPISODE_STATUS_DONE and len(sample.turns) == 3
        assert full_forward_gap(model, sample) < LOGPROB_TOL[torch.float32]

    # The same episodes played in this process against the same reward service give the same group.
    assert spec.environment is not None
    reward = RewardClient(fleet.services.reward_addr, timeout_s=30)
    runner = EpisodeRunner(ActorSettings(actor_id="test"), reward, lambda name, state: contextlib.nullcontext())
    try:
        again = await runner.play(job, spec.seed, spec.rollout, spec.environment,
                                  environment_to_proto(spec.environment, SCRIPTED_ENV), HFBackend(model, tokenizer),
                                  task)
    finally:
        await reward.close()
    assert [comparable(s) for s in again] == [comparable(s) for s in group.samples]
    for mine, stored in zip(again, group.samples, strict=True):  # float rounding differs with the thread count
        gap = max(abs(a - b) for a, b in zip(mine.behaviour_logprobs, stored.behaviour_logprobs, strict=True))
        assert gap < 1e-5

    _, groups, _ = await fleet.replay.sample(other, 2)
    by_prompt = {g.prompt: g for g in groups}
    for sample in by_prompt["a short story"].samples:
        assert sample.episode_status == common_pb2.EPISODE_STATUS_TRUNCATED
        assert len(sample.prompt_token_ids) + len(sample.completion_token_ids) <= 90
        check_episode(sample, tokenizer, limited)
    for sample in by_prompt["please HANG"].samples:
        assert sample.episode_status == common_pb2.EPISODE_STATUS_ENV_ERROR
        assert sample.reward_status == common_pb2.REWARD_STATUS_TIMEOUT and sample.reward == 0.0
        assert "timed out after 1s" in sample.reward_reason and len(sample.turns) == 1
        assert sample.turns[0].env_latency_s < 3
    check_verified(verified_group, tokenizer)


async def test_an_episode_plays_the_same_alone_as_beside_others(fleet: Fleet) -> None:
    """Each call of an episode draws from its own seed (task, episode, turn, call), so episode 0 of a group of
    three plays exactly as episode 0 played alone: the same tokens at every turn, its log-probs within float
    rounding of the padded batch. With one seed per turn shared by the batch, its tokens changed with the
    number of episodes beside it."""
    spec = env_job(params={"turns": 3})
    assert spec.environment is not None
    job = await fleet.create_job(spec, [], environment_file=SCRIPTED_ENV)
    task = common_pb2.Task(job_id=job, task_id="0/0", epoch=0, prompt_index=0, prompt="the sea", metadata_json="{}")
    model, tokenizer = models.load(MODEL)
    reward = RewardClient(fleet.services.reward_addr, timeout_s=30)
    runner = EpisodeRunner(ActorSettings(actor_id="test"), reward, lambda name, state: contextlib.nullcontext())
    env_proto = environment_to_proto(spec.environment, SCRIPTED_ENV)
    try:
        played = {n: await runner.play(job, spec.seed, spec.rollout.model_copy(update={"samples_per_prompt": n}),
                                       spec.environment, env_proto, HFBackend(model, tokenizer), task)
                  for n in (3, 1)}
    finally:
        await reward.close()
        await fleet.jobs.set_state(job, JobState.SUCCEEDED)
    beside, alone = played[3][0], played[1][0]
    assert len(alone.turns) == 3 and comparable(beside) == comparable(alone)
    gap = max(abs(a - b) for a, b in zip(beside.behaviour_logprobs, alone.behaviour_logprobs, strict=True))
    assert gap < LOGPROB_TOL[torch.float32]
    assert {tuple(s.completion_token_ids) for s in played[3]} != {tuple(alone.completion_token_ids)}  # 3 differ


VERIFIER = RewardSpec(builtin="length_penalty", params={"max_length": 12, "penalty": 2.0})


def check_verified(group: common_pb2.Group, tokenizer: Any) -> None:
    """A built-in verifier beside the environment: its score of the last action joins the last turn's reward."""
    verify = verifiers.resolve(VERIFIER.builtin or "", VERIFIER.params)
    assert len(group.samples) == 3
    for sample in group.samples:
        assert sample.episode_status == common_pb2.EPISODE_STATUS_DONE and len(sample.turns) == 2
        actions = [tokenizer.decode(sample.completion_token_ids[t.start:t.end], skip_special_tokens=True)
                   for t in sample.turns]
        steps = [expected_turn(k, action, 2)[1] for k, action in enumerate(actions)]
        verdict = verifiers.scalar(verify(actions[-1], group.prompt, answer=""))
        assert [t.reward for t in sample.turns] == [steps[0], steps[1] + verdict]
        assert sample.reward == sum(steps) + verdict and sample.reward_status == common_pb2.REWARD_STATUS_OK
        assert dict(sample.reward_components) == {"environment": sum(steps), "verifier": verdict}


def comparable(sample: common_pb2.Sample) -> common_pb2.Sample:
    """The sample less its environment latencies (wall-clock times) and log-probs (compared apart)."""
    copy = common_pb2.Sample()
    copy.CopyFrom(sample)
    for turn in copy.turns:
        turn.env_latency_s = 0.0
    del copy.behaviour_logprobs[:]
    return copy


async def _count(fleet: Fleet, job: str, n: int) -> bool:
    return (await fleet.replay.stats(job)).inserted >= n


SLOW_ENV = b'''
import time

class Env:
    def __init__(self, task):
        self.turn = 0

    def reset(self):
        return "Go on."

    def step(self, action):
        time.sleep(1.0)
        self.turn += 1
        return ("again" if self.turn < 4 else None), 1.0, self.turn >= 4
'''

SLOW_AGENT = b'''
import time

def run(client, task):
    messages = [{"role": "user", "content": "Go on."}]
    for turn in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages)
        time.sleep(1.0)
        messages += [reply.choices[0].message, {"role": "user", "content": "again"}]
    return 4.0
'''
SLOW = {"env": SLOW_ENV, "agent": SLOW_AGENT}
"""The same slow episode (4 turns, 1 s in the sandbox after each, reward 4) as an environment and as an agent."""


@pytest.mark.parametrize("kind", sorted(SLOW))
async def test_reward_service_restart_mid_episode_redelivers_the_task(kind: str, fleet: Fleet, tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    argv = ["fleetrl.services.reward", "--listen", f"127.0.0.1:{port}", "--workers", "1", "--set",
            f"metrics_port={metrics_port}"]
    reward = start_service(argv, tmp_path / "reward.log", port)
    try:  # from here on: a failure anywhere (even creating the job) must not leave the reward service running
        spec = env_job(max_turns=4, step_timeout_s=5.0, kind=kind)
        job = await fleet.create_job(spec, [], environment_file=SLOW[kind])
        await fleet.publish_weights(job, 0, dtype="float32")
        fleet.start_actor("ep2", "nak_base_delay_s=0.1", reward_addr=f"127.0.0.1:{port}")
        await fleet.publish_task(job, 0, "restart me", "")
        log = tmp_path / "reward.log"
        # inside the episode (4 steps of 1 s): after its first step, before its last
        await wait_until(lambda: scrape(metrics_port, "fleetrl_reward_env_seconds_count", op="step") >= 1, 90,
                         "the episodes' first step")
        reward.kill()
        reward.wait(10)
        reward = start_service(argv, log, port)
        group = await stored_group(fleet, job)
    finally:
        reward.kill()
        reward.wait(10)
        if "ep2" in fleet.actors:
            fleet.kill("ep2")
    assert "no episode session" in fleet.log_text("ep2")  # the step after the restart failed cleanly
    assert group.lineage.delivery_attempt == 2
    assert (await fleet.replay.stats(job)).inserted == 1
    assert all(s.episode_status == common_pb2.EPISODE_STATUS_DONE and s.reward == 4.0 for s in group.samples)


def scrape(port: int, name: str, **labels: str) -> float:
    """A sample of a service's /metrics (0 when absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


@pytest.mark.parametrize("kind", sorted(SLOW))
async def test_actor_sigkilled_mid_episode(kind: str, fleet: Fleet, tmp_path: Path) -> None:
    """After turn 1, before the last: the task is redelivered to another actor and stored once, and the dead
    actor's session is reaped (its workers killed) within the idle timeout."""
    port, metrics_port, idle_s = free_port(), free_port(), 3.0
    argv = ["fleetrl.services.reward", "--listen", f"127.0.0.1:{port}", "--workers", "1", "--set",
            f"metrics_port={metrics_port}", "--set", f"episode_idle_timeout_s={idle_s}"]
    log = tmp_path / "reward.log"
    reward = start_service(argv, log, port)
    try:  # from here on: a failure anywhere (even creating the job) must not leave the reward service running
        spec = env_job(max_turns=4, step_timeout_s=5.0, episode_timeout_s=60.0, kind=kind)
        job = await fleet.create_job(spec, [], environment_file=SLOW[kind])
        await fleet.publish_weights(job, 0, dtype="float32")
        fleet.start_actor("doomed", reward_addr=f"127.0.0.1:{port}")
        await fleet.publish_task(job, 0, "kill me", "")
        await wait_until(lambda: scrape(metrics_port, "fleetrl_reward_env_seconds_count", op="step") >= 3, 90,
                         "turn 1 of the doomed actor's episodes")
        fleet.kill("doomed")
        killed = time.monotonic()
        assert scrape(metrics_port, "fleetrl_reward_open_episodes") == 3  # none ended: 4 steps each
        await wait_until(lambda: scrape(metrics_port, "fleetrl_reward_episodes_total", job=job,
                                        status="abandoned") == 3, idle_s + 10, "the abandoned session reaped")
        assert time.monotonic() - killed < idle_s + 5
        # a step in flight when the actor died is cancelled by gRPC (its worker killed then), the rest at the reaping
        assert sum(scrape(metrics_port, "fleetrl_reward_worker_restarts_total", reason=reason)
                   for reason in ("abandoned", "cancelled")) == 3
        fleet.start_actor("heir", reward_addr=f"127.0.0.1:{port}")
        group = await stored_group(fleet, job, timeout_s=180)
        await asyncio.sleep(1.0)
        assert scrape(metrics_port, "fleetrl_reward_open_episodes") == 0
    finally:
        reward.kill()
        reward.wait(10)
        if "heir" in fleet.actors:
            fleet.kill("heir")
    assert group.lineage.actor_id == "heir" and group.lineage.delivery_attempt == 2
    assert (await fleet.replay.stats(job)).inserted == 1
    assert all(s.episode_status == common_pb2.EPISODE_STATUS_DONE and len(s.turns) == 4 for s in group.samples)


def test_unfinished_reward_replaces_the_sum_of_unfinished_episodes_only() -> None:
    def episode(status: common_pb2.EpisodeStatus, reward_status: common_pb2.RewardStatus = OK) -> Episode:
        made = Episode(0, [Segment([1, 2])])
        made.segments[0].turns.extend([common_pb2.Turn(start=0, end=1, reward=0.25),
                                   common_pb2.Turn(start=1, end=2, reward=0.5)])
        made.end(status, reward_status)
        return made

    done, truncated = episode(common_pb2.EPISODE_STATUS_DONE), episode(common_pb2.EPISODE_STATUS_TRUNCATED)
    out_of_turns = episode(common_pb2.EPISODE_STATUS_MAX_TURNS)
    failed = episode(common_pb2.EPISODE_STATUS_ENV_ERROR, common_pb2.REWARD_STATUS_TIMEOUT)
    assert [e.reward(None) for e in (done, truncated, out_of_turns, failed)] == [0.75, 0.75, 0.75, 0.0]
    assert [e.reward(-1.0) for e in (done, truncated, out_of_turns, failed)] == [0.75, -1.0, -1.0, 0.0]
