"""The domain values of the Tinker API: what a request asks for and what its result holds, free of HTTP.

services/tinker converts the SDK's JSON and protobuf bodies into these and back (its convert.py);
the library's service, training runs and samplers see only these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Datum:
    """One training example: input tokens and the loss function's per-token inputs."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]
    """loss_fn_inputs by name, each 1-D, as long as `tokens` (`target_tokens` int64, the rest float32)."""


@dataclass(frozen=True)
class LoraRequest:
    """What create_model asks for (the SDK's LoraConfig)."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class AdamParams:
    """One optim_step's hyperparameters (the SDK's AdamParams, its defaults)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    """0: no clipping."""


@dataclass(frozen=True)
class SampleParams:
    """One sample request."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop_tokens: frozenset[int] | None
    """None: the model's end-of-sequence tokens; empty: none (sample max_tokens)."""
    prompt_logprobs: bool


@dataclass(frozen=True)
class Sequence:
    """One sampled sequence."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    """True when a stop token ended it, False when max_tokens did."""


@dataclass(frozen=True)
class SampleResult:
    """The sequences of one sample request, and the prompt's log-probs when asked (NaN first)."""

    sequences: list[Sequence]
    prompt_logprobs: list[float] | None = None


@dataclass(frozen=True)
class ForwardResult:
    """A forward or forward_backward result: each datum's target log-probs and the loss's metrics."""

    logprobs: list[np.ndarray]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SessionSummary:
    """A live session as `GET /api/v1/sessions` lists it to its tenant (and `fleetrl top` shows it)."""

    session_id: str
    tenant: str
    state: str
    """`working` while a request of the session is queued or running, else `idle`."""
    base_models: tuple[str, ...]
    """Of its training runs and sampling sessions, sorted."""
    lora_ranks: tuple[int, ...]
    """Of its training runs, sorted."""
    training_runs: int
    sampling_sessions: int
    optim_steps: int
    """optim_steps applied, summed over its training runs."""
    last_request_age_s: float
    """Seconds since the session's last request (creation, or any call naming it, its runs or its
    sampling sessions; heartbeats and future polls do not count)."""


@dataclass(frozen=True)
class TenantLoad:
    """What one tenant holds on the Tinker service now: the operator's view (services/tinker's /metrics),
    which no tenant-facing call returns."""

    tenant: str
    sessions: int
    """Live sessions, as `max_sessions_per_tenant` counts them."""
    training_runs: int
    """Training runs created or queued for creation, as `max_training_runs_per_tenant` counts them."""
    sampling_sessions: int
    requests_queued: int
    requests_running: int
    optim_steps: int
    """optim_steps applied, summed over its training runs."""
    adapter_bytes: int
    """Bytes of its own tensors: its runs' adapters, gradients and optimizer moments, and its sampling
    sessions' saved adapters (the base models are shared by every tenant's runs and not counted)."""
    last_request_age_s: float | None
    """Seconds since the last request of any of its live sessions; None: it holds no session."""
