"""Settings of the gateway (environment prefix FLEETRL_GATEWAY_).

Auth is closed by default: a gateway with no tokens and `open_mode = false` refuses to start, so
forgetting to configure tokens never exposes jobs. Tokens are stored as sha256 hex digests only
(`fleetrl gateway hash-token TOKEN` prints one); the token fields are `fleetrl.runtime.tokens.TokenSettings`,
shared with the Tinker API.

What a job may ask for is the operator's too: its model comes from an allow-list (`allowed_models`,
`allowed_model_roots`), and every resource size a submitter chooses has a cap in the `[job_caps]`
table. Design choice: the caps are one sub-model whose fields are named after the spec fields they
cap (`job_caps.samples_per_prompt` caps `rollout.samples_per_prompt`), each declaring the spec paths
it covers, so adding a cap is one field; a cap's bounds are its spec field's own bounds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import annotated_types
from pydantic import BaseModel, Field, model_validator
from pydantic.fields import FieldInfo

from fleetrl.policy.models import ModelAllowList
from fleetrl.runtime.tokens import TokenSettings
from fleetrl.spec.config import InfraSettings, JobSpec, Strict

ENV_PREFIX = "FLEETRL_GATEWAY_"
_CAPS_KEY = "caps"
_BOUNDS: dict[type, str] = {annotated_types.Ge: "ge", annotated_types.Gt: "gt", annotated_types.Le: "le"}


def spec_field(path: str) -> FieldInfo:
    """The JobSpec field at a dotted path (`train.lora.rank`), through optional sections."""
    model: type[BaseModel] = JobSpec
    *sections, leaf = path.split(".")
    for name in sections:
        annotation = model.model_fields[name].annotation
        model = next(arg for arg in (annotation, *getattr(annotation, "__args__", ()))
                     if isinstance(arg, type) and issubclass(arg, BaseModel))
    return model.model_fields[leaf]


def _cap(default: float, *paths: str) -> Any:
    """A cap on the spec fields at `paths`, within the first one's own bounds."""
    metadata = spec_field(paths[0]).metadata
    bounds = {_BOUNDS[type(item)]: getattr(item, _BOUNDS[type(item)]) for item in metadata if type(item) in _BOUNDS}
    return Field(default, json_schema_extra={_CAPS_KEY: list(paths)}, **bounds)


def capped_paths(info: FieldInfo) -> list[str]:
    """The spec paths a JobCaps field caps (as `_cap` declared them)."""
    return list(cast("dict[str, list[str]]", info.json_schema_extra)[_CAPS_KEY])


class JobCaps(Strict):
    """The operator's cap on every resource size a submitter chooses: a submission above one is refused
    with INVALID_ARGUMENT naming the spec field and the cap. The defaults admit every example job."""

    prompts_per_step: int = _cap(1024, "rollout.prompts_per_step")
    """Most groups per optimizer step (`rollout.prompts_per_step`)."""
    samples_per_prompt: int = _cap(128, "rollout.samples_per_prompt")
    """Most completions or episodes per group (`rollout.samples_per_prompt`)."""
    max_new_tokens: int = _cap(32768, "rollout.max_new_tokens", "eval.max_new_tokens")
    """Most new tokens per completion (`rollout.max_new_tokens`, `eval.max_new_tokens`)."""
    max_prompt_tokens: int = _cap(32768, "rollout.max_prompt_tokens")
    """Most prompt tokens kept (`rollout.max_prompt_tokens`)."""
    max_turns: int = _cap(100, "environment.max_turns")
    """Most assistant turns of an episode (`environment.max_turns`)."""
    max_total_tokens: int = _cap(131072, "environment.max_total_tokens")
    """Most tokens of an episode's whole sequence (`environment.max_total_tokens`)."""
    step_timeout_s: float = _cap(120.0, "environment.step_timeout_s")
    """Longest sandboxed environment call (`environment.step_timeout_s`)."""
    episode_timeout_s: float = _cap(3600.0, "environment.episode_timeout_s")
    """Longest episode (`environment.episode_timeout_s`)."""
    timeout_per_item_s: float = _cap(60.0, "reward.timeout_per_item_s")
    """Longest scoring of one completion (`reward.timeout_per_item_s`)."""
    memory_limit_mb: int = _cap(4096, "reward.memory_limit_mb", "environment.memory_limit_mb")
    """Largest address space of a sandboxed reward or environment worker (`reward.memory_limit_mb`,
    `environment.memory_limit_mb`)."""
    max_steps: int = _cap(10_000_000, "train.max_steps")
    """Most optimizer steps (`train.max_steps`); the default is the spec's own bound, as a soak job
    runs until it is cancelled."""
    epochs_per_step: int = _cap(16, "train.epochs_per_step")
    """Most passes over each step's batch (`train.epochs_per_step`)."""
    micro_batch_samples: int = _cap(1024, "train.micro_batch_samples")
    """Most sequences per forward/backward pass, the learner's activation memory
    (`train.micro_batch_samples`)."""
    max_staleness: int = _cap(64, "train.max_staleness")
    """Most policy versions of lag, which bounds the tasks in flight (`train.max_staleness`)."""
    keep_checkpoints: int = _cap(10, "train.keep_checkpoints")
    """Most checkpoints kept on disk (`train.keep_checkpoints`)."""
    keep_weight_versions: int = _cap(10, "train.keep_weight_versions")
    """Most full weight snapshots kept in the object store (`train.keep_weight_versions`)."""
    full_publish_interval: int = _cap(100, "train.full_publish_interval")
    """Most versions between full snapshots, the deltas kept beside them (`train.full_publish_interval`)."""
    timeout_per_step_s: float = _cap(3600.0, "train.timeout_per_step_s")
    """Longest a learner waits for one step's groups (`train.timeout_per_step_s`)."""
    task_ack_wait_s: float = _cap(600.0, "train.task_ack_wait_s")
    """Longest an actor may hold a task without progress (`train.task_ack_wait_s`)."""
    max_retries_per_episode: int = _cap(10, "train.max_retries_per_episode")
    """Most deliveries of a task (`train.max_retries_per_episode`)."""
    lora_rank: int = _cap(256, "train.lora.rank")
    """Largest LoRA rank (`train.lora.rank`)."""
    capacity_groups: int = _cap(100_000, "replay.capacity_groups")
    """Largest replay table, in groups (`replay.capacity_groups`)."""
    max_reuse: int = _cap(64, "replay.max_reuse")
    """Most times a group may be trained on (`replay.max_reuse`)."""
    lease_timeout_s: float = _cap(3600.0, "replay.lease_timeout_s")
    """Longest replay lease (`replay.lease_timeout_s`)."""
    eval_problems: int = _cap(10_000, "eval.problems")
    """Most eval prompts per evaluation (`eval.problems`)."""
    eval_samples: int = _cap(64, "eval.samples")
    """Most sampled completions per eval problem (`eval.samples`)."""
    sft_conversations_per_step: int = _cap(1024, "sft.conversations_per_step")
    """Most demonstration conversations per step of an sft job (`sft.conversations_per_step`)."""
    sft_max_seq_tokens: int = _cap(32768, "sft.max_seq_tokens")
    """Longest demonstration conversation, in tokens, an sft job may train on (`sft.max_seq_tokens`)."""


