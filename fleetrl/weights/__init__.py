"""Weights between the learner and the actors, over NATS JetStream.

- `store`: `WeightStore`: the pointer (KV, compare-and-swap, never backwards, fenced by the job-lease
  epoch), publish (full snapshots, deltas, adapters), pull and `update` (digest checked), retention.
- `chunk_reader`: the fast path that reads an object's chunks straight into one buffer.
- `delta`: the delta codec; `adapters`: a LoRA job's adapter tensors and their merge on an actor.
- `publish`: `WeightPublisher`, the learner's side (when and what to publish).

The learner's trainer wires a publisher; an actor's `rollout.job_policy` pulls.
"""
