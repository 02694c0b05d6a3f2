"""Real partitions: the learner alone cut off from NATS in the middle of a weight publish, and before it
claims a job.

The learner reaches nats-server through a TCP proxy in the test process (`Blackhole`); the test reaches
it directly, and replay does not use NATS. The learner trains steps 1-3; then the test watches the
job's object store on its own connection and, when the first chunk of v4 reaches the server, cuts the
proxy: the learner's sockets stay open and get no answer, its new connections are held. The cut lasts
`CUT_S`, past the deadlines of the learner's NATS calls in a weight publish and past its job lease, which
it keeps renewing in Redis. The learner must notice within those deadlines (`NOTICE_S`), not hang on a
socket (before `bus.FLUSH_TIMEOUT_S` it did, until the heal); it waits the cut out with the job paused and the reason
on its status board and in the job's record (RUNNING: an outage is not the job's failure), keeps its
leases, and goes on in the same run once bytes flow again. Then the job succeeds, the ledger holds every
step once, the weight pointer (watched on the test's own connection, every entry) never moved backwards,
and each pointer the test saw named an object that exists and whose bytes match its digest.

Cut off before it claims a job, the learner meets the outage in the run's set-up (the job's streams and task
consumer, the pointer's fence): it keeps the job, paused with the call named, and runs it once NATS answers.

Cut off longer than `store_full_wait_s`, the run stops without failing the job (an outage, not a full store):
the lease lapses, and a claim resumes the job from its checkpoint once NATS answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch
from blackhole import Blackhole
from learner_fleet import create_job, insert_groups, learner_process, replay_service, spec_for
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from test_crash import finish, metrics
from test_store_full import PPS, STEPS, account, assert_exact, learner_status, until

from fleetrl.jobs.store import JobRecord, JobState, JobStore
from fleetrl.replay.client import ReplayClient
from fleetrl.tasks import bus
from fleetrl.weights.publish import WeightPublisher
from fleetrl.weights.store import WeightPointer, WeightStore

CUT_S = 4 * bus.REQUEST_TIMEOUT_S
"""How long the partition lasts: past the deadline of an object's write (`WeightStore._publish_chunks`,
`bus.REQUEST_TIMEOUT_S` and the payload's time at 20 MB/s) and the ping after it (`bus.answers`), and past
the retries of the pause (`full_stores`); so past the job lease too, and into nats-py's stale-connection check
(pings every 10 s, 3 outstanding)."""
NOTICE_S = bus.REQUEST_TIMEOUT_S + 2 * bus.FLUSH_TIMEOUT_S + 2
"""By when the learner must have paused the job: the write's deadline (with the 13 MB payload's 0.7 s), which
a chunk's publish waiting on the undrained socket may overrun by `bus.FLUSH_TIMEOUT_S`, and the ping that finds
NATS silent (as long), not also a probe and a purge of the chunks (a request's deadline each)."""


async def half_written_chunks(js: JetStreamContext, job_id: str) -> list[str]:
    """Chunk subjects of the job's weight bucket that no object names: a failed write's, never purged."""
    bucket = bus.weights_bucket(job_id)
    info = await js.stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.C.>")
    named = {o.nuid for o in await (await bus.ensure_object_store(js, job_id)).list(ignore_deletes=True)}
    return [s for s in (info.state.subjects or {}) if s.rsplit(".", 1)[-1] not in named]


class PointerLog:
    """Every entry of the job's weight pointer, as an actor sees it, each pulled at once and checked."""

    def __init__(self, store: WeightStore, job_id: str) -> None:
        self.store, self.job_id = store, job_id
        self.seen: list[WeightPointer] = []
        self.bad: list[str] = []

    async def follow(self, kv_watch: object) -> None:
        async for entry in kv_watch:  # type: ignore[attr-defined]
            if entry is None or entry.value is None or entry.operation is not None:
                continue
            pointer = WeightPointer.from_json(entry.value)
            self.seen.append(pointer)
            try:
                payload = await self.store.pull(self.job_id, pointer)
            except Exception as error:  # a pointer to a missing or half-written object
                self.bad.append(f"v{pointer.version}: {type(error).__name__}: {error}")
                continue
            if hashlib.sha256(payload).hexdigest() != pointer.sha256:
                self.bad.append(f"v{pointer.version}: digest differs")


async def cut_at_the_next_publish(nc: NATS, proxy: Blackhole, replay: ReplayClient, job: JobRecord) -> float:
    """Insert the job's remaining groups (after the first 3 steps') and cut the proxy once the first chunk of
    the next weight version reaches the server (the test's own connection watches the job's object store);
    the moment of the cut."""
    cut = asyncio.Event()

    async def on_chunk(msg: Msg) -> None:
        if not cut.is_set():
            proxy.cut()
            cut.set()

    sub = await nc.subscribe(f"$O.{bus.weights_bucket(job.job_id)}.C.>", cb=on_chunk)
    await nc.flush()
    await insert_groups(replay, job, STEPS * PPS + 2, skip=3 * PPS)
    await asyncio.wait_for(cut.wait(), 60)
    cut_at = time.monotonic()
    await sub.unsubscribe()
    return cut_at


async def test_the_learner_cut_off_from_nats_mid_publish_waits_it_out_and_goes_on(
        nats_url: str, redis_url: str, tmp_path: Path) -> None:
    host, port = nats_url.removeprefix("nats://").rsplit(":", 1)
    proxy = Blackhole(host, int(port))
    proxied = f"nats://127.0.0.1:{await proxy.start()}"
    jobs = JobStore.from_url(redis_url)
    nc = await bus.connect(nats_url, "test")
    js = bus.jetstream(nc)
    store = WeightStore(nc, js)
    spec = spec_for(max_steps=STEPS, checkpoint_interval=2)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    follower: asyncio.Task[None] | None = None
    try:
        async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
            job = await create_job(jobs, spec)
            await insert_groups(replay, job, 3 * PPS)  # steps 1-3; step 4 waits for the test
            learner = learner_process(proxied, redis_url, addr, run_dir, log, once=False,
                                      FLEETRL_LEARNER_STORE_FULL_RETRY_S="1")
            await until("step 3", lambda: len(metrics(run_dir, job.job_id)) >= 3)
            pointers = PointerLog(store, job.job_id)
            follower = asyncio.create_task(pointers.follow(await (await bus.ensure_weights_kv(js)).watch(job.job_id)))
            cut_at = await cut_at_the_next_publish(nc, proxy, replay, job)  # v4's first chunk reached the server
            pointer_at_cut = await store.latest(job.job_id)
            noticed_s, status = None, None
            while time.monotonic() - cut_at < CUT_S:
                if noticed_s is None and (status := await learner_status(log)).phase == "paused":
                    noticed_s = time.monotonic() - cut_at
                await asyncio.sleep(0.1)
            alive = learner.poll() is None
            during = await jobs.get(job.job_id)
            lease_holder = await jobs.lease_holder(job.job_id)
            steps_during = len(metrics(run_dir, job.job_id))
            proxy.heal()
            healed_at = time.monotonic()
            await until("step 4", lambda: len(metrics(run_dir, job.job_id)) >= 4, 60)
            resumed_s = time.monotonic() - healed_at
            await until("the job's end", lambda: f"job {job.job_id} ledger" in log.read_text(), 60)
            learner.send_signal(signal.SIGTERM)
            await finish(learner)
            record = await jobs.get(job.job_id)
            accounting = await account(nats_url, redis_url, job.job_id)
            await asyncio.sleep(0.5)  # the watcher's last pull
            orphans = await half_written_chunks(js, job.job_id)
    finally:
        if follower is not None:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
        await nc.close()
        await proxy.close()
        await jobs.close()
    text = log.read_text()
    versions = [p.version for p in pointers.seen]
    at_cut = pointer_at_cut and pointer_at_cut.version
    print(f"nats cut off from the learner at v4's first chunk (pointer then v{at_cut})"
          f" for {CUT_S:.0f}s: noticed (status paused) after {noticed_s}s, reason {status and status.paused_reason!r},"
          f" record {during and (during.state.value, during.reason)!r}; step 4 trained {resumed_s:.1f}s after the "
          f"heal; pointer versions seen {versions}; "
          f"{[line.split(' ', 3)[-1] for line in text.splitlines() if re.search('paused|pause ends|failed', line)]}; "
          f"ledger: {accounting.counts}; chunk subjects no object names: {orphans}")
    assert alive, "the learner exited during the partition"
    assert pointer_at_cut is not None and pointer_at_cut.version == 3, pointer_at_cut  # the cut came mid-publish
    assert steps_during == 3  # nothing trained past an unpublished version
    assert lease_holder is not None  # Redis was reachable: the run kept its job lease
    assert noticed_s is not None and noticed_s <= NOTICE_S, noticed_s  # deadlines, not a hang
    assert status is not None and "NATS" in status.paused_reason and "v4" in status.paused_reason, status
    assert during is not None and during.state == JobState.RUNNING and during.reason == status.paused_reason, during
    assert resumed_s <= 2 * bus.REQUEST_TIMEOUT_S, resumed_s
    assert "Traceback" not in text and "resumed from step" not in text  # one run, waited out
    assert record.state == JobState.SUCCEEDED and record.lease_epoch == 1 and not record.reason, record
    assert versions == sorted(versions) and versions[-1] == STEPS, versions  # never backwards
    assert not pointers.bad, pointers.bad  # every pointer seen named a whole object with its digest
    assert not orphans, orphans  # the chunks of v4's failed write were purged once NATS answered again
    assert_exact(accounting, run_dir, job.job_id)


SETUP_CUT_S = 2 * bus.REQUEST_TIMEOUT_S + 5
"""How long the learner is cut off before and after its claim: past the set-up's first call given up on
(`full_stores.OUTAGE_RETRY_BEFORE_PAUSE_S`, one request's deadline) and a try again after it."""


async def test_a_learner_that_claims_a_job_while_cut_off_from_nats_keeps_it_paused_and_runs_it(
        nats_url: str, redis_url: str, tmp_path: Path) -> None:
    host, port = nats_url.removeprefix("nats://").rsplit(":", 1)
    proxy = Blackhole(host, int(port))
    proxied = f"nats://127.0.0.1:{await proxy.start()}"
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=STEPS, checkpoint_interval=2)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    try:
        async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
            learner = learner_process(proxied, redis_url, addr, run_dir, log, once=False,
                                      FLEETRL_LEARNER_STORE_FULL_RETRY_S="1")
            await until("the learner's start", lambda: log.exists() and "status on port" in log.read_text(), 60)
            proxy.cut()  # connected to NATS through the proxy, and now cut off from it
            cut_at = time.monotonic()
            job = await create_job(jobs, spec)
            await insert_groups(replay, job, STEPS * PPS + 2)
            await until("the claim", lambda: f"claimed job {job.job_id}" in log.read_text(), 30)
            claimed_s = time.monotonic() - cut_at
            paused_s, status = None, None
            while time.monotonic() - cut_at < SETUP_CUT_S:
                if paused_s is None and (status := await learner_status(log)).phase == "paused":
                    paused_s = time.monotonic() - cut_at
                await asyncio.sleep(0.1)
            alive = learner.poll() is None
            during = await jobs.get(job.job_id)
            lease_holder = await jobs.lease_holder(job.job_id)
            steps_during = len(metrics(run_dir, job.job_id))
            proxy.heal()
            healed_at = time.monotonic()
            ended = (f"job {job.job_id} ledger", f"job {job.job_id} failed")
            await until("step 1", lambda: metrics(run_dir, job.job_id) or ended[1] in log.read_text(), 60)
            first_step_s = time.monotonic() - healed_at
            await until("the job's end", lambda: any(line in log.read_text() for line in ended), 60)
            learner.send_signal(signal.SIGTERM)
            await finish(learner)
            record = await jobs.get(job.job_id)
            accounting = await account(nats_url, redis_url, job.job_id)
    finally:
        await proxy.close()
        await jobs.close()
    text = log.read_text()
    print(f"nats cut off from the learner before its claim for {SETUP_CUT_S:.0f}s: claimed {claimed_s:.1f}s after the "
          f"cut, paused {paused_s}s after it, reason {status and status.paused_reason!r}, record "
          f"{during and (during.state.value, during.reason)!r}; step 1 trained {first_step_s:.1f}s after the heal; "
          f"{[line.split(' ', 3)[-1] for line in text.splitlines() if re.search('paused|pause ends|failed', line)]}; "
          f"ledger: {accounting.counts}")
    assert alive, "the learner exited during the partition"
    assert during is not None and during.state == JobState.RUNNING, during  # not FAILED at set-up
    assert lease_holder is not None and steps_during == 0  # it kept the job, and trained nothing without NATS
    assert paused_s is not None and paused_s <= claimed_s + bus.REQUEST_TIMEOUT_S + 3, (claimed_s, paused_s)
    assert status is not None and "NATS unreachable" in status.paused_reason, status
    assert "set-up of its streams and task consumer" in status.paused_reason, status
    assert during.reason == status.paused_reason, during
    assert first_step_s <= 2 * bus.REQUEST_TIMEOUT_S, first_step_s
    assert "Traceback" not in text and "resumed from step" not in text  # one run, waited out
    assert record.state == JobState.SUCCEEDED and record.lease_epoch == 1 and not record.reason, record
    assert_exact(accounting, run_dir, job.job_id)


