"""Start, scale and stop a whole fleet on one machine.

The fleet's layout goes to `<run_dir>/fleet.json` (addresses, metrics ports, one per
service and per actor, log directory); `fleetrl scale` writes the wanted actor count to
`<run_dir>/fleet.scale` and sends SIGHUP to the supervising process, which
adds actors or stops the newest ones with SIGTERM (they finish or release
their task first). Each child gets a compute-thread budget from the machine's cores
(`fleetrl.launcher.cores`): torch, OpenMP and BLAS threads alike.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from fleetrl.errors import Unavailable
from fleetrl.launcher import cores, devices, embedded
from fleetrl.launcher.supervisor import ChildSpec, Supervisor
from fleetrl.policy.models import BUILTIN_MODELS
from fleetrl.rollout.settings import ActorSettings

log = logging.getLogger(__name__)

STATE_FILE = "fleet.json"
SCALE_FILE = "fleet.scale"
SERVICES = ("replay", "reward", "gateway", "learner")
TINKER = "tinker"
"""The Tinker API service (`fleetrl up --tinker`): started after SERVICES when asked for."""
# Seconds a service may take to listen: imports of torch/transformers take tens of seconds on a busy 2-core box.
SERVICE_START_S = 120.0
DEFAULT_CORES_MODE = cores.DEFAULT_MODE  # (FleetOptions.cores, a field, hides the module in its body)
ACTOR_STOP_MARGIN_S = 5.0
"""Beyond an actor's grace_s, for it to release its task and drain its connections."""


@dataclass
class FleetOptions:
    """What `fleetrl up` was asked for."""

    run_dir: Path
    actors: int = 2
    nats_url: str | None = None
    redis_url: str | None = None
    host: str = "127.0.0.1"
    tracing: bool = False
    metrics: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    """Environment added to every child last (it overrides the thread budget's variables too)."""
    cores: int | None = None
    """Cores the thread budget divides (None: the CPUs this process may run on)."""
    learner_threads: int | None = None
    """The learner's compute threads (None: the budget's rule, see `cores`)."""
    actor_threads: int | None = None
    """Each actor's compute threads (None: the budget's rule)."""
    cores_mode: str = DEFAULT_CORES_MODE
    """How the learner and the actors divide the cores: one of `cores.MODES`."""
    gpus: list[str] | None = None
    """GPU ids to place the learner and actors on (None: the machine's, see `devices`; []: none)."""
    allowed_models: tuple[str, ...] = ()
    """Model names (hub ids) jobs may train besides the built-in ones (the gateway's allowed_models)."""
    model_roots: tuple[Path, ...] = ()
    """Directories under which jobs may name local model directories (the gateway's allowed_model_roots)."""
    tinker: bool = False
    """Also serve the Tinker API (HTTP), open mode and the gateway's allow-list, as the gateway."""
    tinker_models: tuple[str, ...] = ()
    """Base models whose Tinker samples the actors serve (every actor's `tinker_models`; the Tinker API then
    runs with `sampling = "fleet"`). Needs `tinker`."""
    tinker_learner_models: tuple[str, ...] = ()
    """Base models whose Tinker training runs the learner holds (its `tinker_models`; the Tinker API then runs
    with `training = "fleet"`). Needs `tinker`."""


@dataclass
class FleetLayout:
    """Where a running fleet's parts listen."""

    nats_url: str
    redis_url: str
    addresses: dict[str, str]
    metrics_ports: dict[str, int]
    log_dir: Path
    pid: int
    threads: dict[str, int] = field(default_factory=dict)
    """Compute threads per service at start ("actor": each actor started with the initial count)."""
    gpus: list[str] = field(default_factory=list)
    """GPU ids the learner and actors are placed on (empty: CPU only)."""

    def to_json(self) -> str:
        data = {**self.__dict__, "log_dir": str(self.log_dir)}
        return json.dumps(data, indent=2)

    @classmethod
    def read(cls, run_dir: Path) -> FleetLayout | None:
        path = run_dir / STATE_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        layout = cls(**{**data, "log_dir": Path(data["log_dir"])})
        return layout if pid_alive(layout.pid) else None


