"""LoRA jobs on one actor: one shared base against a base per job.

`python -m bench.tenants --json` prints one JSON object. For 1, 2 and 4 LoRA jobs of the demo's shape
(SmolLM2-135M by default, LoRA rank 16, float32), each measurement in a fresh child process:
- shared: the jobs' backends as an actor builds them with `share_lora_base` (one base, one
  unmerged adapter per job, `fleetrl.policy.shared_base`);
- mixed: the shared base, each round's groups of all the jobs in one batch, each row through its own
  job's adapter (`shared_base.generate_mixed`, peft's mixed-adapter batches);
- own: with `share_lora_base = false` (each job merges its adapter into a base of its own).
The child builds the backends, loads a distinct adapter version into each, then serves the jobs,
one group (`--samples` completions of at most `--new-tokens` tokens, eos allowed) per job per round:
in turn (shared, own), as an actor's rounds of one job's tasks do, or all at once (mixed), after one
untimed short generation per job. It reports its peak RSS (ru_maxrss, after the Python and torch
start-up it shares with every mode), completions/s and new tokens/s over the rounds, and each job's
completions. Goals for 4 jobs on one base: peak RSS <= 1.3x one job's, completions/s >= 0.9x a
single job's. mixed_over_shared_tokens_4: the mixed batch's tokens/s over the jobs in turn, 4 jobs.

Fair share (mode fair, 4 jobs on the shared base): jobs whose groups cost unequally (job j's
completions up to (j + 1) x `--new-tokens` tokens, as tenants' jobs differ), served `--fair-groups`
groups in all, one group at a time, the next job picked as an actor picks it (weighted fair queueing
over the seconds each group took, `fleetrl.rollout.fair_share`, every job its own tenant of weight 1),
then the same number of groups in turn (one group per job, what actors did before fair share). Each
job's share is its actor-seconds; `jain_fair_4` and `jain_in_turn_4` are Jain's fairness index over
them, (sum x)^2 / (n sum x^2): 1.0 when every job had the same time, 1/n when one job had all of it
(goal: >= 0.95). The same split through a whole actor process serving weighted tenants from NATS is
tests/actor/test_fair_share.py.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

JOBS = (1, 2, 4)
PROMPT = [1, *range(100, 140)]
"""Every group's prompt token ids."""


