"""GPUs for each process of a local fleet: the learner and the actors on distinct devices by default.

`fleetrl up` / `fleetrl demo` give every child a `CUDA_VISIBLE_DEVICES`, so each sees only the GPU it
was given (as `cuda:0`) and no process grabs memory on another's device:

- no GPU (or `--gpus none`): every process runs on the CPU; nothing changes;
- one GPU: the learner and the actors share it (generation and training then contend for it; with
  vLLM, leave the learner room with its `gpu_memory_utilization`);
- two or more: the learner has the first to itself and the actors take the others in turn
  (actor i on GPU 1 + (i - 1) mod (n - 1)), so generation never waits on a training step.

The gateway, replay and reward services never use a GPU and see none. An actor given a GPU is told
to generate there (`FLEETRL_ACTOR_DEVICE=cuda`); the learner's `device = "auto"` finds it. The GPUs
are the ones `CUDA_VISIBLE_DEVICES` lists when it is set, else those `nvidia-smi -L` lists, else none;
`--gpus 0,2` chooses them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

NO_GPU = ""
NVIDIA_SMI_TIMEOUT_S = 10.0


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The GPU ids this machine offers the fleet (CUDA_VISIBLE_DEVICES, else nvidia-smi, else none)."""
    environ = dict(os.environ if environ is None else environ)
    if "CUDA_VISIBLE_DEVICES" in environ:
        return parse_gpus(environ["CUDA_VISIBLE_DEVICES"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [m.group(1) for m in re.finditer(r"^GPU (\d+):", listed.stdout, flags=re.MULTILINE)]


def parse_gpus(text: str) -> list[str]:
    """`0,2` -> ["0", "2"]; "", "none" and "-1" -> [] (CUDA's own ways of saying no device)."""
    text = text.strip()
    if text.lower() in ("", "none", "-1"):
        return []
    gpus = [part.strip() for part in text.split(",")]
    if any(not part for part in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"GPU list {text!r}: expected distinct comma-separated ids, e.g. 0,1")
    return gpus


def learner_gpu(gpus: list[str]) -> str:
    """The learner's device: the first GPU ("" when there is none)."""
    return gpus[0] if gpus else NO_GPU


def actor_gpu(gpus: list[str], actor_index: int) -> str:
    """Actor i's device (i from 1): shares the only GPU, else one of the learner's others in turn."""
    if not gpus:
        return NO_GPU
    if len(gpus) == 1:
        return gpus[0]
    others = gpus[1:]
    return others[(actor_index - 1) % len(others)]


def device_env(service: str, gpus: list[str], actor_index: int = 0) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES (and the actor's device setting) of one child."""
    if service == "learner":
        gpu = learner_gpu(gpus)
    elif service == "actor":
        gpu = actor_gpu(gpus, actor_index)
    else:
        gpu = NO_GPU
    env = {"CUDA_VISIBLE_DEVICES": gpu}
    if service == "actor" and gpu != NO_GPU:
        env["FLEETRL_ACTOR_DEVICE"] = "cuda"
    return env
