"""Faults with real processes: Redis kill -9 under AOF, replay service SIGKILL, unsafe Redis, OOM, a full disk."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import redis.exceptions
from replay_helpers import configure, make_group, settings_for

from fleetrl.errors import FailedPrecondition, FleetError, ResourceExhausted, Unavailable
from fleetrl.jobs.store import JobStore, redis_full
from fleetrl.launcher.embedded import EmbeddedValkey, free_port, wait_for_port
from fleetrl.replay.client import INSERTED, ReplayClient
from fleetrl.replay.table import prefix
from fleetrl.services.learner.service import renew_loop, store_full
from fleetrl.services.replay.server import running
from fleetrl.spec.config import JobSpec
from tests.conftest import SmallDisks

SPEC = JobSpec.model_validate({"model": "tiny-llama", "prompts": "p.jsonl", "reward": {"builtin": "numeric_match"}})
LOAD_BEFORE_KILL_S = 5.0
"""How long inserts run before the kill: several AOF `everysec` fsync periods, and more than the 2 s that
Valkey may hold an AOF write back under `everysec` (below), so without WAITAOF writes would be lost."""


async def load_until(client: ReplayClient, stop: asyncio.Event, acked: dict[str, float]) -> None:
    """Insert one group per call until stopped, recording when each insert was acknowledged."""
    i = 0
    while not stop.is_set():
        task = f"0/{i}"
        i += 1
        with contextlib.suppress(FleetError):
            if await client.insert([make_group("j", task, tokens=64)]) == [INSERTED]:
                acked[task] = time.monotonic()


async def stats_within(client: ReplayClient, job: str, timeout_s: float) -> Any:
    """The job's stats, asked again every 0.2 s while the service answers UNAVAILABLE, for at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await client.stats(job)
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


@pytest.mark.parametrize(("fsync", "fsync_timeout_s"), [("always", 2.0), ("everysec", 2.0), ("everysec", 0.0)])
async def test_acknowledged_inserts_survive_redis_kill9(tmp_path: Path, fsync: str, fsync_timeout_s: float) -> None:
    """Replay answers an insert only once Valkey has fsynced it to its AOF (WAITAOF), so no acknowledged
    insert is lost to a kill -9 of Valkey under `always` or `everysec`. Without WAITAOF (timeout 0) under
    `everysec`, Valkey writes the AOF before it answers and a killed process's writes stay in the page
    cache, except while its once-a-second background fsync is slow: then it holds the write back for up to
    2 s and answers anyway (CI's slow disk lost one that way on 2026-12-06): only the inserts acknowledged
    in the last seconds before the kill may be lost there."""
    valkey = EmbeddedValkey(data_dir=tmp_path / "v", appendfsync=fsync)  # type: ignore[arg-type]
    with valkey:
        async with running(settings_for(valkey.url, insert_fsync_timeout_s=fsync_timeout_s)) as svc, \
                ReplayClient(f"127.0.0.1:{svc.port}", timeout_s=3, attempts=1) as client:
            assert svc.tables.waits_for_fsync == (fsync_timeout_s > 0)
            await configure(client, "j", capacity_groups=100_000)
            acked: dict[str, float] = {}
            stop = asyncio.Event()
            loader = asyncio.create_task(load_until(client, stop, acked))
            await asyncio.sleep(LOAD_BEFORE_KILL_S)
            valkey.kill()
            killed_at = time.monotonic()
            await asyncio.sleep(0.3)
            valkey.start()
            await asyncio.sleep(0.5)
            stop.set()
            await loader
            store = redis.Redis.from_url(valkey.url)
            present = {t for t in acked if store.hexists(prefix("j") + "data", t)}
            # the load ran up to the kill, so a lost write could show (WAITAOF answers each insert only after an
            # fsync, which a slow disk can take a second or two over)
            recent = [t for t, at in acked.items() if killed_at - 3.0 <= at < killed_at]
            assert len(acked) > 5 and recent, (len(acked), len(recent))
            lost = sorted(set(acked) - present, key=acked.__getitem__)
            if fsync_timeout_s > 0:
                assert not lost, lost[:10]
            else:  # (task, seconds acknowledged before the kill); the extra second is a loaded machine's slack
                early = [(t, round(killed_at - acked[t], 2)) for t in lost if acked[t] < killed_at - 3.0]
                assert not early, early[:10]
            # the service serves after the restart, once Valkey has replayed its AOF (bounded wait: a loaded
            # box can take longer than the 0.5 s above, and this client does not retry)
            assert (await stats_within(client, "j", 10.0)).size_groups >= len(present)
    print(f"appendfsync {fsync}, WAITAOF timeout {fsync_timeout_s} s: {len(acked)} inserts acknowledged in "
          f"{LOAD_BEFORE_KILL_S} s, {len(set(acked) - present)} lost")


