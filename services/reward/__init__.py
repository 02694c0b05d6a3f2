"""The reward service: `fleetrl reward`, `fleetrl.reward`'s scorer and episode sessions over gRPC.

- `server` + `convert`: the thin gRPC adapter (Score, Validate, Describe, OpenEpisodes, StepEpisodes,
  CloseEpisodes) and the process lifecycle (the reaper of idle pools and abandoned sessions).
- `__main__`: the entry point.

Its settings are `fleetrl.reward.settings.RewardSettings`.
"""
