"""The shared kernel every fleetrl service imports.

- `config`: strict pydantic models for the JobSpec and per-service settings.
- `errors`: the exception root and its one mapping to gRPC status codes.
- `bus`: NATS connection, JetStream streams/consumers/KV/object stores, subject names.
- `jobs`: the job store in Redis (records, prompt and reward files, events).
- `weights`: publishing and pulling policy weights through JetStream.
- `models`: loading policies and tokenizers; export as an HF directory.
- `grpcutil`: server start-up (health, reflection, error mapping), channels and `RetryPolicy`.
- `entry`: `run_service`, the one process entry of every service (arguments, settings, signals, exit codes).
- `telemetry`: OpenTelemetry set-up, W3C context over NATS headers and gRPC metadata.
- `observe`: the gRPC server interceptor that traces and counts every call; /metrics serving.
- `heartbeat`: members' heartbeats in Redis (what `fleetrl top` lists).

Nothing here imports a service package; services import from here.
"""
