"""The gateway: `fleetrl gateway`, how users submit, watch and cancel jobs (gRPC JobService).

Components (none references another's internals; `server.serve` wires them):
- `config`: GatewaySettings (environment prefix FLEETRL_GATEWAY_), with the operator's model
  allow-list and JobCaps, the cap on every resource size a submitter chooses.
- `checks`: the submission checks that need no other service, the allow-list and the caps among them.
- `auth`: bearer-token table (sha256 hashes at rest) and the interceptor that puts the caller's
  tenant on each call; health and reflection are exempt.
- `service`: the domain core (no grpc): submission checks, tenant scoping, the job state machine
  through `fleetrl.jobs.store.JobStore`, watch streams and model downloads.
- `adapters`: what the core calls outside the job store: the reward service's Validate, the JetStream
  task purge, the job event subject, and the fleet view (heartbeats in Redis, queue depths).
- `convert` + `server`: the thin gRPC adapter and the process lifecycle; `__main__` the entry point.

Its client is `fleetrl.sdk.client.Client`; the job commands are `fleetrl.launcher.jobs_cli`.
"""
