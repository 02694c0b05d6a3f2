"""Jobs trained through the real services raise their mean reward: single-turn (GRPO, PPO) and multi-turn.

A whole fleet (`fleetrl.launcher.fleet.Fleet`, as `fleetrl up` runs it: embedded NATS and Valkey,
gateway, reward, replay, learner and two actors as child processes) trains a job submitted through
the gateway. The model is the 15-token word-level Llama of `learner_fleet.tiny_policy`, saved as an
HF directory that actors and learner load by path; the reward file pays 1.0 when the completion's
first word is 7 (1 in 15 for the untrained policy). The reference loop learns the same task
(test_reference.py); here every step goes through tasks, sampling, the reward sandbox, replay, the
learner and weight publishing, with actors up to one version behind; also with PPO's critic, and
with LoRA (adapter versions merged by the actors). About 15 s of training and 15 s
of fleet start-up and shutdown.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from learner_fleet import tiny_policy

from fleetrl.launcher.fleet import Fleet, FleetLayout, FleetOptions
from fleetrl.sdk.client import Client

pytestmark = pytest.mark.slow

STEPS = 15
FAST_ENV = {
    "FLEETRL_ACTOR_TORCH_THREADS": "1", "FLEETRL_ACTOR_POLL_INTERVAL_S": "0.3", "FLEETRL_ACTOR_FETCH_TIMEOUT_S": "0.5",
    "FLEETRL_LEARNER_TORCH_THREADS": "1", "FLEETRL_LEARNER_CLAIM_POLL_S": "0.3", "FLEETRL_LEARNER_SAMPLE_WAIT_S": "0.5",
    "FLEETRL_REWARD_WORKERS_PER_POOL": "1",
}
"""Short polls and one torch thread per process (as in tests/fleet/e2e_fleet.py), so steps take ~1 s."""
REWARD_FILE = '''
def reward(completion, prompt, **metadata):
    words = completion.split()
    return float(bool(words) and words[0] == "7")
'''
PROMPTS = [(1, 2), (3, 4), (2, 2), (5, 1), (0, 3), (4, 4)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetLayout]:
    """One fleet for the module's jobs (a fleet's start and stop cost about 30 s on 2 cores), whose
    gateway lets them train the tiny models each test saves under its own temporary directory."""
    fleet = Fleet(FleetOptions(run_dir=tmp_path_factory.mktemp("learning") / "fleet", actors=2,
                               extra_env=dict(FAST_ENV), model_roots=(tmp_path_factory.getbasetemp(),)))
    try:
        yield fleet.start()
    finally:
        fleet.stop()


@pytest.mark.parametrize("algorithm", [
    {},
    # PPO with its critic: the learner checkpoints the value head and publishes only the policy,
    # which actors load strictly (a published head would fail their load)
    {"algorithm.name": "ppo", "algorithm.value_learning_rate": 0.03, "algorithm.value_coef": 0.5},
    # LoRA: the learner publishes only adapters, which the actors merge into the base they loaded once;
    # lm_head adapted too: this model's logits are too small to favour one word from the trunk alone
    {"train.lora": {"rank": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj", "lm_head"]}},
], ids=["grpo", "ppo", "lora"])
def test_mean_reward_rises_through_the_services(fleet: FleetLayout, tmp_path: Path,
                                                algorithm: dict[str, object]) -> None:
    model, tokenizer = tiny_policy()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    prompts, reward = tmp_path / "prompts.jsonl", tmp_path / "reward.py"
    prompts.write_text("".join(json.dumps({"prompt": f"{a} + {b} =", "answer": str(a + b)}) + "\n" for a, b in PROMPTS))
    reward.write_text(REWARD_FILE)
    with Client(fleet.addresses["gateway"]) as client:
        run = client.create_run(
            str(tmp_path / "model"), prompts, reward, name="learn", seed=3, learning_rate=0.03, prompts_per_step=4,
            samples_per_prompt=8, max_new_tokens=1, max_steps=STEPS, max_staleness=1, checkpoint_interval=STEPS,
            timeout_per_step_s=60, **{"rollout.chat_template": False, "train.task_ack_wait_s": 5, **algorithm})
        info = run.wait(timeout_s=180)
    assert info.state == "succeeded", info.reason
    job_dir = fleet.log_dir.parent / "jobs" / run.job_id  # log_dir is <run dir>/logs
    metrics = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward_mean"] for m in metrics]
    print("reward_mean per step:", " ".join(f"{r:.2f}" for r in rewards))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["staleness_max"] <= 1 for m in metrics)
    early, late = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert early < 0.3, rewards  # about 1/15 before the policy has moved
    assert late > 0.7, rewards
    if "algorithm.name" in algorithm:
        assert metrics[0]["value_mean"] == 0.0 and metrics[-1]["value_mean"] > 0.5, [m["value_mean"] for m in metrics]
        assert (job_dir / "checkpoints" / f"step-{STEPS:08d}" / "critic.safetensors").is_file()


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


def test_mean_episode_reward_rises_through_the_services(fleet: FleetLayout, tmp_path: Path) -> None:
    """A two-turn scripted environment: each turn pays 0.5 when the action's first word is 7, and the
    first observation is the word 3. Every step goes through episodes in the reward service's sandbox,
    batched turns on the actors, loss-masked sequences in replay and the learner."""
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
    path = fleet.log_dir.parent / "jobs" / run.job_id / "metrics.jsonl"  # log_dir is <run dir>/logs
    metrics = [json.loads(line) for line in path.read_text().splitlines()]
    rewards = [m["reward_mean"] for m in metrics]
    print("episode reward_mean per step:", " ".join(f"{r:.2f}" for r in rewards))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["episode/turns_mean"] == 2.0 and m["episode/done_frac"] == 1.0 for m in metrics)
    assert all(m["tokens"] == 2 * 8 * 4 for m in metrics)  # 2 policy tokens per episode: observations are masked
    early, late = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert early < 0.3, rewards  # about 1/15 per turn before the policy has moved
    assert late > 0.6, rewards
