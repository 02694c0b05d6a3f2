"""The replay service: `fleetrl replay`, the replay tables (`fleetrl.replay.table`) over gRPC.

- `server`: the thin gRPC servicer, Prometheus metrics and the process lifecycle (`running`/`serve`),
  which wires Redis, the tables, the servicer and the lease-reclaim task.
- `convert`: request validation and proto <-> domain conversion.
- `config`: `ReplaySettings` (environment prefix FLEETRL_REPLAY_); `__main__` the entry point.

Durability is Redis's: with `appendonly yes` + `appendfsync always` an acknowledged
insert survives a kill -9 of Redis; with `everysec` up to about the last second
(at most ~2 s) of acknowledged writes can be lost; with AOF off everything since
the last RDB snapshot. The service itself holds no state, so killing it loses nothing.
"""
