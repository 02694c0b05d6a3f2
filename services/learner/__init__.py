"""The learner: claims a job, trains the policy on replay groups, publishes weights, checkpoints.

Components (none references another; `trainer.JobRun` wires them in `setup()` and drives them
from `run()`, and `service.serve` owns the process resources and the claim loop):
- `feeder`: prompt JSONL -> tasks on JetStream, in-flight bound by max_staleness; cursor.
- `jobbus`: the learner's only NATS calls for a job (task consumer set-up, task publishing, purge on
  cancel, dead-letter count, step and state events).
- `trained_policy`: model, optimizer, scheduler (and DDP replica) of a job; one step = `optim.train_step`
  (`Policy.step` gives each data-parallel rank its share).
- `lora`: LoRA adapters on a frozen base (`train.lora`): the reference without a second copy, the
  merged weights to publish and export, adapter-only checkpoints.
- `losses`, `batch`, `optim`: the algorithms (pure functions of tensors, one train_step).
- `reference`: the single-process reference loop (documentation and numerical cross-check).
- `leases`: replay leases between a step and the checkpoint that makes it durable (exactly-once).
- `checkpoint`: durable checkpoints (temp dir, fsync, rename, COMPLETE marker), resume, pruning.
- `publish`: weights every publish_interval steps to the job's object store (version == step), as
  full snapshots or deltas (`train.full_publish_interval`).
- `export`: metrics JSONL and the final HF model directory (and a LoRA job's adapter directory).
- `status`, `convert`, `server`: the read-only LearnerService.GetStatus.
- `ddp`: torchrun data parallelism (rank 0 serves, other ranks follow each step).
- `config`: LearnerSettings (environment prefix FLEETRL_LEARNER_).
"""
