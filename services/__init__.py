"""fleetrl: reinforcement learning for language models on a fleet of services.

One package per service (gateway, actor, reward, replay, learner); they share
nothing but the generated protos in `services.proto` and the kernel in
`services.common`.
"""

__version__ = "0.1.0"  # the only place it is written: pyproject.toml reads it from here
