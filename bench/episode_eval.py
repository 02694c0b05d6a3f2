"""A model's episodes on a multi-turn example job: mean episode reward and success rate on held-out prompts.

`python -m bench.episode_eval --json --job examples/retry_feedback/job.toml --eval-file examples/addition/eval.jsonl`
prints one JSON object. A real RewardService (its jail and sandboxed workers) runs the job's
environment file; `actor.episodes.EpisodeRunner` plays `--episodes` episodes of each of the first
`--problems` prompts of the eval file with the job's rollout settings (its sampling temperature) on
the HF backend, with `--model` (default: the job's model; a trained model's exported directory
works too):
- reward_mean: mean episode reward; success_rate: the fraction of episodes with a reward above 0;
- turns_mean, status: turns per episode and the fraction of episodes ending each way;
- wall_s: the time the episodes took.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from collections import Counter
from pathlib import Path

from services.actor.backends import HFBackend
from services.actor.config import ActorSettings
from services.actor.episodes import EpisodeRunner
from services.common import models
from services.common.config import parse_job_spec
from services.gateway.client import load_job_file
from services.proto.fleetrl.v1 import common_pb2
from services.reward.client import RewardClient, environment_to_proto
from services.reward.config import RewardSettings
from services.reward.server import running


async def evaluate(args: argparse.Namespace) -> dict[str, object]:
    spec_json, _, _, environment_file = load_job_file(args.job)
    spec = parse_job_spec(spec_json, "json")
    if spec.environment is None:
        raise SystemExit(f"{args.job} has no [environment]")
    lines = [json.loads(line) for line in args.eval_file.read_text().splitlines() if line.strip()][: args.problems]
    rollout = spec.rollout.model_copy(update={"samples_per_prompt": args.episodes})
    model_name = args.model or spec.model
    model, tokenizer = models.load(model_name)
    backend = HFBackend(model, tokenizer)
    settings = RewardSettings(listen="127.0.0.1:0", workers_per_pool=args.episodes, grace_s=0.5)
    samples: list[common_pb2.Sample] = []
    started = time.monotonic()
    async with running(settings) as service:
        client = RewardClient(f"127.0.0.1:{service.port}", timeout_s=60)
        try:
            runner = EpisodeRunner(ActorSettings(actor_id="eval"), client, lambda name, state: contextlib.nullcontext())
            proto = environment_to_proto(spec.environment, environment_file)
            for index, line in enumerate(lines):
                prompt = line.pop("prompt")
                task = common_pb2.Task(job_id="eval", task_id=f"eval/{index}", prompt=prompt,
                                       metadata_json=json.dumps(line))
                samples += await runner.play("eval", spec.seed, rollout, spec.environment, proto, backend, task)
        finally:
            await client.close()
    statuses = Counter(common_pb2.EpisodeStatus.Name(s.episode_status).removeprefix("EPISODE_STATUS_").lower()
                       for s in samples)
    return {"job": str(args.job), "model": model_name, "problems": len(lines), "episodes": len(samples),
            "reward_mean": statistics.fmean(s.reward for s in samples),
            "success_rate": sum(s.reward > 0 for s in samples) / len(samples),
            "turns_mean": statistics.fmean(len(s.turns) for s in samples),
            "status": {k: v / len(samples) for k, v in sorted(statuses.items())},
            "temperature": rollout.temperature, "wall_s": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, required=True, help="a job TOML with an [environment]")
    parser.add_argument("--eval-file", type=Path, required=True, help="held-out prompt JSONL")
    parser.add_argument("--model", default="", help="model name or directory (default: the job's)")
    parser.add_argument("--problems", type=int, default=20)
    parser.add_argument("--episodes", type=int, default=4, help="episodes per problem")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    result = asyncio.run(evaluate(args))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
