"""Process plumbing every service shares; nothing here knows a model, a task or a job's data.

- `entry`: `run_service`, the one process entry (arguments, settings, logging, signals, exit codes).
- `grpcutil`: servers (health, reflection, one error mapping), channels with deadlines, `RetryPolicy`.
- `observe`: the interceptor that traces and counts every gRPC call; `/metrics`.
- `telemetry`: OpenTelemetry tracing, context across NATS headers and gRPC metadata.
- `heartbeat`: fleet members' heartbeats in Redis (what `fleetrl top` lists).
- `heap`: glibc's mmap threshold; `healthcheck`: the gRPC health probe; `protogen`: the stubs in
  `fleetrl.proto`.

The service shells wire these around the library's components.
"""
