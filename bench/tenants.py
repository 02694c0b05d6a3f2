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

The jobs run one at a time here; the fleet's fair share across them (weighted fair queueing) is
measured by tests/actor/test_fair_share.py, not here.
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


def child(mode: str, jobs: int, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement, in this process."""
    import torch

    from fleetrl.policy.backends import GroupRequest, make_backend
    from fleetrl.policy.shared_base import generate_mixed
    from fleetrl.spec.config import LoraSpec

    torch.set_num_threads(args.threads)
    lora = LoraSpec(rank=args.rank)
    backends = [make_backend("hf", args.model, dtype="float32", device="cpu", lora=lora,
                             share_lora_base=mode != "own", job_id=f"job-{j}") for j in range(jobs)]
    for j, backend in enumerate(backends):
        backend.load_adapter(adapter_version(backend, j))
    prompt = [1, *range(100, 140)]
    for backend in backends:  # warm up: the first forward of each job is not timed
        backend.generate(prompt, 1, max_new_tokens=2, temperature=1.0, top_p=1.0, seed=0)
    done, tokens = [0] * jobs, 0
    started = time.perf_counter()
    for round_ in range(args.rounds):
        requests = [GroupRequest(prompt, args.samples, args.new_tokens, 1.0, 1.0, seed=round_ * jobs + j)
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
            argv = [sys.executable, "-m", "bench.tenants", "--child", mode, str(jobs), *forwarded(args)]
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            out[mode][str(jobs)] = json.loads(done.stdout.strip().splitlines()[-1])
    shared, own = out["shared"], out["own"]
    out["shared_rss_4_over_1"] = shared["4"]["peak_rss_mb"] / shared["1"]["peak_rss_mb"]
    out["own_rss_4_over_1"] = own["4"]["peak_rss_mb"] / own["1"]["peak_rss_mb"]
    out["shared_throughput_4_over_1"] = shared["4"]["completions_per_s"] / shared["1"]["completions_per_s"]
    out["shared_over_own_throughput_1"] = shared["1"]["completions_per_s"] / own["1"]["completions_per_s"]
    out["mixed_over_shared_tokens_4"] = out["mixed"]["4"]["tokens_per_s"] / shared["4"]["tokens_per_s"]
    out["mixed_throughput_4_over_1"] = out["mixed"]["4"]["tokens_per_s"] / shared["1"]["tokens_per_s"]
    return out


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--rank", str(args.rank), "--samples", str(args.samples), "--new-tokens",
            str(args.new_tokens), "--rounds", str(args.rounds), "--threads", str(args.threads)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="completions per group")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="groups per job")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "JOBS"), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args)))
        return
    result = measure(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
