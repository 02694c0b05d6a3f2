"""Replay fixtures: a real ReplayService on a free port over the real Valkey, and a client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from replay_helpers import settings_for

from fleetrl.replay.client import ReplayClient
from fleetrl.services.replay.server import Running, running


@pytest.fixture
async def replay_service(redis_url: str) -> AsyncIterator[Running]:
    async with running(settings_for(redis_url)) as svc:
        yield svc


@pytest.fixture
async def replay(replay_service: Running) -> AsyncIterator[ReplayClient]:
    async with ReplayClient(f"127.0.0.1:{replay_service.port}", timeout_s=5, attempts=3) as client:
        yield client
