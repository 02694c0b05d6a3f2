"""`python -m services.replay` / `fleetrl replay`: run the ReplayService until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from services.common.config import load_settings
from services.common.errors import FleetError
from services.replay.config import ENV_PREFIX, ReplaySettings
from services.replay.server import serve


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleetrl replay", description="Run the replay-buffer service.")
    parser.add_argument("--listen", help="gRPC address host:port (default 127.0.0.1:50052)")
    parser.add_argument("--redis-url", help="Redis/Valkey URL")
    parser.add_argument("--config", type=Path, help="TOML file of ReplaySettings")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> ReplaySettings:
    overrides = list(args.set)
    if args.listen:
        overrides.append(f"listen={args.listen}")
    if args.redis_url:
        overrides.append(f"redis_url={args.redis_url}")
    return load_settings(ReplaySettings, env_prefix=ENV_PREFIX, toml_path=args.config, overrides=overrides)


async def run(settings: ReplaySettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(settings, stop)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = settings_from(args)
    except FleetError as error:
        print(f"fleetrl replay: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(run(settings))
    except FleetError as error:
        print(f"fleetrl replay: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
