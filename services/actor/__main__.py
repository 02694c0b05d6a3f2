"""`python -m fleetrl.services.actor` / `fleetrl actor`: run one actor replica until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import sys

from fleetrl.rollout.settings import ENV_PREFIX, ActorSettings
from fleetrl.runtime.entry import Flag, ServiceEntry, run_service

ENTRY = ServiceEntry(
    "fleetrl actor", "Run one actor (rollout worker).", ActorSettings, ENV_PREFIX, flags=(
        Flag("--actor-id", "id of this replica in lineage (default host-pid-random)"),
        Flag("--nats-url", "NATS server URL(s)"),
        Flag("--redis-url", "Redis/Valkey URL"),
        Flag("--replay-addr", "ReplayService host:port"),
        Flag("--reward-addr", "RewardService host:port"),
    ))
parse_args, settings_from = ENTRY.parse_args, ENTRY.settings_from


async def serve(settings: ActorSettings, stop: asyncio.Event) -> None:
    from fleetrl.services.actor.service import Actor  # imports torch: after argument checks

    await Actor(settings).run(stop)


def main(argv: list[str] | None = None) -> int:
    return run_service(ENTRY, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
