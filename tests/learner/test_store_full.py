"""A store that fills mid-job pauses the job with a named reason; when space returns the job resumes.

- Redis at `maxmemory` (noeviction): a real learner (3 s job lease) trains; after step 3 Valkey's
  maxmemory is set below what it holds, so every write is refused OOM (reads and deletes still work; the
  job-lease renewal is a write script, refused too). Before, the learner's first refused write (the
  ledger's record of the step) failed the job, the FAILED write was refused too, and the learner process
  died on it: under a supervisor, a crash loop, since every claim is a write. Now the run stops as on an
  outage (nothing more written), the learner's status says "paused" with the reason, its claims are
  refused and logged, and once maxmemory is raised a claim resumes the job from its checkpoint: it
  succeeds, and the ledger holds every step once, with nothing lost or trained twice. The same when the
  learner has trained every group there is and waits for more (actors' inserts are refused): it writes
  nothing while it waits, and its refused lease renewals pause the job once the lease runs out.
- A full disk (a tmpfs of its own under the job's directory, filled by the test): checkpoint 4's write
  fails ENOSPC; the job pauses in its run, with the file and ENOSPC in its record beside state RUNNING
  and on the status board, keeps its leases, and writes the checkpoint once the filler is deleted, with
  no resume and nothing trained again. Filled again before the last checkpoint and left full past
  `store_full_wait_s`, the job fails with that reason. (A step's metrics line is waited out the same way;
  whether it meets the full disk depends on the room left in the file's last page, so test_checkpoint
  tests it.)
- JetStream full, twice in one job: the weights bucket at its `max_bytes` (the test lowers it to what
  the bucket holds), then the server at its `max_file_store` (a filler stream takes the rest). Each
  refused write (err_code 10077, then 10023; before, both were retried as an outage for 60 s and then
  failed the job with nats-py's bare ServiceUnavailableError) pauses the job with the refusal named in
  its record. SIGTERM during the first pause hands the job back at once (before, the learner stayed for
  `store_full_wait_s`, 900 s), its lease released and the reason kept; a second learner resumes it from
  checkpoint 2 once the limit is raised. When the filler is deleted, the job goes on in that run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
import time
from pathlib import Path

import grpc
import redis.asyncio as aioredis
from learner_fleet import create_job, insert_groups, learner_process, replay_service, spec_for
from nats.js import JetStreamContext, api
from nats.js.errors import ServiceUnavailableError
from test_crash import finish, metrics

from fleetrl.jobs.store import JobRecord, JobState, JobStore, job_dir
from fleetrl.launcher.embedded import EmbeddedNats
from fleetrl.proto.fleetrl.v1 import learner_pb2, learner_pb2_grpc
from fleetrl.replay.client import ReplayClient
from fleetrl.tasks import bus
from fleetrl.tasks.ledger import Accounting, Ledger
from fleetrl.train import checkpoint as ckpt
from tests.conftest import SmallDisks

STEPS, PPS, LEASE_S = 6, 2, 3.0


async def until(what: str, cond: object, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def learner_status(log: Path) -> learner_pb2.LearnerStatus:
    port = re.search(r"status on port (\d+)", log.read_text())
    assert port is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port.group(1)}") as channel:
        return await learner_pb2_grpc.LearnerServiceStub(channel).GetStatus(learner_pb2.LearnerStatusRequest(),
                                                                            timeout=5)


async def account(nats_url: str, redis_url: str, job_id: str) -> Accounting:
    redis = aioredis.Redis.from_url(redis_url)
    nc = await bus.connect(nats_url, "test")
    try:
        return await Ledger(redis).account(bus.jetstream(nc), job_id)
    finally:
        await nc.close()
        await redis.aclose()


def assert_exact(accounting: Accounting, run_dir: Path, job_id: str) -> None:
    """Every step once in metrics.jsonl and in the ledger, nothing lost or trained twice."""
    counts = accounting.counts
    assert counts["trained"] == STEPS * PPS, counts
    assert counts["lost"] == counts["duplicated"] == counts["unpublished"] == 0, counts
    lines = metrics(run_dir, job_id)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    trained = {m["step"]: sorted(m["task_ids"]) for m in lines}
    assert {s: sorted(t.task_id for t in accounting.tasks if s in t.steps) for s in trained} == trained


async def test_redis_at_maxmemory_pauses_the_job_until_memory_returns(nats_url: str, redis_url: str,
                                                                       tmp_path: Path) -> None:
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=STEPS, checkpoint_interval=2)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    store = aioredis.Redis.from_url(redis_url)
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        job = await create_job(jobs, spec)
        await insert_groups(replay, job, STEPS * PPS + 2)
        learner = learner_process(nats_url, redis_url, addr, run_dir, log, FLEETRL_LEARNER_REPLAY_ATTEMPTS="2")
        await until("step 3", lambda: len(metrics(run_dir, job.job_id)) >= 3)
        await store.config_set("maxmemory", 1)  # below any use: every write is refused OOM
        try:
            await until("the pause", lambda: f"job {job.job_id} paused" in log.read_text())
            status = await learner_status(log)
            await until("a refused claim", lambda: "claim refused" in log.read_text(), LEASE_S + 10)
            paused = await jobs.get(job.job_id)
            assert learner.poll() is None, "the learner exited on a full Redis"
        finally:
            await store.config_set("maxmemory", 0)
        await finish(learner)  # exit 0 once the resumed job succeeded
        record = await jobs.get(job.job_id)
        accounting = await account(nats_url, redis_url, job.job_id)
    await store.aclose()
    await jobs.close()
    text = log.read_text()
    print(f"redis maxmemory after step 3: status {status.phase!r} {status.paused_reason!r}; "
          f"{[line for line in text.splitlines() if 'paused' in line or 'refused' in line or 'resumed' in line]}; "
          f"ledger: {accounting.counts}")
    assert status.phase == "paused" and "Redis is out of memory (maxmemory reached" in status.paused_reason
    assert paused.state == JobState.RUNNING  # not failed: nothing could be written, and nothing was
    assert "Traceback" not in text and f"job {job.job_id} resumed from step 2" in text
    assert record.state == JobState.SUCCEEDED and record.lease_epoch == 2 and not record.reason, record
    assert_exact(accounting, run_dir, job.job_id)


async def test_redis_full_while_the_learner_waits_for_groups_pauses_the_job(nats_url: str, redis_url: str,
                                                                            tmp_path: Path) -> None:
    """The learner has trained every group there is and waits for more when Redis fills: it writes
    nothing while it waits, and the actors that would bring groups are refused. Its job-lease renewal is
    the write that meets the refusal: retried while the lease lasts, then the job pauses (before, the
    renewal's PEXPIRE went through under OOM and the learner waited out `train.timeout_per_step_s`,
    unaware, on the whole fleet past any test's patience)."""
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=STEPS, checkpoint_interval=2)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    store = aioredis.Redis.from_url(redis_url)
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        job = await create_job(jobs, spec)
        await insert_groups(replay, job, 3 * PPS)  # steps 1-3; step 4 waits for groups
        learner = learner_process(nats_url, redis_url, addr, run_dir, log)
        await until("step 3", lambda: len(metrics(run_dir, job.job_id)) >= 3)
        await store.config_set("maxmemory", 1)
        full_at = time.monotonic()
        try:
            await until("the pause", lambda: f"job {job.job_id} paused" in log.read_text(), LEASE_S + 5)
            paused_after_s = time.monotonic() - full_at
            status = await learner_status(log)
            assert learner.poll() is None, "the learner exited on a full Redis"
        finally:
            await store.config_set("maxmemory", 0)
        await insert_groups(replay, job, STEPS * PPS + 2, skip=3 * PPS)
        await finish(learner)
        record = await jobs.get(job.job_id)
        accounting = await account(nats_url, redis_url, job.job_id)
    await store.aclose()
    await jobs.close()
    text = log.read_text()
    print(f"redis maxmemory while waiting for step 4's groups: paused after {paused_after_s:.1f} s, status "
          f"{status.phase!r} {status.paused_reason!r}; ledger: {accounting.counts}")
    assert status.phase == "paused" and "Redis is out of memory (maxmemory reached" in status.paused_reason
    assert f"lease renewal of job {job.job_id} failed: command not allowed when used memory" in text
    assert "Traceback" not in text and f"job {job.job_id} resumed from step 2" in text
    assert record.state == JobState.SUCCEEDED and record.lease_epoch == 2 and not record.reason, record
    assert_exact(accounting, run_dir, job.job_id)


