"""The Python client users script the fleet with (`from fleetrl import Client`).

- `client`: the synchronous `Client` of the gateway's JobService (submit, watch, cancel, download).
- `records`: the plain dataclasses it returns (`JobInfo`, `StepInfo`, ...), no protobuf.
- `convert`: protos to those records, and the numbering both sides of the wire share.
- `sweep`: hyperparameter sweeps submitted as jobs that share the fleet.
"""
