"""Full snapshots against deltas on weights from real learner steps (part of `python -m bench.weights`).

The model (SmolLM2-135M by default) takes `steps` full fine-tuning optimizer steps of the demo job
(examples/addition/job.toml: its algorithm, KL reference and batch shape, through
`fleetrl.train.optim.train_step`, on the batch `bench.train_step` builds: the job's prompts,
random completions of max_new_tokens, rewards alternating 0/1) at `learning_rate`: FULL_FT_LR by
default, not the job's, because the demo job trains LoRA adapters (lr 1e-4) and deltas are for full
fine-tuning, where a step 10x larger would change about 3x more bf16 values than such a job does.
After each step its bf16 payload is published twice through one WeightStore: as a full snapshot
(job `bench-full`) and as a delta against the step before (job `bench-delta`). Per step it records
the bytes of each object, the fraction of bf16 values that changed, publish seconds, and the
seconds a reader takes to get the new version's verified payload: `update` from nothing (full pull)
against `update` from the previous version held (delta pull + scatter of the changed words + sha256
of the result). Pulls are timed `repeats` times, the fastest kept.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from bench.train_step import DEFAULT_JOB, job_groups, job_prompts
from fleetrl.policy import models
from fleetrl.spec.config import parse_job_spec
from fleetrl.tasks import bus
from fleetrl.train import optim
from fleetrl.train.losses import loss_config_for
from fleetrl.weights.channel import HeldWeights, encode_safetensors
from fleetrl.weights.store import WeightStore

FULL_FT_LR = 1e-5
"""The learning rate at which the demo job's full fine-tuning variant was measured (examples/addition/job.toml)."""


def _changed_fraction(before: bytes, after: bytes) -> float:
    a, b = np.frombuffer(before, dtype=np.uint8), np.frombuffer(after, dtype=np.uint8)
    differs = (a != b).reshape(-1, 2).any(axis=1) if len(a) % 2 == 0 else a != b  # bf16: 2 bytes a value
    return float(differs.mean())


def train_payloads(model_name: str, steps: int, learning_rate: float = FULL_FT_LR
                   ) -> tuple[list[bytes], dict[str, Any]]:
    """The bf16 payload before and after each of `steps` demo-job full fine-tuning steps at
    `learning_rate`, and the step times."""
    torch.manual_seed(0)
    spec = parse_job_spec(DEFAULT_JOB.read_text())
    spec = spec.model_copy(update={"model": model_name,
                                   "optim": spec.optim.model_copy(update={"learning_rate": learning_rate})})
    prompts = job_prompts(DEFAULT_JOB, spec)
    model, tokenizer = models.load(spec.model)
    reference = None
    if spec.algorithm.kl_coef > 0:
        reference, _ = models.load(spec.model)
        reference.requires_grad_(False)
    optimizer = optim.build_optimizer(model, spec.optim)
    scheduler = optim.build_scheduler(optimizer, spec.optim, spec.train.max_steps)
    cfg = loss_config_for(spec)
    payloads = [encode_safetensors(models.state_dict_for_publish(model, "bfloat16"))]
    step_s = []
    for step in range(steps):
        groups = job_groups(spec, prompts, tokenizer, seed=step)
        started = time.perf_counter()
        optim.train_step(model, optimizer, scheduler, groups, cfg, spec, reference)
        step_s.append(round(time.perf_counter() - started, 1))
        payloads.append(encode_safetensors(models.state_dict_for_publish(model, "bfloat16")))
    return payloads, {"delta_model": spec.model, "delta_learning_rate": spec.optim.learning_rate,
                      "delta_train_steps": steps, "delta_train_step_s": step_s}


async def _fastest(repeats: int, pull: Any) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        await pull()
        best = min(best, time.perf_counter() - started)
    return best


async def measure_deltas(url: str, payloads: list[bytes], repeats: int) -> dict[str, Any]:
    nc = await bus.connect(url, "bench-deltas")
    store = WeightStore(nc, bus.jetstream(nc))
    rows = []
    base: HeldWeights | None = None
    for version, payload in enumerate(payloads):
        started = time.perf_counter()
        full = await store.publish("bench-full", version, payload, "bfloat16", keep=2)
        full_publish_s = time.perf_counter() - started
        started = time.perf_counter()
        delta = await store.publish("bench-delta", version, payload, "bfloat16", keep=2, base=base,
                                    full_interval=len(payloads))
        delta_publish_s = time.perf_counter() - started
        if base is not None:
            previous = base.pointer
            info = await (await bus.jetstream(nc).object_store(bus.weights_bucket("bench-delta"))).get_info(
                delta.object_name)
            full_s = await _fastest(repeats, lambda p=full: store.update("bench-full", p, None))
            delta_times = []
            for _ in range(repeats):
                held = HeldWeights(previous, memoryview(bytearray(payloads[version - 1])))  # copied untimed
                started = time.perf_counter()
                pulled = await store.update("bench-delta", delta, held)
                delta_times.append(time.perf_counter() - started)
                assert bytes(pulled.payload) == payload and pulled.fallback is None
            rows.append({
                "version": version, "full_bytes": len(payload), "delta_bytes": int(info.size or 0),
                "changed_bf16_fraction": round(_changed_fraction(payloads[version - 1], payload), 5),
                "full_publish_s": round(full_publish_s, 3), "delta_publish_s": round(delta_publish_s, 3),
                "full_pull_apply_s": round(full_s, 3), "delta_pull_apply_s": round(min(delta_times), 3),
            })
        base = HeldWeights(delta, memoryview(payload))
    await nc.drain()
    mean = {key: float(np.mean([r[key] for r in rows])) for key in rows[0] if key != "version"}
    return {
        "delta_versions": rows,
        "full_bytes_per_version": mean["full_bytes"], "delta_bytes_per_version": mean["delta_bytes"],
        "delta_bytes_ratio": round(mean["delta_bytes"] / mean["full_bytes"], 4),
        "changed_bf16_fraction_per_step": round(mean["changed_bf16_fraction"], 5),
        "full_pull_apply_s": round(mean["full_pull_apply_s"], 3),
        "delta_pull_apply_s": round(mean["delta_pull_apply_s"], 3),
        "delta_pull_apply_speedup": round(mean["full_pull_apply_s"] / mean["delta_pull_apply_s"], 2),
    }


def model_available(name: str) -> str | None:
    """None when `name` loads here, else why not."""
    try:
        models.check_available(name)
    except Exception as error:  # the bench reports it and measures the rest
        return str(error)
    return None

