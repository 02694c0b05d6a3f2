"""Agent episodes through real services: an actor process, the reward service's sandboxed agent (the real
`openai` SDK inside the jail), replay, and a tiny model.

A scripted agent makes three calls: one, one that extends it with a tool message, and one on a
rewritten history. The group replay stores holds, for each episode, two samples (the segments, the
first marked `continues`), and its tokens are exactly what the policy generated: an in-process
`EpisodeRunner` against the same reward service, with the same weights and seeds, records every
completion its backend returns and produces the same group. The tool message's tokens are what the
chat template renders for it alone; nothing the policy wrote is re-tokenized. Log-probs match a full
forward pass, the loss mask covers the policy's tokens only, and the reward is what `run` computed
from the texts, usage and finish reasons it was given. How often re-rendering the conversation
through the chat template would have changed the tokens is counted too (the issue asks to report it).

In-flight weight updates (`environment.inflight_updates`): weights published during an episode are
loaded between its turns, and each turn records the version whose log-probs it carries.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import torch
from actor_fleet import MODEL, Fleet, wait_until
from test_episodes import comparable, full_forward_gap, serving, stored_group

from fleetrl.policy import models
from fleetrl.policy.backends import LOGPROB_TOL, Completion, HFBackend, conversation_tokens, observation_tokens
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.reward.client import RewardClient, environment_to_proto
from fleetrl.rollout.episodes import EpisodeRunner
from fleetrl.rollout.settings import ActorSettings
from fleetrl.spec.config import JobSpec

AGENT = b'''
def run(client, task):
    messages = [{"role": "user", "content": "Say anything about: " + task["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    text = first.choices[0].message.content
    messages += [first.choices[0].message, {"role": "tool", "content": f"you wrote {len(text)} characters"}]
    client.chat.completions.create(model="policy", messages=messages)
    again = [{"role": "user", "content": "Once more about " + task["prompt"]}]
    third = client.chat.completions.create(model="policy", messages=again)
    return len(text) % 2 + 0.25 * first.usage.completion_tokens + (third.choices[0].finish_reason == "length")
'''


def agent_job() -> JobSpec:
    return JobSpec.model_validate({
        "model": MODEL, "prompts": "prompts.jsonl", "seed": 5,
        "agent": {"file": "agent.py", "max_turns": 4, "max_total_tokens": 400, "step_timeout_s": 5.0,
                  "memory_limit_mb": 512},
        "rollout": {"samples_per_prompt": 3, "max_new_tokens": 8, "prompts_per_step": 4, "temperature": 1.0},
        "train": {"task_ack_wait_s": 10.0, "max_retries_per_episode": 3, "max_staleness": 0},
    })


class Recording(HFBackend):
    """An HFBackend that keeps every batch of completions it returns."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        super().__init__(model, tokenizer)
        self.batches: list[list[Completion]] = []

    def generate_batch(self, *args: Any, **kwargs: Any) -> list[Completion]:
        completions = super().generate_batch(*args, **kwargs)
        self.batches.append(completions)
        return completions


