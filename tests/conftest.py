"""Fixtures shared by every test: real nats-server and Valkey processes on free ports, and tiny models.

Each server is a child process with its data under the test's tmp_path, so a
test may SIGKILL it (`server.kill()`) and bring it back on the same port with
the same data (`server.start()`). Nothing in the suite mocks NATS or Redis.
`tiny_model(name)` builds a fresh named tiny test model (random weights, fixed
seed: the same bits in every process) with its tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetrl.launcher.embedded import EmbeddedNats, EmbeddedValkey
from fleetrl.policy import models

TinyModel = Callable[..., tuple[Any, Any]]


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
