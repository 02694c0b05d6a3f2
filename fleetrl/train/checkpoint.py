"""Durable checkpoints of a job: model, optimizer, scheduler, RNG, step, feeder cursor, leases.

Layout: `{run_dir}/jobs/{job}/checkpoints/step-{N:08d}/` holding `model.safetensors`,
`optimizer.pt`, `extra.pt` (scheduler and RNG states), `state.json` (step, version, feeder
cursor, replay leases to commit, counters) and, for a job with a critic (ppo), `critic.safetensors`
(the value head; its optimizer state is in optimizer.pt), then a `COMPLETE` marker.

Design choice: a checkpoint is written into `step-N.tmp`, every file and the directory are
fsynced, the directory is renamed to `step-N`, and only then is `COMPLETE` written (and fsynced).
A reader trusts only directories with the marker, so a learner killed at any moment leaves
either the previous complete checkpoint or a new complete one, never a half-read state. `write` and
`complete` are the two halves, so the learner can check its fencing token between them.

Every file is written through `files.write_file`, so a full disk raises `files.NoSpace` naming the
file and ENOSPC; `write` deletes its partial directory first, so a failed attempt does not keep the
space it took (the learner waits for space: `fleetrl.train.full_stores`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fleetrl.train.files import NoSpace, torch_save, write_file

MARKER = "COMPLETE"
CRITIC_FILE = "critic.safetensors"
_NAME_RE = re.compile(r"^step-(\d{8})$")
_TMP_RE = re.compile(r"^step-(\d{8})(?:\.e\d+)?\.tmp$")


@dataclass
class Checkpoint:
    """What a checkpoint holds, in memory."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    state: dict[str, Any]
    """JSON-able: version, feeder cursor, pending leases, counters."""
    critic: dict[str, torch.Tensor] | None = None
    """The value head's tensors (ppo); None for a job without a critic."""


def checkpoint_root(run_dir: Path, job_id: str) -> Path:
    return Path(run_dir) / "jobs" / job_id / "checkpoints"


def rng_state() -> dict[str, Any]:
    """Every RNG that training may draw from."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: Path, ckpt: Checkpoint, *, delay_s: float = 0.0) -> Path:
    """Write ckpt durably (temp dir, fsync, rename, marker); returns the final directory."""
    return complete(root, write(root, ckpt, delay_s=delay_s))


def write(root: Path, ckpt: Checkpoint, *, delay_s: float = 0.0, lease_epoch: int | None = None) -> Path:
    """The first half of `save`: every file in `step-N.tmp` (`step-N.e<lease_epoch>.tmp` when given, so
    two learners of one job never write into one directory), fsynced; returns that directory."""
    root.mkdir(parents=True, exist_ok=True)
    owner = "" if lease_epoch is None else f".e{lease_epoch}"
    tmp = root / f"step-{ckpt.step:08d}{owner}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a previous incarnation's partial attempt at this step
    tmp.mkdir()
    try:
        _write_files(tmp, ckpt)
    except NoSpace:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if delay_s:
        time.sleep(delay_s)
    return tmp


def _write_files(tmp: Path, ckpt: Checkpoint) -> None:
    write_file(tmp / "model.safetensors", lambda path: save_file(ckpt.model, str(path)))
    if ckpt.critic is not None:
        critic = ckpt.critic
        write_file(tmp / CRITIC_FILE, lambda path: save_file(critic, str(path)))
    write_file(tmp / "optimizer.pt", torch_save(ckpt.optimizer))
    write_file(tmp / "extra.pt", torch_save({"scheduler": ckpt.scheduler, "rng": ckpt.rng}))
    state = json.dumps({"step": ckpt.step, **ckpt.state}, sort_keys=True)
    write_file(tmp / "state.json", lambda path: path.write_text(state))
    for item in tmp.iterdir():
        write_file(item, _fsync)
    write_file(tmp, _fsync)


def complete(root: Path, tmp: Path) -> Path:
    """The second half of `save`: rename `step-N.tmp` to `step-N` (replacing an older one), then the marker."""
    match = _TMP_RE.match(tmp.name)
    assert match is not None, tmp
    final = root / f"step-{match.group(1)}"
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    _fsync(root)
    write_file(final / MARKER, lambda path: path.write_text(str(int(final.name.removeprefix("step-")))))
    write_file(final / MARKER, _fsync)
    _fsync(final)
    return final


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under root, ascending."""
    if not root.is_dir():
        return []
    out = []
    for item in root.iterdir():
        match = _NAME_RE.match(item.name)
        if match and (item / MARKER).is_file():
            out.append(int(match.group(1)))
    return sorted(out)


def load(root: Path, step: int) -> Checkpoint:
    path = root / f"step-{step:08d}"
    extra = torch.load(path / "extra.pt", weights_only=False)
    state = json.loads((path / "state.json").read_text())
    return Checkpoint(
        step=int(state.pop("step")), model=load_file(str(path / "model.safetensors")),
        optimizer=torch.load(path / "optimizer.pt", weights_only=False),
        scheduler=extra["scheduler"], rng=extra["rng"], state=state,
        critic=load_file(str(path / CRITIC_FILE)) if (path / CRITIC_FILE).is_file() else None,
    )


def load_latest(root: Path) -> Checkpoint | None:
    """The newest complete checkpoint; partial ones are ignored."""
    steps = complete_steps(root)
    return load(root, steps[-1]) if steps else None


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and any partial one not newer than the newest."""
    steps = complete_steps(root)
    kept = set(steps[-keep:])
    newest = steps[-1] if steps else -1
    for item in root.iterdir():
        partial = _TMP_RE.match(item.name)
        match = partial or _NAME_RE.match(item.name)
        if not match:
            continue
        step = int(match.group(1))
        if step <= newest and (partial or step not in kept):
            shutil.rmtree(item, ignore_errors=True)
