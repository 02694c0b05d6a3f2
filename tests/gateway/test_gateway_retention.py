"""Retention and deletion at the gateway: a finished job past `retention_s` is deleted from every store,
a queued or running one never is, and `DeleteJob` is the tenant's own (another's job is NOT_FOUND)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
import redis.asyncio as aioredis

from fleetrl.errors import FleetError, grpc_code
from fleetrl.jobs.store import JobState, JobStore
from fleetrl.sdk.client import Client
from fleetrl.weights.channel import WeightChannel
from fleetrl.weights.filesystem import FilesystemTransport
from tests.gateway.conftest import TOKENS, Infra

PROMPTS = b'{"prompt": "1 + 1?", "answer": "2"}\n'
SPEC = json.dumps({"name": "kept", "model": "tiny-test", "prompts": "p.jsonl", "reward": {"builtin": "numeric_match"}})


def keys_of(infra: Infra, job_id: str) -> list[bytes]:
    async def scan() -> list[bytes]:
        redis = aioredis.Redis.from_url(infra.redis_url)
        try:
            return [k async for k in redis.scan_iter(match=f"*{job_id}*")]
        finally:
            await redis.aclose()

    return asyncio.run(scan())


def test_retention_deletes_finished_jobs_only(infra: Infra) -> None:
    proc = infra.gateway("retention", "retention_s = 1.0").start()
    try:
        with Client(proc.address, token=TOKENS["alice"]) as alice, Client(proc.address, token=TOKENS["bob"]) as bob:
            finished = alice.submit(SPEC, PROMPTS, spec_format="json")
            queued = alice.submit(SPEC, PROMPTS, spec_format="json")
            assert keys_of(infra, finished.job_id)
            with pytest.raises(FleetError) as others:
                bob.delete_job(finished.job_id)
            assert grpc_code(others.value) == grpc.StatusCode.NOT_FOUND
            with pytest.raises(FleetError) as active:
                alice.delete_job(queued.job_id)
            assert grpc_code(active.value) == grpc.StatusCode.FAILED_PRECONDITION
            alice.cancel_job(finished.job_id)
            deadline = time.monotonic() + 30
            while keys_of(infra, finished.job_id):
                assert time.monotonic() < deadline, keys_of(infra, finished.job_id)
                time.sleep(0.5)
            with pytest.raises(FleetError) as gone:
                alice.get_job(finished.job_id)
            assert grpc_code(gone.value) == grpc.StatusCode.NOT_FOUND
            assert alice.get_job(queued.job_id).state == "queued"  # older than retention_s, but not finished
            infra.store(lambda store: _finish(store, queued.job_id))
            held = alice.delete_job(queued.job_id)  # at once, whatever the retention
            assert held.redis_keys >= 2 and keys_of(infra, queued.job_id) == []
    finally:
        proc.stop()


def test_delete_job_deletes_weights_under_weights_dir(infra: Infra) -> None:
    """With `weights_dir` set, a job's weights travel as files there (`FilesystemTransport`): what a learner
    published and an actor pulled is counted with the job's files and deleted by `fleetrl delete`, and another
    job's weights stay."""
    weights_dir = infra.tmp / "shared-weights"
    channel = WeightChannel(FilesystemTransport(weights_dir))
    payload = b"weights" * 1000
    proc = infra.gateway("weights-dir", f'weights_dir = "{weights_dir}"').start()
    try:
        with Client(proc.address, token=TOKENS["alice"]) as alice:
            job = alice.submit(SPEC, PROMPTS, spec_format="json")
            other = alice.submit(SPEC, PROMPTS, spec_format="json")
            pointers = [asyncio.run(channel.publish(j.job_id, 0, payload, "float32")) for j in (job, other)]
            assert bytes(asyncio.run(channel.pull(job.job_id, pointers[0]))) == payload
            infra.store(lambda store: _finish(store, job.job_id))
            held = alice.delete_job(job.job_id)
            assert held.disk_files >= 2 and held.disk_bytes >= len(payload), held
            assert not (weights_dir / job.job_id).exists()
            assert bytes(asyncio.run(channel.pull(other.job_id, pointers[1]))) == payload
            assert held.nats_bytes == 0  # nothing of the weights went through NATS
    finally:
        proc.stop()


async def _finish(store: JobStore, job_id: str) -> None:
    await store.set_state(job_id, JobState.FAILED, "failed for the test")
