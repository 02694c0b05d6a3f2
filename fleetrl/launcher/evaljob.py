"""`fleetrl eval MODEL_OR_JOB --prompts eval.jsonl`: pass@1 and pass@k of a model, scored by the reward service.

The model is a built-in name (`smollm2-135m`, `tiny-llama`, ...), a local HF directory, or a job id,
whose exported model is downloaded through the gateway and whose reward spec, rollout settings and
seed are used. Otherwise the reward comes from `--job JOB.toml` (its reward, rollout and seed) or
from `--reward-builtin` / `--reward-file` (with `--reward-params`). Completions are scored exactly
as in training: a `Score` call to the reward service (the same sandbox, the same spec), never in
this process.

Per problem: one greedy completion (temperature 0) and `--samples` k sampled ones (the job's
temperature and top-p, problem i drawn with seed + i, by the actor's own sampler). A completion
*passes* when the reward service scored it OK with a reward >= `--threshold` (default 1.0). Greedy
pass@1 is the fraction of problems whose greedy completion passes; sampled pass@1 and pass@k are
the unbiased estimator over the k samples, averaged over problems (fleetrl/eval/passk.py,
shared with the learner's `eval.interval`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from fleetrl.errors import ConfigError, FieldViolation, FleetError
from fleetrl.eval.result import EvalResult
from fleetrl.launcher.jobs_cli import report as report_error
from fleetrl.proto.fleetrl.v1 import reward_pb2
from fleetrl.spec.config import JobSpec, RewardSpec, RolloutConfig, read_bytes
from fleetrl.spec.prompts import read_prompts

if TYPE_CHECKING:
    from fleetrl.eval.passk import Completions

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2
JOB_ID = re.compile(r"^j-[0-9a-f]{12}$")
DEFAULT_REWARD_ADDR = "127.0.0.1:50053"
SCORE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Target:
    """What to evaluate and how to score it."""

    model: str
    reward_spec: reward_pb2.RewardSpec
    rollout: RolloutConfig
    seed: int
    label: str


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetrl eval", description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="a model name or directory, or a job id (its exported model)")
    p.add_argument("--prompts", type=Path, required=True, help="held-out prompt JSONL (`prompt` + metadata)")
    p.add_argument("--job", type=Path, help="take reward, rollout and seed from this job TOML")
    p.add_argument("--reward-builtin", help="a built-in reward (e.g. numeric_match)")
    p.add_argument("--reward-file", type=Path, help="a reward file (Python)")
    p.add_argument("--reward-params", default="{}", help="JSON object of the reward's params")
    p.add_argument("--samples", type=int, default=8, help="k: sampled completions per problem (0: greedy only)")
    p.add_argument("--problems", type=int, default=0, help="evaluate the first N problems (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="default: the rollout's max_new_tokens")
    p.add_argument("--threshold", type=float, default=1.0, help="reward at or above which a completion passes")
    p.add_argument("--reward-addr", help="reward service host:port (env FLEETRL_REWARD_ADDR; else the fleet "
                                          f"recorded in --dir; else {DEFAULT_REWARD_ADDR})")
    p.add_argument("--dir", type=Path, default=Path("runs/local"), help="run directory of a local fleet")
    p.add_argument("--gateway", help="gateway host:port, for a job id (env FLEETRL_GATEWAY)")
    p.add_argument("--token", help="bearer token, for a job id (env FLEETRL_TOKEN)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv[1:] if argv[:1] == ["eval"] else argv)
    out = Console(soft_wrap=True)
    try:
        report = run(args)
    except (ConfigError, ValueError) as error:
        report_error(error if isinstance(error, FleetError) else ConfigError(str(error)), args.json)
        return EXIT_BAD_INPUT
    except FleetError as error:
        report_error(error, args.json)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        out.print(table(report))
    return EXIT_OK


def run(args: argparse.Namespace) -> EvalResult:
    problems = read_problems(args.prompts, args.problems)
    if args.samples < 0:
        raise ConfigError("bad --samples", [FieldViolation("samples", "must be >= 0")])
    with tempfile.TemporaryDirectory(prefix="fleetrl-eval-") as scratch:
        target = resolve(args, Path(scratch))
        max_new = args.max_new_tokens or target.rollout.max_new_tokens
        return evaluate(target, problems, args.samples, max_new, args.threshold, reward_address(args))


def read_problems(path: Path, limit: int) -> list[dict[str, Any]]:
    """The prompt lines (each an object with a string `prompt`), ConfigError naming the bad line."""
    rows = read_prompts(read_bytes(path, "prompts"))
    return rows[:limit] if limit > 0 else rows


def resolve(args: argparse.Namespace, scratch: Path) -> Target:
    """The model to load and the reward spec to score with, from the target and the reward flags."""
    from fleetrl.reward.client import spec_to_proto
    from fleetrl.sdk.client import Client, load_job_file

    explicit = _explicit_reward(args)
    if JOB_ID.match(args.target):
        with Client(args.gateway, token=args.token) as client:
            spec = JobSpec.model_validate(client.get_job(args.target).spec)
            model_dir = client.download_model(args.target, scratch / "model", merged=True)  # a LoRA job: merged
        if explicit is None:
            job_reward = _reward_of(spec, f"job {args.target}")
            if job_reward.file is not None:
                raise ConfigError("the job scores with a reward file", [FieldViolation(
                    "reward_file", f"job {args.target} uses {job_reward.file}; pass it with --reward-file")])
            explicit = spec_to_proto(job_reward)
        return Target(str(model_dir), explicit, spec.rollout, spec.seed, args.target)
    if args.job is not None:
        payload = load_job_file(args.job)
        spec = JobSpec.model_validate_json(payload.spec)
        reward = explicit or spec_to_proto(_reward_of(spec, str(args.job)), payload.reward_file)
        return Target(args.target, reward, spec.rollout, spec.seed, args.target)
    if explicit is None:
        raise ConfigError("no reward to score with", [FieldViolation(
            "reward", "give --job JOB.toml, --reward-builtin NAME or --reward-file FILE")])
    return Target(args.target, explicit, RolloutConfig(), 0, args.target)


def _reward_of(spec: JobSpec, where: str) -> RewardSpec:
    if spec.reward is None:
        raise ConfigError("no reward to score with", [FieldViolation(
            "reward", f"{where} has an [environment], not a [reward]: give --reward-builtin or --reward-file")])
    return spec.reward


def _explicit_reward(args: argparse.Namespace) -> reward_pb2.RewardSpec | None:
    from fleetrl.reward.client import spec_to_proto

    if args.reward_builtin is None and args.reward_file is None:
        return None
    try:
        params = json.loads(args.reward_params)
    except ValueError as error:
        raise ConfigError("bad --reward-params", [FieldViolation("reward_params", str(error))]) from None
    if not isinstance(params, dict):
        raise ConfigError("bad --reward-params", [FieldViolation("reward_params", "expected a JSON object")])
    if args.reward_file is not None:
        source = read_bytes(args.reward_file, "reward_file")
        return spec_to_proto(RewardSpec(file=args.reward_file.name, params=params), source)
    return spec_to_proto(RewardSpec(builtin=args.reward_builtin, params=params))


def reward_address(args: argparse.Namespace) -> str:
    """--reward-addr, else FLEETRL_REWARD_ADDR, else the reward service of the fleet in --dir, else the default."""
    from fleetrl.launcher.fleet import FleetLayout

    if args.reward_addr:
        return str(args.reward_addr)
    if os.environ.get("FLEETRL_REWARD_ADDR"):
        return os.environ["FLEETRL_REWARD_ADDR"]
    layout = FleetLayout.read(args.dir)
    return layout.addresses["reward"] if layout is not None else DEFAULT_REWARD_ADDR


def evaluate(target: Target, problems: list[dict[str, Any]], samples: int, max_new_tokens: int, threshold: float,
             reward_addr: str) -> EvalResult:
    """Generate greedy and sampled completions, score them through the reward service, and sum up."""
    from fleetrl.eval import passk as evaluation
    from fleetrl.policy import models

    started = time.monotonic()
    model, tokenizer = models.load(target.model)
    completions = evaluation.complete(model, tokenizer, problems, rollout=target.rollout, samples=samples,
                                      max_new_tokens=max_new_tokens, seed=target.seed)
    results = asyncio.run(_score(reward_addr, target.reward_spec, problems, completions))
    held_out = evaluation.summarise(results, len(problems), samples, threshold)
    return replace(held_out, model=target.label, wall_s=round(time.monotonic() - started, 1))


async def _score(addr: str, spec: reward_pb2.RewardSpec, problems: list[dict[str, Any]],
                 completions: Completions) -> list[reward_pb2.ScoreResult]:
    from fleetrl.eval import passk as evaluation
    from fleetrl.reward.client import RewardClient
    from fleetrl.runtime.grpcutil import RetryPolicy

    reward = RewardClient(addr, timeout_s=SCORE_TIMEOUT_S, retry=RetryPolicy(deadline_s=SCORE_TIMEOUT_S))
    try:
        return await evaluation.score(reward, "eval", spec, problems, completions)
    finally:
        await reward.close()


def table(report: EvalResult) -> Table:
    out = Table(title=f"{report.model}: {report.problems} problems, pass = reward >= {report.threshold:g}")
    out.add_column("")
    out.add_column("pass@1", justify="right")
    out.add_column(f"pass@{report.samples}" if report.samples else "pass@k", justify="right")
    out.add_column("mean reward", justify="right")
    out.add_row("greedy", f"{report.greedy_pass_at_1:.3f}", "-", f"{report.greedy_reward_mean:.3f}")
    if report.sampled_pass_at_1 is not None:
        out.add_row(f"sampled (k={report.samples})", f"{report.sampled_pass_at_1:.3f}",
                    f"{report.sampled_pass_at_k:.3f}", f"{report.sampled_reward_mean:.3f}")
    out.caption = f"{report.errors} scoring errors, {report.wall_s:.0f} s"
    return out
