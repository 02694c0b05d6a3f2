"""A multi-turn job trained through the real services raises its mean episode reward.

A whole fleet (as in test_learning.py: embedded NATS and Valkey, gateway, reward, replay, learner and
two actors as child processes) trains `learner_fleet.tiny_policy` on a two-turn scripted environment
submitted through the gateway: each turn pays 0.5 when the action's first word is 7, and the first
observation is the word 3. Every step goes through episodes in the reward service's sandbox, batched
turns on the actors, loss-masked sequences in replay and the learner.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from learner_fleet import tiny_policy

from services.fleet.fleet import FleetLayout
from services.gateway.client import Client
from tests.learner.test_learning import PROMPTS, fleet  # noqa: F401 - the fleet fixture

pytestmark = pytest.mark.slow

STEPS = 15
ENV_FILE = '''
class Env:
    def __init__(self, task):
        self.turn = 0

    def reset(self):
        return "1 + 2 ="

    def step(self, action):
        self.turn += 1
        words = action.split()
        reward = 0.5 if words and words[0] == "7" else 0.0
        return ("3" if self.turn < 2 else None), reward, self.turn >= 2
'''
JOB = '''
name = "learn-episodes"
model = "unused"
prompts = "prompts.jsonl"

[environment]
file = "env.py"
max_turns = 2
max_total_tokens = 32
step_timeout_s = 5.0
'''


def test_mean_episode_reward_rises_through_the_services(fleet: FleetLayout, tmp_path: Path) -> None:  # noqa: F811
    model, tokenizer = tiny_policy()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {b} ="}) + "\n" for a, b in PROMPTS))
    (tmp_path / "env.py").write_text(ENV_FILE)
    (tmp_path / "job.toml").write_text(JOB)
    with Client(fleet.addresses["gateway"]) as client:
        run = client.create_run(
            str(tmp_path / "model"), tmp_path / "prompts.jsonl", spec_file=tmp_path / "job.toml", seed=3,
            learning_rate=0.03, prompts_per_step=4, samples_per_prompt=8, max_new_tokens=1, max_steps=STEPS,
            max_staleness=1, checkpoint_interval=STEPS, timeout_per_step_s=60,
            **{"rollout.chat_template": False, "train.task_ack_wait_s": 5})
        info = run.wait(timeout_s=240)
    assert info.state == "succeeded", info.reason
    path = tmp_path / "fleet" / "jobs" / run.job_id / "metrics.jsonl"
    metrics = [json.loads(line) for line in path.read_text().splitlines()]
    rewards = [m["reward_mean"] for m in metrics]
    print("episode reward_mean per step:", " ".join(f"{r:.2f}" for r in rewards))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["episode/turns_mean"] == 2.0 and m["episode/done_frac"] == 1.0 for m in metrics)
    assert all(m["tokens"] == 2 * 8 * 4 for m in metrics)  # 2 policy tokens per episode: observations are masked
    early, late = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert early < 0.3, rewards  # about 1/15 per turn before the policy has moved
    assert late > 0.6, rewards
