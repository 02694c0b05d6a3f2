"""Data parallelism under torchrun: rank 0 runs the learner service, the other ranks follow.

`torchrun --nproc_per_node N -m fleetrl.services.learner ...` starts N processes; each joins the
default process group (gloo on CPU, NCCL on GPU). Rank 0 alone talks to NATS, Redis and
replay, runs the feeder, publishes, checkpoints and exports; through `trained_policy.Followers` it sends
the other ranks each job, checkpoint restore and step, and every rank trains its share of the
step's groups in a DDP replica (`trained_policy.Policy.step`). Checkpoints are read by every rank from
the run directory, which must be shared. The process-group timeout is a day, since followers
wait in a collective while rank 0 waits for data or for a job.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any

import torch
import torch.distributed as dist

from fleetrl.policy.models import resolve_device
from fleetrl.train.settings import LearnerSettings
from fleetrl.train.trained_policy import Followers, follow

log = logging.getLogger(__name__)


def backend_for(settings: LearnerSettings) -> str:
    return "nccl" if resolve_device(settings.device) == "cuda" else "gloo"


def main(settings: LearnerSettings, once: bool,
         run: Callable[[LearnerSettings, bool], Coroutine[Any, Any, None]]) -> int:
    """Join the process group; rank 0 serves (then tells the followers to exit), others follow."""
    if settings.max_jobs > 1:
        raise ValueError(f"max_jobs={settings.max_jobs}: a learner under torchrun trains one job at a time (its "
                         "ranks follow one job); set max_jobs to 1")
    dist.init_process_group(backend_for(settings), timeout=datetime.timedelta(days=1))
    rank = dist.get_rank()
    log.info("rank %d of %d (%s): %s", rank, dist.get_world_size(), dist.get_backend(),
             "serving" if rank == 0 else "following rank 0")
    if backend_for(settings) == "nccl":
        # torchrun sets LOCAL_RANK, the rank on this machine; the global rank would pick a GPU that
        # does not exist on the second machine of a multi-node job
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if rank == 0:
        try:
            asyncio.run(run(settings, once))
        finally:
            Followers().send("exit")
    else:
        follow()
    # Reached only by a rank that ended well. A rank that raised leaves the group as it is: its peers may
    # be blocked in a collective, where a collective destroy would hang with them, and torchrun stops them
    # once it exits non-zero. Here every rank has had "exit" before any tears its connections down (a rank
    # destroying the group while a peer is still inside the last collective is how teardowns crash).
    dist.barrier()
    dist.destroy_process_group()
    log.info("rank %d: process group destroyed", rank)
    return 0
