"""The whole RL algorithm in one process, with no services: documentation, baseline, cross-check.

Per step (on-policy, as a fleet with max_staleness = 0 and publish_interval = 1 would run it):

1. take the next `prompts_per_step` prompts in the feeder's order: cursor position p is prompt
   `prompt_order(N, seed, p // N)[p % N]` of epoch `p // N` (fleetrl/spec/seeding.py);
2. for each, sample `samples_per_prompt` completions with the current weights through the actor's
   own sampler (`fleetrl.policy.backends.HFBackend`, seeded by `task_seed(seed, task_id)`: the
   rule every actor follows), so the reference and an actor draw bit-identical groups; the step's
   groups are generated in one batch (`generate_groups`), as an actor generates a round of tasks;
3. score each completion with `reward_fn(completion, prompt, **metadata)`;
4. build the same `common_pb2.Group`s an actor inserts into replay, and call `train_step`,
   the function the distributed trainer calls too (for ppo on the policy and its value head,
   `critic.ActorCritic`, as the learner's `Policy` does).

The backend's sampler is a KV-cache loop: logits / temperature, nucleus filter at top_p, one
`torch.multinomial` draw per position for the whole group from the task's generator. The behaviour
log-prob of a token is taken under softmax(logits / temperature) before the nucleus filter, the same
distribution `completion_logprobs` scores on the learner side. The sampler is the one piece of
another service this file imports: a one-process reference must roll out exactly as actors do.

    python -m fleetrl.train.reference --job examples/addition/job.toml --steps 20
prints one JSON line of metrics per step.
"""

from __future__ import annotations

import argparse
import copy
import json
import runpy
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from fleetrl.errors import ConfigError, FieldViolation
from fleetrl.policy.backends import GroupRequest, HFBackend, prompt_tokens
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.reward import verifiers
from fleetrl.spec.config import JobSpec, apply_overrides, validate
from fleetrl.spec.prompts import read_prompts
from fleetrl.spec.seeding import prompt_order, task_id, task_seed
from fleetrl.train.critic import with_critic
from fleetrl.train.losses import loss_config_for
from fleetrl.train.optim import build_optimizer, build_scheduler, train_step

RewardFn = Callable[..., float]
"""reward(completion, prompt, **metadata) -> float, as a reward file defines it."""

def reward_of(spec: JobSpec) -> RewardFn:
    """The job's reward, run in this process (no sandbox: the reference loop is for trusted code): its
    reward file's `reward` function, or the built-in the reward service runs (`reward/verifiers.py`)."""
    reward = spec.reward
    if reward is None:
        raise ConfigError("the reference loop runs single-turn jobs only",
                          [FieldViolation("environment", "a job with an environment runs on the fleet")])
    if reward.file is not None:
        return runpy.run_path(reward.file)["reward"]  # type: ignore[no-any-return]
    assert reward.builtin is not None  # RewardSpec holds exactly one of file and builtin
    try:
        builtin = verifiers.resolve(reward.builtin, reward.params)
    except (KeyError, ValueError) as error:
        raise ConfigError("bad reward for the reference loop", [FieldViolation("reward.builtin", str(error))]) from None
    return lambda completion, prompt, **metadata: verifiers.scalar(builtin(completion, prompt, **metadata))


def tasks_of_step(step: int, num_prompts: int, spec: JobSpec) -> Iterator[tuple[int, int]]:
    """(epoch, prompt_index) of each task of a step, following the feeder's cursor order."""
    for position in range(step * spec.rollout.prompts_per_step, (step + 1) * spec.rollout.prompts_per_step):
        epoch = position // num_prompts
        yield epoch, prompt_order(num_prompts, spec.seed, epoch)[position % num_prompts]


def rollout_group(
    model: Any, tokenizer: Any, spec: JobSpec, row: dict[str, Any], epoch: int, index: int,
    version: int, reward_fn: RewardFn,
) -> common_pb2.Group:
    """The group an actor would insert for task (epoch, index), generated with the current weights."""
    (group,) = rollout_groups(model, tokenizer, spec, [(row, epoch, index)], version, reward_fn)
    return group


