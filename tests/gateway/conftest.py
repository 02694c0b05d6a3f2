"""Gateway test fixtures: one real Valkey, NATS and reward service per session, and real gateway
processes (`python -m fleetrl.services.gateway`) on free ports that tests may SIGKILL and restart.

The shared gateway has three tenants (alice, bob, carol) and small limits (4 MiB messages, 1 MiB
prompts, 16 KiB reward files) so oversize paths are cheap to reach. Test gateways allow the jobs'
model name `tiny-test` besides the built-in models (the operator's allow-list).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fleetrl.jobs.store import JobStore
from fleetrl.launcher.embedded import EmbeddedNats, EmbeddedValkey, free_port, wait_for_port
from fleetrl.policy.models import BUILTIN_MODELS
from fleetrl.sdk.client import Client
from fleetrl.services.gateway.auth import hash_token

ROOT = Path(__file__).resolve().parents[2]
TOKENS = {"alice": "tok-alice-1", "bob": "tok-bob-2", "carol": "tok-carol-3"}
TEST_MODELS = (*BUILTIN_MODELS, "tiny-test")
"""The allow-list of test gateways: the test jobs name `tiny-test`, which no learner ever loads."""
T = TypeVar("T")


@dataclass
class Proc:
    """A service child process on a fixed port; kill() is SIGKILL, start() reuses the port."""

    args: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> Proc:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, *self.args, "--listen", self.address], cwd=ROOT,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for_port("127.0.0.1", self.port, timeout_s, self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Infra:
    redis_url: str
    nats_url: str
    reward_addr: str
    tmp: Path

    def gateway(self, name: str, settings: str = "", *, tokens: dict[str, str] | None = None,
                reward_addr: str | None = None, models: tuple[str, ...] | None = TEST_MODELS,
                redis_url: str | None = None, nats_url: str | None = None) -> Proc:
        """A gateway process (not started) with the given extra TOML settings (models: its allowed_models;
        None leaves the setting to `settings` or its default), on the session's Valkey and NATS unless given."""
        table = TOKENS if tokens is None else tokens
        lines = [f'redis_url = "{redis_url or self.redis_url}"', f'nats_url = "{nats_url or self.nats_url}"',
                 f'reward_addr = "{reward_addr or self.reward_addr}"', 'watch_poll_s = 0.05']
        if models is not None:
            lines.append(f"allowed_models = {json.dumps(list(models))}")
        lines.append(settings)
        if table:
            lines.append("[tokens]\n" + "\n".join(f'{t} = "{hash_token(v)}"' for t, v in table.items()))
        config = self.tmp / f"{name}.toml"
        config.write_text("\n".join(lines) + "\n")
        return Proc(["-m", "fleetrl.services.gateway", "--config", str(config)], self.tmp / f"{name}.log")

    def store(self, fn: Callable[[JobStore], Awaitable[T]]) -> T:
        """Run fn against a fresh JobStore (playing the learner's part in tests)."""
        async def go() -> T:
            store = JobStore.from_url(self.redis_url)
            try:
                return await fn(store)
            finally:
                await store.close()

        return asyncio.run(go())


@pytest.fixture(scope="session")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Infra]:
    tmp = tmp_path_factory.mktemp("gateway-infra")
    with EmbeddedValkey(data_dir=tmp / "valkey") as valkey, EmbeddedNats(data_dir=tmp / "nats") as nats:
        reward = Proc(["-m", "fleetrl.services.reward", "--workers", "1"], tmp / "reward.log").start()
        try:
            yield Infra(valkey.url, nats.url, reward.address, tmp)
        finally:
            reward.stop()


@pytest.fixture(scope="session")
def gateway(infra: Infra) -> Iterator[Proc]:
    proc = infra.gateway("shared", 'max_message_mb = 4\nmax_prompts_mb = 1\nmax_reward_file_kb = 16\n'
                         'operators = ["carol"]').start()
    yield proc
    proc.stop()


@pytest.fixture
def client_for(gateway: Proc) -> Iterator[Callable[..., Client]]:
    """client_for("alice") -> a Client with alice's token; client_for(None) sends no token."""
    made: list[Client] = []

    def make(tenant: str | None, token: str | None = None, **kwargs: Any) -> Client:
        client = Client(kwargs.pop("address", gateway.address),
                        token=token if token is not None else TOKENS.get(tenant or "", ""), **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A job TOML with its prompt JSONL and reward file next to it."""
    (tmp_path / "prompts.jsonl").write_text(
        "".join(f'{{"prompt": "What is {a} + {a}?", "answer": "{2 * a}"}}\n' for a in range(5)))
    (tmp_path / "reward.py").write_text("def reward(completion, prompt, **metadata):\n    return 1.0\n")
    (tmp_path / "job.toml").write_text(
        'name = "cli-job"\nmodel = "tiny-test"\nprompts = "prompts.jsonl"\n\n'
        '[reward]\nfile = "reward.py"\n\n[train]\nmax_steps = 3\n')
    return tmp_path


os.environ.pop("FLEETRL_GATEWAY", None)
os.environ.pop("FLEETRL_TOKEN", None)
