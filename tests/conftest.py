"""Fixtures shared by every test: real nats-server and Valkey processes on free ports.

Each server is a child process with its data under the test's tmp_path, so a
test may SIGKILL it (`server.kill()`) and bring it back on the same port with
the same data (`server.start()`). Nothing in the suite mocks NATS or Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.embedded import EmbeddedNats, EmbeddedValkey


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
