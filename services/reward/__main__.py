"""`python -m fleetrl.services.reward` / `fleetrl reward`: run the RewardService until SIGTERM or SIGINT."""

from __future__ import annotations

import sys

from fleetrl.reward.settings import ENV_PREFIX, RewardSettings
from fleetrl.runtime.entry import Flag, ServiceEntry, run_service
from fleetrl.services.reward.server import serve

ENTRY = ServiceEntry(
    "fleetrl reward", "Run the reward service.", RewardSettings, ENV_PREFIX, flags=(
        Flag("--listen", "gRPC address host:port (default 127.0.0.1:50053)"),
        Flag("--workers", "sandboxed workers per reward spec", key="workers_per_pool", type=int),
    ))


def main(argv: list[str] | None = None) -> int:
    return run_service(ENTRY, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
