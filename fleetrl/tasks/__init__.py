"""The task lifecycle: from the prompt file to a trained, dropped or dead-lettered task.

- `bus`: every NATS name (streams, subjects, consumers, buckets), the connection and idempotent set-up.
- `feeder`: the prompt file to tasks on JetStream, bounded by staleness; its cursor is checkpointed.
- `jobbus`: the learner's NATS calls for one job (tasks out, dead letters and events).
- `queue`: `JobQueue`, an actor's share of a job's task consumer (fetch, in-progress, ack, nak,
  dead-letter), knowing nothing of models.
- `ledger`: what became of every published task, joined across Redis and JetStream.

The learner's trainer wires the feeder and the job bus; an actor wires a queue per served job.
"""
