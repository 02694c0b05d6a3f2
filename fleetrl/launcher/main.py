"""The `fleetrl` command: one entry point that dispatches to each service and tool.

Subcommands are imported lazily, so `fleetrl --help` and `fleetrl version`
never import torch. Each service keeps its own argument parser in its
`__main__.main(argv)`; this module only routes argv to it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fleetrl import __version__

# subcommand -> (module with main(argv), whether argv keeps the subcommand name, help)
ROUTES: dict[str, tuple[str, bool, str]] = {
    "gateway": ("fleetrl.services.gateway.__main__", False, "run the gateway (gRPC JobService)"),
    "replay": ("fleetrl.services.replay.__main__", False, "run the replay-buffer service"),
    "reward": ("fleetrl.services.reward.__main__", False, "run the reward service"),
    "actor": ("fleetrl.services.actor.__main__", False, "run one actor (rollout worker)"),
    "learner": ("fleetrl.services.learner.__main__", False, "run a learner"),
    "tinker": ("fleetrl.services.tinker.__main__", False, "serve the Tinker-compatible training API (HTTP)"),
    "submit": ("fleetrl.launcher.jobs_cli", True, "submit a job spec (TOML)"),
    "status": ("fleetrl.launcher.jobs_cli", True, "show a job, or all jobs"),
    "watch": ("fleetrl.launcher.jobs_cli", True, "follow a job's progress live"),
    "cancel": ("fleetrl.launcher.jobs_cli", True, "cancel a job"),
    "delete": ("fleetrl.launcher.jobs_cli", True, "delete a finished job's data from every store"),
    "jobs": ("fleetrl.launcher.jobs_cli", True, "list jobs"),
    "download": ("fleetrl.launcher.jobs_cli", True, "download a trained model"),
    "sweep": ("fleetrl.launcher.jobs_cli", True, "submit a grid of jobs and compare them"),
    "up": ("fleetrl.launcher.cli", True, "start the whole fleet locally"),
    "scale": ("fleetrl.launcher.cli", True, "change the number of actors of a running fleet"),
    "demo": ("fleetrl.launcher.cli", True, "train SmolLM2-135M on two-digit addition, end to end"),
    "top": ("fleetrl.launcher.top", True, "live view of a running fleet"),
    "eval": ("fleetrl.launcher.evaljob", True, "pass@1 and pass@k of a model, scored by the reward service"),
    "secrets": ("fleetrl.launcher.credentials", False, "make the NATS and Redis credentials of a compose or k8s fleet"),
}


def _infra(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl infra", description="embedded NATS + Valkey for local runs")
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start embedded nats-server (JetStream) and Valkey")
    up.add_argument("--dir", type=Path, default=Path("runs/infra"), help="data directory")
    up.add_argument("--detach", action="store_true", help="leave them running and return")
    down = sub.add_parser("down", help="stop servers a detached `infra up` started")
    down.add_argument("--dir", type=Path, default=Path("runs/infra"), help="data directory")
    args = parser.parse_args(argv)

    from fleetrl.launcher import embedded

    if args.action == "down":
        if not embedded.read_state(args.dir):
            print(f"no servers recorded in {args.dir}")
            return 0
        stopped = embedded.stop_recorded(args.dir)
        print(f"stopped {len(stopped)} server(s)" if stopped else "no recorded server was still running")
        return 0
    if embedded.read_state(args.dir):
        print(f"servers already recorded in {args.dir}; run `fleetrl infra down --dir {args.dir}` first",
              file=sys.stderr)
        return 1
    infra = embedded.Infra(args.dir).start()
    state = embedded.write_state(args.dir, infra)
    print(f"NATS   {infra.nats.host}:{infra.nats.port}   (JetStream data in {infra.nats.data_dir})")
    print(f"Valkey {infra.valkey.host}:{infra.valkey.port}   (AOF in {infra.valkey.data_dir})")
    print(f"both require credentials; export the URLs (which carry them) with:  set -a; . {state}; set +a")
    if args.detach:
        return 0
    print("Ctrl-C stops both.")
    stop = _wait_for_signal()
    infra.stop()
    (args.dir / embedded.STATE_FILE).unlink(missing_ok=True)
    print(f"stopped ({stop})")
    return 0


def _wait_for_signal() -> str:
    received: list[str] = []

    def handler(signum: int, _frame: object) -> None:
        received.append(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    while not received:
        time.sleep(0.2)
    return received[0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetrl",
        description="Reinforcement learning for language models on a fleet of services.",
        epilog="Run `fleetrl COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("version", help="print the version")
    sub.add_parser("infra", help="embedded NATS + Valkey: `infra up` / `infra down`", add_help=False)
    for name, (_, _, text) in ROUTES.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _parser().print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in ("version", "--version"):
        print(f"fleetrl {__version__}")
        return 0
    if command == "infra":
        return _infra(rest)
    if command not in ROUTES:
        _parser().error(f"unknown command {command!r}")
    module_name, keep_name, _ = ROUTES[command]
    entry: Callable[[list[str]], int] = importlib.import_module(module_name).main
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return int(entry([command, *rest] if keep_name else rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
