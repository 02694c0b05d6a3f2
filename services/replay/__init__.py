"""The replay service: `fleetrl replay`, the replay tables (`fleetrl.replay.table`) over gRPC.

- `server`: the thin gRPC servicer, Prometheus metrics and the process lifecycle (`running`/`serve`),
  which wires Redis, the tables, the servicer and the lease-reclaim task.
- `convert`: request validation and proto <-> domain conversion.
- `config`: `ReplaySettings` (environment prefix FLEETRL_REPLAY_); `__main__` the entry point.

Durability: an Insert is answered only once Redis has fsynced it to its AOF (`WAITAOF`,
`insert_fsync_timeout_s`), so a kill -9 of Redis or of the machine loses no acknowledged group under
`appendfsync always` or `everysec`; other writes are as durable as the policy (docs/guarantees.md).
The service itself holds no state, so killing it loses nothing.
"""
