"""The learner's optimizer step on a real model for a job's batch: time, model FLOPs against the
machine's measured matmul throughput, and peak RSS against the training state.

`python -m bench.train_step --json [--job examples/addition/job.toml --model smollm2-135m --steps 1]`
prints one JSON object. The batch is the job's: `prompts_per_step` groups of `samples_per_prompt`
samples, prompts from its prompt file through the chat template, every completion
`max_new_tokens` random tokens long (the longest a step can get), rewards alternating 0/1. Each
step is `fleetrl.train.optim.train_step` with the job's algorithm, micro-batches and frozen
reference (when `kl_coef` > 0), as the learner runs it. After one warm-up step (it allocates the
AdamW state), `steps` timed steps run on the learner's log-prob path, then `steps` on the path it
replaced (logits at T + 1 positions, full-vocabulary log_softmax, entropy always, also for the
reference; swapped in for `optim.completion_logprobs`), and `steps` with `train.share_prompts`
off (one padded row per sequence: the layout before shared prompts), on the same model. A job
with a critic (ppo) trains the policy and its value head (`critic.ActorCritic`) as the learner
does; its policy passes read logits and values from one forward, so the naive path changes only
its reference pass.

- model_flops_per_step = 3 * F (full fine-tuning: forward, and a backward for activations and
  weights) or 2 * F (LoRA: the frozen weights get no weight gradients; the adapters' own FLOPs
  are left out), + F for the reference's forward and as much again for a critic's no-grad value
  pass, with F = 2 * N_body * computed_tokens + 2 * d * V * scored_positions the forward, N_body
  the parameters without the token embedding, computed_tokens the tokens the micro-batches'
  forwards hold (padding included: it is computed; with shared prompts, each shared prompt
  once), scored_positions the positions whose logits are taken, d x V the output projection.
  Attention scores are left out (under 1% at these lengths). Each path's FLOPs are its own:
  the unshared path computes more tokens for the same samples.
- matmul_gflops: the best of `--matmul-repeats` `--matmul-n`-square products (2048 by default) in the
  step's dtype on its device, same threads: the peak this machine reaches on the model's own arithmetic.
- mfu: model_flops_per_step / step_s / (matmul_gflops * 1e9).
- state_gb: weights + gradients + AdamW's two moments (+ the reference's weights), in the step's dtype.
- `--device cuda --dtype bfloat16` (default cpu, float32, as the learner trains): the model and its
  reference are loaded in that dtype on that device, so weights, gradients and AdamW's moments are bf16
  and the matmul peak is the GPU's bf16 rate (take `--matmul-n 8192`: a 2048 product does not fill a
  GPU); every timed step and product waits for the device to finish. On CUDA, peak_gpu_memory_gb:
  `torch.cuda.max_memory_allocated` over the whole run.
- peak_rss_gb: the process's peak resident memory during the timed steps of a path (VmHWM,
  reset through /proc/self/clear_refs before each path; without that, the peak since start).
- base_rss_gb: resident memory before the model loads (the interpreter, torch, transformers and
  peft: what any learner holds before its first weight); rest_rss_gb: after the timed steps, between
  steps; peak_beyond_base_over_state: (peak_rss_gb - base_rss_gb) / state_gb, the peak's ratio with
  the libraries' fixed cost left out.
- `--micro-batch-tokens N` adds a path with `train.micro_batch_tokens` N: its peak RSS beyond the
  base over the job path's (`bounded_over_job_peak_rss_beyond_base`) and its step time over the job
  path's; `--max-new-tokens` sets the completions' length (long agent segments).
- `--malloc-mmap-threshold N` fixes glibc's mmap threshold as the learner's
  `malloc_mmap_threshold_bytes` does (fleetrl/runtime/heap.py): with `--activation-checkpointing`
  and 1048576 the peak RSS meets 1.3x the state, each step slower.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from peft import PeftModel
from torch import Tensor
from transformers import PreTrainedModel

from fleetrl.policy import lora, models
from fleetrl.policy.backends import prompt_tokens
from fleetrl.policy.logprobs import naive_token_logprobs
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.runtime import heap
from fleetrl.spec.config import JobSpec, LoraSpec, parse_job_spec
from fleetrl.spec.prompts import read_prompts
from fleetrl.train import optim
from fleetrl.train.batch import TrainBatch, build_batch, group_rewards, micro_batches, share_prompts
from fleetrl.train.critic import with_critic
from fleetrl.train.losses import loss_config_for
from fleetrl.train.trained_policy import checkpoint_activations

DEFAULT_JOB = Path(__file__).resolve().parents[1] / "examples" / "addition" / "job.toml"
MATMUL_N = 2048
PEAK_RESET = False
"""Whether the last timed_steps could reset the peak RSS (else peak_rss_gb is the peak since start)."""


def naive_completion_logprobs(
    model: torch.nn.Module, batch: TrainBatch, temperature: float = 1.0, *, entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The learner's log-probs before `logprobs.token_logprobs` (same signature; entropy always)."""
    keep = batch.input_ids.shape[1] - batch.start
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep, use_cache=False)
    logprobs, ent = naive_token_logprobs(out.logits[:, :-1], batch.input_ids[:, batch.start + 1 :], temperature)
    return logprobs, ent if entropy_grad else ent.detach()