def start_service(port: int, redis_url: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "fleetrl.services.replay", "--listen", f"127.0.0.1:{port}", "--redis-url", redis_url,
           "--set", "reclaim_interval_s=0.2"]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], start_new_session=True)
    wait_for_port("127.0.0.1", port, 30, proc)
    return proc


async def test_service_sigkill_and_restart_loses_nothing(redis_url: str) -> None:
    port = free_port()
    proc = start_service(port, redis_url)
    try:
        async with ReplayClient(f"127.0.0.1:{port}", timeout_s=3, attempts=10) as client:
            await configure(client, "j", capacity_groups=1000)
            await client.insert([make_group("j", f"0/{i}") for i in range(20)])
            lease, groups, _ = await client.sample("j", 5)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            pending = asyncio.create_task(client.insert([make_group("j", f"1/{i}") for i in range(10)]))
            await asyncio.sleep(0.5)
            proc = start_service(port, redis_url)
            assert await pending == [INSERTED] * 10  # retried through the outage
            assert await client.commit("j", lease) == 5
            stats = await client.stats("j")
            assert (stats.inserted, stats.size_groups, stats.committed, stats.leased_groups) == (30, 25, 5, 0)
            _, rest, _ = await client.sample("j", 100)
            assert len(rest) == 25 and not {g.task_id for g in groups} & {g.task_id for g in rest}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_refuses_redis_that_can_evict(redis_url: str) -> None:
    await aioredis.Redis.from_url(redis_url).config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(FailedPrecondition, match="noeviction"):
        async with running(settings_for(redis_url)):
            pass


async def test_without_an_aof_inserts_are_answered_once_applied_and_the_service_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """WAITAOF needs an AOF: against a Valkey without one, the service warns at start that acknowledged
    groups may be lost to a Redis crash, and serves inserts answered once applied."""
    with EmbeddedValkey(data_dir=tmp_path / "v", appendonly=False) as valkey:
        async with running(settings_for(valkey.url)) as svc, \
                ReplayClient(f"127.0.0.1:{svc.port}", timeout_s=3, attempts=1) as client:
            assert not svc.tables.waits_for_fsync
            await configure(client, "j")
            assert await client.insert([make_group("j", "0/0")]) == [INSERTED]
    assert "inserts are answered before they are on disk: WAITAOF failed" in caplog.text
    assert "appendonly" in caplog.text  # Valkey's reason


async def test_redis_oom_is_backpressure_and_commit_still_works(redis_url: str) -> None:
    async with running(settings_for(redis_url)) as svc, \
            ReplayClient(f"127.0.0.1:{svc.port}", timeout_s=3, attempts=2) as client:
        await configure(client, "j", capacity_groups=1000)
        await client.insert([make_group("j", f"0/{i}", tokens=2000) for i in range(20)])
        lease, _, _ = await client.sample("j", 20)
        store = aioredis.Redis.from_url(redis_url)
        used = int((await store.info("memory"))["used_memory"])
        await store.config_set("maxmemory", used - 1024)
        with pytest.raises(ResourceExhausted, match="out of memory") as refused:
            await client.insert([make_group("j", "1/0", tokens=2000)])
        # the learner knows replay's answer again as a full Redis (a pause), and no other RESOURCE_EXHAUSTED
        assert store_full(refused.value).startswith("Redis is out of memory (maxmemory reached")
        assert store_full(ResourceExhausted("3 episodes are open")) == ""
        assert await client.commit("j", lease) == 20  # frees memory even when Redis is full
        await store.config_set("maxmemory", 0)
        assert await client.insert([make_group("j", "1/0")]) == [INSERTED]