LONG_CUT_WAIT_S = 2
"""The learner's `store_full_wait_s` in the test of a cut longer than the wait."""


async def test_a_nats_cut_longer_than_the_wait_pauses_the_job_and_a_claim_resumes_it(
        nats_url: str, redis_url: str, tmp_path: Path) -> None:
    """NATS unreachable past `store_full_wait_s` is an outage, not the job's failure: the run stops as on an
    unreachable Redis (lease left to lapse, nothing more written), the job stays RUNNING with the outage as its
    reason, and once NATS answers a claim resumes it from its checkpoint. Before, the job was marked FAILED."""
    host, port = nats_url.removeprefix("nats://").rsplit(":", 1)
    proxy = Blackhole(host, int(port))
    proxied = f"nats://127.0.0.1:{await proxy.start()}"
    jobs = JobStore.from_url(redis_url)
    nc = await bus.connect(nats_url, "test")
    spec = spec_for(max_steps=STEPS, checkpoint_interval=2)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    try:
        async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
            job = await create_job(jobs, spec)
            await insert_groups(replay, job, 3 * PPS)
            learner = learner_process(proxied, redis_url, addr, run_dir, log, once=False,
                                      FLEETRL_LEARNER_STORE_FULL_WAIT_S=str(LONG_CUT_WAIT_S),
                                      FLEETRL_LEARNER_STORE_FULL_RETRY_S="1")
            await until("step 3", lambda: len(metrics(run_dir, job.job_id)) >= 3)
            cut_at = await cut_at_the_next_publish(nc, proxy, replay, job)  # v4's first chunk reached the server
            stopped = (f"job {job.job_id} paused, NATS unreachable past store_full_wait_s", f"job {job.job_id} failed")
            await until("the run's stop", lambda: any(line in log.read_text() for line in stopped), 90)
            stopped_s = time.monotonic() - cut_at
            during = await jobs.get(job.job_id)
            alive = learner.poll() is None
            proxy.heal()
            ended = (f"job {job.job_id} ledger", f"job {job.job_id} failed")
            await until("the job's end", lambda: any(line in log.read_text() for line in ended), 120)
            learner.send_signal(signal.SIGTERM)
            await finish(learner)
            record = await jobs.get(job.job_id)
            accounting = await account(nats_url, redis_url, job.job_id)
    finally:
        await nc.close()
        await proxy.close()
        await jobs.close()
    text = log.read_text()
    print(f"nats cut off from the learner at v4's first chunk, store_full_wait_s {LONG_CUT_WAIT_S}: the run stopped "
          f"{stopped_s:.1f}s after the cut, record {during.state.value, during.reason}; "
          f"{[line.split(' ', 3)[-1] for line in text.splitlines() if re.search('paused|resumed|failed', line)]}; "
          f"final {record.state.value} epoch {record.lease_epoch}; ledger: {accounting.counts}")
    assert alive, "the learner exited during the partition"
    assert during.state == JobState.RUNNING and "NATS unreachable" in during.reason, during  # not FAILED
    assert f"job {job.job_id} failed" not in text
    assert "resumed from step 2" in text  # a later claim, from the checkpoint before the cut
    assert record.state == JobState.SUCCEEDED and record.lease_epoch >= 2 and not record.reason, record
    assert_exact(accounting, run_dir, job.job_id)


