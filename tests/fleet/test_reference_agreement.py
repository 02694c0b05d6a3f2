"""The distributed path reproduces the single-process reference loop.

A whole fleet (1 actor, max_staleness 0: strictly on-policy, step s's prompts go out only after
weights v=s) trains 3 steps of a tiny job; `fleetrl.train.reference.run` trains the same spec
from the same initial weights in this process. Both follow the shared seeding rules (feeder order,
per-task sampling seeds) and call the same `train_step`, so every step sees the same prompts, the
same sampled tokens and the same rewards, and the losses agree within float tolerance.

Settings that make the two paths comparable: published weights in float32 (the default bfloat16
would give the actor a rounded copy of the policy; the actor computes in float32 by default), and a
reward with variance inside a group (numeric_match on a random tiny model scores every sample 0,
making every advantage 0 and every loss exactly 0, which would prove nothing).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from e2e_fleet import MODEL, FleetUnderTest, job_params, running_fleet

from fleetrl.policy import models
from fleetrl.sdk.client import spec_from_params
from fleetrl.spec.config import JobSpec, validate
from fleetrl.spec.prompts import read_prompts
from fleetrl.train.reference import reward_of, run, tasks_of_step

pytestmark = pytest.mark.slow

STEPS = 3
REWARD_FILE = '''
def reward(completion, prompt, **metadata):
    """Deterministic and varied on a random policy: the completion's length modulo 5, in [0, 1]."""
    return (len(completion) % 5) / 4
'''
# Per-step tolerance. Both paths sample identical tokens (same seed rule), but the actor's HF backend
# prefills a prompt once and shares its KV cache while the reference prefills one copy per sample, so
# behaviour log-probs differ by float rounding (~1e-5; tests/actor/test_backend.py); they enter the
# loss only through the truncated importance weights (~1 on-policy). Replay may also hand the learner
# a step's groups in another order than the reference builds them, which changes float summation
# order only. Observed agreement is ~1e-6 relative; a step's update moves the loss by >1e-3 relative.
REL, ABS = 1e-4, 1e-6
ENTROPY_COEF = 0.01
"""On-policy GRPO's surrogate is ~0 at every step (ratio 1, advantages sum to 0 in a group); the
entropy bonus makes the loss a function of the weights, so equal losses mean equal policies."""


@pytest.fixture(scope="module")
def one_actor_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetUnderTest]:
    with running_fleet(tmp_path_factory.mktemp("fleet"), actors=1) as running:
        yield running


def params() -> dict[str, Any]:
    """The e2e tiny job, strictly on-policy, float32 weights; a large step so versions differ clearly."""
    return job_params(max_steps=STEPS, max_staleness=0, checkpoint_interval=STEPS, learning_rate=0.05,
                      entropy_coef=ENTROPY_COEF, **{"train.weights_dtype": "float32"})


def reference_history(fleet: FleetUnderTest, reward_file: Path) -> tuple[JobSpec, list[dict[str, float]]]:
    data = spec_from_params(params())
    data.update(name="reference", model=MODEL, prompts=str(fleet.prompts), reward={"file": str(reward_file)})
    spec = validate(JobSpec, data, "job spec")
    torch.manual_seed(spec.seed)
    model, tokenizer = models.load(spec.model)
    return spec, run(spec, model, tokenizer, reward_of(spec), STEPS)


def test_one_actor_on_policy_fleet_matches_the_reference_loop(one_actor_fleet: FleetUnderTest,
                                                              tmp_path: Path) -> None:
    fleet = one_actor_fleet
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    job = fleet.client.create_run(MODEL, fleet.prompts, reward_file, name="agreement", **params())
    info = job.wait(timeout_s=120)
    assert info.state == "succeeded", (info.reason, fleet.log("learner")[-3000:])
    distributed = fleet.metrics(job.job_id)
    spec, reference = reference_history(fleet, reward_file)

    assert [m["step"] for m in distributed] == list(range(1, STEPS + 1))
    num_prompts = len(read_prompts(fleet.prompts.read_bytes()))
    for step, (dist, ref) in enumerate(zip(distributed, reference, strict=True)):
        expected = [f"{epoch}/{index}" for epoch, index in tasks_of_step(step, num_prompts, spec)]
        assert sorted(dist["task_ids"]) == sorted(expected), step
        assert dist["staleness_max"] == 0, step
        print(f"step {step + 1}: loss fleet {dist['loss']:.8f} reference {ref['loss']:.8f}; "
              f"reward_mean fleet {dist['reward_mean']:.6f} reference {ref['reward_mean']:.6f}")
        assert dist["reward_mean"] == pytest.approx(ref["reward_mean"], rel=1e-6, abs=1e-9), step
        assert dist["loss"] == pytest.approx(ref["loss"], rel=REL, abs=ABS), step
        assert dist["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL, abs=ABS), step
    # the tolerance tells policy versions apart: each step's update moves the loss well beyond it
    losses = [m["loss"] for m in reference]
    assert all(abs(a - b) > 10 * REL * abs(b) for a, b in itertools.pairwise(losses)), losses
