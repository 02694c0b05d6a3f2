"""A model's episodes on a multi-turn example job: mean episode reward and success rate on held-out prompts.

`python -m bench.episode_eval --json --job examples/retry_feedback/job.toml --eval-file examples/addition/eval.jsonl`
prints one JSON object: `fleetrl.launcher.episode_eval.evaluate`'s figures (a real RewardService, its jail and
sandboxed workers, running the job's environment file; `fleetrl.rollout.episodes.EpisodeRunner` playing
`--episodes` episodes of each of the first `--problems` prompts of the eval file with the job's
rollout settings on the HF backend) with `--model` (default: the job's model; a trained model's
exported directory works too):
- reward_mean: mean episode reward; success_rate: the fraction of episodes with a reward above 0;
- turns_mean, status: turns per episode and the fraction of episodes ending each way;
- wall_s: the time the episodes took.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fleetrl.launcher import episode_eval
from fleetrl.sdk.client import load_job_file
from fleetrl.spec.config import parse_job_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, required=True, help="a job TOML with an [environment]")
    parser.add_argument("--eval-file", type=Path, required=True, help="held-out prompt JSONL")
    parser.add_argument("--model", default="", help="model name or directory (default: the job's)")
    parser.add_argument("--problems", type=int, default=20)
    parser.add_argument("--episodes", type=int, default=4, help="episodes per problem")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    payload = load_job_file(args.job)
    spec = parse_job_spec(payload.spec, "json")
    if spec.environment is None:
        raise SystemExit(f"{args.job} has no [environment]")
    lines = [json.loads(line) for line in args.eval_file.read_text().splitlines() if line.strip()][: args.problems]
    figures = episode_eval.figures(episode_eval.evaluate(spec, payload.environment_file, args.model or spec.model,
                                                         lines, args.episodes))
    result = {"job": str(args.job), **figures}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