async def test_agent_groups_hold_exactly_the_generated_tokens(fleet: Fleet) -> None:
    spec = agent_job()
    assert spec.environment is not None and spec.environment.kind == "agent"
    job = await fleet.create_job(spec, [], environment_file=AGENT)
    await fleet.publish_weights(job, 0, dtype="float32")
    task = await fleet.publish_task(job, 0, "the sea", "")
    with serving(fleet, "agent0"):
        group = await stored_group(fleet, job)

    model, tokenizer = models.load(MODEL)
    backend = Recording(model, tokenizer)
    reward = RewardClient(fleet.services.reward_addr, timeout_s=30)
    runner = EpisodeRunner(ActorSettings(actor_id="test"), reward, lambda name, state: contextlib.nullcontext())
    try:
        again = await runner.play(job, spec.seed, spec.rollout, spec.environment,
                                  environment_to_proto(spec.environment, AGENT), backend, task)
    finally:
        await reward.close()
    assert [comparable(s) for s in again] == [comparable(s) for s in group.samples]

    assert [s.continues for s in group.samples] == [True, False] * 3
    assert [len(s.turns) for s in group.samples] == [2, 1] * 3
    assert [len(batch) for batch in backend.batches] == [3, 3, 3]  # three calls of three live episodes
    rerendered = 0
    for episode in range(3):
        first, second = group.samples[2 * episode], group.samples[2 * episode + 1]
        generated = [backend.batches[turn][episode] for turn in range(3)]
        stored = [list(s.completion_token_ids[t.start:t.end]) for s in (first, second) for t in s.turns]
        assert stored == [c.token_ids for c in generated]  # byte-identical: never re-tokenized
        assert len(generated[0].token_ids) <= 4  # the call's max_tokens
        text = generated[0].text
        tool = [{"role": "tool", "content": f"you wrote {len(text)} characters"}]
        between = list(first.completion_token_ids[first.turns[0].end:first.turns[1].start])
        assert between == observation_tokens(tokenizer, tool, spec.rollout,
                                             after_eos=generated[0].finish_reason == "eos")
        opening = [{"role": "user", "content": "Say anything about: the sea"}]
        assert list(first.prompt_token_ids) == conversation_tokens(tokenizer, opening, spec.rollout)
        assert list(second.prompt_token_ids) == conversation_tokens(
            tokenizer, [{"role": "user", "content": "Once more about the sea"}], spec.rollout)
        expected = len(text) % 2 + 0.25 * len(generated[0].token_ids) + (generated[2].finish_reason == "length")
        for sample in (first, second):
            assert sample.reward == expected and sample.reward_status == common_pb2.REWARD_STATUS_OK
            assert sample.episode_status == common_pb2.EPISODE_STATUS_DONE
            policy = [False] * len(sample.completion_token_ids)
            for turn in sample.turns:
                policy[turn.start:turn.end] = [True] * (turn.end - turn.start)
            assert list(sample.loss_mask) == policy
            assert full_forward_gap(model, sample) < LOGPROB_TOL[torch.float32]
        conversation = [*opening, {"role": "assistant", "content": text}, *tool,
                        {"role": "assistant", "content": generated[1].text}]
        rendered = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
        rerendered += rendered[:len(first.prompt_token_ids) + len(first.completion_token_ids)] != [
            *first.prompt_token_ids, *first.completion_token_ids]
    print(f"re-rendering through the chat template changed {rerendered} of 3 first segments")


CONCURRENT_AGENT = b'''
import asyncio

async def run(client, task):
    a_done = asyncio.Event()

    async def chain(name):
        if name == "C":
            await a_done.wait()  # its calls come after A's: two turns of their own
        messages = [{"role": "user", "content": f"{name}: {task['prompt']}"}]
        first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        text = first.choices[0].message.content
        messages += [first.choices[0].message, {"role": "tool", "content": f"{name} wrote {len(text)}"}]
        second = await client.chat.completions.create(model="policy", messages=messages)
        if name == "A":
            a_done.set()
        return len(text) + len(second.choices[0].message.content)

    return float(sum(await asyncio.gather(chain("A"), chain("B"), chain("C"))) % 5)
'''


async def test_concurrent_agent_calls_share_a_batch_and_grow_their_own_segments(fleet: Fleet) -> None:
    """An async agent's calls under `asyncio.gather` are generated together: chains A and B of each of the
    three episodes make one batch of 6 rows per turn, then C's calls (made once A is done) batches of 3. Each
    chain is a segment of its own holding exactly the tokens generated for its two calls, with the tool
    message between them rendered alone; the episode's reward is what `run` computed from the texts."""
    spec = agent_job()
    assert spec.environment is not None
    environment = spec.environment.model_copy(update={"max_turns": 4})
    model, tokenizer = models.load(MODEL)
    backend = Recording(model, tokenizer)
    reward = RewardClient(fleet.services.reward_addr, timeout_s=30)
    runner = EpisodeRunner(ActorSettings(actor_id="test"), reward, lambda name, state: contextlib.nullcontext())
    task = common_pb2.Task(task_id="concurrent/0", prompt="the sea")
    try:
        samples = await runner.play("concurrent", spec.seed, spec.rollout, environment,
                                    environment_to_proto(environment, CONCURRENT_AGENT), backend, task)
    finally:
        await reward.close()
    assert [len(batch) for batch in backend.batches] == [6, 6, 3, 3]
    assert [s.continues for s in samples] == [True, True, False] * 3
    for episode in range(3):
        generated = {"A": [backend.batches[0][2 * episode], backend.batches[1][2 * episode]],
                     "B": [backend.batches[0][2 * episode + 1], backend.batches[1][2 * episode + 1]],
                     "C": [backend.batches[2][episode], backend.batches[3][episode]]}
        lengths = 0
        for sample, (name, (first, second)) in zip(samples[3 * episode:3 * episode + 3], generated.items(),
                                                   strict=True):
            assert sample.episode_status == common_pb2.EPISODE_STATUS_DONE, sample.reward_reason
            assert list(sample.prompt_token_ids) == conversation_tokens(
                tokenizer, [{"role": "user", "content": f"{name}: the sea"}], spec.rollout)
            assert [list(sample.completion_token_ids[t.start:t.end]) for t in sample.turns] == [
                first.token_ids, second.token_ids]
            tool = [{"role": "tool", "content": f"{name} wrote {len(first.text)}"}]
            between = list(sample.completion_token_ids[sample.turns[0].end:sample.turns[1].start])
            assert between == observation_tokens(tokenizer, tool, spec.rollout,
                                                 after_eos=first.finish_reason == "eos")
            assert full_forward_gap(model, sample) < LOGPROB_TOL[torch.float32]
            lengths += len(first.text) + len(second.text)
        assert {s.reward for s in samples[3 * episode:3 * episode + 3]} == {float(lengths % 5)}


