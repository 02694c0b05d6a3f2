"""`python -m fleetrl.services.replay` / `fleetrl replay`: run the ReplayService until SIGTERM or SIGINT."""

from __future__ import annotations

import sys

from fleetrl.runtime.entry import Flag, ServiceEntry, run_service
from fleetrl.services.replay.config import ENV_PREFIX, ReplaySettings
from fleetrl.services.replay.server import serve

ENTRY = ServiceEntry(
    "fleetrl replay", "Run the replay-buffer service.", ReplaySettings, ENV_PREFIX, flags=(
        Flag("--listen", "gRPC address host:port (default 127.0.0.1:50052)"),
        Flag("--redis-url", "Redis/Valkey URL"),
    ))


def main(argv: list[str] | None = None) -> int:
    return run_service(ENTRY, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
