"""The actor service: rollout workers that turn tasks into scored groups in replay.

Components: `backends` (the inference Protocol, the HF sampler, the factory; `vllm_backend` for vLLM),
`policy.JobPolicy` (a job's backend and the weight version it holds, moved only forward),
`worker.TaskLoop` (fetch -> ensure_weights -> generate -> score -> insert -> ack, dead-lettering),
`clients` (reward gRPC client). Components don't reference each other's wiring: `service.Actor`
wires them per served job and drives them from its main loop; `__main__` is the process entry point.
"""
