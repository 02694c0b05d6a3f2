"""Settings of the learner service (environment prefix FLEETRL_LEARNER_).

What a job trains (model, algorithm, schedule, intervals) is in its JobSpec; these settings say
how one learner process runs: where the infrastructure is, where it writes, how it holds leases.
This module imports no torch, so `--help` and validation are instant.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Literal

from pydantic import Field

from fleetrl.spec.config import InfraSettings

ENV_PREFIX = "FLEETRL_LEARNER_"


def default_learner_id() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


class LearnerSettings(InfraSettings):
    """How one learner process runs."""

    replay_addr: str = "127.0.0.1:50052"
    """ReplayService address host:port."""
    reward_addr: str = "127.0.0.1:50053"
    """RewardService address host:port: scores the held-out evaluation of jobs that set eval.interval."""
    listen: str = "127.0.0.1:50054"
    """gRPC listen address of LearnerService (status); port 0: a free port."""
    learner_id: str = Field(default_factory=default_learner_id)
    """Id of this learner replica in job leases and status (default host/pid/random)."""
    lease_s: float = Field(15.0, ge=1, le=3600)
    """TTL of the job lease; renewed every lease_s / 3, each renewal giving up after lease_s / 3. A learner
    with no successful renewal within lease_s of the last good one stops the run (its lease has lapsed)."""
    claim_poll_s: float = Field(1.0, gt=0, le=60)
    """How often an idle learner looks for a queued job."""
    max_jobs: int = Field(1, ge=1, le=64)
    """Jobs this learner trains at once. Past the first, it claims only LoRA jobs on the base model of
    the LoRA jobs it trains already, and holds that base once for all of them (`lora.SharedBases`): each
    job adds its adapters and their optimizer state, and their steps take turns on the one compute
    thread, so one job's step runs while another waits for its groups. A full fine-tune runs alone.
    1 under torchrun (the ranks follow one job)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model trains; auto: cuda when available, else cpu."""
    tinker_models: list[str] = Field(default_factory=list, max_length=16)
    """Base models whose Tinker API training runs this learner hosts (a tinker service with
    `training = "fleet"` places each run on one such learner, `fleetrl.tinker.learners`): each run's adapter
    and optimizer on the base its LoRA jobs use, held once, its calls on the compute thread beside its jobs'
    steps."""
    tinker_max_runs: int = Field(8, ge=1, le=1000)
    """Tinker training runs this learner holds at most; a placement past it goes to another learner."""
    tinker_run_idle_s: float = Field(900.0, ge=10, le=7 * 86400)
    """A Tinker training run no call reached for this long is dropped (its service ended it, or restored it
    elsewhere after taking this learner for lost)."""
    torch_threads: int = Field(0, ge=0, le=1024)
    """torch intra-op threads, set with torch.set_num_threads at start (0: torch's default, one per
    core). The local launcher sets it from its thread budget (fleetrl/launcher/cores.py)."""
    compute_nice: int = Field(0, ge=0, le=19)
    """Niceness of the one thread that builds the model and trains (and of the OpenMP threads it
    starts): 0 is normal priority. The local launcher's lending modes set 19, so actors on the same
    cores come first and the learner computes on what they leave idle; the service's own threads
    (gRPC, NATS, lease renewal) keep normal priority."""
    malloc_mmap_threshold_bytes: int = Field(0, ge=0, le=32 * 2**20)
    """glibc's malloc mmap threshold, fixed at start (fleetrl/runtime/heap.py): allocations of this
    size and more get their own pages, returned to the kernel when freed, so peak RSS follows the
    tensors alive rather than the heap's holes. 1048576 with train.activation_checkpointing brought
    the demo learner's peak RSS from 1.42x to 1.27x the training state, each step 17% slower. 0:
    glibc's default (a threshold that rises with the sizes freed)."""
    sample_wait_s: float = Field(2.0, gt=0, le=60)
    """Longest one replay Sample call waits for groups (the step deadline is the job's
    train.timeout_per_step_s)."""
    rpc_timeout_s: float = Field(30.0, gt=0, le=600)
    """Deadline of each replay call beyond its own wait."""
    replay_attempts: int = Field(30, ge=1, le=1000)
    """Tries of a replay call that fails UNAVAILABLE, RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED, with
    jittered backoff capped at 5 s (30: about two minutes), so a replay restart does not fail the job."""
    grace_s: float = Field(5.0, ge=0, le=600)
    """Seconds in-flight status calls may finish at shutdown."""
    store_full_wait_s: float = Field(900.0, ge=0, le=7 * 24 * 3600)
    """How long a job waits for space when a checkpoint file (ENOSPC) or a JetStream write (its storage
    limit, or a stream's or bucket's) is refused for want of it: paused, its reason naming the refusal,
    and trying again every store_full_retry_s with its leases kept; past this the job fails with that
    reason. A NATS outage that a task or weight publish meets is waited out the same way, but past this
    the run stops without failing the job: its lease lapses and a claim resumes it from its checkpoint.
    (A full Redis pauses the job until Redis takes writes, however long.)"""
    store_full_retry_s: float = Field(5.0, gt=0, le=600)
    """How often a job paused on a full checkpoint disk or JetStream, or on a NATS outage, tries the write again."""
    checkpoint_delay_s: float = Field(0.0, ge=0, le=600)
    """Fault injection for tests: sleep this long after a checkpoint's files are written and
    before it is renamed and marked complete (0 in production)."""
