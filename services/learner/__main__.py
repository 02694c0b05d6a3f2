"""`python -m services.learner` / `fleetrl learner`: claim jobs and train them until SIGTERM.

Under `torchrun --nproc_per_node N -m services.learner ...` rank 0 runs the service (feeder,
replay, publishing, checkpoints) and the other ranks follow it step by step (see `ddp`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from services.common.config import load_settings
from services.common.errors import FleetError
from services.learner.config import ENV_PREFIX, LearnerSettings


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleetrl learner", description="Run a learner: claim jobs and train them.")
    parser.add_argument("--config", type=Path, help="TOML file of LearnerSettings")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    parser.add_argument("--once", action="store_true", help="run one job, then exit")
    parser.add_argument("--nats-url", help="NATS server URL(s)")
    parser.add_argument("--redis-url", help="Redis/Valkey URL")
    parser.add_argument("--replay-addr", help="ReplayService host:port")
    parser.add_argument("--run-dir", help="directory for checkpoints, exports and metrics")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> LearnerSettings:
    overrides = list(args.set)
    for flag, key in (("nats_url", "nats_url"), ("redis_url", "redis_url"), ("replay_addr", "replay_addr"),
                      ("run_dir", "run_dir")):
        value = getattr(args, flag)
        if value:
            overrides.append(f'{key}="{value}"')
    return load_settings(LearnerSettings, env_prefix=ENV_PREFIX, toml_path=args.config, overrides=overrides)


async def run(settings: LearnerSettings, once: bool) -> None:
    from services.learner.service import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(settings, stop, once=once)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = settings_from(args)
    except FleetError as error:
        print(f"fleetrl learner: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from services.learner.ddp import main as ddp_main

        return ddp_main(settings, args.once, run)
    try:
        asyncio.run(run(settings, args.once))
    except FleetError as error:
        print(f"fleetrl learner: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
