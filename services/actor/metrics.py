"""Prometheus metrics of an actor process (served on `metrics_port` when it is set)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TASKS = Counter("fleetrl_actor_tasks_total", "Tasks finished, by outcome (inserted, duplicate)", ["job", "outcome"])
NAKS = Counter("fleetrl_actor_task_naks_total", "Deliveries released for redelivery after a failure", ["job"])
DEAD_LETTERED = Counter("fleetrl_actor_dead_lettered_total", "Tasks moved to the dead-letter subject", ["job"])
WEIGHT_LOADS = Counter("fleetrl_actor_weight_loads_total", "Weight versions pulled and loaded", ["job"])
WEIGHTS_CORRUPT = Counter("fleetrl_actor_weights_corrupt_total", "Pulled weight objects rejected (sha256/size)",
                          ["job"])
POLICY_VERSION = Gauge("fleetrl_actor_policy_version", "Policy version held", ["job"])
GENERATED_TOKENS = Counter("fleetrl_actor_generated_tokens_total", "Completion tokens generated", ["job"])
STEP_SECONDS = Histogram("fleetrl_actor_step_seconds", "Seconds per task-loop step", ["step"])
