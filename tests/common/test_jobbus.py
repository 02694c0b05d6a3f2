"""A job event met by a NATS outage: tried again within a deadline, stored once, and when NATS stays away,
logged and dropped, never raised (events are informational; `JobBus.event`).

The server is SIGKILLed and the client's outgoing buffer filled, as a weight write that failed in the outage
leaves it: a publish then raises OutboundBufferLimitError at once. Before, `event` was a bare core publish,
so that error reached the learner's run (after a job's success too) and failed the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import nats.errors
import pytest
from nats.aio.client import Client as NATS

from fleetrl.launcher.embedded import EmbeddedNats
from fleetrl.tasks import bus
from fleetrl.tasks.jobbus import JobBus

FILLER_BYTES = (512 * 1024, 1024, 8)
"""Payloads that fill the client's outgoing buffer (`pending_size`, 2 MiB) to within 8 bytes, each size until
the next does not fit: an event's JSON does not fit after them."""


async def cut_off(nc: NATS, server: EmbeddedNats) -> None:
    """SIGKILL the server, wait for the client to see it, and fill the client's outgoing buffer."""
    server.kill()
    deadline = time.monotonic() + 10
    while nc.is_connected:
        assert time.monotonic() < deadline, "the client did not see the server die"
        await asyncio.sleep(0.05)
    for size in FILLER_BYTES:
        with pytest.raises(nats.errors.OutboundBufferLimitError):
            for _ in range(10_000):
                await nc.publish("filler", bytes(size))


async def close(nc: NATS) -> None:
    with contextlib.suppress(ConnectionResetError):  # nats-py's close flushes its buffer into a dead socket
        await nc.close()


async def events_stored(nc: NATS, job_id: str) -> dict[str, int]:
    """Messages of the job's event subject in FLEET_EVENTS."""
    info = await bus.jetstream(nc).stream_info(bus.EVENTS_STREAM, subjects_filter=bus.events_subject(job_id))
    return dict(info.state.subjects or {})


async def test_an_event_met_by_a_nats_outage_is_tried_again_and_stored_once(nats_server: EmbeddedNats) -> None:
    nc = await bus.connect(nats_server.url, "test")
    job_bus = JobBus(nc, "je", outage_retry_s=60)
    try:
        await bus.ensure_streams(bus.jetstream(nc))
        await cut_off(nc, nats_server)
        published = asyncio.create_task(job_bus.event({"type": "step", "step": 1}))
        await asyncio.sleep(2)
        assert not published.done()  # still trying, not failed at once
        await asyncio.to_thread(nats_server.start)
        await asyncio.wait_for(published, bus.OUTAGE_RETRY_S)
        stored = await events_stored(nc, "je")
        last = await bus.jetstream(nc).get_last_msg(bus.EVENTS_STREAM, bus.events_subject("je"))
    finally:
        await close(nc)
    assert stored == {bus.events_subject("je"): 1}, stored
    assert last.data == b'{"type": "step", "step": 1}'


async def test_an_event_lost_to_a_nats_outage_is_logged_not_raised(nats_server: EmbeddedNats,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    nc = await bus.connect(nats_server.url, "test")
    job_bus = JobBus(nc, "jl", outage_retry_s=2)
    try:
        await bus.ensure_streams(bus.jetstream(nc))
        await cut_off(nc, nats_server)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="fleetrl.tasks.jobbus"):
            await job_bus.event({"type": "state", "state": "succeeded"})
        elapsed = time.monotonic() - started
    finally:
        await close(nc)
    assert elapsed < job_bus.outage_retry_s + bus.REQUEST_TIMEOUT_S + 1, elapsed  # bounded: its deadline, one try
    dropped = [r.getMessage() for r in caplog.records if "event is dropped" in r.getMessage()]
    assert len(dropped) == 1 and "job jl: state event failed: NATS unreachable" in dropped[0], dropped
