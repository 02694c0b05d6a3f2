"""An actor's work: a task's group from a job's policy, scored, stored in replay.

- `rollout`: `Rollout` (ensure weights, generate, score or play episodes, build the group, insert);
  nothing of NATS.
- `episodes`: `EpisodeRunner`, a multi-turn group as n episodes against the reward service's sessions.
- `job_policy`: `JobPolicy`, a job's backend and the weight version it holds, moved only forward.
- `metrics`: the actor's Prometheus metrics and `Activity`; `settings`: `ActorSettings`.

The actor service (`fleetrl.services.actor`) wires a rollout to each served job's task queue.
"""
