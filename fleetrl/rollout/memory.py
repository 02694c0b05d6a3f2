"""The actor's memory budget: which jobs it holds at once.

A job an actor serves holds a backend, whose memory is mostly its model's weights. Before a job is
opened, `job_cost` estimates what it will commit, from the model's config on torch's meta device
(nothing loaded): its weights in the actor's dtype; on the HF backend a LoRA job whose adapter is
merged also keeps its target layers' base weights aside (`fleetrl.weights.adapters.MergedAdapter`),
while LoRA jobs sharing their base (`share_lora_base`, `fleetrl.policy.shared_base`) each commit
their adapter and the base once between them; a vLLM backend adds its KV cache
(`vllm_kv_cache_gib`) to its engine, and LoRA jobs sharing a vLLM engine (one base, one rank bucket)
each commit their adapter and the engine once between them; the fixed backend holds a tokenizer
only. A shared hf base the actor preloaded (`preload_models`, and the `tinker_models` bases) is committed
from the start, held or not, and so are the Tinker samplers' adapters on it (`MemoryBudget.samplers`).
Activations and the HF backend's KV cache during a generation are not counted: they are per
generation, not per job, and the budget's default leaves room for them.

`MemoryBudget` keeps what each held job committed and when it last served a task. A job that fits
is taken. One that does not fit is taken after dropping the jobs served least recently among those
held for at least `min_residency_s` (so two jobs that do not fit together take turns instead of
thrashing), if that makes room; otherwise it is not taken now and is tried again at the next
refresh, and a job larger than the whole budget is never taken. The actor counts each outcome
(`fleetrl_actor_jobs_dropped_total`, `fleetrl_actor_jobs_deferred_total`) and exports the committed
bytes and the budget.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from fleetrl.rollout.settings import ActorSettings
from fleetrl.spec.config import JobSpec

AUTO_FRACTION = 0.8
"""The default budget: this share of the memory the process may use."""


@dataclass(frozen=True)
class Cost:
    """What a job commits: bytes of its own, and a base it shares with other jobs (held once)."""

    own: int
    base: tuple[tuple[str, str, str], int] | None = None
    """(the shared base's key: model, dtype, device; its bytes), for a LoRA job on a shared base."""


def job_cost(spec: JobSpec, settings: ActorSettings) -> Cost:
    """What a job's backend will hold (see the module docstring)."""
    from fleetrl.policy import models
    from fleetrl.policy.backends import resolve_backend

    lora = spec.train.lora
    backend = resolve_backend(settings.backend, spec.model, settings.device, lora)
    if backend == "fixed":
        return Cost(0)
    sizes = models.weight_sizes(spec.model, settings.dtype, lora.target_modules if lora else ())
    if backend == "vllm":
        engine = sizes.total + (settings.vllm_kv_cache_gib << 30)
        if lora is None:  # full weights change the base: an engine of its own
            return Cost(engine)
        from fleetrl.policy.vllm_backend import engine_rank

        try:
            bucket = engine_rank(lora.rank)
        except ValueError:  # no engine takes the rank: opening the job fails, naming it
            return Cost(engine)
        # LoRA jobs of one base and rank bucket share one engine (fleetrl/policy/vllm_backend.py)
        return Cost(lora.rank * sizes.adapter_per_rank,
                    ((spec.model, settings.dtype, f"{settings.device} vllm rank {bucket}"), engine))
    if lora is not None and settings.share_lora_base:  # hf
        return Cost(lora.rank * sizes.adapter_per_rank, (shared_base_key(spec.model, settings), sizes.total))
    return Cost(sizes.total + (sizes.targeted if lora is not None else 0))


def shared_base_key(model: str, settings: ActorSettings) -> tuple[str, str, str]:
    """The key of the hf backend's shared LoRA base of model here (`fleetrl.policy.shared_base.BaseKey`)."""
    return model, settings.dtype, settings.device


def preloaded_base(model: str, settings: ActorSettings) -> tuple[tuple[str, str, str], int]:
    """What a preloaded shared base commits: (its key, the model's weights in the actor's dtype)."""
    from fleetrl.policy import models

    return shared_base_key(model, settings), models.weight_sizes(model, settings.dtype).total


def preloadable(model: str, settings: ActorSettings) -> bool:
    """Whether a LoRA job on model would run on a shared hf base here, the only kind an actor preloads."""
    from fleetrl.policy.backends import resolve_backend
    from fleetrl.spec.config import LoraSpec

    return settings.share_lora_base and resolve_backend(settings.backend, model, settings.device, LoraSpec()) == "hf"


def memory_limit_bytes() -> int:
    """What this process may use: its cgroup's memory.max (v2) or limit_in_bytes (v1), else the
    machine's memory."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 says "no limit" with a huge number
            return int(text)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget_bytes(settings: ActorSettings) -> int:
    """The actor's budget: memory_budget_mb, or AUTO_FRACTION of memory_limit_bytes when it is 0."""
    if settings.memory_budget_mb:
        return settings.memory_budget_mb << 20
    return int(AUTO_FRACTION * memory_limit_bytes())


@dataclass
class MemoryBudget:
    """The jobs held against a budget: what each committed, when it was opened and last served."""

    limit: int
    min_residency_s: float
    costs: dict[str, Cost] = field(default_factory=dict)
    pinned: set[tuple[tuple[str, str, str], int]] = field(default_factory=set)
    """Preloaded shared bases (key, bytes): committed whatever jobs are held."""
    samplers: int = 0
    """Bytes the Tinker API's samplers hold on this actor (their adapters on the shared base, their cached
    versions: `fleetrl.tinker.fleet.ActorSampling`, which drops its least recently used ones to stay within the
    budget); committed as a held job's are, so a job that no longer fits beside them is deferred."""
    opened: dict[str, float] = field(default_factory=dict)
    served: dict[str, float] = field(default_factory=dict)

    @property
    def used(self) -> int:
        return self._used(set(self.costs))

    def _used(self, jobs: set[str], extra: Cost | None = None) -> int:
        """Bytes the jobs (and a job of cost extra) commit: each one's own, each shared base once."""
        costs = [self.costs[job] for job in jobs] + ([extra] if extra is not None else [])
        bases = {cost.base for cost in costs if cost.base is not None} | self.pinned
        return sum(cost.own for cost in costs) + sum(size for _, size in bases) + self.samplers

    def make_room(self, cost: Cost, now: float) -> list[str] | None:
        """The held jobs to drop (least recently served first) so that cost fits, [] when it fits
        already, None when it cannot fit now (too few jobs held long enough) or ever (over the limit)."""
        if self._used(set(), cost) > self.limit:
            return None
        kept, victims = set(self.costs), []
        candidates = sorted((job for job, opened in self.opened.items() if now - opened >= self.min_residency_s),
                            key=lambda job: self.served.get(job, self.opened[job]))
        for job in candidates:
            if self._used(kept, cost) <= self.limit:
                break
            kept.discard(job)
            victims.append(job)
        return victims if self._used(kept, cost) <= self.limit else None

    def hold(self, job_id: str, cost: Cost, now: float) -> None:
        self.costs[job_id], self.opened[job_id] = cost, now

    def release(self, job_id: str) -> None:
        for table in (self.costs, self.opened, self.served):
            table.pop(job_id, None)

    def mark_served(self, job_id: str, now: float) -> None:
        self.served[job_id] = now
