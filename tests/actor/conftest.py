"""A real fleet minus the learner, shared by the actor tests of one module.

NATS, Valkey, the replay service and the reward service are real processes started once per
module (each test uses its own job id); `Fleet` (actor_fleet.py) plays the learner's part.
Actors are `python -m fleetrl.services.actor` subprocesses that tests SIGKILL, SIGSTOP and restart.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from actor_fleet import Fleet, Services, start_service

from fleetrl.errors import FailedPrecondition
from fleetrl.jobs.store import JobState, JobStore
from fleetrl.launcher.embedded import EmbeddedNats, EmbeddedValkey, free_port
from fleetrl.replay.client import ReplayClient
from fleetrl.tasks import bus
from fleetrl.weights.store import WeightStore

EPISODE_IDLE_TIMEOUT_S = 4.0
"""The reward service's episode_idle_timeout_s in these tests: a killed actor's sessions are reaped after it."""


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("fleet")
    with EmbeddedNats(data_dir=root / "nats") as nats_server, EmbeddedValkey(data_dir=root / "valkey") as valkey:
        replay_port, reward_port = free_port(), free_port()
        procs: list[subprocess.Popen[bytes]] = []
        try:  # a failed start of the second service must not leave the first one running
            procs.append(start_service(["fleetrl.services.replay", "--listen", f"127.0.0.1:{replay_port}",
                                        "--redis-url", valkey.url], root / "replay.log", replay_port))
            procs.append(start_service(["fleetrl.services.reward", "--listen", f"127.0.0.1:{reward_port}",
                                        "--workers", "1", "--set", f"episode_idle_timeout_s={EPISODE_IDLE_TIMEOUT_S}"],
                                       root / "reward.log", reward_port))
            yield Services(nats_server.url, valkey.url, f"127.0.0.1:{replay_port}", f"127.0.0.1:{reward_port}", root)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)


@pytest_asyncio.fixture
async def fleet(services: Services) -> AsyncIterator[Fleet]:
    nc = await bus.connect(services.nats_url, "actor-tests")
    js = bus.jetstream(nc)
    await bus.ensure_streams(js)
    jobs = JobStore.from_url(services.redis_url)
    replay = ReplayClient(services.replay_addr)
    fleet = Fleet(services, nc, js, jobs, replay, WeightStore(nc, js))
    try:
        yield fleet
    finally:
        fleet.stop_all()
        for job_id in fleet.job_ids:  # later tests' actors must not serve this job (unless a learner ended it)
            with contextlib.suppress(FailedPrecondition):
                await jobs.set_state(job_id, JobState.SUCCEEDED)
        for name in fleet.actors:
            print(f"----- {name}\n{fleet.log_text(name)[-3000:]}")
        await replay.close()
        await jobs.close()
        await nc.close()
