"""The replay-buffer service: rollout groups between actors and the learner, stored in Redis.

Components:
- `table`: the domain core (`ReplayTables`, `TableConfig` with sampler strategies and
  Reverb-like named factories). Imports no grpc.
- `scripts`: the Lua scripts that make each insert, sample, commit and release atomic.
- `convert`: request validation and proto <-> domain conversion.
- `server`: the thin gRPC servicer, Prometheus metrics and the process lifecycle
  (`running`/`serve`), which wires Redis, the tables, the servicer and the lease-reclaim task.
- `client`: `ReplayClient`, the async client actors and the learner use.
- `config`: `ReplaySettings` (environment prefix FLEETRL_REPLAY_).

`__main__.main` builds the settings and calls `server.serve`; components do not
reference each other beyond that chain.

Durability is Redis's: with `appendonly yes` + `appendfsync always` an acknowledged
insert survives a kill -9 of Redis; with `everysec` up to about the last second
(at most ~2 s) of acknowledged writes can be lost; with AOF off everything since
the last RDB snapshot. The service itself holds no state, so killing it loses nothing.
"""
