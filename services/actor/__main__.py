"""`python -m services.actor` / `fleetrl actor`: run one actor replica until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from services.actor.config import ENV_PREFIX, ActorSettings
from services.common.config import load_settings
from services.common.errors import FleetError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleetrl actor", description="Run one actor (rollout worker).")
    parser.add_argument("--config", type=Path, help="TOML file of ActorSettings")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    parser.add_argument("--actor-id", help="id of this replica in lineage (default host-pid-random)")
    parser.add_argument("--nats-url", help="NATS server URL(s)")
    parser.add_argument("--redis-url", help="Redis/Valkey URL")
    parser.add_argument("--replay-addr", help="ReplayService host:port")
    parser.add_argument("--reward-addr", help="RewardService host:port")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> ActorSettings:
    overrides = list(args.set)
    for flag in ("actor_id", "nats_url", "redis_url", "replay_addr", "reward_addr"):
        value = getattr(args, flag)
        if value:
            overrides.append(f"{flag}={value}")
    return load_settings(ActorSettings, env_prefix=ENV_PREFIX, toml_path=args.config, overrides=overrides)


async def run(settings: ActorSettings) -> None:
    from services.actor.service import Actor  # imports torch: after argument checks

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await Actor(settings).run(stop)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = settings_from(args)
    except FleetError as error:
        print(f"fleetrl actor: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)
    try:
        asyncio.run(run(settings))
    except FleetError as error:
        print(f"fleetrl actor: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