async def test_valkey_disk_full_refuses_writes_misconf_and_they_resume_with_space(
        tmp_path: Path, small_disk: SmallDisks, caplog: pytest.LogCaptureFixture) -> None:
    """Valkey's AOF on a file system that fills (`appendfsync everysec`): once an AOF write fails, every
    write is refused MISCONF, which replay answers RESOURCE_EXHAUSTED naming it (the actor keeps its task);
    a learner's lease renewal, refused too, is retried and keeps the lease through a spell shorter than
    it, and replay's lease reclaim skips the spell; every insert acknowledged before is kept, and once
    space returns Valkey writes its AOF again and takes writes. (Under `appendfsync always` Valkey exits
    on the failed write instead: an outage.)"""
    valkey = EmbeddedValkey(data_dir=small_disk.mount(tmp_path / "v", 8))
    with valkey:
        store = JobStore.from_url(valkey.url)
        job = await store.create("t", SPEC, b"", None)
        assert await store.claim("L1", lease_s=5) is not None
        deps = SimpleNamespace(settings=SimpleNamespace(lease_s=5.0, learner_id="L1"), jobs=store,
                               lease_lost=asyncio.Event())
        renewer = asyncio.create_task(renew_loop(deps, job.job_id))  # type: ignore[arg-type]
        # the insert whose AOF write fails is refused once its WAITAOF times out: short, so the spell
        # stays shorter than the lease
        async with running(settings_for(valkey.url, insert_fsync_timeout_s=0.5)) as svc, \
                ReplayClient(f"127.0.0.1:{svc.port}", timeout_s=3, attempts=1) as client:
            await configure(client, "j", capacity_groups=1000)
            acked = [t for i in range(10) if await client.insert([make_group("j", t := f"0/{i}")]) == [INSERTED]]
            filler = small_disk.fill(valkey.data_dir)
            refused, started = None, time.monotonic()
            while refused is None and time.monotonic() - started < 10:
                try:
                    task = f"1/{len(acked)}"
                    if await client.insert([make_group("j", task, tokens=256)]) == [INSERTED]:
                        acked.append(task)
                except ResourceExhausted as error:
                    refused = error
            with pytest.raises(redis.exceptions.ResponseError) as direct:
                await store.redis.set("x", "y")
            await asyncio.sleep(1.5)  # renewals refused meanwhile
            filler.unlink()
            back = await _until_accepted(client, 10)
            assert not svc.background.done(), svc.background  # lease reclaim skipped the spell, did not die
            assert not renewer.done() and not deps.lease_lost.is_set()
            renewer.cancel()
            present = {t for t in acked if await store.redis.hexists(prefix("j") + "data", t)}
        await store.close()
    print(f"valkey disk full: {len(acked)} inserts acknowledged, refused with {refused}; writes back after "
          f"{back:.1f} s; lease kept")
    assert refused is not None and store_full(refused).startswith("Redis cannot persist writes (MISCONF"), refused
    assert redis_full(direct.value).startswith("Redis cannot persist writes (MISCONF")
    assert present == set(acked)
    assert f"lease renewal of job {job.job_id} failed: MISCONF" in caplog.text  # refused, retried, not dead
    assert "lease reclaim failed: Redis cannot persist writes (MISCONF" in caplog.text


async def _until_accepted(client: ReplayClient, timeout_s: float) -> float:
    """Seconds until an insert is accepted again."""
    started = time.monotonic()
    while True:
        try:
            await client.insert([make_group("j", "2/0")])
            return time.monotonic() - started
        except ResourceExhausted:
            assert time.monotonic() - started < timeout_s, "writes still refused"
            await asyncio.sleep(0.2)
