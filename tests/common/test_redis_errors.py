"""What redis-py really raises on a dead, restarting or stopped Valkey, and that the retry paths catch it.

redis-py's ConnectionError and TimeoutError are not the builtins: a retry path written as
`except (ConnectionError, TimeoutError)` lets them through. The learner's lease renewal was such a
path (its task died on the first failed renewal); the renewal test fails on that code. The job
store retries a refused connection for a bounded time (`jobs.RetryFor`), so a Redis restart is a pause:
a learner's step write during a Valkey kill no longer failed the job (the last test fails without it).
"""

from __future__ import annotations

import asyncio
import signal
import time
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from fleetrl.errors import Unavailable
from fleetrl.jobs.store import REDIS_RETRY_S, REDIS_UNREACHABLE, RENEW_SHARE_OF_LEASE, JobStore
from fleetrl.launcher.embedded import EmbeddedValkey
from fleetrl.replay.table import ReplayTables
from fleetrl.services.learner.service import renew_loop
from fleetrl.spec.config import JobSpec
from fleetrl.train.settings import LearnerSettings

SPEC = JobSpec.model_validate({"model": "tiny-llama", "prompts": "p.jsonl", "reward": {"builtin": "numeric_match"}})


async def test_dead_and_stopped_redis_raise_what_retry_paths_catch(valkey_server: EmbeddedValkey) -> None:
    store = JobStore.from_url(valkey_server.url, retry_s=0.5)
    quick = aioredis.Redis.from_url(valkey_server.url, socket_timeout=0.5)
    await store.redis.ping() and await quick.ping()
    valkey_server.kill()
    with pytest.raises(REDIS_UNREACHABLE) as dead:  # what JobStore callers and the renewal see
        await store.redis.get("x")
    assert not isinstance(dead.value, ConnectionError | TimeoutError)  # the builtins would not catch it
    with pytest.raises(Unavailable):  # replay's core maps the same errors to UNAVAILABLE
        await ReplayTables(store.redis).jobs()
    valkey_server.start()
    await quick.ping()
    assert valkey_server.proc is not None
    valkey_server.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(REDIS_UNREACHABLE) as stopped:
            await quick.get("x")
    finally:
        valkey_server.proc.send_signal(signal.SIGCONT)
    print("dead:", type(dead.value).__name__, "stopped:", type(stopped.value).__name__)
    await quick.aclose()
    await store.close()


async def test_lease_renewal_survives_a_redis_restart(valkey_server: EmbeddedValkey) -> None:
    store = JobStore.from_url(valkey_server.url)
    job = await store.create("t", SPEC, b"", None)
    assert await store.claim("L1", lease_s=6) is not None
    deps = SimpleNamespace(settings=SimpleNamespace(lease_s=6.0, learner_id="L1"), jobs=store,
                           lease_lost=asyncio.Event())
    renewer = asyncio.create_task(renew_loop(deps, job.job_id))  # type: ignore[arg-type]
    await asyncio.sleep(2.5)  # a renewal went through, and the lease key is on disk (AOF everysec)
    valkey_server.kill()
    await asyncio.sleep(2.5)  # at least one renewal fails against the dead server
    valkey_server.start()
    await asyncio.sleep(2.5)  # the next renewals reach the restarted server
    assert not renewer.done(), renewer.exception() if renewer.done() else None
    assert not deps.lease_lost.is_set()
    assert await store.lease_holder(job.job_id) == "L1"
    renewer.cancel()
    await store.close()


async def test_a_store_call_waits_out_a_redis_restart_within_its_bound(valkey_server: EmbeddedValkey) -> None:
    store = JobStore.from_url(valkey_server.url)
    job = await store.create("t", SPEC, b"", None)
    valkey_server.kill()
    started = time.monotonic()
    write = asyncio.create_task(store.append_step(job.job_id, {"step": 1}, lease_epoch=0))
    await asyncio.sleep(1.5)  # the write's connection is refused meanwhile, and retried
    assert not write.done(), write.exception() if write.done() else None
    valkey_server.start()
    await write
    waited = time.monotonic() - started
    assert 1.5 <= waited < 1.5 + REDIS_RETRY_S
    assert [s["step"] for s in await store.steps(job.job_id)] == [1]
    await store.close()
    gone = JobStore.from_url(valkey_server.url, retry_s=1.0)
    valkey_server.kill()
    started = time.monotonic()
    with pytest.raises(REDIS_UNREACHABLE):  # and not longer than its bound (twice: connect inside command)
        await gone.redis.get("x")
    assert time.monotonic() - started < 2 * 1.0 + 1.0
    await gone.close()


DEFAULT_LEASE_S = float(LearnerSettings.model_fields["lease_s"].default)


async def test_one_renewal_against_a_stopped_redis_gives_up_within_a_third_of_the_lease(
        valkey_server: EmbeddedValkey) -> None:
    """With the default 15 s lease, a renewal against a stopped Valkey raised after the client's 10 s
    socket timeout, and could take about 20 s through the nested retries: longer than the lease."""
    store = JobStore.from_url(valkey_server.url)
    job = await store.create("t", SPEC, b"", None)
    assert await store.claim("L1", lease_s=DEFAULT_LEASE_S) is not None
    assert await store.renew(job.job_id, "L1", DEFAULT_LEASE_S)
    bound_s = DEFAULT_LEASE_S * RENEW_SHARE_OF_LEASE
    assert valkey_server.proc is not None
    valkey_server.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(REDIS_UNREACHABLE, match="gave up"):
            await store.renew(job.job_id, "L1", DEFAULT_LEASE_S)
        took = time.monotonic() - started
    finally:
        valkey_server.proc.send_signal(signal.SIGCONT)
    print(f"renewal against a stopped Valkey gave up after {took:.2f} s (bound {bound_s:.1f} s)")
    assert bound_s - 0.1 <= took < bound_s + 1.0
    assert await store.renew(job.job_id, "L1", DEFAULT_LEASE_S)  # the client works again after SIGCONT
    await store.close()


async def test_lease_renewal_stops_the_run_when_redis_stays_stopped_past_the_lease(
        valkey_server: EmbeddedValkey) -> None:
    lease_s = 3.0
    store = JobStore.from_url(valkey_server.url)
    job = await store.create("t", SPEC, b"", None)
    assert await store.claim("L1", lease_s=lease_s) is not None
    deps = SimpleNamespace(settings=SimpleNamespace(lease_s=lease_s, learner_id="L1"), jobs=store,
                           lease_lost=asyncio.Event())
    renewer = asyncio.create_task(renew_loop(deps, job.job_id))  # type: ignore[arg-type]
    await asyncio.sleep(lease_s / 3 + 0.3)  # a renewal went through
    assert valkey_server.proc is not None
    valkey_server.proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        await asyncio.wait_for(deps.lease_lost.wait(), lease_s + 3.0)
        lost_after = time.monotonic() - stopped_at
        await asyncio.wait_for(renewer, 1.0)  # the loop ended with it
    finally:
        valkey_server.proc.send_signal(signal.SIGCONT)
    print(f"Valkey stopped: lease_lost set {lost_after:.2f} s later (lease {lease_s} s)")
    # the last good renewal began at most a third of the lease before the stop, and the loop stops a
    # lease after it: no sooner, and never a socket timeout (10 s) later
    assert lease_s - lease_s / 3 - 0.3 <= lost_after <= lease_s + 1.0
    await store.close()
