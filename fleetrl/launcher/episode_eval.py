"""A model's episodes on a job's environment: mean episode reward, success rate, turns and how episodes end.

The held-out evaluation of a job with an `[environment]` (`fleetrl demo --job` of a multi-turn
example, and `python -m bench.episode_eval`). A RewardService runs in this process, with its jail
and sandboxed workers, and hosts the job's environment file; `fleetrl.rollout.episodes.EpisodeRunner` plays
`episodes` episodes of each problem on the HF backend with the job's rollout settings (its sampling
temperature and seed), exactly the episodes an actor plays, the job's built-in verifier included.
An episode *succeeds* when its reward is above 0. The figures are an `EvalResult` (fleetrl/eval/result.py):
the success rate is its `sampled_pass_at_1`, the mean episode reward its `sampled_reward_mean`; `figures`
lays them out as the demo's report and the bench print them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections import Counter
from typing import Any

from fleetrl.eval.result import EvalResult
from fleetrl.policy import models
from fleetrl.policy.backends import HFBackend
from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2
from fleetrl.reward.client import RewardClient, environment_to_proto, spec_to_proto
from fleetrl.reward.settings import RewardSettings
from fleetrl.rollout.episodes import EpisodeRunner, Verifier
from fleetrl.rollout.rollout import score_items
from fleetrl.rollout.settings import ActorSettings
from fleetrl.services.reward.server import running
from fleetrl.spec.config import JobSpec

CALL_TIMEOUT_S = 60.0


def evaluate(spec: JobSpec, environment_file: bytes, model_name: str, problems: list[dict[str, Any]],
             episodes: int) -> EvalResult:
    """`episodes` episodes of each problem (a prompt line: "prompt" and its metadata): the mean episode reward,
    the success rate, and in `extras` the episodes played, turns per episode, how they ended and the temperature."""
    if spec.environment is None:
        raise ValueError("the job has no [environment]")
    started = time.monotonic()
    samples = asyncio.run(_play(spec, environment_file, model_name, problems, episodes))
    statuses = Counter(common_pb2.EpisodeStatus.Name(s.episode_status).removeprefix("EPISODE_STATUS_").lower()
                       for s in samples)
    return EvalResult(
        model=model_name, problems=len(problems), samples=episodes,
        sampled_reward_mean=statistics.fmean(s.reward for s in samples),
        sampled_pass_at_1=sum(s.reward > 0 for s in samples) / len(samples),
        wall_s=round(time.monotonic() - started, 1),
        extras={"episodes": len(samples), "turns_mean": statistics.fmean(len(s.turns) for s in samples),
                "status": {k: v / len(samples) for k, v in sorted(statuses.items())},
                "temperature": spec.rollout.temperature})


def figures(result: EvalResult) -> dict[str, Any]:
    """{"model", "problems", "episodes", "reward_mean", "success_rate", "turns_mean", "status": {end: fraction},
    "temperature", "wall_s"}: a stage of the demo's eval.json, and `bench.episode_eval`'s JSON."""
    return {"model": result.model, "problems": result.problems, "episodes": result.extras["episodes"],
            "reward_mean": result.sampled_reward_mean, "success_rate": result.sampled_pass_at_1,
            "turns_mean": result.extras["turns_mean"], "status": result.extras["status"],
            "temperature": result.extras["temperature"], "wall_s": result.wall_s}


async def _play(spec: JobSpec, environment_file: bytes, model_name: str, problems: list[dict[str, Any]],
                episodes: int) -> list[common_pb2.Sample]:
    assert spec.environment is not None
    rollout = spec.rollout.model_copy(update={"samples_per_prompt": episodes})
    model, tokenizer = models.load(model_name)
    backend = HFBackend(model, tokenizer)
    settings = RewardSettings(listen="127.0.0.1:0", workers_per_pool=episodes, grace_s=0.5)
    samples: list[common_pb2.Sample] = []
    async with running(settings) as service:
        client = RewardClient(f"127.0.0.1:{service.port}", timeout_s=CALL_TIMEOUT_S)
        try:
            runner = EpisodeRunner(ActorSettings(actor_id="eval"), client, lambda name, state: contextlib.nullcontext())
            proto = environment_to_proto(spec.environment, environment_file)
            verifier_spec = spec_to_proto(spec.reward, b"") if spec.reward is not None else None
            for index, line in enumerate(problems):
                metadata = {k: v for k, v in line.items() if k != "prompt"}
                task = common_pb2.Task(job_id="eval", task_id=f"eval/{index}", prompt=str(line["prompt"]),
                                       metadata_json=json.dumps(metadata))
                verifier = _verifier(client, verifier_spec, task) if verifier_spec is not None else None
                samples += await runner.play("eval", spec.seed, rollout, spec.environment, proto, backend, task,
                                             verifier)
        finally:
            await client.close()
    return samples


def _verifier(client: RewardClient, spec: reward_pb2.RewardSpec, task: common_pb2.Task) -> Verifier:
    """The job's built-in verifier of final actions, as `Rollout.verifier` gives an actor."""
    async def verify(texts: list[str]) -> list[reward_pb2.ScoreResult]:
        return await client.score("eval", spec, score_items(task, texts))
    return verify
