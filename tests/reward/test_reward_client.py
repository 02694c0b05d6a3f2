"""The actor's reward client over a half-open connection (the reward service's host vanished, or a
middlebox dropped the flow): a real reward service behind the test's `Blackhole` proxy, whose
`drop_established` blackholes the connections open at that moment and forwards new ones."""

from __future__ import annotations

import time
from pathlib import Path

from blackhole import Blackhole

from fleetrl.errors import DeadlineExceeded
from fleetrl.reward.client import RewardClient
from fleetrl.runtime.grpcutil import RetryPolicy
from tests.reward.conftest import builtin_spec, items, reward_server

DEADLINE_S = 3.0
SLACK_S = 3.0
"""What a loaded 2-core machine may add to a bound (before, the next calls failed for tens of seconds)."""


async def test_reward_client_leaves_a_half_open_connection_after_one_deadline(tmp_path: Path) -> None:
    """A Score call on a connection gone half-open fails at its deadline, and the next call goes on a new
    connection at once, instead of down the dead one until grpc's own ping times out (tens of seconds)."""
    spec, scored = builtin_spec("numeric_match"), items(("42", {"answer": "42"}))
    async with reward_server(tmp_path) as (_, service):
        proxy = Blackhole("127.0.0.1", service.port)
        await proxy.start()
        assert proxy.server is not None
        port = proxy.server.sockets[0].getsockname()[1]
        client = RewardClient(f"127.0.0.1:{port}", timeout_s=DEADLINE_S, retry=RetryPolicy(attempts=1))
        try:
            assert [r.reward for r in await client.score("j", spec, scored)] == [1.0]
            assert proxy.drop_established() == 1
            started = time.monotonic()
            try:
                await client.score("j", spec, scored)
                raise AssertionError("a call over the half-open connection answered")
            except DeadlineExceeded:
                assert time.monotonic() - started <= DEADLINE_S + SLACK_S
            started = time.monotonic()
            assert [r.reward for r in await client.score("j", spec, scored)] == [1.0]
            assert time.monotonic() - started <= SLACK_S and proxy.accepted == 2
        finally:
            await client.close()
            await proxy.close()
