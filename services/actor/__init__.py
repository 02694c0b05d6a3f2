"""The actor service: `fleetrl actor`, rollout workers that turn tasks into scored groups in replay.

- `service`: `Actor`, the process: which jobs to serve, their models and task queues, the main loop
  that hands each queue's delivery to a `fleetrl.rollout.Rollout`, heartbeats and SIGTERM.
- `__main__`: the entry point.

Its settings are `fleetrl.rollout.settings.ActorSettings`.
"""
