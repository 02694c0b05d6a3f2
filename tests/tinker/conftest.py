"""A real Tinker API server (services/tinker) on a free port, driven by the official `tinker` SDK.

The server runs `serve` on its own event loop in a thread of the test process, the way `fleetrl
tinker` runs it, and stops through its stop event; its checkpoints go under a directory the test
chooses, so a second server on the same directory is a restarted one. Two tenants, alice and bob,
each with its own token (the SDK's API key).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tinker
import torch

from fleetrl.launcher.embedded import EmbeddedNats, EmbeddedValkey
from fleetrl.runtime.tokens import hash_token
from fleetrl.services.tinker.config import TinkerSettings
from fleetrl.services.tinker.server import serve

KEYS = {"alice": "tml-alice-key", "bob": "tml-bob-key"}
MODEL = "tiny-llama"
ROOT = Path(__file__).resolve().parents[2]


class Processes:
    """Service processes of the fleet (actors, learners) by name, each logging to `<log_dir>/<name>.log`
    (appended: a restarted process keeps its predecessor's lines)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, argv: list[str]) -> None:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "FLEETRL_TRACING": "0"}
        with open(self.log(name), "ab") as out:
            self.procs[name] = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def text(self, name: str) -> str:
        return self.log(name).read_text(errors="replace") if self.log(name).exists() else ""

    def wait_for(self, name: str, line: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while line not in self.text(name):
            assert self.procs[name].poll() is None, f"{name} exited:\n{self.text(name)[-3000:]}"
            assert time.monotonic() < deadline, f"{name} never logged {line!r}:\n{self.text(name)[-3000:]}"
            time.sleep(0.02)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def stop_all(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            print(f"----- {name}\n{self.text(name)[-2000:]}")


class TinkerServer:
    """One server process's worth of Tinker API, in a thread."""

    run_dir: Path
    url: str
    settings: dict[str, Any]
    """TinkerSettings fields besides the tests' own (quotas, ...)."""
    _loop: asyncio.AbstractEventLoop | None
    _stop: asyncio.Event | None
    _thread: threading.Thread | None

    def __init__(self, run_dir: Path, **settings: Any) -> None:
        self.run_dir, self.url, self.settings = run_dir, "", settings
        self._loop = self._stop = self._thread = None

    def start(self) -> TinkerServer:
        settings = TinkerSettings(listen="127.0.0.1:0", run_dir=self.run_dir, poll_s=5.0, allowed_models=(MODEL,),
                                  tokens={tenant: hash_token(key) for tenant, key in KEYS.items()}, **self.settings)
        started = threading.Event()

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()

            def on_start(port: int) -> None:
                self.url = f"http://127.0.0.1:{port}"
                started.set()

            await serve(settings, self._stop, on_start)

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        self._thread.start()
        assert started.wait(30), "the tinker server did not start"
        return self

    def stop(self) -> None:
        assert self._loop is not None and self._stop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def client(self, tenant: str = "alice") -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=KEYS[tenant])


@pytest.fixture(scope="module")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNats, EmbeddedValkey, Path]]:
    """A NATS and a Valkey of the module's own, and a directory for its processes' logs."""
    root = tmp_path_factory.mktemp("fleet")
    with EmbeddedNats(data_dir=root / "nats") as nats_server, EmbeddedValkey(data_dir=root / "valkey") as valkey:
        yield nats_server, valkey, root


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The server's work runs with one torch thread, as `fleetrl tinker --set torch_threads=1`: on 2 busy
    cores two OpenMP threads spin against each other (docs/tinker.md); restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    # one server for the module's tests, alice's runs from all of them: no quota in their way
    running = TinkerServer(tmp_path_factory.mktemp("tinker"), max_training_runs_per_tenant=1000).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def alice(server: TinkerServer) -> tinker.ServiceClient:
    return server.client("alice")
