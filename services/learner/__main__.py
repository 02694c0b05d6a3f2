"""`python -m fleetrl.services.learner` / `fleetrl learner`: claim jobs and train them until SIGTERM.

Under `torchrun --nproc_per_node N -m fleetrl.services.learner ...` rank 0 runs the service (feeder,
replay, publishing, checkpoints) and the other ranks follow it step by step (see `ddp`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from fleetrl.runtime.entry import Flag, ServiceEntry, run_service, until_signal
from fleetrl.train.settings import ENV_PREFIX, LearnerSettings


def add_once(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true", help="run one job, then exit")


ENTRY = ServiceEntry(
    "fleetrl learner", "Run a learner: claim jobs and train them.", LearnerSettings, ENV_PREFIX, flags=(
        Flag("--nats-url", "NATS server URL(s)"),
        Flag("--redis-url", "Redis/Valkey URL"),
        Flag("--replay-addr", "ReplayService host:port"),
        Flag("--run-dir", "directory for checkpoints, exports and metrics"),
    ), extra=add_once)
parse_args, settings_from = ENTRY.parse_args, ENTRY.settings_from


async def run(settings: LearnerSettings, once: bool) -> None:
    """Serve until SIGTERM or SIGINT (once: until the first job ends)."""
    from fleetrl.services.learner.service import serve  # imports torch: after argument checks

    await until_signal(lambda stop: serve(settings, stop, once=once))


def main(argv: list[str] | None = None) -> int:
    once = ENTRY.parse_args(argv).once

    def launch(settings: LearnerSettings, args: argparse.Namespace) -> int | None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from fleetrl.services.learner.ddp import main as ddp_main

            return ddp_main(settings, args.once, run)
        return None

    async def serve(settings: LearnerSettings, stop: asyncio.Event) -> None:
        from fleetrl.services.learner.service import serve as serve_jobs

        await serve_jobs(settings, stop, once=once)

    return run_service(ENTRY, serve, argv, launch=launch)


if __name__ == "__main__":
    sys.exit(main())
