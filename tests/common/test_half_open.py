"""Half-open connections: the peer's host vanished or a middlebox dropped the flow, so the client's socket
stays established, its writes are buffered and nothing ever comes back, while a new connection to the same
address works (the service restarted elsewhere, the route healed).

Each client (the replay service's gRPC client, nats-py, redis-py) reaches a real server through the test's
`Blackhole` proxy, whose `drop_established` blackholes the connections open at that moment for good and
forwards new ones. Asserted: the call in flight fails within its deadline, and the client's next calls
succeed on a new connection within a stated bound. docs/guarantees.md has the figures before and after.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar
from urllib.parse import urlsplit

import pytest
import redis.exceptions
from blackhole import Blackhole

from fleetrl.errors import DeadlineExceeded
from fleetrl.jobs.store import JobStore
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.replay.client import INSERTED, ReplayClient
from fleetrl.runtime.grpcutil import RetryPolicy
from fleetrl.services.replay.config import ReplaySettings
from fleetrl.services.replay.server import Running, running
from fleetrl.spec.config import ReplayConfig
from fleetrl.tasks import bus

DEADLINE_S = 2.0
"""The replay client's deadline in these tests (the actor's is 10 s, the learner's 30 s)."""
SLACK_S = 1.0
"""What a loaded 2-core machine may add to a bound."""
T = TypeVar("T")


def group(task: str) -> common_pb2.Group:
    sample = common_pb2.Sample(prompt_token_ids=[1], completion_token_ids=[2], behaviour_logprobs=[-0.5])
    return common_pb2.Group(job_id="j", task_id=task, samples=[sample, sample])


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port
    return parts.hostname, parts.port


async def proxied(host: str, port: int) -> Blackhole:
    proxy = Blackhole(host, port)
    await proxy.start()
    return proxy


def proxy_port(proxy: Blackhole) -> int:
    assert proxy.server is not None
    return int(proxy.server.sockets[0].getsockname()[1])


@pytest.fixture
async def replay_service(redis_url: str) -> AsyncIterator[Running]:
    settings = ReplaySettings.model_validate({"listen": "127.0.0.1:0", "redis_url": redis_url, "grace_s": 0})
    async with running(settings) as service:
        yield service


async def timed(call: Awaitable[T]) -> tuple[float, T | Exception]:
    """(seconds, result or the exception raised) of awaiting call."""
    started = time.monotonic()
    try:
        result: T | Exception = await call
    except Exception as error:
        result = error
    return time.monotonic() - started, result


async def test_replay_client_leaves_a_half_open_connection_after_one_deadline(replay_service: Running) -> None:
    """A call in flight when its connection goes half-open fails at its deadline, and the next call goes on a
    new connection at once. Before, grpc kept sending calls down the dead connection until a ping of its own
    went unanswered for 60 s: every call failed DEADLINE_EXCEEDED for 60 to 89 s."""
    proxy = await proxied("127.0.0.1", replay_service.port)
    async with ReplayClient(f"127.0.0.1:{proxy_port(proxy)}", timeout_s=DEADLINE_S,
                            retry=RetryPolicy(attempts=1)) as replay:
        await replay.configure("j", ReplayConfig.model_validate({}))
        sampling = asyncio.ensure_future(timed(replay.sample("j", 1, wait_s=1.0)))  # waits 1 s on the empty table
        await asyncio.sleep(0.3)
        assert proxy.drop_established() == 1
        took, failed = await sampling
        assert isinstance(failed, DeadlineExceeded), failed
        assert DEADLINE_S + 1.0 - 0.1 <= took <= DEADLINE_S + 1.0 + SLACK_S  # its deadline: timeout_s + wait_s

        took, stats = await timed(replay.stats("j"))
        assert not isinstance(stats, Exception), stats
        assert took <= SLACK_S and proxy.accepted == 2

        await asyncio.sleep(1.0)  # idle: the next half-open connection is met by a call, not one in flight
        assert proxy.drop_established() == 1
        took, failed = await timed(replay.stats("j"))
        assert isinstance(failed, DeadlineExceeded) and took <= DEADLINE_S + SLACK_S, (took, failed)
        took, stats = await timed(replay.stats("j"))
        assert not isinstance(stats, Exception) and took <= SLACK_S and proxy.accepted == 3, (took, stats)
    await proxy.close()


