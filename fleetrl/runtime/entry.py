"""The one process entry of every service: arguments, settings, logging, signals, exit codes.

Each `services/<name>/__main__.py` describes its command (a `ServiceEntry`: program name, settings
model, environment prefix, flags) and calls `run_service(entry, serve, argv)`:
- `--config FILE` (TOML) and `--set key=value` (repeatable) on every service; each flag is a shortcut
  for one setting and is applied after the `--set`s, its value quoted as a TOML string, so a URL or a
  path needs no quoting of its own. Settings load as defaults < TOML < environment < `--set` < flags.
- Bad settings (or a `ConfigError` while starting, e.g. an address it cannot listen on) end the
  process with one line on stderr and exit 2; any other `FleetError` or `OSError` (NATS
  unreachable, a taken metrics port) with one line and exit 1; a clean stop exits 0.
- SIGTERM and SIGINT set the `stop` event the service's `serve(settings, stop)` watches.
This module imports no torch: `--help` and validation stay instant.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from fleetrl.errors import ConfigError, FleetError
from fleetrl.runtime import heap
from fleetrl.spec.config import InfraSettings, load_settings

S = TypeVar("S", bound=InfraSettings)
Serve = Callable[[S, asyncio.Event], Awaitable[None]]
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class Flag:
    """A command-line shortcut for one setting: `--nats-url URL` is `--set nats_url="URL"`."""

    option: str
    help: str
    key: str = ""
    """The setting it overrides (default: the option's name with '_' for '-')."""
    type: type = str
    store_true: bool = False

    @property
    def setting(self) -> str:
        return self.key or self.option.lstrip("-").replace("-", "_")

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")

    def override(self, value: Any) -> str:
        literal = "true" if value is True else json.dumps(value) if isinstance(value, str) else str(value)
        return f"{self.setting}={literal}"


@dataclass(frozen=True)
class ServiceEntry(Generic[S]):
    """How one service's command reads its arguments and settings."""

    prog: str
    description: str
    settings: type[S]
    env_prefix: str
    flags: Sequence[Flag] = ()
    extra: Callable[[argparse.ArgumentParser], None] | None = None
    """Adds arguments that are not settings (the learner's --once)."""

    def parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=self.prog, description=self.description)
        parser.add_argument("--config", type=Path, help=f"TOML file of {self.settings.__name__}")
        parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
        for flag in self.flags:
            if flag.store_true:
                parser.add_argument(flag.option, action="store_true", help=flag.help)
            else:
                parser.add_argument(flag.option, type=flag.type, help=flag.help)
        if self.extra is not None:
            self.extra(parser)
        return parser

    def parse_args(self, argv: Sequence[str] | None) -> argparse.Namespace:
        return self.parser().parse_args(argv)

    def settings_from(self, args: argparse.Namespace) -> S:
        overrides = list(args.set)
        for flag in self.flags:
            value = getattr(args, flag.dest)
            if value:
                overrides.append(flag.override(value))
        return load_settings(self.settings, env_prefix=self.env_prefix, toml_path=args.config, overrides=overrides)

    def fail(self, error: BaseException) -> None:
        print(f"{self.prog}: {error}", file=sys.stderr)


async def until_signal(serve: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run serve(stop) with SIGTERM and SIGINT setting stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(stop)


def run_service(
    entry: ServiceEntry[S],
    serve: Serve[S],
    argv: Sequence[str] | None = None,
    *,
    check: Callable[[S], object] | None = None,
    launch: Callable[[S, argparse.Namespace], int | None] | None = None,
) -> int:
    """Parse argv, load settings, log, and serve until SIGTERM or SIGINT; the process's exit code.

    check(settings) runs with the settings checks (its ConfigError or OSError exits 2); launch, when
    it returns a code, replaces the single-process run (the learner's torchrun ranks)."""
    args = entry.parse_args(argv)
    try:
        settings = entry.settings_from(args)
        if check is not None:
            check(settings)
    except (FleetError, OSError) as error:
        entry.fail(error)
        return 2
    logging.basicConfig(level=settings.log_level, format=LOG_FORMAT)
    # a crash in native code (SIGSEGV, SIGABRT from a C++ terminate) prints every thread's Python stack
    # to stderr before the process dies: the one clue a log gets of where it happened
    faulthandler.enable(all_threads=True)
    heap.set_mmap_threshold(getattr(settings, "malloc_mmap_threshold_bytes", 0))  # before torch allocates
    threads = getattr(settings, "torch_threads", 0)
    if threads:
        # OpenMP's thread count is per thread: set_num_threads changes only this one, and threads started
        # later (the default executor's, vLLM's) start from OMP_NUM_THREADS as it was when torch loaded.
        # vLLM's CPU attention checks that the two agree (a mismatch fails the forward), and the setting
        # is meant for every thread: export it before torch loads, where it has not yet.
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)
    if launch is not None:
        code = launch(settings, args)
        if code is not None:
            return code
    try:
        asyncio.run(until_signal(lambda stop: serve(settings, stop)))
    except ConfigError as error:
        entry.fail(error)
        return 2
    except (FleetError, OSError) as error:  # OSError: e.g. the metrics port is taken
        entry.fail(error)
        return 1
    return 0
