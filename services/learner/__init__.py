"""The learner service: `fleetrl learner`, claims a job, trains it, repeats.

- `service`: the process: claims a job (lease in Redis, renewed), runs a `fleetrl.train.trainer.JobRun`,
  marks failures, releases the lease.
- `server`, `convert`: the read-only LearnerService.GetStatus over the status board.
- `ddp`: torchrun data parallelism (rank 0 serves, other ranks follow each step).
- `__main__`: the entry point.

Its settings are `fleetrl.train.settings.LearnerSettings`.
"""