async def test_a_chain_repair_cut_off_from_nats_raises_what_the_run_waits_out(nats_url: str) -> None:
    """A delta job's learner waiting for groups repairs its chain when a reader asks (`repair_if_requested`);
    cut off from NATS, the call must end in NatsUnreachable, which the run waits out with the job paused
    (`full_stores.WAITED_OUT`), not in nats-py's bare timeout, which failed the job."""
    host, port = nats_url.removeprefix("nats://").rsplit(":", 1)
    proxy = Blackhole(host, int(port))
    nc = await bus.connect(f"nats://127.0.0.1:{await proxy.start()}", "test publisher")
    job_id = f"repair-{uuid.uuid4().hex[:8]}"
    publisher = WeightPublisher(WeightStore(nc, bus.jetstream(nc)), job_id, "float32", interval=1, keep=3,
                                lease_epoch=1, full_interval=4, outage_retry_s=1)
    model = torch.nn.Linear(4, 8)
    try:
        await publisher.publish(model, 1)
        with torch.no_grad():
            model.weight.add_(1)
        assert (await publisher.publish(model, 2) or pytest.fail("v2 not published")).chain == (1, 2)
        proxy.cut()
        started = time.monotonic()
        with pytest.raises(bus.NatsUnreachable, match="repair of the chain of v2"):
            await publisher.repair_if_requested()
        print(f"repair cut off from NATS: NatsUnreachable after {time.monotonic() - started:.1f}s")
    finally:
        proxy.heal()
        await nc.close()
        await proxy.close()