INFLIGHT_ENV = b'''
import time

class Env:
    def __init__(self, task):
        self.turn = 0

    def reset(self):
        return "Tell me about the sea."

    def step(self, action):
        time.sleep(3.0 if self.turn == 0 else 0.1)  # the new version is published during the first step
        self.turn += 1
        return ("More." if self.turn < 3 else None), 1.0, self.turn >= 3
'''


def token_gaps(model: torch.nn.Module, sample: common_pb2.Sample, turn: common_pb2.Turn) -> float:
    """max |behaviour log-prob - the model's log-prob| over one turn's tokens."""
    tokens = [*sample.prompt_token_ids, *sample.completion_token_ids]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
    start = len(sample.prompt_token_ids)
    return max(abs(logp[start + i - 1, sample.completion_token_ids[i]].item() - sample.behaviour_logprobs[i])
               for i in range(turn.start, turn.end))


async def test_inflight_update_mid_episode_records_each_turns_version(fleet: Fleet) -> None:
    """With environment.inflight_updates, weights published during an episode's first step are loaded before
    its second turn: turn 0 is version 0's, turns 1 and 2 version 1's, each turn's behaviour log-probs are its
    own version's (and not the other's: the check can fail), and the group's version is the oldest."""
    spec = JobSpec.model_validate({
        "model": MODEL, "prompts": "prompts.jsonl", "seed": 3,
        "environment": {"file": "env.py", "max_turns": 3, "max_total_tokens": 400, "step_timeout_s": 10.0,
                        "memory_limit_mb": 256, "inflight_updates": True},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 6, "prompts_per_step": 4, "temperature": 1.0},
        "train": {"task_ack_wait_s": 20.0, "max_retries_per_episode": 3, "max_staleness": 4},
    })
    job = await fleet.create_job(spec, [], environment_file=INFLIGHT_ENV)
    (old, _), (new, _) = models.load(MODEL), models.load(MODEL)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in new.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    await fleet.publish_weights(job, 0, dtype="float32")
    await fleet.publish_task(job, 0, "the sea", "")
    with serving(fleet, "inflight"):
        await wait_until(lambda: _loaded(fleet, "inflight", 0), 120, "version 0 loaded")
        await asyncio.sleep(1.0)  # inside the first step (3 s), after the first turn's generation
        await fleet.publish_weights(job, 1, models.state_dict_for_publish(new, "float32"), dtype="float32")
        group = await stored_group(fleet, job)
    assert group.policy_version == 0
    for sample in group.samples:
        assert sample.episode_status == common_pb2.EPISODE_STATUS_DONE
        assert [t.policy_version for t in sample.turns] == [0, 1, 1]
        for turn in sample.turns:
            mine, other = (old, new) if turn.policy_version == 0 else (new, old)
            assert token_gaps(mine, sample, turn) < LOGPROB_TOL[torch.float32]
            assert token_gaps(other, sample, turn) > 100 * LOGPROB_TOL[torch.float32]


async def _loaded(fleet: Fleet, actor: str, version: int) -> bool:
    return f"loaded weights v{version}" in fleet.log_text(actor)
