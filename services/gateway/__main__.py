"""`python -m fleetrl.services.gateway` / `fleetrl gateway`: run the JobService until SIGTERM or SIGINT.

Start-up problems end the process with one line on stderr and no traceback: exit 2 for bad
settings (an unreadable or broken --config, tokens or TLS file, an address it cannot listen on),
exit 1 for anything else (NATS unreachable, a taken metrics port).

`fleetrl gateway hash-token TOKEN` prints the sha256 digest to put in the `tokens` setting.
"""

from __future__ import annotations

import sys

from fleetrl.runtime.entry import Flag, ServiceEntry, run_service
from fleetrl.services.gateway.auth import hash_token
from fleetrl.services.gateway.config import ENV_PREFIX, GatewaySettings
from fleetrl.services.gateway.server import serve

ENTRY = ServiceEntry(
    "fleetrl gateway", "Run the job gateway (or: fleetrl gateway hash-token TOKEN).", GatewaySettings, ENV_PREFIX,
    flags=(
        Flag("--listen", "gRPC address host:port (default 127.0.0.1:50051)"),
        Flag("--redis-url", "Redis/Valkey URL"),
        Flag("--nats-url", "NATS URL(s), comma-separated"),
        Flag("--reward-addr", "RewardService address host:port"),
        Flag("--open-mode", "no authentication (single-user machines only)", store_true=True),
    ))
parse_args, settings_from = ENTRY.parse_args, ENTRY.settings_from


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hash-token"]:
        if len(argv) != 2:
            print("usage: fleetrl gateway hash-token TOKEN", file=sys.stderr)
            return 2
        print(hash_token(argv[1]))
        return 0
    return run_service(ENTRY, serve, argv, check=GatewaySettings.token_table)


if __name__ == "__main__":
    sys.exit(main())