async def test_a_full_disk_pauses_the_job_then_fails_it_past_the_wait(
        nats_url: str, redis_url: str, tmp_path: Path, small_disk: SmallDisks) -> None:
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=STEPS, checkpoint_interval=2)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        job = await create_job(jobs, spec)
        disk = small_disk.mount(job_dir(run_dir, job.job_id), 160)  # three checkpoints' room, and metrics.jsonl
        await insert_groups(replay, job, 3 * PPS)  # steps 1-3; each later step waits until the disk is full
        learner = learner_process(nats_url, redis_url, addr, run_dir, log, FLEETRL_LEARNER_STORE_FULL_WAIT_S="4",
                                  FLEETRL_LEARNER_STORE_FULL_RETRY_S="0.3")
        await until("step 3", lambda: len(metrics(run_dir, job.job_id)) >= 3)
        filler = small_disk.fill(disk)
        await insert_groups(replay, job, 5 * PPS, skip=3 * PPS)  # steps 4 and 5
        paused = await _until_reason(jobs, job.job_id)
        status = await learner_status(log)
        filler.unlink()  # space returns: checkpoint 4 is written, and the job goes on
        await until("step 5", lambda: len(metrics(run_dir, job.job_id)) >= 5)
        going_on = await jobs.get(job.job_id)
        small_disk.fill(disk)  # full again before checkpoint 6, and left full
        await insert_groups(replay, job, STEPS * PPS + 2, skip=5 * PPS)
        await finish(learner)  # exit 0: the job failed, the learner did not
        record = await jobs.get(job.job_id)
        accounting = await account(nats_url, redis_url, job.job_id)
    await jobs.close()
    text = log.read_text()
    print(f"disk full at checkpoint 4: record {paused.state.value} {paused.reason!r}, status {status.phase!r}; "
          f"freed: {going_on.state.value} {going_on.reason!r}; full at checkpoint 6: {record.state.value} "
          f"{record.reason!r}; ledger: {accounting.counts}")
    root = ckpt.checkpoint_root(run_dir, job.job_id)
    path = root / "step-00000004.e1.tmp" / "model.safetensors"
    assert paused.state == JobState.RUNNING, paused
    assert paused.reason == f"[Errno 28] no space left on device (ENOSPC) writing: '{path}'", paused.reason
    assert status.phase == "paused" and status.paused_reason == paused.reason
    assert going_on.state == JobState.RUNNING and not going_on.reason  # the pause ended with the write
    assert "the disk store took the write, the pause ends" in text
    assert "resumed from step" not in text and record.lease_epoch == 1  # one run: paused, never stopped
    assert record.state == JobState.FAILED and "NoSpace" in record.reason, record
    assert "ENOSPC" in record.reason and str(root / "step-00000006.e1.tmp") in record.reason, record.reason
    assert ckpt.complete_steps(root) == [2, 4]
    counts = accounting.counts  # step 6 was trained and recorded; its checkpoint, then its report, failed
    assert counts["trained"] == STEPS * PPS and counts["lost"] == counts["duplicated"] == 0, counts
    lines = metrics(run_dir, job.job_id)
    assert [m["step"] for m in lines] == list(range(1, STEPS))
    assert all(sorted(m["task_ids"]) == sorted(t.task_id for t in accounting.tasks if m["step"] in t.steps)
               for m in lines)


