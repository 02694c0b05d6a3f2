"""`python -m fleetrl.services.tinker` / `fleetrl tinker`: serve the Tinker API until SIGTERM or SIGINT.

Start-up problems end the process with one line on stderr and no traceback: exit 2 for bad
settings (no tokens outside open mode, an address it cannot listen on), exit 1 for anything else.
"""

from __future__ import annotations

import sys

from fleetrl.runtime.entry import Flag, ServiceEntry, run_service
from fleetrl.services.tinker.config import ENV_PREFIX, TinkerSettings
from fleetrl.services.tinker.server import serve

ENTRY = ServiceEntry(
    "fleetrl tinker", "Serve the Tinker-compatible training API (HTTP).", TinkerSettings, ENV_PREFIX,
    flags=(
        Flag("--listen", "HTTP address host:port (default 127.0.0.1:8090)"),
        Flag("--run-dir", "directory for checkpoints (under tinker/)"),
        Flag("--open-mode", "no authentication (single-user machines only)", store_true=True),
    ))


def main(argv: list[str] | None = None) -> int:
    return run_service(ENTRY, serve, argv, check=TinkerSettings.token_table)


if __name__ == "__main__":
    sys.exit(main())
