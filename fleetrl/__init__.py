"""fleetrl: reinforcement learning for language models on a fleet of independent services.

The library users import. One package per concept, each testable in one process:

- `spec`: the job spec and every setting (`JobSpec`, `InfraSettings`), seeding rules.
- `policy`: loading models and tokenizers, generation backends, chat templates, log-probs, LoRA.
- `weights`: the weight store (pointer, publish, pull, deltas, adapters) over NATS JetStream.
- `tasks`: the task lifecycle: feeder, the actors' queue, NATS subjects, the ledger, dead letters.
- `rollout`: an actor's rollouts: single-turn groups and multi-turn episodes, the policy it holds.
- `env`: the `Env` and `ToolEnv` bases environment files subclass, and tool use.
- `reward`: built-in verifiers, scoring, the sandbox user code runs in, and the reward client.
- `replay`: the replay table (Redis scripts, samplers) and its client.
- `train`: the learner's step: batches, losses, critic, optimizer, checkpoints, the reference loop.
- `eval`: pass@k, held-out evaluation while training, the demo's addition check.
- `jobs`: the job store in Redis; `runtime`: process plumbing every service shares (entry, gRPC,
  telemetry, heartbeats); `errors`: the one exception root; `proto`: the generated gRPC stubs.
- `sdk`: the Python client (`Client`) and sweeps.

The process shells (`fleetrl.services.<name>`: settings wiring, gRPC servicer, main) and the launcher
(`fleetrl.launcher`: `fleetrl up`, `demo`, `top`, the CLI) import the library; the library imports
neither (checked by import-linter's contracts in pyproject.toml).

This module imports nothing but the standard library: it is imported inside the reward sandbox, and
`Client` and `JobSpec` load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"  # the only place it is written: pyproject.toml reads it from here

if TYPE_CHECKING:
    from fleetrl.sdk.client import Client
    from fleetrl.spec.config import JobSpec

__all__ = ["Client", "JobSpec", "__version__"]

_LAZY = {"Client": "fleetrl.sdk.client", "JobSpec": "fleetrl.spec.config"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fleetrl' has no attribute {name!r}")