async def test_replay_insert_retried_over_a_half_open_connection_lands(replay_service: Running) -> None:
    """With retries (the actor's and the learner's policies), an insert whose connection went half-open lands
    on its second try: one deadline plus one backoff delay."""
    proxy = await proxied("127.0.0.1", replay_service.port)
    async with ReplayClient(f"127.0.0.1:{proxy_port(proxy)}", timeout_s=DEADLINE_S,
                            retry=RetryPolicy(attempts=3)) as replay:
        await replay.configure("j", ReplayConfig.model_validate({}))
        assert await replay.insert([group("t0")]) == [INSERTED]
        proxy.drop_established()
        took, outcomes = await timed(replay.insert([group("t1")]))
        assert outcomes == [INSERTED], outcomes
        assert DEADLINE_S <= took <= DEADLINE_S + 0.3 + SLACK_S  # the first delay is at most 0.2 s * 1.5
        assert (await replay.stats("j")).size_groups == 2
    await proxy.close()


async def test_replay_service_leaves_a_half_open_redis_connection(redis_url: str) -> None:
    """The replay service's own Redis connections going half-open: the client's call fails at its deadline
    (grpc cancels the service's handler, and redis-py closes the connection it was reading), and the next
    calls, three at once, are served on new connections, not on the pool's other dead ones."""
    proxy = await proxied(*host_port(redis_url))
    url = f"redis://127.0.0.1:{proxy_port(proxy)}"
    settings = ReplaySettings.model_validate({"listen": "127.0.0.1:0", "redis_url": url, "grace_s": 0})
    async with running(settings) as service, ReplayClient(f"127.0.0.1:{service.port}", timeout_s=DEADLINE_S,
                                                          retry=RetryPolicy(attempts=1)) as replay:
        await replay.configure("j", ReplayConfig.model_validate({}))
        await asyncio.gather(*(replay.insert([group(f"t{i}")]) for i in range(3)))
        proxy.drop_established()
        took, failed = await timed(replay.stats("j"))
        assert isinstance(failed, DeadlineExceeded) and took <= DEADLINE_S + SLACK_S, (took, failed)
        took, stats = await timed(asyncio.gather(*(replay.stats("j") for _ in range(3))))
        assert not isinstance(stats, Exception) and took <= SLACK_S, (took, stats)
    await proxy.close()


async def test_redis_client_leaves_a_half_open_connection_after_its_socket_timeout(redis_url: str) -> None:
    """JobStore's client (the learner's, the actor's, the gateway's), at its production settings: a call on a
    half-open connection fails at its socket timeout (10 s), and the calls after it, three at once, are
    served at once on new connections. Before, the pool's two other idle connections were dead too, and two
    of the three waited out 10 s more and failed."""
    proxy = await proxied(*host_port(redis_url))
    store = JobStore.from_url(f"redis://127.0.0.1:{proxy_port(proxy)}")
    try:
        await asyncio.gather(*(store.redis.blpop(["nothing"], timeout=0.2) for _ in range(3)))  # 3 in the pool
        assert proxy.drop_established() == 3
        took, failed = await timed(store.redis.set("k", "v"))
        assert isinstance(failed, redis.exceptions.TimeoutError) and 10.0 <= took <= 10.0 + SLACK_S, (took, failed)
        took, results = await timed(asyncio.gather(*(store.redis.blpop(["nothing"], timeout=0.2) for _ in range(3))))
        assert results == [None, None, None] and took <= 0.2 + SLACK_S, (took, results)
    finally:
        await store.close()
        await proxy.close()


PING_INTERVAL_S = 1.0
MAX_OUTSTANDING_PINGS = 2


async def test_nats_client_leaves_a_half_open_connection_when_its_pings_go_unanswered(nats_url: str) -> None:
    """nats-py reconnects once a ping is due with more than max_outstanding_pings unanswered: within
    (max_outstanding_pings + 1) * ping_interval of the connection going half-open (here 3 s; the production's
    10 s and 3: 40 s, measured 40.1 s), each call meanwhile failing at its own deadline."""
    proxy = await proxied(*host_port(nats_url))
    nc = await bus.connect(f"nats://127.0.0.1:{proxy_port(proxy)}", "half-open", ping_interval_s=PING_INTERVAL_S,
                           max_outstanding_pings=MAX_OUTSTANDING_PINGS)
    try:
        js = nc.jetstream(timeout=1.0)
        await js.add_stream(name="HALF_OPEN", subjects=["half.open"])
        await js.publish("half.open", b"0")
        proxy.drop_established()
        cut = time.monotonic()
        took, failed = await timed(js.publish("half.open", b"1"))
        assert isinstance(failed, TimeoutError) and took <= 1.0 + SLACK_S, (took, failed)
        while isinstance(failed, Exception) and time.monotonic() - cut < 20:
            await asyncio.sleep(0.1)
            _, failed = await timed(js.publish("half.open", b"2"))
        recovered = time.monotonic() - cut
        assert not isinstance(failed, Exception), failed
        assert recovered <= (MAX_OUTSTANDING_PINGS + 1) * PING_INTERVAL_S + SLACK_S + 1.0, recovered  # + a publish
        assert proxy.accepted == 2
    finally:
        await nc.close()
        await proxy.close()
