"""The job spec and every setting, in one home.

- `config`: strict pydantic models: `JobSpec` (reward or environment, algorithm, optim, rollout, train,
  replay, eval) and `InfraSettings` (what every service's settings extend), the loading rules (TOML,
  `FLEETRL_` environment, `--set`) and the one prompt-file reader.
- `seeding`: the seeding rules every process follows (the feeder's prompt order, an actor's sampler
  seed), so a run reproduces across services.

Imports no torch: validating a spec or printing `--help` is instant.
"""
