"""The whole RL algorithm in one process, with no services: documentation, baseline, cross-check.

Per step (on-policy, as a fleet with max_staleness = 0 and publish_interval = 1 would run it):

1. take the next `prompts_per_step` prompts in the feeder's order: cursor position p is prompt
   `prompt_order(N, seed, p // N)[p % N]` of epoch `p // N` (services/common/seeding.py);
2. for each, sample `samples_per_prompt` completions with the current weights, seeded by
   `task_seed(seed, task_id)` through a torch.Generator (the rule an actor must follow);
3. score each completion with `reward_fn(completion, prompt, **metadata)`;
4. build the same `common_pb2.Group`s an actor inserts into replay, and call `train_step`,
   the function the distributed trainer calls too.

Sampling (`sample_group`) is a plain KV-cache loop: logits / temperature, nucleus filter at top_p,
one `torch.multinomial` draw per position for the whole group from the task's generator. The
behaviour log-prob of a token is taken under softmax(logits / temperature) before the nucleus
filter, the same distribution `completion_logprobs` scores on the learner side.

    python -m services.learner.reference --job examples/addition/job.toml --steps 20
prints one JSON line of metrics per step.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import runpy
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from services.common.config import JobSpec, apply_overrides, validate
from services.common.errors import ConfigError, FieldViolation
from services.common.seeding import prompt_order, task_id, task_seed
from services.learner.losses import loss_config_for
from services.learner.optim import build_optimizer, build_scheduler, train_step
from services.proto.fleetrl.v1 import common_pb2

RewardFn = Callable[..., float]
"""reward(completion, prompt, **metadata) -> float, as a reward file defines it."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def numeric_match(completion: str, prompt: str, answer: str | float | None = None, **_: Any) -> float:
    """1.0 when the last number in the completion equals `answer`, else 0.0 (the addition task)."""
    numbers = _NUMBER.findall(completion)
    return float(bool(numbers) and answer is not None and float(numbers[-1]) == float(answer))


def reward_of(spec: JobSpec) -> RewardFn:
    """The job's reward, run in-process: its reward file's `reward` function, or the numeric_match built-in."""
    if spec.reward.file is not None:
        return runpy.run_path(spec.reward.file)["reward"]  # type: ignore[no-any-return]
    if spec.reward.builtin == "numeric_match":
        return numeric_match
    raise ConfigError("the reference loop only runs reward files and numeric_match",
                      [FieldViolation("reward.builtin", f"{spec.reward.builtin!r} is not available here")])


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """The prompt JSONL: one object per line with `prompt` and metadata."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Completion:
    """One sampled completion: tokens (with a final eos if generated) and their behaviour log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def encode_prompt(tokenizer: Any, text: str, spec: JobSpec) -> list[int]:
    """Prompt tokens as the actor feeds them: chat template when asked and available, left-truncated."""
    rollout = spec.rollout
    if rollout.chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": rollout.system_prompt}] if rollout.system_prompt else []
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(ids)[-rollout.max_prompt_tokens :]


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """probs (G, V) with everything outside the top_p mass zeroed (the top token always kept)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p
    return probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))


@torch.no_grad()
def sample_group(
    model: Any, prompt_ids: list[int], spec: JobSpec, eos_ids: set[int], generator: torch.Generator
) -> list[Completion]:
    """samples_per_prompt completions of one prompt, drawn from `generator` (see module docstring)."""
    size, rollout = spec.rollout.samples_per_prompt, spec.rollout
    out = model(input_ids=torch.tensor([prompt_ids] * size), use_cache=True)
    tokens_T, logprobs_T = [], []
    done = torch.zeros(size, dtype=torch.bool)
    for _ in range(rollout.max_new_tokens):
        logp = torch.log_softmax(out.logits[:, -1].float() / rollout.temperature, dim=-1)  # (G, V)
        token = torch.multinomial(_nucleus(logp.exp(), rollout.top_p), 1, generator=generator)  # (G, 1)
        tokens_T.append(token[:, 0])
        logprobs_T.append(logp.gather(-1, token)[:, 0])
        done |= torch.isin(token[:, 0], torch.tensor(sorted(eos_ids)))
        if bool(done.all()):
            break
        out = model(input_ids=token, cache=out.cache, use_cache=True)
    return [_cut(torch.stack(tokens_T)[:, g].tolist(), torch.stack(logprobs_T)[:, g].tolist(), eos_ids)
            for g in range(size)]


def _cut(tokens: list[int], logprobs: list[float], eos_ids: set[int]) -> Completion:
    """A row of the group up to and including its first eos."""
    for position, token in enumerate(tokens):
        if token in eos_ids:
            return Completion(tokens[: position + 1], logprobs[: position + 1], "eos")
    return Completion(tokens, logprobs, "length")


def eos_ids_of(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a completion: the tokenizer's eos and the generation config's."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    listed = configured if isinstance(configured, list) else [configured]
    return {i for i in [tokenizer.eos_token_id, *listed] if i is not None}


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
    tid = task_id(epoch, index)
    prompt_ids = encode_prompt(tokenizer, row["prompt"], spec)
    generator = torch.Generator().manual_seed(task_seed(spec.seed, tid))
    metadata = {k: v for k, v in row.items() if k != "prompt"}
    group = common_pb2.Group(job_id=spec.name, task_id=tid, policy_version=version, prompt=row["prompt"])
    for completion in sample_group(model, prompt_ids, spec, eos_ids_of(model, tokenizer), generator):
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        group.samples.append(common_pb2.Sample(
            prompt_token_ids=prompt_ids, completion_token_ids=completion.token_ids,
            behaviour_logprobs=completion.logprobs, completion_text=text,
            reward=float(reward_fn(text, row["prompt"], **metadata)),
            reward_status=common_pb2.REWARD_STATUS_OK, finish_reason=completion.finish_reason,
        ))
    return group


def run(
    spec: JobSpec, model: Any, tokenizer: Any, reward_fn: RewardFn, steps: int,
    log: Callable[[dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Train `model` in place for `steps` steps of the job; returns (and logs) each step's metrics."""
    prompts = read_prompts(Path(spec.prompts))
    cfg = loss_config_for(spec)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    optimizer = build_optimizer(model, spec.optim)
    scheduler = build_scheduler(optimizer, spec.optim, spec.train.max_steps)
    history = []
    for step in range(steps):
        started = time.perf_counter()
        model.eval()
        groups = [rollout_group(model, tokenizer, spec, prompts[index], epoch, index, step, reward_fn)
                  for epoch, index in tasks_of_step(step, len(prompts), spec)]
        rollout_s = time.perf_counter() - started
        metrics = train_step(model, optimizer, scheduler, groups, cfg, spec, ref_model)
        metrics.update(step=float(step), rollout_s=rollout_s, step_s=time.perf_counter() - started)
        history.append(metrics)
        if log is not None:
            log(metrics)
    return history


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m services.learner.reference --job JOB.toml [--steps N] [--set key=value ...]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, required=True, help="job spec TOML")
    parser.add_argument("--steps", type=int, default=None, help="steps to run (default train.max_steps)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="override key=value")
    args = parser.parse_args(argv)
    import tomllib

    from services.common.models import load

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
