"""Several LoRA jobs on one learner (one base, `LearnerSettings.max_jobs`) against one learner per job.

`python -m bench.learner_jobs --json [--job examples/addition/job.toml --model smollm2-135m --jobs 2 4]`
prints one JSON object. For each job count N, in one run:

- `shared`: one process holds the base once (`lora.SharedBases`) and N LoRA policies on it, each with
  its adapters and AdamW state, stepping in turn on the one compute thread with `--threads` threads, as
  a learner with max_jobs N does.
- `own`: N processes, each a policy with its own base (N learners on the same cores), running at once,
  `--threads` // N threads each (at least 1), so both modes have the same cores.

Each policy takes `--steps` optimizer steps on its job's batch (`bench.train_step.job_groups`: the
job's prompts, `max_new_tokens` random tokens per completion) after one untimed warm-up step (it
allocates the AdamW state). Reported per mode: the peak RSS summed over its processes (ru_maxrss: the
interpreter and libraries count once per process, as they do per learner), steps per second over all
jobs (N x steps / the wall time of the timed steps), and `shared_over_own` ratios of both.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def child(mode: str, jobs: int, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """`jobs` policies in this process (mode shared: on one base; own: `jobs` is 1), timed."""
    import torch

    from bench.train_step import job_groups, job_prompts
    from fleetrl.policy.lora import SharedBases
    from fleetrl.spec.config import LoraSpec, parse_job_spec
    from fleetrl.train.trained_policy import Policy

    torch.set_num_threads(threads)
    spec = parse_job_spec(args.job.read_text())
    train = spec.train.model_copy(update={"lora": LoraSpec(rank=args.rank, alpha=2 * args.rank)})
    spec = spec.model_copy(update={"model": args.model, "train": train})
    prompts = job_prompts(args.job, spec)
    bases = SharedBases() if mode == "shared" else None
    policies = [Policy(spec, bases=bases) for _ in range(jobs)]
    batches = [job_groups(spec, prompts, policy.tokenizer, seed=j) for j, policy in enumerate(policies)]
    for policy, groups in zip(policies, batches, strict=True):
        policy.step(groups)
    started = time.perf_counter()
    for _ in range(args.steps):
        for policy, groups in zip(policies, batches, strict=True):
            policy.step(groups)
    return {"seconds": time.perf_counter() - started, "steps": jobs * args.steps,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def spawn(mode: str, jobs: int, threads: int, args: argparse.Namespace) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "bench.learner_jobs", "--child", mode, str(jobs), str(threads), "--job",
            str(args.job), "--model", args.model, "--rank", str(args.rank), "--steps", str(args.steps)]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"a bench child exited with {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"job": str(args.job), "model": args.model, "rank": args.rank, "steps": args.steps,
                           "threads": args.threads}
    for jobs in args.jobs:
        shared = result_of(spawn("shared", jobs, args.threads, args))
        started = time.perf_counter()
        children = [spawn("own", 1, max(1, args.threads // jobs), args) for _ in range(jobs)]
        own = [result_of(proc) for proc in children]
        wall = time.perf_counter() - started  # includes each child's start: its timed steps' seconds are used
        own_seconds = max(r["seconds"] for r in own)
        row = {
            "shared": {"peak_rss_mb": shared["peak_rss_mb"], "steps_per_s": shared["steps"] / shared["seconds"]},
            "own": {"peak_rss_mb": sum(r["peak_rss_mb"] for r in own),
                    "steps_per_s": sum(r["steps"] for r in own) / own_seconds, "wall_s": wall},
        }
        row["shared_over_own_rss"] = row["shared"]["peak_rss_mb"] / row["own"]["peak_rss_mb"]
        row["shared_over_own_steps_per_s"] = row["shared"]["steps_per_s"] / row["own"]["steps_per_s"]
        out[str(jobs)] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=REPO / "examples" / "addition" / "job.toml")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per job")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the whole learner")
    parser.add_argument("--jobs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--child", nargs=3, metavar=("MODE", "JOBS", "THREADS"), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]), args)))
        return
    result = measure(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
