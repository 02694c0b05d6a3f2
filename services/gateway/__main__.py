"""`python -m services.gateway` / `fleetrl gateway`: run the JobService until SIGTERM or SIGINT.

Start-up problems end the process with one line on stderr and no traceback: exit 2 for bad
settings (an unreadable or broken --config, tokens or TLS file, an address it cannot listen on),
exit 1 for anything else (NATS unreachable, a taken metrics port).

`fleetrl gateway hash-token TOKEN` prints the sha256 digest to put in the `tokens` setting.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from services.common.config import load_settings
from services.common.errors import ConfigError, FleetError
from services.gateway.auth import hash_token
from services.gateway.config import ENV_PREFIX, GatewaySettings
from services.gateway.server import serve


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fleetrl gateway", description="Run the job gateway (or: fleetrl gateway hash-token TOKEN).")
    parser.add_argument("--listen", help="gRPC address host:port (default 127.0.0.1:50051)")
    parser.add_argument("--redis-url", help="Redis/Valkey URL")
    parser.add_argument("--nats-url", help="NATS URL(s), comma-separated")
    parser.add_argument("--reward-addr", help="RewardService address host:port")
    parser.add_argument("--open-mode", action="store_true", help="no authentication (single-user machines only)")
    parser.add_argument("--config", type=Path, help="TOML file of GatewaySettings")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> GatewaySettings:
    overrides = list(args.set)
    for name in ("listen", "redis_url", "nats_url", "reward_addr"):
        if getattr(args, name):
            overrides.append(f'{name}="{getattr(args, name)}"')
    if args.open_mode:
        overrides.append("open_mode=true")
    return load_settings(GatewaySettings, env_prefix=ENV_PREFIX, toml_path=args.config, overrides=overrides)


async def run(settings: GatewaySettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(settings, stop)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hash-token"]:
        if len(argv) != 2:
            print("usage: fleetrl gateway hash-token TOKEN", file=sys.stderr)
            return 2
        print(hash_token(argv[1]))
        return 0
    args = parse_args(argv)
    try:
        settings = settings_from(args)
        settings.token_table()
    except (FleetError, OSError) as error:
        print(f"fleetrl gateway: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(run(settings))
    except ConfigError as error:
        print(f"fleetrl gateway: {error}", file=sys.stderr)
        return 2
    except (FleetError, OSError) as error:  # OSError: e.g. the metrics port is taken
        print(f"fleetrl gateway: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