async def _until_reason(jobs: JobStore, job_id: str) -> JobRecord:
    deadline = time.monotonic() + 60
    while not (record := await jobs.get(job_id)).reason:
        assert time.monotonic() < deadline, "timed out waiting for the job's pause reason"
        await asyncio.sleep(0.05)
    return record


async def test_a_full_jetstream_pauses_the_job_until_space_returns(redis_url: str, tmp_path: Path) -> None:
    nats = EmbeddedNats(data_dir=tmp_path / "nats", max_file_store_mb=256)
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=STEPS, checkpoint_interval=2)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    with nats:
        nc = await bus.connect(nats.url, "test")
        js = bus.jetstream(nc)
        async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
            job = await create_job(jobs, spec)
            await insert_groups(replay, job, 2 * PPS)
            learner = learner_process(nats.url, redis_url, addr, run_dir, log, FLEETRL_LEARNER_STORE_FULL_RETRY_S="0.3")
            await until("step 2", lambda: len(metrics(run_dir, job.job_id)) >= 2)
            bucket = (await js.stream_info(f"OBJ_{bus.weights_bucket(job.job_id)}")).config
            held = (await js.stream_info(bucket.name)).state.bytes
            await js.update_stream(dataclasses.replace(bucket, max_bytes=held + 1024 * 1024))  # no room for v3
            await insert_groups(replay, job, 4 * PPS, skip=2 * PPS)
            bucket_full = await _until_reason(jobs, job.job_id)
            learner.send_signal(signal.SIGTERM)  # paused: it hands the job back now, not after the 900 s wait
            stopping = time.monotonic()
            await finish(learner, 30)
            stopped_s = time.monotonic() - stopping
            handed_back, holder = await jobs.get(job.job_id), await jobs.lease_holder(job.job_id)
            await js.update_stream(dataclasses.replace(bucket, max_bytes=-1))
            learner = learner_process(nats.url, redis_url, addr, run_dir, log, FLEETRL_LEARNER_STORE_FULL_RETRY_S="0.3")
            await until("step 4", lambda: len(metrics(run_dir, job.job_id)) >= 4)
            filled = await _fill_jetstream(js)
            await insert_groups(replay, job, STEPS * PPS + 2, skip=4 * PPS)
            server_full = await _until_reason(jobs, job.job_id)
            await js.delete_stream("FILLER")
            await finish(learner)
            record = await jobs.get(job.job_id)
            accounting = await account(nats.url, redis_url, job.job_id)
        await nc.close()
    await jobs.close()
    text = log.read_text()
    print(f"jetstream full: weights bucket at max_bytes: {bucket_full.reason!r}, SIGTERM then: exited in "
          f"{stopped_s:.1f}s; server at max_file_store (filler {filled / 2**20:.0f} MB): {server_full.reason!r}; "
          f"{record.state.value}; ledger: {accounting.counts}")
    assert bucket_full.state == JobState.RUNNING and "publish of weights v3 refused: JetStream is full" in \
        bucket_full.reason and "err_code 10077" in bucket_full.reason, bucket_full.reason
    assert f"job {job.job_id} handed back: job {job.job_id}: SIGTERM while paused on the nats store" in text
    assert handed_back.state == JobState.RUNNING and handed_back.reason == bucket_full.reason  # until a claim
    assert holder is None and handed_back.lease_epoch == 1 and stopped_s < 10  # released, not left to lapse
    assert server_full.state == JobState.RUNNING and "JetStream is full" in server_full.reason, server_full.reason
    assert "err_code 10023" in server_full.reason, server_full.reason
    assert text.count("the nats store took the write, the pause ends") == 1  # the server-full pause, in its run
    assert f"job {job.job_id} resumed from step 2" in text and record.lease_epoch == 2
    assert record.state == JobState.SUCCEEDED and not record.reason, record
    assert_exact(accounting, run_dir, job.job_id)


async def _fill_jetstream(js: JetStreamContext) -> int:
    """Publish 1 MB messages to a stream of the test's own until JetStream refuses one; the bytes it took."""
    await js.add_stream(api.StreamConfig(name="FILLER", subjects=["filler"], storage=api.StorageType.FILE))
    chunk, taken = bytes(1 << 20), 0
    while True:
        try:
            await js.publish("filler", chunk)
        except ServiceUnavailableError as error:
            assert bus.jetstream_full(error), error
            return taken
        taken += len(chunk)
