"""The learner's training: one job, from its first step to its exported model.

Components (none references another; `trainer.JobRun` wires them in `setup()` and drives them from
`run()`):
- `trained_policy`: a job's model, optimizer and scheduler (and DDP replica); one step is
  `optim.train_step`.
- `losses`, `off_policy`, `batch`, `optim`, `critic`: the algorithms as pure functions of tensors (the
  off-policy corrections of the actor/learner mismatch beside them), padded or packed batches, AdamW
  and its schedule, PPO's critic.
- `reference`: the whole algorithm in one process (documentation and numerical cross-check).
- `leases`: replay leases between a step and the checkpoint that makes it durable (exactly-once).
- `checkpoint`: durable checkpoints, resume, pruning; `export`: metrics JSONL and the final model;
  `files`: writing them so that a full disk is named (`NoSpace`); `full_stores`: a full disk or
  JetStream waited out with the job paused.
- `observability`, `status`: the step's metrics and spans, and the status board.
- `settings`: `LearnerSettings`.

The learner service (`fleetrl.services.learner`) claims jobs and runs a `JobRun` for each.
"""
