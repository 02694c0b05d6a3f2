"""The process shells of fleetrl, installed as `fleetrl.services` (never as a top-level `services`).

One package per service (gateway, actor, reward, replay, learner), each wiring only: its settings,
its gRPC servicer and proto conversion, and its `__main__` (`fleetrl <name>`). The domain lives in the
`fleetrl` library; no service imports another (import-linter contracts in pyproject.toml).
"""