class TenantQuota(Strict):
    """What one tenant's jobs may take of the shared fleet."""

    weight: float = Field(1.0, gt=0, le=1000)
    """The tenant's share of actor time, relative to the other tenants' weights: an actor serving jobs of
    several tenants gives each tenant time in proportion to its weight (weighted fair queueing), split
    equally among that tenant's jobs. Recorded in each job at submission."""
    max_active_jobs: int = Field(1000, ge=1, le=100_000)
    """Jobs of the tenant queued or running at once; a submission beyond it is RESOURCE_EXHAUSTED naming
    this quota. Concurrent episodes per tenant are the reward service's `max_episodes_per_tenant`."""


class GatewaySettings(InfraSettings, TokenSettings, ModelAllowList):
    """How one gateway process runs."""

    listen: str = "127.0.0.1:50051"
    """gRPC listen address host:port (port 0: a free port)."""
    reward_addr: str = "127.0.0.1:50053"
    """RewardService address; SubmitJob asks it to check every reward spec."""
    reward_validate_timeout_s: float = Field(15.0, gt=0, le=600)
    """Deadline of one RewardService.Validate call."""
    tls_cert: Path | None = None
    """PEM certificate chain; with tls_key, the gateway serves TLS only."""
    tls_key: Path | None = None
    """PEM private key of tls_cert."""
    max_message_mb: float = Field(80.0, gt=0, le=2000)
    """Largest request gRPC accepts; larger ones are refused with RESOURCE_EXHAUSTED by gRPC itself."""
    max_prompts_mb: float = Field(64.0, gt=0, le=2000)
    """Largest prompt JSONL a submission may carry (RESOURCE_EXHAUSTED above)."""
    max_reward_file_kb: float = Field(1024.0, gt=0, le=1_000_000)
    """Largest reward file, and largest environment file, a submission may carry (RESOURCE_EXHAUSTED above)."""
    max_list_jobs: int = Field(1000, ge=1, le=100_000)
    """Cap on ListJobs' limit."""
    watch_poll_s: float = Field(0.25, gt=0, le=60)
    """How often a WatchJob stream re-reads the job and its steps."""
    download_chunk_kb: int = Field(1024, ge=1, le=32 * 1024)
    """Size of the FileChunks DownloadModel streams."""
    grace_s: float = Field(5.0, ge=0, le=600)
    """Seconds in-flight calls may finish after SIGTERM."""
    job_caps: JobCaps = Field(default_factory=JobCaps)
    """The cap on every resource size a submitter chooses."""
    retention_s: float | None = Field(None, gt=0, le=10 * 365 * 86400)
    """Finished jobs (succeeded, failed, cancelled) are deleted from every store (Redis, NATS, the run
    directory) this long after they ended; None keeps them until `fleetrl delete`."""
    tenant_quotas: dict[str, TenantQuota] = Field(default_factory=dict)
    """Each named tenant's weight and quotas (`[tenant_quotas.alice] weight = 2`)."""
    default_tenant_quota: TenantQuota = Field(default_factory=TenantQuota)
    """The weight and quotas of every tenant not named in `tenant_quotas`."""

    def quota(self, tenant: str) -> tuple[TenantQuota, str]:
        """The tenant's quota and the setting it comes from."""
        if tenant in self.tenant_quotas:
            return self.tenant_quotas[tenant], f"tenant_quotas.{tenant}"
        return self.default_tenant_quota, "default_tenant_quota"

    @model_validator(mode="after")
    def _tls_pair(self) -> GatewaySettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("set both tls_cert and tls_key, or neither")
        return self
