"""Fixtures shared by every test: real nats-server and Valkey processes on free ports, and tiny models.

Each server is a child process with its data under the test's tmp_path, so a
test may SIGKILL it (`server.kill()`) and bring it back on the same port with
the same data (`server.start()`). Nothing in the suite mocks NATS or Redis.
`tiny_model(name)` builds a fresh named tiny test model (random weights, fixed
seed: the same bits in every process) with its tokenizer. `small_disk.mount(path, size_mb)` mounts
a tmpfs of that size at path and `small_disk.fill(path)` fills it, for tests of a full disk (mounting
needs root; without it the test skips).
"""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetrl.launcher.embedded import EmbeddedNats, EmbeddedValkey
from fleetrl.policy import models

TinyModel = Callable[..., tuple[Any, Any]]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put every test in its module's xdist group (`--dist loadgroup`, pyproject.toml), so a module's
    fixtures are built once, on one worker. Runs before xdist reads the groups. Modules need no group of
    their own for the sandbox uids they count at teardown: each process claims its range (sandbox_uids)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A fresh JetStream-enabled nats-server for one test."""
    server = EmbeddedNats(data_dir=tmp_path / "nats")
    with server:
        yield server


@pytest.fixture
def valkey_server(tmp_path: Path) -> Iterator[EmbeddedValkey]:
    """A fresh Valkey (AOF everysec, noeviction) for one test."""
    server = EmbeddedValkey(data_dir=tmp_path / "valkey")
    with server:
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
def redis_url(valkey_server: EmbeddedValkey) -> str:
    return valkey_server.url


@pytest.fixture(scope="session")
def tiny_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-model-cache")


@pytest.fixture
def tiny_model(tiny_model_cache: Path) -> TinyModel:
    """`tiny_model(name="tiny-llama", **load_kwargs)` -> a fresh (model, tokenizer) the test may change."""

    def load(name: str = "tiny-llama", **kwargs: Any) -> tuple[Any, Any]:
        if not name.startswith("tiny-"):
            raise ValueError(f"{name!r} is not a tiny test model")
        return models.load(name, cache_dir=tiny_model_cache, **kwargs)

    return load



class SmallDisks:
    """tmpfs mounts of a test, for a full disk: `mount(path, size_mb)`, then `fill(path)`."""

    mounted: list[Path]

    def __init__(self) -> None:
        self.mounted = []

    def mount(self, path: Path, size_mb: int) -> Path:
        """Mount a tmpfs of size_mb at path (made if missing); skip the test when that is not allowed."""
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"a full disk needs a small file system, and tmpfs cannot be mounted here (root "
                        f"only): {done.stderr.strip() or done.returncode}")
        self.mounted.append(path)
        return path

    @staticmethod
    def fill(path: Path) -> Path:
        """Write zeros into a file under path until its file system is full (ENOSPC); returns the file."""
        filler = path / "filler"
        with filler.open("wb", buffering=0) as handle:
            try:
                while True:
                    handle.write(bytes(1 << 20))
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
        return filler

    def unmount_all(self) -> None:
        for path in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture
def small_disk() -> Iterator[SmallDisks]:
    """Small file systems for a test (`SmallDisks`), unmounted after it."""
    disks = SmallDisks()
    yield disks
    disks.unmount_all()