def child(mode: str, jobs: int, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement, in this process."""
    from fleetrl.policy.backends import GroupRequest
    from fleetrl.policy.shared_base import generate_mixed

    backends = job_backends(jobs, args, share_base=mode != "own")
    done, tokens = [0] * jobs, 0
    started = time.perf_counter()
    for round_ in range(args.rounds):
        requests = [GroupRequest(PROMPT, args.samples, args.new_tokens, 1.0, 1.0, seed=round_ * jobs + j)
                    for j in range(jobs)]
        if mode == "mixed":  # the round's groups in one batch, each row through its job's adapter
            groups = generate_mixed(list(zip(backends, requests, strict=True)))  # type: ignore[arg-type]
        else:  # one job's group at a time
            groups = [backend.generate_groups([request])[0]
                      for backend, request in zip(backends, requests, strict=True)]
        for j, group in enumerate(groups):
            done[j] += len(group)
            tokens += sum(len(c.token_ids) for c in group)
    seconds = time.perf_counter() - started
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "completions_per_s": sum(done) / seconds, "tokens_per_s": tokens / seconds, "completions_per_job": done}


def fair_child(jobs: int, args: argparse.Namespace) -> dict[str, Any]:
    """Jobs of unequal cost on one shared base, served by the actor's fair share and then in turn."""
    from fleetrl.policy.backends import GroupRequest
    from fleetrl.rollout.fair_share import FairShare, job_weights

    backends = job_backends(jobs, args, share_base=True)
    names = [str(j) for j in range(jobs)]
    weights = job_weights({name: (name, 1.0) for name in names})
    out: dict[str, Any] = {}
    for policy in ("fair", "in_turn"):
        fair, seconds, groups = FairShare(), [0.0] * jobs, [0] * jobs
        for served in range(args.fair_groups):
            first = int(fair.order(names)[0])  # the job the actor's fair share would serve next
            j = first if policy == "fair" else served % jobs
            request = GroupRequest(PROMPT, args.samples, args.new_tokens * (j + 1), 1.0, 1.0, seed=served)
            began = time.perf_counter()
            backends[j].generate_groups([request])
            took = time.perf_counter() - began
            fair.served(names[j], took, weights[names[j]])
            seconds[j] += took
            groups[j] += 1
        out[policy] = {"seconds_per_job": [round(x, 2) for x in seconds], "groups_per_job": groups,
                       "jain": jain(seconds)}
    return out


def job_backends(jobs: int, args: argparse.Namespace, *, share_base: bool) -> list[Any]:
    """The jobs' backends as an actor builds them (one shared base, or a base each), each with a distinct
    adapter version loaded and one untimed short generation done."""
    import torch

    from fleetrl.policy.backends import make_backend
    from fleetrl.spec.config import LoraSpec

    torch.set_num_threads(args.threads)
    backends = [make_backend("hf", args.model, dtype="float32", device="cpu", lora=LoraSpec(rank=args.rank),
                             share_lora_base=share_base, job_id=f"job-{j}") for j in range(jobs)]
    for j, backend in enumerate(backends):
        backend.load_adapter(adapter_version(backend, j))
        backend.generate(PROMPT, 1, max_new_tokens=2, temperature=1.0, top_p=1.0, seed=0)
    return backends


def jain(shares: list[float]) -> float:
    """Jain's fairness index: 1.0 when every share is the same, 1/n when one holds everything."""
    return sum(shares) ** 2 / (len(shares) * sum(x * x for x in shares))


def adapter_version(backend: Any, seed: int) -> dict[str, Any]:
    """A random adapter version with the names and shapes the backend's job publishes."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {name: 0.01 * torch.randn(shape, generator=generator) for name, shape in backend.adapter_shapes().items()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"model": args.model, "rank": args.rank, "samples": args.samples,
                           "new_tokens": args.new_tokens, "rounds": args.rounds}
    for mode in ("shared", "mixed", "own"):
        out[mode] = {}
        for jobs in JOBS:
            out[mode][str(jobs)] = in_child(mode, jobs, args)
    out["fair"] = in_child("fair", JOBS[-1], args)
    out["jain_fair_4"], out["jain_in_turn_4"] = out["fair"]["fair"]["jain"], out["fair"]["in_turn"]["jain"]
    shared, own = out["shared"], out["own"]
    out["shared_rss_4_over_1"] = shared["4"]["peak_rss_mb"] / shared["1"]["peak_rss_mb"]
    out["own_rss_4_over_1"] = own["4"]["peak_rss_mb"] / own["1"]["peak_rss_mb"]
    out["shared_throughput_4_over_1"] = shared["4"]["completions_per_s"] / shared["1"]["completions_per_s"]
    out["shared_over_own_throughput_1"] = shared["1"]["completions_per_s"] / own["1"]["completions_per_s"]
    out["mixed_over_shared_tokens_4"] = out["mixed"]["4"]["tokens_per_s"] / shared["4"]["tokens_per_s"]
    out["mixed_throughput_4_over_1"] = out["mixed"]["4"]["tokens_per_s"] / shared["1"]["tokens_per_s"]
    return out


def in_child(mode: str, jobs: int, args: argparse.Namespace) -> Any:
    """One measurement in a fresh child process: its JSON line."""
    argv = [sys.executable, "-m", "bench.tenants", "--child", mode, str(jobs), *forwarded(args)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--rank", str(args.rank), "--samples", str(args.samples), "--new-tokens",
            str(args.new_tokens), "--rounds", str(args.rounds), "--threads", str(args.threads),
            "--fair-groups", str(args.fair_groups)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="completions per group")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="groups per job")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fair-groups", type=int, default=16, help="groups served by each policy in mode fair")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "JOBS"), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    if args.child:
        mode, jobs = args.child[0], int(args.child[1])
        print(json.dumps(fair_child(jobs, args) if mode == "fair" else child(mode, jobs, args)))
        return
    result = measure(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
