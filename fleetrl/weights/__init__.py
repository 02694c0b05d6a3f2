"""Weights between the learner and the actors, over a swappable transport.

- `transport`: the `Transport` Protocol: a job's named payloads and its pointer, and nothing of what they mean.
- `channel`: `WeightChannel`, the rules over any transport: the pointer (compare-and-swap, never backwards,
  fenced by the job-lease epoch), publish (full snapshots, deltas, adapters), pull and `update` (digest
  checked), retention.
- `jetstream`: `NatsTransport`, NATS JetStream's object store and KV (imports no torch), with `chunk_reader`,
  the fast path that reads an object's chunks straight into one buffer; `store`: `WeightStore`, the channel
  over it.
- `filesystem`: `FilesystemTransport`, a directory per job (one box or a shared volume).
- `factory`: the transport the services' `weights_dir` setting picks (unset: NATS).
- `delta`: the delta codec; `adapters`: a LoRA job's adapter tensors and their merge on an actor.
- `publish`: `WeightPublisher`, the learner's side (when and what to publish).

The learner's trainer wires a publisher and the actor's `rollout.job_policy` pulls, each through a
`WeightChannel`; the services build it over `factory.transport`, through which the gateway's retention also
deletes a job's weights (`Transport.purge`).
"""
