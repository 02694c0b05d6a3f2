"""The single-process reference loop learns a simple task, reproduces under its seeds, and runs as a CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from learner_fleet import first_word_is_seven, tiny_policy

from fleetrl.errors import ConfigError
from fleetrl.spec.config import JobSpec
from fleetrl.train.batch import build_batch, completion_logprobs, group_advantages
from fleetrl.train.losses import loss_config_for
from fleetrl.train.reference import reward_of, rollout_group, run, tasks_of_step

REPO = Path(__file__).resolve().parents[2]


def job(tmp_path: Path, **rollout: Any) -> JobSpec:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a} + {b} =", "answer": str(a + b)}) + "\n"
                               for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 3), (4, 4)]))
    return JobSpec(
        name="ref", prompts=str(prompts), reward={"builtin": "numeric_match"}, seed=3,
        algorithm={"name": "grpo"}, optim={"learning_rate": 0.01},
        rollout={"prompts_per_step": 4, "samples_per_prompt": 8, "max_new_tokens": 3, "chat_template": False,
                 **rollout},
        train={"max_steps": 30, "micro_batch_samples": 16},
    )


def test_reference_loop_learns_first_token(tmp_path: Path) -> None:
    model, tokenizer = tiny_policy()
    history = run(job(tmp_path), model, tokenizer, first_word_is_seven, steps=30)
    early = sum(m["reward_mean"] for m in history[:5]) / 5
    late = sum(m["reward_mean"] for m in history[-5:]) / 5
    assert early < 0.3, early  # about 1/15 for a near-uniform policy
    assert late > 0.7, (early, late)
    # on-policy: the actor's behaviour log-probs are the learner's, so the TIS weights are 1
    assert all(m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4) for m in history if "tokens" in m)
    assert all(m["ratio_mean"] == pytest.approx(1.0, abs=1e-5) for m in history if "tokens" in m)


def test_rollout_follows_seeding_rules(tmp_path: Path) -> None:
    spec = job(tmp_path, samples_per_prompt=4, max_new_tokens=5)
    model, tokenizer = tiny_policy()
    tasks = list(tasks_of_step(0, 6, spec)) + list(tasks_of_step(1, 6, spec))
    assert sorted(index for epoch, index in tasks[:6]) == list(range(6)) and {e for e, _ in tasks[6:]} == {1}
    row = {"prompt": "3 + 4 =", "answer": "7"}
    numeric_match = reward_of(spec)
    first = rollout_group(model, tokenizer, spec, row, 0, 1, 0, numeric_match)
    again = rollout_group(model, tokenizer, spec, row, 0, 1, 0, numeric_match)
    other = rollout_group(model, tokenizer, spec, row, 0, 2, 0, numeric_match)
    tokens = [list(s.completion_token_ids) for s in first.samples]
    assert tokens == [list(s.completion_token_ids) for s in again.samples]  # same task -> same samples
    assert tokens != [list(s.completion_token_ids) for s in other.samples]  # another task id -> another draw
    assert first.task_id == "0/1" and len(first.samples) == 4
    for sample in first.samples:
        ended = sample.completion_token_ids[-1] == tokenizer.eos_token_id
        assert sample.finish_reason == ("eos" if ended else "length")
        assert 1 not in sample.completion_token_ids[:-1]  # cut at the first eos
    # behaviour log-probs from the KV-cache sampler equal the learner's full-sequence log-probs
    batch = build_batch([first], group_advantages([first], loss_config_for(spec)), pad_id=0)
    with torch.no_grad():
        learner = completion_logprobs(model, batch, spec.rollout.temperature)[0]
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(learner[mask], batch.behaviour_logprobs[mask], atol=1e-5, rtol=0)


def test_the_reward_is_the_reward_services_builtin_run_in_process() -> None:
    spec = JobSpec(prompts="p.jsonl", reward={"builtin": "numeric_match"})  # type: ignore[arg-type]
    numeric_match = reward_of(spec)
    assert numeric_match("The answer is 126.", "q", answer="126") == 1.0
    assert numeric_match("12 then 125", "q", answer="126") == 0.0
    assert numeric_match("no digits", "q", answer="1") == 0.0
    summed = reward_of(JobSpec(prompts="p.jsonl", reward={  # type: ignore[arg-type]
        "builtin": "weighted_sum", "params": {"terms": [
            {"builtin": "numeric_match", "weight": 1.0}, {"builtin": "regex", "weight": 0.5,
                                                          "params": {"pattern": "\\d+", "mode": "fullmatch"}}]}}))
    assert summed("126", "q", answer="126") == 1.5 and summed("it is 126", "q", answer="126") == 1.0
    with pytest.raises(ConfigError) as bad:
        reward_of(JobSpec(prompts="p.jsonl", reward={"builtin": "no_such"}))  # type: ignore[arg-type]
    assert [v.field for v in bad.value.violations] == ["reward.builtin"]


def test_cli_prints_one_json_line_per_step(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in (REPO / "examples/addition/train.jsonl").read_text().splitlines()[:4]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "job.toml").write_text(
        'model = "tiny-llama"\nprompts = "p.jsonl"\n[reward]\nbuiltin = "numeric_match"\n'
        "[rollout]\nprompts_per_step = 2\nsamples_per_prompt = 2\nmax_new_tokens = 4\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "fleetrl.train.reference", "--job", str(tmp_path / "job.toml"), "--steps", "2",
         "--set", "optim.learning_rate=0.001"],
        cwd=REPO, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [m["step"] for m in lines] == [0.0, 1.0]
    assert all(m["sequences"] == 4.0 and m["lr"] == 0.001 for m in lines)


def test_kl_to_the_frozen_reference(tmp_path: Path) -> None:
    spec = job(tmp_path).model_copy(update={"algorithm": job(tmp_path).algorithm.model_copy(update={"kl_coef": 0.1})})
    model, tokenizer = tiny_policy()
    history = run(spec, model, tokenizer, first_word_is_seven, steps=6)
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert history[-1]["kl"] > 1e-4
