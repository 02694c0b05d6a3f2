"""Seeding rules every process shares, so runs reproduce across services.

The feeder orders prompts with `prompt_order`; an actor seeds the sampler of a
task with `task_seed`. The single-process reference loop follows the same two
rules, which is what lets a distributed run with one actor reproduce its losses.
"""

from __future__ import annotations

import hashlib
import random


def task_seed(job_seed: int, task_id: str) -> int:
    """63-bit sampling seed of one task: independent of which actor runs it or how often."""
    digest = hashlib.sha256(f"{job_seed}:{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def prompt_order(num_prompts: int, seed: int, epoch: int) -> list[int]:
    """Prompt indices of one epoch, shuffled by (seed, epoch)."""
    order = list(range(num_prompts))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def task_id(epoch: int, prompt_index: int) -> str:
    """The task id of a prompt in an epoch (the replay dedup key within a job)."""
    return f"{epoch}/{prompt_index}"


def parse_task_id(task_id: str) -> tuple[int, int]:
    """(epoch, prompt_index) of a task id made by `task_id`; ValueError for anything else."""
    epoch, sep, index = task_id.partition("/")
    if not sep or not epoch.isdigit() or not index.isdigit():
        raise ValueError(f"task id {task_id!r} is not <epoch>/<prompt_index>")
    return int(epoch), int(index)
