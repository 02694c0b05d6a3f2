"""The actor service: rollout workers that turn tasks into scored groups in replay.

Components: `backends` (the inference Protocol, the HF sampler, the factory; `vllm_backend` for vLLM),
`job_policy.JobPolicy` (a job's backend and the weight version it holds, moved only forward),
`taskqueue.JobQueue` (JetStream only: fetch, in-progress beats, ack, nak with delay, dead-letter),
`rollout.Rollout` (no NATS: ensure_weights -> generate -> score -> build the group -> insert),
the reward and replay clients (`services.reward.client`, `services.replay.client`).
Components don't reference each other's wiring: `service.Actor`
wires them per served job (`service.take_one` hands a queue's delivery to the rollout) and drives
them from its main loop; `__main__` is the process entry point.
"""