@contextlib.contextmanager
def naive_path() -> Iterator[None]:
    saved = optim.completion_logprobs
    optim.completion_logprobs = naive_completion_logprobs
    try:
        yield
    finally:
        optim.completion_logprobs = saved


def job_prompts(job: Path, spec: JobSpec) -> list[str]:
    """The first 64 prompts of the job file's prompt file (read as the gateway reads it): what `job_groups`
    builds a step's batch from."""
    return [row["prompt"] for row in read_prompts((job.parent / spec.prompts).read_bytes())[:64]]


def job_groups(spec: JobSpec, prompts: list[str], tokenizer: Any, seed: int) -> list[common_pb2.Group]:
    rng = random.Random(seed)
    rollout = spec.rollout
    groups = []
    for index in range(rollout.prompts_per_step):
        prompt = prompt_tokens(tokenizer, prompts[index % len(prompts)], rollout)
        group = common_pb2.Group(task_id=f"0/{index}")
        for sample in range(rollout.samples_per_prompt):
            completion = [rng.randrange(len(tokenizer)) for _ in range(rollout.max_new_tokens)]
            group.samples.append(common_pb2.Sample(
                prompt_token_ids=prompt, completion_token_ids=completion,
                behaviour_logprobs=[-1.0] * len(completion), reward=float(sample % 2)))
        groups.append(group)
    return groups


def synchronize(device: str) -> None:
    """Wait for the device's queued work: CUDA runs kernels asynchronously, so a timer read without
    this measures their launch, not their work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def matmul_gflops(repeats: int, n: int = MATMUL_N, dtype: torch.dtype = torch.float32, device: str = "cpu") -> float:
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    torch.mm(a, b)
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _status_gb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_rss_gb() -> float:
    return _status_gb("VmHWM")


def rss_gb() -> float:
    return _status_gb("VmRSS")


def step_flops(
    model: PreTrainedModel | PeftModel, module: torch.nn.Module, spec: JobSpec, groups: list[common_pb2.Group],
    reference: bool,
) -> dict[str, float]:
    """Computed tokens and scored positions of the step's micro-batches, and its model FLOPs (see above)."""
    cfg = loss_config_for(spec)
    batch = build_batch(groups, [group_rewards(group) for group in groups], optim.PAD_ID)
    ratio = optim.packing_cost_ratio(module) if spec.train.share_prompts else None
    slices = micro_batches(batch, spec.train.micro_batch_samples, spec.train.micro_batch_tokens)
    micros = [share_prompts(m, ratio) for m in slices]
    computed = sum((m.input_ids if m.packed is None else m.packed.input_ids).numel() for m in micros)
    scored = sum(m.completion_mask.numel() if m.packed is None else m.packed.keep.numel() * m.packed.input_ids.shape[0]
                 for m in micros)
    head = model.config.vocab_size * model.config.hidden_size  # d x V: the embedding, and the output projection
    n_total = sum(p.numel() for p in model.parameters())  # a tied weight counts once
    n_body = n_total - head * (1 if model.config.tie_word_embeddings else 2)
    forward = 2 * n_body * computed + 2 * head * scored
    train = 2 if isinstance(model, PeftModel) else 3
    flops = train * forward * spec.train.epochs_per_step + forward * (int(reference) + int(cfg.uses_critic))
    return {"params": n_total, "params_body": n_body, "computed_tokens": computed,
            "padded_tokens": batch.input_ids.numel(), "scored_positions": scored,
            "packed_micro_batches": sum(m.packed is not None for m in micros),
            "completion_tokens": batch.num_tokens, "model_flops_per_step": flops}


def timed_steps(train: Any, steps: int, what: str, device: str = "cpu") -> tuple[list[float], float]:
    gc.collect()
    global PEAK_RESET
    PEAK_RESET = reset_peak_rss()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train()
        synchronize(device)
        times.append(time.perf_counter() - start)
        print(f"{what} step: {times[-1]:.1f}s", file=sys.stderr, flush=True)
    return times, peak_rss_gb()