def rollout_groups(
    model: Any, tokenizer: Any, spec: JobSpec, tasks: list[tuple[dict[str, Any], int, int]], version: int,
    reward_fn: RewardFn,
) -> list[common_pb2.Group]:
    """The groups of tasks (row, epoch, index), generated together in one batch as an actor's round is
    (`HFBackend.generate_groups`: one group alone is `generate` itself)."""
    rollout = spec.rollout
    prompts = [prompt_tokens(tokenizer, row["prompt"], rollout) for row, _, _ in tasks]
    requests = [GroupRequest(prompt_ids, rollout.samples_per_prompt, rollout.max_new_tokens, rollout.temperature,
                             rollout.top_p, task_seed(spec.seed, task_id(epoch, index)))
                for prompt_ids, (_, epoch, index) in zip(prompts, tasks, strict=True)]
    groups = []
    for (row, epoch, index), prompt_ids, completions in zip(
            tasks, prompts, HFBackend(model, tokenizer).generate_groups(requests), strict=True):
        metadata = {k: v for k, v in row.items() if k != "prompt"}
        group = common_pb2.Group(job_id=spec.name, task_id=task_id(epoch, index), policy_version=version,
                                 prompt=row["prompt"])
        for completion in completions:
            group.samples.append(common_pb2.Sample(
                prompt_token_ids=prompt_ids, completion_token_ids=completion.token_ids,
                behaviour_logprobs=completion.logprobs, completion_text=completion.text,
                reward=float(reward_fn(completion.text, row["prompt"], **metadata)),
                reward_status=common_pb2.REWARD_STATUS_OK, finish_reason=completion.finish_reason,
            ))
        groups.append(group)
    return groups


def run(
    spec: JobSpec, model: Any, tokenizer: Any, reward_fn: RewardFn, steps: int,
    log: Callable[[dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Train `model` in place for `steps` steps of the job; returns (and logs) each step's metrics."""
    prompts = read_prompts(Path(spec.prompts).read_bytes())
    cfg = loss_config_for(spec)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    module, critic = with_critic(model, cfg)
    optimizer = build_optimizer(model, spec.optim, critic, spec.algorithm.value_learning_rate)
    scheduler = build_scheduler(optimizer, spec.optim, spec.train.max_steps)
    history = []
    for step in range(steps):
        started = time.perf_counter()
        model.eval()
        groups = rollout_groups(model, tokenizer, spec, [(prompts[index], epoch, index)
                                                         for epoch, index in tasks_of_step(step, len(prompts), spec)],
                                step, reward_fn)
        rollout_s = time.perf_counter() - started
        metrics = train_step(module, optimizer, scheduler, groups, cfg, spec, ref_model)
        metrics.update(step=float(step), rollout_s=rollout_s, step_s=time.perf_counter() - started)
        history.append(metrics)
        if log is not None:
            log(metrics)
    return history


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m fleetrl.train.reference --job JOB.toml [--steps N] [--set key=value ...]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, required=True, help="job spec TOML")
    parser.add_argument("--steps", type=int, default=None, help="steps to run (default train.max_steps)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="override key=value")
    args = parser.parse_args(argv)
    import tomllib

    from fleetrl.policy.models import load

    data = apply_overrides(tomllib.loads(args.job.read_text()), args.overrides)
    spec = validate(JobSpec, data, "job spec")
    prompts = Path(spec.prompts)
    if not prompts.is_absolute() and not prompts.exists():
        spec = spec.model_copy(update={"prompts": str(args.job.parent / prompts)})
    torch.manual_seed(spec.seed)
    model, tokenizer = load(spec.model)
    steps = args.steps or spec.train.max_steps
    run(spec, model, tokenizer, reward_of(spec), steps, log=lambda m: print(json.dumps(m), flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
