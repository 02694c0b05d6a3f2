"""Settings of the Tinker API service (environment prefix FLEETRL_TINKER_).

Its tokens are the gateway's (`TokenSettings`: one tenant token works on both; the SDK sends it as
its API key, which it insists starts with `tml-`), and so is its model allow-list (`ModelAllowList`).
Auth is closed by default: no tokens and `open_mode = false` refuses to start.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleetrl.policy.models import ModelAllowList
from fleetrl.runtime.tokens import TokenSettings
from fleetrl.spec.config import InfraSettings

ENV_PREFIX = "FLEETRL_TINKER_"


class TinkerSettings(InfraSettings, TokenSettings, ModelAllowList):
    """How one Tinker API process runs. Checkpoints go under `run_dir`/tinker."""

    listen: str = "127.0.0.1:8090"
    """HTTP listen address host:port (port 0: a free port); the SDK's base_url is http://host:port."""
    max_lora_rank: int = Field(256, ge=1, le=1024)
    """Largest LoRA rank create_lora_training_client may ask for."""
    max_sample_tokens: int = Field(4096, ge=1, le=131072)
    """Largest max_tokens of one sample request."""
    max_num_samples: int = Field(128, ge=1, le=4096)
    """Most sequences one sample request may ask for."""
    max_sessions_per_tenant: int = Field(64, ge=1, le=100_000)
    """Live sessions (ServiceClients not closed, nor reaped after `session_idle_s`) one tenant may hold;
    one more is refused with 429 and `x-should-retry: false` (the SDK raises RateLimitError at once)."""
    max_training_runs_per_tenant: int = Field(8, ge=1, le=10_000)
    """Training runs one tenant may hold, created or queued, over all its sessions: each holds its adapter
    and its optimizer state in this process (or on a learner, with training = "fleet"). One more is refused as
    `max_sessions_per_tenant` is; closing a session frees its runs."""
    max_request_mb: float = Field(256.0, gt=0, le=4096)
    """Largest request body (a forward_backward chunk); larger ones are refused with 413."""
    poll_s: float = Field(10.0, gt=0, le=40)
    """How long a retrieve_future call waits for its result before answering try_again (the SDK waits
    45 s for an answer and polls again at once)."""
    session_idle_s: float = Field(300.0, ge=30, le=7 * 86400)
    """A session with no heartbeat for this long (the SDK sends one every 10 s while its client lives) is
    finished: its training runs and sampling sessions are freed; its checkpoints stay on disk."""
    keep_requests_per_scope: int = Field(4096, ge=16, le=1_000_000)
    """Request ids (and results) kept per training run or sampling session; an older one is refused,
    never run again."""
    torch_threads: int = Field(0, ge=0, le=1024)
    """torch intra-op threads, set with torch.set_num_threads at start (0: torch's default, one per
    core). On a machine shared with other work, 1 avoids OpenMP's spinning threads fighting for the
    cores (a SmolLM2 forward of 40 tokens: 0.3 s with 1 thread, 4-8 s with 2 on 2 busy cores)."""
    sampling: Literal["local", "fleet"] = "local"
    """Where `sample` and `compute_logprobs` run. "local": in this process, one sampler per base model.
    "fleet": on the fleet's actors (those with the base among their `tinker_models`), through NATS
    (`nats_url`): each sampler version's adapter is published to the weight store and each request is
    served by any such actor, redelivered to another when its actor dies."""
    training: Literal["local", "fleet"] = "local"
    """Where training runs live. "local": in this process, their base shared. "fleet": each on one of the
    fleet's learners (those with the base among their `tinker_models`), driven through NATS (`nats_url`), its
    base shared with the learner's LoRA jobs; a run whose learner dies is restored on another from its newest
    save_state checkpoint, and its next call fails saying so (docs/tinker.md)."""
    train_timeout_s: float = Field(300.0, gt=0, le=3600)
    """With training = "fleet": a call to a run's learner not answered within this many seconds (or whose
    learner is gone: pings every 2 s) counts the learner as lost, and the run is restored on another."""
    sample_timeout_s: float = Field(300.0, gt=0, le=3600)
    """With sampling = "fleet": a sample request not answered by an actor within this many seconds fails
    (the SDK's RequestFailedError), and an actor that receives it later drops it unserved."""
    sampler_versions_kept: int = Field(8, ge=1, le=1000)
    """With sampling = "fleet": the newest sampler versions the weight store keeps of each training run (and
    of each checkpoint loaded by path); a sampling client on an older one gets an error naming it."""
    grace_s: float = Field(5.0, ge=0, le=600)
    """Seconds in-flight HTTP requests may finish after SIGTERM."""
