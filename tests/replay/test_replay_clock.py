"""Replay replicas with skewed clocks share one lease clock: Redis's.

Three replay replicas serve one Valkey, as the HA overlay runs them: one in this process on the true
clock, and two real service processes whose `time.time()` is an hour ahead and an hour behind (the
wrapper below patches it before the service starts; nothing else differs). Leases are sampled through
one replica and looked at, renewed and committed through the others, while every replica's reclaim
loop runs every 0.2 s. With lease expiry computed from each replica's own clock, the replica ahead
reclaims every live lease at once and a lease sampled through the replica behind is born expired;
from Redis's `TIME`, no live lease expires, and an abandoned one still does.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from replay_helpers import configure, make_group, settings_for

from fleetrl.errors import NotFound
from fleetrl.launcher.embedded import free_port, wait_for_port
from fleetrl.replay.client import INSERTED, ReplayClient
from fleetrl.services.replay.server import running

SKEW_S = 3600.0
LEASE_TIMEOUT_S = 30.0
SHORT_LEASE_S = 1.0

SKEWED_REPLICA = """\
import runpy
import time

_true_time = time.time
time.time = lambda: _true_time() + {skew_s!r}  # this replica's clock only
runpy.run_module("fleetrl.services.replay", run_name="__main__", alter_sys=True)
"""


@contextmanager
def skewed_replicas(redis_url: str, tmp_path: Path, *skews_s: float) -> Iterator[list[str]]:
    """A replay service process for each skew, whose time.time() is that many seconds off; yields their
    addresses. The processes start together (each start is mostly imports), then each is waited for."""
    procs: list[subprocess.Popen[bytes]] = []
    addrs: list[str] = []
    try:
        for skew_s in skews_s:
            port = free_port()
            wrapper = tmp_path / f"replica_{port}.py"
            wrapper.write_text(SKEWED_REPLICA.format(skew_s=skew_s))
            cmd = [sys.executable, str(wrapper), "--listen", f"127.0.0.1:{port}", "--redis-url", redis_url,
                   "--set", "reclaim_interval_s=0.2"]
            procs.append(subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], start_new_session=True))
            addrs.append(f"127.0.0.1:{port}")
        for proc, addr in zip(procs, addrs, strict=True):
            wait_for_port("127.0.0.1", int(addr.rsplit(":", 1)[1]), 60, proc)
        yield addrs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


async def test_a_skewed_replica_expires_no_live_lease(redis_url: str, tmp_path: Path) -> None:
    with skewed_replicas(redis_url, tmp_path, SKEW_S, -SKEW_S) as (ahead_addr, behind_addr):
        async with running(settings_for(redis_url)) as svc, \
                ReplayClient(f"127.0.0.1:{svc.port}", timeout_s=5) as true, \
                ReplayClient(ahead_addr, timeout_s=5) as ahead, ReplayClient(behind_addr, timeout_s=5) as behind:
            await configure(true, "j", capacity_groups=100, lease_timeout_s=LEASE_TIMEOUT_S)
            assert await true.insert([make_group("j", f"0/{i}") for i in range(6)]) == [INSERTED] * 6
            lease_true, groups, _ = await true.sample("j", 2)
            lease_behind, more, _ = await behind.sample("j", 2)
            assert len(groups) == len(more) == 2
            await asyncio.sleep(1.0)  # every replica's reclaim loop runs about five times
            for client in (ahead, behind, true):  # Stats reclaims expired leases first, on the replica's clock
                stats = await client.stats("j")
                assert (stats.leased_groups, stats.expired_leases) == (4, 0), stats
            assert await ahead.renew("j", [lease_true, lease_behind]) == []
            assert await behind.commit("j", lease_true) == 2
            assert await ahead.commit("j", lease_behind) == 2

            # an abandoned lease still expires, after its timeout by Redis's clock
            await configure(true, "j", capacity_groups=100, lease_timeout_s=SHORT_LEASE_S)
            abandoned, _, _ = await ahead.sample("j", 2)
            sampled_at = time.monotonic()
            stats = await behind.stats("j")
            assert (stats.leased_groups, stats.expired_leases) == (2, 0), stats
            while (await true.stats("j")).expired_leases == 0:
                assert time.monotonic() - sampled_at < SHORT_LEASE_S + 5, "the abandoned lease never expired"
                await asyncio.sleep(0.1)
            assert time.monotonic() - sampled_at >= SHORT_LEASE_S - 0.1
            with pytest.raises(NotFound):
                await behind.commit("j", abandoned)
            final = await true.stats("j")
            assert (final.committed, final.leased_groups, final.expired_leases) == (4, 0, 1), final