class Fleet:
    """The fleet's processes. `start()`, then `serve(stop)` until stop is set, then `stop()`."""

    def __init__(self, options: FleetOptions) -> None:
        self.options = options
        self.run_dir = options.run_dir.resolve()
        self.infra: embedded.Infra | None = None
        self.supervisor = Supervisor(self.run_dir / "logs")
        self.layout: FleetLayout | None = None
        self._actor_ids = 0
        self._rescale = threading.Event()
        self.cores = options.cores or cores.machine_cores()
        self.threads = cores.budget(self.cores, options.actors, options.learner_threads, options.actor_threads,
                                    options.cores_mode)
        if options.tinker_models and not options.tinker:
            raise ValueError("tinker_models needs tinker: the actors would serve a Tinker API that does not run")
        if options.tinker_learner_models and not options.tinker:
            raise ValueError("tinker_learner_models needs tinker: the learner would host runs of a Tinker API that "
                             "does not run")
        if options.tinker:  # it trains and samples as a learner does, on the learner's share of the cores
            self.threads[TINKER] = self.threads["learner"]
        self.services = (*SERVICES, TINKER) if options.tinker else SERVICES
        self.gpus = options.gpus if options.gpus is not None else devices.visible_gpus()

    def start(self) -> FleetLayout:
        nats_url, redis_url = self._start_infra()
        host = self.options.host
        addresses = {name: f"{host}:{embedded.free_port(host)}" for name in self.services}
        metrics = {name: embedded.free_port(host) if self.options.metrics else 0 for name in self.services}
        self.layout = FleetLayout(nats_url, redis_url, addresses, metrics, self.supervisor.log_dir, os.getpid(),
                                  dict(self.threads), list(self.gpus))
        self._log_threads()
        for name in self.services:
            self.supervisor.add(ChildSpec(name, _module_argv(name), self._env(name, threads=self.threads[name])))
        self._wait_listening()
        self.set_actors(self.options.actors)
        self._write_layout()
        return self.layout

    def _write_layout(self) -> None:
        """`fleet.json`, replaced whole (a temporary file renamed over it): `fleetrl scale`, `top` and the
        tests read it while actors are scaled, and a rewrite in place let one of them read it empty."""
        if self.layout is None:  # not started: nothing to describe
            return
        tmp = self.run_dir / f".{STATE_FILE}.tmp"
        tmp.write_text(self.layout.to_json())
        os.replace(tmp, self.run_dir / STATE_FILE)

    def _log_threads(self) -> None:
        summary = ", ".join(f"{name} {n}" for name, n in self.threads.items())
        log.info("compute threads on %d cores (%s): %s (each actor)", self.cores, self.options.cores_mode, summary)
        if cores.oversubscribed(self.threads, self.cores, self.options.actors, self.options.cores_mode):
            log.warning("the learner and %d actor(s) run more compute threads than the %d cores",
                        self.options.actors, self.cores)

    def _actor_threads(self, count: int) -> int:
        """Threads of an actor started when the fleet runs `count` actors: the running learner keeps its own."""
        share = cores.budget(self.cores, count, self.threads["learner"], self.options.actor_threads,
                             self.options.cores_mode)
        return share["actor"]

    def _wait_listening(self) -> None:
        """Every service accepts connections; the gateway checks each submission with the reward service."""
        assert self.layout is not None
        for name, address in self.layout.addresses.items():
            host, port = address.rsplit(":", 1)
            child = self.supervisor.children[name]
            try:
                embedded.wait_for_port(host, int(port), SERVICE_START_S, child.proc)
            except Unavailable as e:
                raise Unavailable(f"{name} did not start ({e}); see {child.log_path}") from e

    def _start_infra(self) -> tuple[str, str]:
        if self.options.nats_url and self.options.redis_url:
            return self.options.nats_url, self.options.redis_url
        self.infra = embedded.Infra(self.run_dir / "infra")
        if not self.options.nats_url:
            self.infra.nats.start()
        if not self.options.redis_url:
            self.infra.valkey.start()
        return self.options.nats_url or self.infra.nats.url, self.options.redis_url or self.infra.valkey.url

    def _env(self, service: str, actor_index: int = 0, threads: int = 1) -> dict[str, str]:
        assert self.layout is not None
        prefix = f"FLEETRL_{service.upper()}_"
        addresses = self.layout.addresses
        env = {
            "NATS_URL": self.layout.nats_url, "REDIS_URL": self.layout.redis_url, "RUN_DIR": str(self.run_dir),
            "REPLAY_ADDR": addresses["replay"], "REWARD_ADDR": addresses["reward"],
            "GATEWAY_ADDR": addresses["gateway"], "LEARNER_ADDR": addresses["learner"],
        }
        if service in addresses:
            env["LISTEN"] = addresses[service]
        port = self.layout.metrics_ports.get(f"actor-{actor_index}" if service == "actor" else service, 0)
        if port:
            env["METRICS_PORT"] = str(port)
        if service == "actor":
            env["ACTOR_ID"] = f"actor-{actor_index}"
        if service in ("gateway", TINKER):
            env.update(self._admission_env())
        if self.options.tinker_models:  # samples on the actors: the API sends them, every actor serves them
            if service == TINKER:
                env["SAMPLING"] = "fleet"
            elif service == "actor":
                env["TINKER_MODELS"] = json.dumps(list(self.options.tinker_models))
        if self.options.tinker_learner_models:  # training runs on the learner
            if service == TINKER:
                env["TRAINING"] = "fleet"
            elif service == "learner":
                env["TINKER_MODELS"] = json.dumps(list(self.options.tinker_learner_models))
        out = {prefix + key: value for key, value in env.items()}
        out["FLEETRL_TRACING"] = "1" if self.options.tracing else "0"
        out["TOKENIZERS_PARALLELISM"] = "false"
        return {**out, **cores.thread_env(service, threads, self.options.cores_mode),
                **devices.device_env(service, self.gpus, actor_index), **self.options.extra_env}

    def _admission_env(self) -> dict[str, str]:
        """The gateway's and the Tinker API's: open mode (one user, this machine), and the models its
        jobs and training runs may train."""
        env = {"OPEN_MODE": "true"}
        if self.options.allowed_models:
            env["ALLOWED_MODELS"] = json.dumps([*BUILTIN_MODELS, *self.options.allowed_models])
        if self.options.model_roots:
            env["ALLOWED_MODEL_ROOTS"] = json.dumps([str(root) for root in self.options.model_roots])
        return env

    def actor_names(self) -> list[str]:
        return sorted((n for n in self.supervisor.children if n.startswith("actor-")), key=lambda n: int(n[6:]))

    def set_actors(self, count: int) -> None:
        """Add actors, or stop the newest ones (SIGTERM: they finish or release their task)."""
        assert self.layout is not None
        names = self.actor_names()
        surplus = names[count:]
        if surplus:
            self.supervisor.remove(surplus, self._actor_grace_s() + ACTOR_STOP_MARGIN_S)
        for name in surplus:
            self.layout.metrics_ports.pop(name, None)
        threads = self._actor_threads(count)
        for _ in range(count - len(names)):
            self._actor_ids += 1
            name = f"actor-{self._actor_ids}"
            if self.options.metrics:
                self.layout.metrics_ports[name] = embedded.free_port(self.options.host)
            env = self._env("actor", self._actor_ids, threads)
            self.supervisor.add(ChildSpec(name, _module_argv("actor"), env))
        self._write_layout()
        log.info("actors: %s", ", ".join(self.actor_names()) or "none")

    def _actor_grace_s(self) -> float:
        """How long an actor may take after SIGTERM to finish its task (its grace_s setting)."""
        configured = self.options.extra_env.get("FLEETRL_ACTOR_GRACE_S") or os.environ.get("FLEETRL_ACTOR_GRACE_S")
        return float(configured) if configured else ActorSettings.model_fields["grace_s"].default

    def request_rescale(self, *_: object) -> None:
        self._rescale.set()

    def serve(self, stop: threading.Event) -> None:
        """Supervise until stop is set: restart crashed children, apply `fleetrl scale` requests.

        On the main thread this installs the SIGHUP handler `fleetrl scale` signals; a caller that
        serves from another thread installs `request_rescale` itself (only the main thread may).
        """
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGHUP, self.request_rescale)
        while not stop.wait(0.25):
            for name in self.supervisor.poll():
                log.warning("restarted %s", name)
            if self._rescale.is_set():
                self._rescale.clear()
                self.set_actors(read_scale(self.run_dir))

    def stop(self) -> None:
        """Actors first, while replay and reward still serve the task each one finishes; then the rest."""
        if self.layout is not None:
            self.set_actors(0)
        self.supervisor.stop_all()
        if self.infra is not None:
            self.infra.stop()
        (self.run_dir / STATE_FILE).unlink(missing_ok=True)


def model_admission(model: str) -> tuple[tuple[str, ...], tuple[Path, ...]]:
    """(allowed_models, model_roots) a local fleet needs to train `model`: nothing for a built-in name,
    the directory itself for an absolute path, else the name (a hub id)."""
    if model in BUILTIN_MODELS:
        return (), ()
    if model.startswith("/"):
        return (), (Path(model),)
    return (model,), ()


def _module_argv(service: str) -> list[str]:
    return [sys.executable, "-m", f"fleetrl.services.{service}"]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def read_scale(run_dir: Path) -> int:
    return int(json.loads((run_dir / SCALE_FILE).read_text())["actor"])


def request_scale(run_dir: Path, actors: int) -> FleetLayout:
    """Ask the fleet running in run_dir to run `actors` actors."""
    layout = FleetLayout.read(run_dir)
    if layout is None:
        raise RuntimeError(f"no running fleet recorded in {run_dir} (start one with `fleetrl up --dir {run_dir}`)")
    (run_dir / SCALE_FILE).write_text(json.dumps({"actor": actors}))
    os.kill(layout.pid, signal.SIGHUP)
    return layout
