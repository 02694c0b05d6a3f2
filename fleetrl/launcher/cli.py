"""`fleetrl up`, `fleetrl scale` and `fleetrl demo`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from fleetrl.launcher import cores, devices
from fleetrl.launcher.fleet import TINKER, Fleet, FleetLayout, FleetOptions, request_scale
from fleetrl.spec.config import redacted


def _up_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="start the whole fleet as supervised processes")
    parser.add_argument("--actors", type=int, default=2, help="actor replicas (default 2)")
    parser.add_argument("--dir", type=Path, default=Path("runs/local"), help="run directory (logs, data, models)")
    parser.add_argument("--nats-url", help="use this NATS instead of an embedded one")
    parser.add_argument("--redis-url", help="use this Redis instead of an embedded Valkey")
    parser.add_argument("--tracing", action="store_true", help="write traces to RUN_DIR/traces (or OTLP)")
    parser.add_argument("--allow-model", action="append", default=[], metavar="NAME",
                        help="a hub id jobs may train besides the built-in models (repeatable)")
    parser.add_argument("--model-root", action="append", default=[], type=_directory, metavar="DIR",
                        help="a directory under which jobs may name local model directories by absolute path "
                             "(repeatable; default: none)")
    parser.add_argument("--tinker", action="store_true",
                        help="also serve the Tinker API (HTTP) for the official tinker SDK, in open mode: any "
                             "API key starting with tml- is tenant local")
    parser.add_argument("--tinker-on-actors", action="append", default=[], metavar="MODEL",
                        help="with --tinker: the actors serve the Tinker API's samples of this base model "
                             "(sampling = fleet; repeatable)")
    parser.add_argument("--tinker-on-learner", action="append", default=[], metavar="MODEL",
                        help="with --tinker: the learner holds the Tinker API's training runs of this base model "
                             "(training = fleet; repeatable)")
    add_placement_flags(parser)
    return parser


def add_placement_flags(parser: argparse.ArgumentParser) -> None:
    """Overrides of the thread budget (fleetrl.launcher.cores) and the GPU placement (fleetrl.launcher.devices)."""
    parser.add_argument("--cores", type=_positive, help="cores the compute threads divide (default: this machine's)")
    parser.add_argument("--learner-threads", type=_positive, help="the learner's compute threads (default: the rest)")
    share = round(cores.ACTOR_SHARE * 100)
    parser.add_argument("--actor-threads", type=_positive,
                        help=f"each actor's compute threads (default: {share}%% of the cores, shared)")
    parser.add_argument("--cores-mode", choices=cores.MODES, default=cores.DEFAULT_MODE,
                        help="split: a fixed learner-heavy split; lend: the learner also computes, at the lowest "
                             "priority, on cores idle actors leave; turns: the actors take every core while "
                             f"they generate, the learner between (default {cores.DEFAULT_MODE})")
    parser.add_argument("--gpus", type=_gpus, help="GPU ids for the learner (the first) and the actors (the "
                                                   "others, in turn), e.g. 0,1, or none (default: the machine's)")


def _gpus(text: str) -> list[str]:
    try:
        return devices.parse_gpus(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _directory(text: str) -> Path:
    path = Path(text).expanduser().resolve()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return path


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def options_from(args: argparse.Namespace) -> FleetOptions:
    if args.actors < 0:
        raise SystemExit("--actors must be >= 0")
    if args.tinker_on_actors and not args.tinker:
        raise SystemExit("--tinker-on-actors needs --tinker")
    if args.tinker_on_learner and not args.tinker:
        raise SystemExit("--tinker-on-learner needs --tinker")
    return FleetOptions(run_dir=args.dir, actors=args.actors, nats_url=args.nats_url, redis_url=args.redis_url,
                        tracing=args.tracing, cores=args.cores, learner_threads=args.learner_threads,
                        actor_threads=args.actor_threads, cores_mode=args.cores_mode, gpus=args.gpus,
                        allowed_models=tuple(args.allow_model), model_roots=tuple(args.model_root),
                        tinker=args.tinker, tinker_models=tuple(args.tinker_on_actors),
                        tinker_learner_models=tuple(args.tinker_on_learner))


def print_layout(layout: FleetLayout, actors: int) -> None:
    print(f"NATS     {redacted(layout.nats_url)}")
    print(f"Redis    {redacted(layout.redis_url)}")
    for name, address in layout.addresses.items():
        metrics = layout.metrics_ports.get(name)
        print(f"{name:<8} {address}" + (f"   metrics http://127.0.0.1:{metrics}/metrics" if metrics else ""))
    for name, port in layout.metrics_ports.items():
        if name.startswith("actor-") and port:
            print(f"{name:<8} metrics http://127.0.0.1:{port}/metrics")
    print(f"actors   {actors}   logs in {layout.log_dir}")
    if layout.threads:
        print("threads  " + ", ".join(f"{name} {n}" for name, n in layout.threads.items()) + " (each actor)")


def up(argv: list[str]) -> int:
    args = _up_parser("fleetrl up").parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fleet %(levelname)s %(message)s")
    fleet = Fleet(options_from(args))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        layout = fleet.start()
        print_layout(layout, args.actors)
        gateway = layout.addresses["gateway"]
        print(f"submit with: fleetrl submit JOB.toml --gateway {gateway}   (Ctrl-C stops the fleet)")
        if TINKER in layout.addresses:
            print(f"Tinker SDK: TINKER_BASE_URL=http://{layout.addresses[TINKER]} TINKER_API_KEY=tml-local")
        sys.stdout.flush()
        fleet.serve(stop)
    finally:
        fleet.stop()
    print("fleet stopped")
    return 0


def scale(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl scale", description="change the actor count of a running fleet")
    parser.add_argument("target", help="actor=N")
    parser.add_argument("--dir", type=Path, default=Path("runs/local"), help="run directory of the fleet")
    args = parser.parse_args(argv)
    role, _, count = args.target.partition("=")
    if role != "actor" or not count.isdigit():
        print(f"expected actor=N, got {args.target!r}", file=sys.stderr)
        return 2
    try:
        request_scale(args.dir, int(count))
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"asked the fleet in {args.dir} for {count} actor(s)")
    return 0


def main(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    if command == "up":
        return up(rest)
    if command == "scale":
        return scale(rest)
    if command == "demo":
        from fleetrl.launcher.demo import main as demo_main

        return demo_main(rest)
    raise SystemExit(f"unknown fleet command {command!r}")