def run(args: argparse.Namespace) -> dict[str, Any]:
    heap.set_mmap_threshold(args.malloc_mmap_threshold)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    spec = parse_job_spec(args.job.read_text())
    if args.model:
        spec = spec.model_copy(update={"model": args.model})
    if args.algorithm:
        spec = spec.model_copy(update={"algorithm": spec.algorithm.model_copy(update={"name": args.algorithm})})
    if args.max_new_tokens:
        rollout = spec.rollout.model_copy(update={"max_new_tokens": args.max_new_tokens})
        spec = spec.model_copy(update={"rollout": rollout})
    prompts = job_prompts(args.job, spec)
    gc.collect()
    base_rss = rss_gb()
    model: PreTrainedModel | PeftModel
    if args.activation_checkpointing:
        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"activation_checkpointing": True})})
    dtype = models.as_dtype(args.dtype)
    model, tokenizer = models.load(spec.model, dtype=dtype, device=args.device)
    if spec.train.activation_checkpointing:
        checkpoint_activations(model)
    reference: torch.nn.Module | None = None
    if args.lora_rank:
        wrapped = lora.wrap(model, LoraSpec(rank=args.lora_rank, alpha=2 * args.lora_rank), spec.seed)
        reference = lora.FrozenBase(wrapped) if spec.algorithm.kl_coef > 0 else None
        model = wrapped
    elif spec.algorithm.kl_coef > 0:
        reference, _ = models.load(spec.model, dtype=dtype, device=args.device)
        reference.requires_grad_(False)
    cfg = loss_config_for(spec)
    module, critic = with_critic(cast(PreTrainedModel, model), cfg)  # a PeftModel passes for one, as in trained_policy
    optimizer = optim.build_optimizer(model, spec.optim, critic, spec.algorithm.value_learning_rate)
    scheduler = optim.build_scheduler(optimizer, spec.optim, spec.train.max_steps)
    groups = job_groups(spec, prompts, tokenizer, seed=0)
    last: dict[str, float] = {}

    unshared = spec.model_copy(update={"train": spec.train.model_copy(update={"share_prompts": False})})
    job = spec

    def train() -> None:
        last.update(optim.train_step(module, optimizer, scheduler, groups, cfg, job, reference))

    gflops = matmul_gflops(args.matmul_repeats, args.matmul_n, dtype, args.device)
    timed_steps(train, 1, "warm-up", args.device)  # AdamW state, allocator
    new_times, new_rss = timed_steps(train, args.steps, "learner path", args.device)
    new_fb = last["forward_backward_s"]
    gc.collect()
    rest_rss = rss_gb()
    old_layout: dict[str, Any] = {}
    if args.unshared_steps and spec.train.share_prompts:
        job = unshared
        times, rss = timed_steps(train, args.unshared_steps, "unshared prompts", args.device)
        job = spec
        old_layout = {"unshared_step_s": round(min(times), 3), "unshared_step_s_all": [round(t, 3) for t in times],
                      "unshared_peak_rss_gb": round(rss, 3),
                      "unshared_over_shared_step_time": round(min(times) / min(new_times), 3)}
    bounded: dict[str, Any] = {}
    if args.micro_batch_tokens:
        train_config = spec.train.model_copy(update={"micro_batch_tokens": args.micro_batch_tokens})
        job = spec.model_copy(update={"train": train_config})
        times, rss = timed_steps(train, args.steps, f"micro_batch_tokens {args.micro_batch_tokens}", args.device)
        whole = build_batch(groups, [group_rewards(g) for g in groups], optim.PAD_ID)
        bounded = {"bounded_micro_batch_tokens": args.micro_batch_tokens,
                   "bounded_micro_batches": len(micro_batches(whole, job.train.micro_batch_samples,
                                                              args.micro_batch_tokens)),
                   "bounded_step_s": round(min(times), 3), "bounded_peak_rss_gb": round(rss, 3),
                   "bounded_over_job_peak_rss_beyond_base": round((rss - base_rss) / (new_rss - base_rss), 3),
                   "bounded_over_job_step_time": round(min(times) / min(new_times), 3)}
        job = spec
    naive: dict[str, Any] = {}
    if args.naive_steps:
        with naive_path():
            old_times, old_rss = timed_steps(train, args.naive_steps, "naive path", args.device)
        old_step_s = min(old_times)
        naive = {
            "naive_step_s": round(old_step_s, 3), "naive_step_s_all": [round(t, 3) for t in old_times],
            "naive_forward_backward_s": round(last["forward_backward_s"], 3), "naive_peak_rss_gb": round(old_rss, 3),
            "naive_over_new_step_time": round(old_step_s / min(new_times), 3),
        }
    gflops = max(gflops, matmul_gflops(args.matmul_repeats, args.matmul_n, dtype, args.device))
    figures = step_flops(model, module, spec, groups, reference is not None)
    if old_layout:
        flops = step_flops(model, module, unshared, groups, reference is not None)["model_flops_per_step"]
        old_layout["unshared_mfu"] = round(flops / old_layout["unshared_step_s"] / (gflops * 1e9), 3)
    n = figures["params"]
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    copies = 1 + (reference is not None and not args.lora_rank)  # LoRA's reference is the frozen base itself
    state = dtype.itemsize * (n * copies + 3 * trained)  # weights (+ reference), grads + 2 AdamW moments of what trains
    step_s = min(new_times)
    return {
        "model": spec.model, "device": args.device, "dtype": args.dtype, "lora_rank": args.lora_rank,
        "trainable_params": trained,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2), "steps": args.steps,
        "prompts_per_step": spec.rollout.prompts_per_step, "samples_per_prompt": spec.rollout.samples_per_prompt,
        "max_new_tokens": spec.rollout.max_new_tokens, "micro_batch_samples": spec.train.micro_batch_samples,
        "algorithm": spec.algorithm.name, "kl_coef": spec.algorithm.kl_coef,
        "entropy_coef": spec.algorithm.entropy_coef, "activation_checkpointing": spec.train.activation_checkpointing,
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
        **figures,
        "step_s": round(step_s, 3), "step_s_all": [round(t, 3) for t in new_times],
        "forward_backward_s": round(new_fb, 3),
        "matmul_gflops": round(gflops, 2),
        "model_gflops_per_s": round(figures["model_flops_per_step"] / step_s / 1e9, 2),
        "mfu": round(figures["model_flops_per_step"] / step_s / (gflops * 1e9), 3),
        "state_gb": round(state / 1e9, 3), "peak_rss_gb": round(new_rss, 3),
        "peak_rss_over_state": round(new_rss / (state / 1e9), 3),
        "peak_rss_reset": PEAK_RESET,
        "base_rss_gb": round(base_rss, 3), "rest_rss_gb": round(rest_rss, 3),
        "peak_beyond_base_over_state": round((new_rss - base_rss) / (state / 1e9), 3),
        **gpu_memory(args.device),
        **old_layout,
        **bounded,
        **naive,
    }


