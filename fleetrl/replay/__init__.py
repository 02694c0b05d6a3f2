"""The replay buffer: rollout groups between actors and the learner, stored in Redis.

- `table`: the domain core (`ReplayTables`, `TableConfig` with sampler strategies and Reverb-like
  named factories). Imports no grpc.
- `scripts`: the Lua scripts that make each insert, sample, commit and release atomic.
- `wire`: zero-copy protobuf handling of the two hot RPCs, Insert and Sample.
- `client`: `ReplayClient`, which actors and the learner use.

The replay service (`fleetrl.services.replay`) serves the tables over gRPC.
"""
