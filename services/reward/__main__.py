"""`python -m services.reward` / `fleetrl reward`: run the RewardService until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from services.common.config import load_settings
from services.common.errors import FleetError
from services.reward.config import ENV_PREFIX, RewardSettings
from services.reward.server import serve


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleetrl reward", description="Run the reward service.")
    parser.add_argument("--listen", help="gRPC address host:port (default 127.0.0.1:50053)")
    parser.add_argument("--workers", type=int, help="sandboxed workers per reward spec")
    parser.add_argument("--config", type=Path, help="TOML file of RewardSettings")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> RewardSettings:
    overrides = list(args.set)
    if args.listen:
        overrides.append(f"listen={args.listen}")
    if args.workers:
        overrides.append(f"workers_per_pool={args.workers}")
    return load_settings(RewardSettings, env_prefix=ENV_PREFIX, toml_path=args.config, overrides=overrides)


async def run(settings: RewardSettings) -> None:
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
        print(f"fleetrl reward: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(run(settings))
    except FleetError as error:
        print(f"fleetrl reward: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