def gpu_memory(device: str) -> dict[str, float]:
    """peak_gpu_memory_gb on a CUDA device (module docstring); nothing on the CPU."""
    if torch.device(device).type != "cuda":
        return {}
    return {"peak_gpu_memory_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--job", type=Path, default=DEFAULT_JOB, help="job TOML (default examples/addition/job.toml)")
    parser.add_argument("--model", help="model instead of the job's (e.g. tiny-llama for a quick check)")
    parser.add_argument("--algorithm", help="algorithm.name instead of the job's (e.g. ppo, ppo_rloo)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per path (default 1; best counts)")
    parser.add_argument("--matmul-repeats", type=int, default=5, help="timed matmul products (best counts)")
    parser.add_argument("--matmul-n", type=int, default=MATMUL_N, help="side of the timed square products (default "
                        "2048; 8192 on a GPU)")
    parser.add_argument("--device", default="cpu", help="device of the model and the step (default cpu; cuda)")
    parser.add_argument("--dtype", default="float32",
                        help="dtype of the model, its gradients, AdamW state and the matmul peak (default float32, "
                             "the learner's; bfloat16)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train LoRA adapters of this rank (alpha 2 x rank, the default targets; the frozen "
                             "base is the KL reference) instead of every weight (0, the default)")
    parser.add_argument("--naive-steps", type=int, default=None,
                        help="timed steps on the replaced log-prob path (default: --steps; 0 skips it)")
    parser.add_argument("--unshared-steps", type=int, default=None,
                        help="timed steps with train.share_prompts off (default: --steps; 0 skips it)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="train.activation_checkpointing on (default: the job's setting)")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=0,
                        help="glibc's mmap threshold in bytes, as the learner's malloc_mmap_threshold_bytes")
    parser.add_argument("--max-new-tokens", type=int, default=0,
                        help="rollout.max_new_tokens instead of the job's: every completion's length")
    parser.add_argument("--micro-batch-tokens", type=int, default=0,
                        help="also time steps with train.micro_batch_tokens at this bound (bounded_* figures, the "
                             "job's own path the baseline)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    args = parser.parse_args(argv)
    if args.naive_steps is None:
        args.naive_steps = args.steps
    if args.unshared_steps is None:
        args.unshared_steps = args.steps
    result = run(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
